"""The seeds' examples (examples/seeds/) run as a user would launch them, on 2 ranks,
and the demo script runs (briefly)."""

from __future__ import annotations

import os
import subprocess
import sys

import multirank
import pytest
from example_cases import CASES, METHOD_A, STAGES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEEDS = os.path.join(ROOT, "examples", "seeds")


def _launch(*argv: str, timeout: int = 300, cwd: str = ROOT) -> str:
    cmd = [sys.executable, "-m", "zeroshard.tools.cli", *argv]
    out = subprocess.run(
        cmd,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


def _case_id(argv) -> str:  # a list of str, from a tuple or a pytest.param
    if "--deepspeed" in argv:
        return "method_a"
    return argv[-1] + (" (run)" if argv[0] == "run" and argv[-1].endswith("method_b.py") else "")


@pytest.mark.parametrize(
    ("argv", "expect"),
    CASES,
    ids=[_case_id(getattr(c, "values", c)[0]) for c in CASES],
)
def test_seed_example(argv: list[str], expect: str | tuple[str, ...]) -> None:
    pytest.importorskip("transformers")
    out = _launch(*argv)
    for line in (expect,) if isinstance(expect, str) else expect:
        assert line in out, out[-3000:]


def test_seed001_method_b_one_rank_without_launcher() -> None:
    """seeds/001 method B as a plain `python script.py`: world size 1, no launcher."""
    out = multirank.run_script(  # `python script.py`, forked from the preloaded server
        ["examples/seeds/seed001_method_b.py"],
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "seed001 method B: 1 optimizer step(s) after 10 micro-steps" in out.stdout


@pytest.mark.slow  # the Trainer itself, on zeroshard through the alias (slow: imports it)
def test_seed001_method_a_trainer_writes_under_runs(tmp_path) -> None:
    # from another folder, as printed: the Trainer's output_dir lands in that folder's
    # runs/, not in an out/ beside whatever the user had there
    os.symlink(os.path.join(ROOT, "examples"), tmp_path / "examples")
    out = _launch(*METHOD_A, cwd=str(tmp_path))
    assert "'train_loss'" in out, out[-3000:]
    assert not (tmp_path / "out").exists()
    assert (tmp_path / "runs" / "seed001_method_a").is_dir()


@pytest.mark.parametrize(
    "stage", [pytest.param(s, marks=pytest.mark.slow) if s < 3 else s for s in STAGES]
)
def test_seed003_zero_stages(stage: int) -> None:
    pytest.importorskip("transformers")
    out = _launch("run", "--nproc", "2", "examples/seeds/seed003_zero.py", "--stage", str(stage))
    assert f"seed003 ZeRO-{stage}: loss" in out and "step applied True" in out


def test_demo_runs_briefly(tmp_path) -> None:
    """The demo in DeepSpeed's spelling (the launcher passes --local_rank=N, the config
    comes as --deepspeed PATH); its first line counts the whole model, not ZeRO-3's
    shards. (A rerun into the same directory: test_faults' run-directory test.)"""
    from zeroshard.models import GPT, GPTConfig

    argv = ["--num_gpus", "2", "examples/train_gpt.py", "--deepspeed", "examples/ds_config_demo.json"]  # fmt: skip
    argv += ["--model", "tiny", "--run-dir", str(tmp_path / "demo")]
    out = _launch(*argv, "--steps", "5")
    n_params = sum(p.numel() for p in GPT(GPTConfig.preset("tiny", seq_len=128)).parameters())
    assert f"GPT tiny: {n_params / 1e6:.2f}M params, seq 128, micro 8 x gas 1 x 2 ranks, ZeRO stage 3" in out, out  # fmt: skip
    assert "trained 5 steps" in out and "rank 1 memory" in out and "held-out loss" in out
    assert len((tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()) == 5
    assert (tmp_path / "demo" / "Train_Samples_train_loss.csv").exists()
