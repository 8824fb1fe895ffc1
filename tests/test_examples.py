"""The seeds' examples (examples/seeds/) run as a user would launch them, on 2 ranks,
and the demo script runs (briefly)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEEDS = os.path.join(ROOT, "examples", "seeds")


def _launch(*argv: str, timeout: int = 300, cwd: str = ROOT) -> str:
    cmd = [sys.executable, "-m", "zeroshard.cli", *argv]
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


CASES = [
    (
        ["--num_gpus", "2", "examples/seeds/seed001_method_b.py"],
        "seed001 method B: 1 optimizer step",
    ),
    (
        ["run", "--nproc", "2", "examples/seeds/seed001_method_b_as_printed.py"],
        (  # the seed's config file unchanged: the micro-batch size from the first batch
            "seed001 method B as printed: 1 optimizer step(s) after 10 micro-steps, micro-batch 8",
            "train_micro_batch_size_per_gpu is not in the config; taken from the first batch: 8",
        ),
    ),
    (["run", "--nproc", "2", "examples/seeds/seed002_initialize.py"], "seed002: loss"),
    (
        ["run", "--nproc", "2", "examples/seeds/seed003_as_printed.py"],
        "refused as expected: optimizer",
    ),
    (
        [
            "--num_gpus",
            "2",
            "examples/seeds/seed001_method_a_equivalent.py",
            "--deepspeed",
            "examples/seeds/seed001_ds_config.json",
        ],
        "method A equivalent: 4 steps",
    ),
    pytest.param(  # the docstring's other spelling of the same launch
        ["run", "--nproc", "2", "examples/seeds/seed001_method_b.py"],
        "seed001 method B: 1 optimizer step",
        marks=pytest.mark.slow,
    ),
]
METHOD_A = ["--num_gpus", "2", "--as-deepspeed", "examples/seeds/seed001_method_a.py"]
STAGES = (1, 2, 3)
#: every command these tests launch, as the examples' docstrings print them (the doc-test
#: checks that each printed command is one of these)
LAUNCHED = ["zeroshard " + " ".join(getattr(c, "values", c)[0]) for c in CASES] + [
    "zeroshard " + " ".join(METHOD_A),
    "python examples/seeds/seed001_method_b.py",
    *(f"zeroshard run --nproc 2 examples/seeds/seed003_zero.py --stage {s}" for s in STAGES),
]


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
    out = subprocess.run(
        [sys.executable, "examples/seeds/seed001_method_b.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
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
    out = _launch(
        "run",
        "--nproc",
        "2",
        "examples/train_gpt.py",
        "--deepspeed_config",
        "examples/ds_config_demo.json",
        "--model",
        "tiny",
        "--steps",
        "5",
        "--run-dir",
        str(tmp_path / "demo"),
    )
    assert "trained 5 steps" in out and "rank 1 memory" in out and "held-out loss" in out
    assert len((tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()) == 5
    assert (tmp_path / "demo" / "Train_Samples_train_loss.csv").exists()
