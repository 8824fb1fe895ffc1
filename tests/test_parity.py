"""Parity: every ZeRO stage on 2 and 3 ranks reproduces single-process fp32 AdamW.

Cases cover accumulation 1 and 4, clipping, two param groups (different lr and weight
decay), a frozen parameter, tied embeddings, small buckets (parameters straddling
bucket and rank boundaries) and a client optimizer. One spawn per world size runs all
cases; each rank compares its own final parameters and losses with the reference.
"""

from __future__ import annotations

import multirank
import parity
import pytest

TOL = 2e-5

STAGES = [0, 1, 2, 3]


def _cases() -> list[dict]:
    cases = []
    for stage in STAGES:
        cases += [
            {"stage": stage, "gas": 1, "clip": 0.0},
            {"stage": stage, "gas": 4, "clip": 1.0, "micro": 1},
            {"stage": stage, "gas": 2, "clip": 0.05, "client": True, "tied": False},
            {"stage": stage, "gas": 1, "clip": 0.0, "bucket": 10**9, "frozen": False},
            {"stage": stage, "gas": 2, "clip": 1.0, "unused": True},
        ]
    # Stage 3 with every parameter partitioned (the tiny model is below the default
    # persistence threshold), with and without prefetch, with a live-parameter cap, and
    # with small parameters persistent.
    z3 = "zero_optimization"
    cases += [
        {"stage": 3, "gas": 1, "extra": {z3: {"stage3_param_persistence_threshold": 0}}},
        {
            "stage": 3,
            "gas": 4,
            "micro": 1,
            "clip": 1.0,
            "extra": {
                z3: {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0}
            },
        },
        {
            "stage": 3,
            "gas": 2,
            "clip": 0.05,
            "client": True,
            "tied": False,
            "extra": {
                z3: {
                    "stage3_param_persistence_threshold": 100,
                    "stage3_prefetch_bucket_size": 5000,
                    "stage3_max_live_parameters": 8000,
                }
            },
        },
        {
            "stage": 3,
            "gas": 1,
            "frozen": False,
            "extra": {
                z3: {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 10**9}
            },
        },
    ]
    return cases


def _worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    out = []
    for case in cases:
        ref_losses, ref_params = parity.reference(case, world)
        losses, engine = parity.train(case, rank, world)
        out.append(
            {
                "case": case,
                "losses": losses,
                "ref_losses": ref_losses,
                "param_diff": parity.max_param_diff(parity.full_params(engine), ref_params),
            }
        )
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_stage_parity(world: int) -> None:
    cases = _cases()
    results = multirank.run(_worker, world, cases, timeout=600)
    failures = []
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        losses = [
            sum(r["losses"][s] for r in per_rank) / world for s in range(len(per_rank[0]["losses"]))
        ]
        loss_diff = max(abs(a - b) for a, b in zip(losses, per_rank[0]["ref_losses"], strict=True))
        param_diff = max(r["param_diff"] for r in per_rank)
        if not (loss_diff <= TOL and param_diff <= TOL):
            failures.append(f"{case}: loss diff {loss_diff:.3g}, param diff {param_diff:.3g}")
    assert not failures, "\n".join(failures)


LOW_TOL = {"bf16": (2e-3, 1.5e-2), "fp16": (5e-4, 1e-2)}  # (loss, parameter) abs tolerance


def _low_cases() -> list[dict]:
    z3 = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    return [
        {"stage": s, "dtype": d, "gas": gas, "clip": 1.0, "extra": z3 if s == 3 else {}}
        for d in ("bf16", "fp16")
        for s in (0, 1, 2, 3)
        for gas in (1, 2)
    ]


def test_low_precision_parity() -> None:
    """bf16 / fp16 compute with fp32 masters agree with the fp32 reference within the
    dtype's resolution (bf16 keeps 8 mantissa bits, fp16 11)."""
    cases = _low_cases()
    results = multirank.run(_worker, 2, cases, timeout=600)
    failures = []
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        steps = len(per_rank[0]["losses"])
        losses = [sum(r["losses"][s] for r in per_rank) / 2 for s in range(steps)]
        loss_diff = max(abs(a - b) for a, b in zip(losses, per_rank[0]["ref_losses"], strict=True))
        param_diff = max(r["param_diff"] for r in per_rank)
        loss_tol, param_tol = LOW_TOL[case["dtype"]]
        if not (loss_diff <= loss_tol and param_diff <= param_tol):
            failures.append(f"{case}: loss diff {loss_diff:.3g}, param diff {param_diff:.3g}")
    assert not failures, "\n".join(failures)
