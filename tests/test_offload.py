"""Offload parity: where shards live changes nothing numerically.

Stages 1-3 with the optimizer (fp32 masters, Adam states, and from stage 2 the
accumulated gradient shard) in CPU memory; stage 3 with parameters in CPU memory too;
the CPU-AdamW hybrid of seeds/004 (stage 2 + CPU optimizer) on 1 and 2 ranks. All with
accumulation 4 and clipping, against single-process fp32 AdamW.
"""

from __future__ import annotations

import multirank
import parity
from test_parity import _worker

CPU = {"device": "cpu", "pin_memory": True}


def _cases() -> list[dict]:
    base = {"gas": 4, "micro": 1, "clip": 1.0}
    z = "zero_optimization"
    cases = [{**base, "stage": s, "extra": {z: {"offload_optimizer": CPU}}} for s in (1, 2, 3)]
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
            case = {"stage": stage, "steps": 1, "staged": staged}
            case["extra"] = {"zero_optimization": offload}
            _, engine = parity.train(case, rank, world)
            stager = engine.reducer._stager
            out.append(
                {
                    "stage": stage,
                    "staged": staged,
                    "memory": engine.memory_stats(),
                    "masters_on": str(engine.optimizer.masters[0].device),
                    "grad_on": str(engine.reducer.grad_chunks[0].device),
                    "separate": engine.optimizer.separate_masters,
                    "moved": stager.submitted if stager is not None else 0,
                    "pending": stager.pending if stager is not None else 0,
                    "buckets": len(engine.flat.layout.segments),
                    "pipelined": engine.optimizer._pipelined,
                }
            )
    return out


def test_offload_parity_two_ranks() -> None:
    cases = _cases()
    parity.assert_parity(cases, multirank.run(_worker, 2, cases, timeout=600), 2)


def test_hybrid_cpu_adamw_one_rank() -> None:
    """seeds/004's single-device recipe: CPU AdamW with gradients offloaded and
    accumulated on the CPU (stage 2 + offload_optimizer cpu on one rank)."""
    cases = [
        {
            "stage": 2,
            "gas": 4,
            "micro": 1,
            "clip": 1.0,
            "extra": {"zero_optimization": {"offload_optimizer": CPU}},
        }
    ]
    parity.assert_parity(cases, multirank.run(_worker, 1, cases, timeout=300), 1)


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
