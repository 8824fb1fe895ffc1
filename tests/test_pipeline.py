"""Pipeline engine parity against the single-process fp32 reference (tests/pipeline_cases.py):
every schedule at pp2 and pp4 with a tied embedding, dp x pp with ZeRO, tp x pp,
dp x tp x pp; activation memory per stage (1F1B holds at most p micro-batches, GPipe m)."""

from __future__ import annotations

import pipeline_cases as pc
import pytest
from multirank import run

SCHEDULES = [
    {"schedule": "gpipe"},
    {"schedule": "1f1b"},
    {"schedule": "interleaved_1f1b", "virtual": 2},
    {"schedule": "zb_h1"},
]


def _check(results: list[list[dict]], cases: list[dict]) -> None:
    for i, case in enumerate(cases):
        for rank, per_case in enumerate(results):
            r = per_case[i]
            for got, want in zip(r["losses"], r["ref_losses"], strict=True):
                assert abs(got - want) <= pc.TOL, (case, rank, r["losses"], r["ref_losses"])
            assert r["param_diff"] <= pc.TOL, (case, rank, r["param_diff"])


def test_pp2_1f1b_tied_parity_and_memory() -> None:
    """pp2 1F1B and GPipe with a tied embedding and clipping (the norm spans both
    stages) match the reference; 1F1B's stage s holds p - s micro-batches' saved
    activations, GPipe all m (bytes from saved_tensors_hooks)."""
    m = 4
    cases = [
        {"stages": 2, "schedule": "1f1b", "clip": 0.5, "gas": m},
        {"stages": 2, "schedule": "gpipe", "clip": 0.5, "gas": m, "steps": 1},
    ]
    results = run(pc.train_many, 2, cases, timeout=240)
    _check(results, cases)
    for stage, (ofob, gpipe) in enumerate(results):
        assert ofob["memory"]["peak_inflight"] == 2 - stage
        assert gpipe["memory"]["peak_inflight"] == m
        # micro-batches alternate sequence lengths 6 and 7: the p held by 1F1B weigh at
        # most p / m of GPipe's m, plus one longer sequence's share
        bound = gpipe["memory"]["peak_saved_bytes"] * (2 - stage) / m * (1 + 1 / pc.SEQ)
        assert ofob["memory"]["peak_saved_bytes"] <= bound
        assert ofob["comm"]["send"]["calls"] > 0 and ofob["comm"]["recv"]["calls"] > 0


@pytest.mark.slow
def test_every_schedule_pp2() -> None:
    cases = [{"stages": 2, "clip": 0.5, **s} for s in SCHEDULES]
    _check(run(pc.train_many, 2, cases, timeout=400), cases)


@pytest.mark.slow
def test_every_schedule_pp4() -> None:
    cases = [{"stages": 4, "clip": 0.5, "steps": 2, **s} for s in SCHEDULES]
    results = run(pc.train_many, 4, cases, timeout=500)
    _check(results, cases)
    for stage, per_case in enumerate(results):
        assert per_case[1]["memory"]["peak_inflight"] == 4 - stage  # 1F1B
        assert per_case[3]["memory"]["peak_inflight"] <= 4  # ZB-H1: at most p
