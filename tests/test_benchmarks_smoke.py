"""Every benchmark runs at a toy size (``--smoke``), so a refactor cannot break one unseen.

Each ``benchmarks/*.py`` script (not the ``_`` helpers) runs as its own process, as a
user would start it, with ``--smoke``: the tiny GPT, one round, the CPU, systems that
need DeepSpeed's venv left out (the run says so), nothing appended to RESULTS.md. The
test checks the exit status, that the script said something, and that the repository's
files are unchanged afterwards (smoke runs write only under temporary directories).
The benchmarks that need a GPU run their code on the CPU (``ZEROSHARD_STAGE_ON_CPU=1``,
CPU tensors) when there is none.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")

# script -> the arguments before --smoke (bench_offload's part is positional)
ARGS = {"bench_offload.py": ["all"]}
SCRIPTS = sorted(f for f in os.listdir(BENCH) if f.endswith(".py") and not f.startswith("_"))
SKIP_DIRS = {".git", ".venv", ".venv-bench", ".mypy_cache", ".pytest_cache", ".ruff_cache", "__pycache__"}  # fmt: skip


def _files() -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file of the repository outside caches and venvs."""
    out = {}
    for d, dirs, names in os.walk(ROOT):
        dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.startswith(".venv")]
        for n in names:
            p = os.path.join(d, n)
            st = os.stat(p)
            out[os.path.relpath(p, ROOT)] = (st.st_size, st.st_mtime_ns)
    return out


def test_every_benchmark_is_listed() -> None:
    """A new benchmark is picked up by the listing above (nothing to register)."""
    assert "bench_train.py" in SCRIPTS and "cuda_env.py" in SCRIPTS
    assert not [s for s in SCRIPTS if s.startswith("_")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_smoke(script: str) -> None:
    before = _files()
    env = {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }
    run = subprocess.run(
        [sys.executable, os.path.join(BENCH, script), *ARGS.get(script, []), "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    tail = run.stdout[-3000:] + run.stderr[-3000:]
    assert run.returncode == 0, tail
    assert run.stdout.strip(), f"{script} --smoke printed nothing\n{tail}"
    after = _files()
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    assert not changed, f"{script} --smoke wrote into the repository: {changed}"
