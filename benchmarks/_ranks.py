"""Run a benchmark's per-rank half as a fresh set of processes and collect its results.

A benchmark script that handles ``<script> _rank ARGS... OUT`` (each rank writes a JSON
object to ``OUT.<rank>``) is launched as ``zeroshard run --nproc N <script> _rank
ARGS... OUT`` (the ``zeroshard`` next to this interpreter); :func:`run_ranks` waits for
it, reads every ``OUT.<rank>`` back in rank order and removes them. The ranks talk to
each other only through the launcher's process group; nothing here communicates.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile


class RanksFailed(RuntimeError):
    """The launcher exited non-zero; ``output`` is its stdout then stderr."""

    def __init__(self, returncode: int, output: str) -> None:
        super().__init__(f"zeroshard run exited {returncode}")
        self.returncode, self.output = returncode, output


def run_ranks(
    script: str,
    args: list[str],
    nproc: int = 2,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    prefix: str = "zs-ranks-",
    python: str | None = None,
) -> list[dict]:
    """Run ``zeroshard run --nproc NPROC SCRIPT _rank *ARGS OUT`` and return each rank's
    JSON from ``OUT.<rank>``, rank 0 first.

    ``OUT`` (a fresh temp path named ``PREFIX...``) is always the last argument, so
    ``args`` may end with a flag that takes it (``--out``). ``env`` is added to
    ``os.environ``. Raises :class:`RanksFailed` on a non-zero exit and
    ``subprocess.TimeoutExpired`` past ``timeout`` seconds; the out files are removed
    either way. ``python`` picks another interpreter's ``zeroshard`` (a venv with
    DeepSpeed)."""
    out = tempfile.mktemp(prefix=prefix)
    cmd = [
        os.path.join(os.path.dirname(python or sys.executable), "zeroshard"),
        "run",
        "--nproc",
        str(nproc),
        os.path.abspath(script),
        "_rank",
        *args,
        out,
    ]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=timeout
        )
        if proc.returncode != 0:
            raise RanksFailed(proc.returncode, proc.stdout + proc.stderr)
        ranks = []
        for r in range(nproc):
            with open(f"{out}.{r}") as f:
                ranks.append(json.load(f))
        return ranks
    finally:
        for r in range(nproc):
            if os.path.exists(f"{out}.{r}"):
                os.remove(f"{out}.{r}")
