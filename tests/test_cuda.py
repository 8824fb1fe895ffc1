"""The CUDA code path, run where a GPU is present (skipped elsewhere, so on CI).

On one rank (NCCL) the engine computes on ``cuda:0``; every ZeRO stage and every offload
tier must match the single-process fp32 CPU reference to the parity tolerance. With
the optimizer offloaded this is the path the CPU-only suite can only imitate: pinned
host buffers, the side copy stream that moves reduced gradient chunks to the host, and
the segment-by-segment step whose non-blocking copies back to the GPU overlap the next
segment's step. When two ranks share the one GPU they use gloo (NCCL refuses two ranks
on one device), which still runs every stream and host copy of the offload path.
"""

from __future__ import annotations

from typing import Any

import multirank
import parity
import pytest
import test_checkpoint
import torch
from test_offload import CPU
from test_parity import _worker

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
    ]
    return cases


def test_parity_on_cuda_one_rank(tmp_path) -> None:
    cases = _cases(tmp_path)
    parity.assert_parity(cases, multirank.run(_worker, 1, cases, timeout=600), 1)


def test_parity_on_cuda_two_ranks_sharing_the_gpu(tmp_path) -> None:
    cases: list[dict[str, Any]] = [c for c in _cases(tmp_path) if c["stage"] > 0]
    parity.assert_parity(cases, multirank.run(_worker, 2, cases, timeout=600), 2)


def _offload_path(rank: int, world: int) -> list[dict]:
    out = []
    for stage in (1, 2, 3):
        extra: dict[str, Any] = {"offload_optimizer": CPU}
        if stage == 3:
            extra.update(offload_param=CPU, stage3_param_persistence_threshold=0)
        case = {"stage": stage, "steps": 2, "gas": 2, "micro": 1, "extra": {Z: extra}}
        _, engine = parity.train(case, rank, world)
        opt, stager = engine.optimizer.states, engine.reducer._stager
        out.append(
            {
                "stage": stage,
                "device": str(engine.device),
                "param_on": str(next(engine.module.parameters()).device),
                "masters_on": sorted({str(m.device) for m in opt.masters}),
                "masters_pinned": all(m.is_pinned() for m in opt.masters),
                "grads_on": sorted({str(g.device) for g in engine.reducer.grad_chunks}),
                "separate": opt.separate,
                "pipelined": opt.pipelined,
                "side_stream": stager is not None and stager._stream is not None,
                "stager_pinned": stager is not None
                and all(b.is_pinned() for b in stager.buffers()),
                "moved": stager.submitted if stager is not None else 0,
                "pending": stager.pending if stager is not None else -1,
                "buckets": len(engine.flat.layout.segments),
                "by_location": engine.memory_stats()["by_location"],
            }
        )
    return out


def test_offload_takes_the_pinned_stream_path() -> None:
    for r in multirank.run(_offload_path, 1, timeout=300)[0]:
        assert r["device"] == "cuda:0" and r["param_on"].startswith("cuda"), r
        # masters (and moments) in page-locked CPU memory, the source of the copies back;
        # the gradient shard is in CPU memory too, written by the host from the pinned
        # staging buffers, so it needs no pinning
        assert r["masters_on"] == ["cpu"] and r["masters_pinned"] and r["grads_on"] == ["cpu"], r
        assert r["separate"] and r["pipelined"], r
        # gradient chunks left the GPU through the pinned buffers on the side stream:
        # each bucket once per micro-step (stage 2, 3) or once at the boundary (stage 1)
        assert r["side_stream"] and r["stager_pinned"] and r["pending"] == 0, r
        per_step = r["buckets"] * (1 if r["stage"] == 1 else 2)
        assert r["moved"] == 2 * per_step, r
        # memory_stats places them truthfully: optimizer side on the host; stages 1-2 keep
        # their parameters on the GPU (stage 3 here offloads them too)
        assert r["by_location"]["cpu"] > 0, r
        assert r["stage"] == 3 or r["by_location"].get("cuda:0", 0) > 0, r


# The cases run on the H100 (2026-11-23). The dropout case came later: attention dropout
# under deterministic algorithms is not yet checked on a GPU.
_CUDA_RESUME = [c for c in test_checkpoint.RESUME_CASES if not c.get("dropout")]


def _resume(rank: int, world: int, phase: str, root: str) -> list:
    torch.use_deterministic_algorithms(True)
    return test_checkpoint._resume_phase(rank, world, phase, root, _CUDA_RESUME)


@pytest.mark.parametrize("world", [1, 2])
def test_exact_resume_on_cuda(tmp_path, world: int) -> None:
    """Save at step 5 and resume: the same losses and parameters, bit for bit, as 10
    uninterrupted steps, for every stage, CPU offload, fp16 and bf16 (test_checkpoint's
    cases); the GPU tensors go through the checkpoint."""
    root = str(tmp_path)
    straight = multirank.run(_resume, world, "straight", root, timeout=600)
    multirank.run(_resume, world, "first", root, timeout=600)
    resumed = multirank.run(_resume, world, "second", root, timeout=600)
    for i, case in enumerate(_CUDA_RESUME):
        a, b = straight[0][i], resumed[0][i]
        assert a["losses"] == b["losses"], (case, a["losses"], b["losses"])
        assert a["params"] == b["params"], case
        assert a["scale"] == b["scale"] and a["lr"] == b["lr"], case


def test_write_back_casts_on_the_device() -> None:
    """fp32 masters in pinned memory into bf16 parameters: uploaded as they are, piece
    by piece through one device buffer, cast there; exactly ``values.to(bf16)``."""
    from zeroshard.offload.store import upload_and_cast

    values = torch.randn(4567, pin_memory=True)
    dst = torch.zeros(5000, dtype=torch.bfloat16, device="cuda")
    # 1000 elements a piece: several pieces, a ragged last one
    buf = upload_and_cast(dst[100 : 100 + values.numel()], values, None, max_numel=1000)
    torch.cuda.synchronize()
    assert torch.equal(dst[100:4667].cpu(), values.to(torch.bfloat16))
    assert not dst[:100].any() and not dst[4667:].any()
    assert buf is not None and buf.numel() == 1000 and buf.device.type == "cuda"
