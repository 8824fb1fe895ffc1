"""Offload parity: where shards live changes nothing numerically.

Stages 1-3 with the optimizer (fp32 masters, Adam states, and from stage 2 the
accumulated gradient shard) in CPU memory; stage 3 with parameters in CPU memory too;
the CPU-AdamW hybrid of seeds/004 (stage 2 + CPU optimizer) on 1 and 2 ranks. All with
accumulation 4 and clipping, against single-process fp32 AdamW.
"""

from __future__ import annotations

from typing import Any

import multirank
import parity
import pytest

CPU = parity.PINNED_CPU


def _cases() -> list[dict]:
    base = {"gas": 4, "micro": 1, "clip": 1.0}
    z = "zero_optimization"
    cases: list[dict[str, Any]] = [
        {**base, "stage": s, "extra": {z: {"offload_optimizer": CPU}}} for s in (1, 2, 3)
    ]
    cases.append(
        {
            **base,
            "stage": 3,
            "extra": {
                z: {
                    "offload_optimizer": CPU,
                    "offload_param": CPU,
                    "stage3_param_persistence_threshold": 0,
                }
            },
        }
    )
    cases.append(
        {
            **base,
            "stage": 3,
            "client": True,
            "extra": {z: {"offload_param": CPU, "stage3_param_persistence_threshold": 0}},
        }
    )
    # each case twice: as a CPU-only user runs it (masters are views of the parameters,
    # as without offload) and as a GPU run does (separate masters, staged moves)
    return [{**c, "staged": staged} for c in cases for staged in (False, True)]


def _memory(rank, world):
    out = []
    for stage in (1, 2):
        for staged in (False, True):
            offload = {"offload_optimizer": CPU}
            case: dict[str, Any] = {"stage": stage, "steps": 1, "staged": staged}
            case["extra"] = {"zero_optimization": offload}
            _, engine = parity.train(case, rank, world)
            offload = engine.reducer.offload  # None: no host apart from the device
            stager = offload.stager if offload is not None else None
            out.append(
                {
                    "stage": stage,
                    "staged": staged,
                    "memory": engine.memory_stats(),
                    "masters_on": str(engine.optimizer.states.masters[0].device),
                    "grad_on": str(engine.reducer.grad_chunks[0].device),
                    "separate": engine.optimizer.states.separate,
                    "moved": stager.submitted if stager is not None else 0,
                    "pending": stager.pending if stager is not None else 0,
                    "buckets": len(engine.flat.layout.segments),
                    "pipelined": engine.optimizer.states.pipelined,
                }
            )
    return out


def _one_host_copy(rank, world):
    """Stage 3 with parameters and optimizer offloaded to the host, bf16, on the GPU code
    path: bytes per element of this rank's shard, by kind."""
    out = {}
    for dtype in ("bf16", "fp32"):
        zc = {
            "offload_optimizer": CPU,
            "offload_param": CPU,
            "stage3_param_persistence_threshold": 0,
        }
        case: dict[str, Any] = {
            "stage": 3,
            "steps": 1,
            "staged": True,
            "dtype": dtype,
            "frozen": False,
        }
        case["extra"] = {"zero_optimization": zc}
        _, engine = parity.train(case, rank, world)
        shard = engine.flat.layout.shard_numel
        m = engine.memory_stats()
        out[dtype] = {
            "params": m["params"] / shard,
            "optimizer_states": m["optimizer_states"] / shard,
            "store_dtype": str(engine.flat.store.dtype),
            "separate": engine.optimizer.states.separate,
            "kinds": engine.optimizer.states.kinds,
        }
    return out


def test_offloaded_stage3_keeps_one_fp32_host_copy() -> None:
    """With parameters and optimizer both in host memory the fp32 master *is* the
    parameter shard: 4 bytes of parameters and 8 of Adam moments per shard element,
    no separate master copy and no write-back (before: a bf16 shard plus an fp32 master,
    2 + 12 bytes, or 4 + 12 in fp32). Gathers cast to bf16 on the device."""
    for per_rank in multirank.run(_one_host_copy, 2, timeout=300):
        for dtype, r in per_rank.items():
            assert r["store_dtype"] == "torch.float32" and not r["separate"], r
            assert r["params"] == 4.0, r  # the fp32 shard = master
            # Adam's two moments, plus a few step counters
            assert 8.0 <= r["optimizer_states"] < 8.01, r
            # bf16 checkpoints still save the fp32 masters for an exact resume
            assert ("master" in r["kinds"]) == (dtype == "bf16"), r


def test_offload_parity_two_ranks(subtests: pytest.Subtests) -> None:
    cases = _cases()
    parity.check_parity(subtests, cases, multirank.run(parity.run_cases, 2, cases, timeout=600), 2)


def test_hybrid_cpu_adamw_one_rank(subtests: pytest.Subtests) -> None:
    """seeds/004's single-device recipe: CPU AdamW with gradients offloaded and
    accumulated on the CPU (stage 2 + offload_optimizer cpu on one rank)."""
    cases: list[dict[str, Any]] = [
        {
            "stage": 2,
            "gas": 4,
            "micro": 1,
            "clip": 1.0,
            "extra": {"zero_optimization": {"offload_optimizer": CPU}},
        }
    ]
    parity.check_parity(subtests, cases, multirank.run(parity.run_cases, 1, cases, timeout=300), 1)


@pytest.mark.slow
def test_offload_keeps_optimizer_state_off_the_device() -> None:
    for per_rank in multirank.run(_memory, 2, timeout=300):
        assert any(r["pipelined"] for r in per_rank)  # the parity model has several buckets
        for r in per_rank:
            # the optimizer side (masters, moments, gradient shard) is in CPU memory; on a
            # CPU-only run the masters are the parameters themselves (nothing to copy),
            # in the GPU code path a separate copy
            assert r["masters_on"] == "cpu" and r["grad_on"] == "cpu", r
            assert r["separate"] == r["staged"], r
            # staged: every bucket's reduced chunk went through the host buffers, once
            # per micro-step (stage 2) or at the boundary (stage 1), and none is left
            assert r["moved"] == (r["buckets"] if r["staged"] else 0), r
            assert r["pending"] == 0, r
            # the GPU path steps segment by segment, each one's copy back overlapping
            # the next one's step
            assert r["pipelined"] == (r["staged"] and r["buckets"] > 1), r
            m = r["memory"]
            total = m["params"] + m["grads"] + m["optimizer_states"]
            assert sum(m["by_location"].values()) == total
