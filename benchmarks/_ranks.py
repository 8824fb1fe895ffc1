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
import runpy
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
    return _launch(cmd, [out], nproc, env, timeout)[0]


def run_ranks_each(
    script: str,
    argvs: list[list[str]],
    nproc: int = 2,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
) -> list[list[dict]]:
    """One launch of ``nproc`` ranks that each run ``SCRIPT _rank *ARGV OUT`` for every
    ``ARGV`` of ``argvs`` in turn (same processes); returns :func:`run_ranks`'s result
    for each ``ARGV``, in order. For ``--smoke`` runs (see the module docstring)."""
    out = tempfile.mktemp(prefix="zs-ranks-")
    outs = [f"{out}-{i}" for i in range(len(argvs))]
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "zeroshard"),
        "run",
        "--nproc",
        str(nproc),
        os.path.abspath(__file__),
        os.path.abspath(script),
        json.dumps([[*a, o] for a, o in zip(argvs, outs, strict=True)]),
    ]
    return _launch(cmd, outs, nproc, env, timeout)


def _launch(
    cmd: list[str], outs: list[str], nproc: int, env: dict[str, str] | None, timeout: float | None
) -> list[list[dict]]:
    """Run ``cmd``; per out path, each rank's JSON (``OUT.RANK``); the files go either way."""
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=timeout
        )
        if proc.returncode != 0:
            raise RanksFailed(proc.returncode, proc.stdout + proc.stderr)
        results = []
        for o in outs:
            ranks = []
            for r in range(nproc):
                with open(f"{o}.{r}") as f:
                    ranks.append(json.load(f))
            results.append(ranks)
        return results
    finally:
        for o in outs:
            for r in range(nproc):
                if os.path.exists(f"{o}.{r}"):
                    os.remove(f"{o}.{r}")


def _each(script: str, argvs: list[list[str]]) -> None:
    """A rank of :func:`run_ranks_each`: the script's ``_rank`` half once per argv, as
    ``python SCRIPT _rank ARGV`` would run it (its ``__main__`` block, re-executed)."""
    for argv in argvs:
        sys.argv = [script, "_rank", *argv]
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    _each(sys.argv[1], json.loads(sys.argv[2]))
