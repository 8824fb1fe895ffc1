"""``--smoke``: a benchmark's whole code path at a toy size on the CPU, in seconds, for CI
(``tests/test_benchmarks_smoke.py`` runs every benchmark this way from ``make test``).

A smoke run measures nothing worth keeping: one round of the smallest model, systems that
need what CI lacks (DeepSpeed's venv, a GPU) left out with a line saying so, nothing
appended to ``benchmarks/RESULTS.md`` and nothing written into the repository (files go
to a fresh temporary directory). No communication here.
"""

from __future__ import annotations

import argparse
import os
import tempfile

HELP = (
    "CI: a toy size on the CPU in seconds, 1 round; records nothing and writes only under "
    "a fresh temporary directory"
)


def add_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help=HELP)


def scratch(name: str) -> str:
    """A fresh temporary directory for a smoke run's files (left for the OS to clear)."""
    return tempfile.mkdtemp(prefix=f"zs-smoke-{name}-")


def skip(what: str, why: str) -> None:
    """Say that the smoke run leaves ``what`` out, and why (CI's logs show it)."""
    print(f"smoke: {what} skipped: {why}", flush=True)


def cpu_only_env() -> dict[str, str]:
    """The environment for a smoke run's child processes: CPU, one thread."""
    return {**os.environ, "ZEROSHARD_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
