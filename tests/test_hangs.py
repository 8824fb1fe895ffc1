"""Hangs become reports, and ranks must agree (issue 15): a call made on one rank only
ends, within the comm_timeout, in a watchdog report naming every rank's state instead
of a 30-minute hang; a different model or config on one rank is an error naming the
rank and the first difference, raised on every rank."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import multirank
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "one_rank_only.py"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "call, where_blocked, timeout_from",
    [("save", "in save_checkpoint", "config"), ("eval", "in forward", "flag")],
)
def test_a_call_on_one_rank_ends_in_a_report(tmp_path, call, where_blocked, timeout_from):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    flag = ["--comm-timeout", "3"] if timeout_from == "flag" else []
    start = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "zeroshard.tools.cli", "run", "--nproc", "2", *flag, str(SCRIPT), call,
         str(tmp_path / "ckpt"), timeout_from],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert res.returncode != 0 and "DONE" not in res.stdout, res.stdout
    report = [line for line in res.stderr.splitlines() if "watchdog" in line or "  rank" in line]
    assert "rank 0: blocked" in report[0] and where_blocked in report[0], res.stderr
    assert "rank 1:" in report[1] and "never entered" in report[1], res.stderr
    assert elapsed < 60, elapsed  # the timeout is 3 s; start-up dominates


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["sleep", "stop"])
def test_a_rank_stalled_after_steps_is_reported_where_it_stopped(how):
    """Rank 1 stalls after 3 steps (asleep; or SIGSTOPped, so nothing of it runs) while
    rank 0 blocks in step 4: the report says rank 1 returned from step() at step 3 and
    names its last collective (not "never reached a zeroshard call")."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    res = subprocess.run(
        [sys.executable, "-m", "zeroshard.tools.cli", "run", "--nproc", "2", "--shutdown-timeout", "2",
         str(ROOT / "tests" / "scripts" / "stall_after_steps.py"), how],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert res.returncode != 0 and "DONE" not in res.stdout, res.stdout
    lines = res.stderr.splitlines()
    first = next(i for i, line in enumerate(lines) if "zeroshard watchdog:" in line)
    blocked, stalled = lines[first], lines[first + 1]
    assert "rank 0: blocked" in blocked and "in backward at step 3" in blocked, res.stderr
    assert "rank 1: outside zeroshard since step() returned at step 3" in stalled, stalled
    assert "has not entered backward at step 3" in stalled, stalled
    assert "its last collective:" in stalled and "in step at step 2" in stalled, stalled
    assert "never" not in stalled, stalled
    assert ("no report for" in stalled) == (how == "stop"), stalled


def _disagree(rank: int, world: int) -> list[str]:
    import zeroshard
    from zeroshard.models import GPT, GPTConfig

    out = []
    for what in ("model", "config"):
        torch.manual_seed(0)
        wide = 32 if (what == "model" and rank == 1) else 16
        model = GPT(GPTConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=wide))
        stage = 2 if (what == "config" and rank == 1) else 1
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage},
        }
        try:
            zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
            out.append("")
        except RuntimeError as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def test_ranks_that_disagree_fail_together():
    for errors in multirank.run(_disagree, 2, timeout=120):
        model, config = errors
        assert "RanksDisagreeError" in model and "rank 1" in model, model
        assert "tok_emb.weight" in model and "(32, 16)" in model, model
        assert "zero_optimization.stage: 1" in config and "stage: 2" in config, config
