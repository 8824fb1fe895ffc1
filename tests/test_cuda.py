"""The CUDA code path, run where a GPU is present (skipped elsewhere, so on CI).

On one rank (NCCL) the engine computes on ``cuda:0``; every ZeRO stage and every offload
tier must match the single-process fp32 CPU reference to the parity tolerance. With
the optimizer offloaded this is the path the CPU-only suite can only imitate: pinned
host buffers, the side copy stream that moves reduced gradient chunks to the host, and
the segment-by-segment step whose non-blocking copies back to the GPU overlap the next
segment's step (the CPU suite runs its order through a fake device runtime,
test_device_seam.py, but not real streams, pinned memory or CUDA kernels). When two
ranks share the one GPU they use gloo (NCCL refuses two ranks on one device), which
still runs every stream and host copy of the offload path; both make ``cuda:0`` current
(test_mesh.py checks that on the CPU with ``torch.cuda`` answering as a one-GPU host).

Last run: an H200 (torch 2.11+cu130) at a4c6c42, 6 of 6 passed (``make gpu-check``,
benchmarks/RESULTS.md).
"""

from __future__ import annotations

from typing import Any

import multirank
import offload_paths
import parity
import pytest
import resume
import torch

CPU = parity.PINNED_CPU  # the offload sections
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _on_cuda(monkeypatch) -> None:
    """Ranks compute on the GPU (conftest.py sends the rest of the suite to the CPU);
    cuBLAS and the scatter-adds of embedding backward run deterministically, so a
    resumed run can be compared bit for bit."""
    monkeypatch.setenv("ZEROSHARD_ACCELERATOR", "cuda")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


Z = "zero_optimization"


def _cases(tmp) -> list[dict]:
    acc = {"gas": 4, "micro": 1, "clip": 1.0}
    part = {"stage3_param_persistence_threshold": 0}
    nvme = {"device": "nvme", "nvme_path": str(tmp)}
    cases: list[dict[str, Any]] = [
        {**acc, "stage": s, "extra": {Z: part if s == 3 else {}}} for s in (0, 1, 2, 3)
    ]
    cases += [{**acc, "stage": s, "extra": {Z: {"offload_optimizer": CPU}}} for s in (1, 2, 3)]
    cases += [
        {**acc, "stage": 3, "extra": {Z: {"offload_optimizer": CPU, "offload_param": CPU, **part}}},
        {**acc, "stage": 3, "client": True, "extra": {Z: {"offload_param": CPU, **part}}},
        {
            **acc,
            "stage": 3,
            "extra": {
                Z: {
                    "offload_optimizer": {
                        **nvme,
                        "pipeline_read": True,
                        "pipeline_write": True,
                        "buffer_count": 6,
                    },
                    "offload_param": nvme,
                    "sub_group_size": 5000,
                    **part,
                }
            },
        },
        # bf16 parameters: the write-back uploads fp32 masters and casts on the GPU
        {"stage": 2, "gas": 2, "dtype": "bf16", "extra": {Z: {"offload_optimizer": CPU}}},
        {
            "stage": 3,
            "gas": 2,
            "dtype": "bf16",
            "extra": {Z: {"offload_optimizer": CPU, "offload_param": CPU, **part}},
        },
        # other optimizers through the pipelined write-back
        {**acc, "stage": 2, "opt": "SGD", "lr": 0.1, "extra": {Z: {"offload_optimizer": CPU}}},
        {**acc, "stage": 1, "opt": "Adam-L2", "extra": {Z: {"offload_optimizer": CPU}}},
        # Twin-Flow: part of the optimizer stays and steps on the GPU, the rest on the host
        {**acc, "stage": 2, "extra": {Z: {"offload_optimizer": TWIN}}},
        {**acc, "stage": 3, "extra": {Z: {"offload_optimizer": {**CPU, "ratio": 0.5}, **part}}},
        {"stage": 2, "gas": 2, "dtype": "bf16", "extra": {Z: {"offload_optimizer": TWIN}}},
        {"stage": 1, "gas": 1, "dtype": "bf16", "extra": {Z: {"offload_optimizer": TWIN}}},
    ]
    return cases


TWIN = {**CPU, "ratio": 0.3}


def _twin_places(rank: int, world: int) -> list[dict]:
    """Where Twin-Flow puts each share on the GPU, at stages 1-3 (bf16, gas 1)."""
    out = []
    for stage in (1, 2, 3):
        case = {"stage": stage, "steps": 2, "dtype": "bf16", "extra": {Z: {"offload_optimizer": TWIN}}}  # fmt: skip
        _, engine = parity.train(case, rank, world)
        states, k = engine.optimizer.states, engine.optimizer.states.device_segments
        chunks = engine.reducer.grad_chunks
        out.append(
            {
                "k": k,
                "n": len(states.masters),
                "masters": [str(m.device) for m in states.masters],
                "pinned": [m.is_pinned() for m in states.masters[k:]],
                "grads": [str(c.device) for c in chunks if c.numel()],
                "twin": engine.memory_stats()["twin_flow"],
            }
        )
    return out


def test_twin_flow_keeps_its_share_on_the_gpu() -> None:
    """offload_optimizer.ratio 0.3: the leading segments' masters and reduced gradients
    on the GPU, the others' masters in pinned host memory, their gradients on the host."""
    for r in multirank.run(_twin_places, 1, timeout=300)[0]:
        k, n = r["k"], r["n"]
        assert 0 < k < n, r
        assert r["masters"] == ["cuda:0"] * k + ["cpu"] * (n - k), r
        assert all(r["pinned"]), r
        assert r["grads"][0] == "cuda:0" and r["grads"][-1] == "cpu", r
        assert 0.5 < r["twin"]["device_share"] <= 0.7, r


def test_parity_on_cuda_one_rank(tmp_path, subtests: pytest.Subtests) -> None:
    cases = _cases(tmp_path)
    parity.check_parity(subtests, cases, multirank.run(parity.run_cases, 1, cases, timeout=600), 1)


def test_parity_on_cuda_two_ranks_sharing_the_gpu(tmp_path, subtests: pytest.Subtests) -> None:
    cases: list[dict[str, Any]] = [c for c in _cases(tmp_path) if c["stage"] > 0]
    parity.check_parity(subtests, cases, multirank.run(parity.run_cases, 2, cases, timeout=600), 2)


def test_offload_takes_the_pinned_stream_path() -> None:
    """CPU optimizer offload at stages 1-3 on the GPU: masters in page-locked host
    memory, written back segment by segment (stage 3 with the parameters offloaded too:
    the pinned fp32 shard is the master, no write-back), gradient chunks through pinned
    buffers on the side stream. test_device_seam.py checks the same on the CPU with a
    fake device runtime."""
    rows = multirank.run(offload_paths.offload_path, 1, timeout=300)[0]
    offload_paths.check_offload_path(rows, gpu=True)


# The cases run on the H100 (2026-11-23). The dropout case came later: attention dropout
# under deterministic algorithms is not yet checked on a GPU.
_CUDA_RESUME = [c for c in resume.RESUME_CASES if not c.get("dropout")]


def _resume(rank: int, world: int, phase: str, root: str) -> dict:
    torch.use_deterministic_algorithms(True)
    return resume.resume_phase(rank, world, phase, root, _CUDA_RESUME)


@pytest.mark.parametrize("world", [1, 2])
def test_exact_resume_on_cuda(tmp_path, world: int, subtests: pytest.Subtests) -> None:
    """Save at step 5 and resume: the same losses and parameters, bit for bit, as 10
    uninterrupted steps, for every stage, CPU offload, fp16 and bf16 (test_checkpoint's
    cases); the GPU tensors go through the checkpoint."""
    root = str(tmp_path)
    straight = multirank.run(_resume, world, "straight", root, timeout=600)
    first = multirank.run(_resume, world, "first", root, timeout=600)
    resumed = multirank.run(_resume, world, "second", root, timeout=600)
    resume.check_resume(subtests, _CUDA_RESUME, straight, first, resumed)


def test_write_back_casts_on_the_device() -> None:
    """fp32 masters in pinned memory into bf16 parameters: uploaded as they are, piece
    by piece through one device buffer, cast there; exactly ``values.to(bf16)``."""
    from zeroshard.offload.store import MemoryShard
    from zeroshard.zero.layout.partition import FlatLayout

    # a device buffer of 1000 elements: several pieces, a ragged last one
    shard = MemoryShard.empty(
        FlatLayout([5000], 1), torch.bfloat16, "cuda", False, upload_numel=1000
    )
    shard.buffer.zero_()
    values = torch.randn(4567, pin_memory=True)
    shard.write_chunk(0, values, 100)
    torch.cuda.synchronize()
    dst = shard.buffer
    assert torch.equal(dst[100:4667].cpu(), values.to(torch.bfloat16))
    assert not dst[:100].any() and not dst[4667:].any()
    upload = shard._upload
    assert upload is not None and upload.numel() == 1000 and upload.device.type == "cuda"
