"""Every benchmark runs at a toy size (``--smoke``), so a refactor cannot break one unseen.

Each ``benchmarks/*.py`` script (not the ``_`` helpers) runs as its own process, as a
user would start it, with ``--smoke``: the tiny GPT, one round, the CPU, systems that
need DeepSpeed's venv left out (the run says so), nothing appended to RESULTS.md. The
process is forked from the tests' preloaded forkserver (``multirank.run_script``:
``python SCRIPT --smoke`` without importing torch and zeroshard again). The
test checks the exit status, that the script said something, and that the repository's
files are unchanged afterwards (smoke runs write only under temporary directories).
The benchmarks that need a GPU run their code on the CPU (``ZEROSHARD_STAGE_ON_CPU=1``,
CPU tensors) when there is none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import multirank
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
    run = multirank.run_script(
        [os.path.join(BENCH, script), *ARGS.get(script, []), "--smoke"],
        cwd=ROOT,
        env=env,
        timeout=540,
    )
    tail = run.stdout[-3000:] + run.stderr[-3000:]
    assert run.returncode == 0, tail
    assert run.stdout.strip(), f"{script} --smoke printed nothing\n{tail}"
    after = _files()
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    assert not changed, f"{script} --smoke wrote into the repository: {changed}"


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="a GPU is here: gpu-check would run"
)
def test_gpu_check_fails_fast_without_a_gpu() -> None:
    """``make gpu-check`` on a machine without CUDA: one line naming why, exit 2, at once
    (the time is torch's import)."""
    run = multirank.run_script(
        [os.path.join(BENCH, "gpu_check.py")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=120,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stdout == "", run.stdout
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA device"), run.stderr


def test_gpu_green_report(tmp_path) -> None:
    """What CI prints: no record yet; a record and the device-touching files changed
    since its commit; a record git cannot compare."""
    sys.path.insert(0, BENCH)
    import _gpu_green

    missing = tmp_path / "none.json"
    assert "no green run recorded" in _gpu_green.report(str(missing))
    head = subprocess.run(["git", "rev-parse", "HEAD~1"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("no git history here")
    rec = tmp_path / "green.json"
    rec.write_text(json.dumps({"commit": head.stdout.strip(), "card": "H100", "torch": "x"}))
    text = _gpu_green.report(str(rec))
    assert text.startswith(f"gpu-check: last green {head.stdout.strip()[:12]} on H100")
    diff = subprocess.run(["git", "diff", "--name-only", head.stdout.strip()], cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    touched = [p for p in diff.stdout.splitlines() if _gpu_green.device_touching(p)]
    for p in touched:
        assert f"  {p}" in text
    assert ("no device-touching file changed since" in text) == (not touched)
    rec.write_text(json.dumps({"commit": "0" * 40, "card": "H100"}))
    assert "git cannot compare" in _gpu_green.report(str(rec))
    assert _gpu_green.device_touching("tests/test_cuda.py")
    assert _gpu_green.device_touching("zeroshard/offload/staging.py")
    assert not _gpu_green.device_touching("README.md")


def test_gpu_decode_keeps_the_rows_of_a_killed_section() -> None:
    """gpu_check kills the decode section at its budget: the rows it printed are kept in
    the table (with their roof on a known card), the others are failed rows that say why."""
    sys.path.insert(0, BENCH)
    import _gpu_decode

    done = {"ok": True, "tokens_s": 1000.0, "rounds": 3, "bytes": 2_400_000_000, "tokens": [[1, 2]]}  # fmt: skip
    eager = {**done, "tokens_s": 100.0, "tokens": [[1, 3]]}
    stdout = "  decode bf16 captured: ...\nDECODE_ROW " + json.dumps({"bf16 captured": done})
    stdout += "\nDECODE_ROW " + json.dumps({"bf16 eager": eager}) + "\nnoise"
    args = type("Args", (), {"new": 128, "decode_compile": False})()
    result = _gpu_decode.partial_result(stdout, "over its 60 s budget", args)
    rows = result["rows"]
    assert rows["bf16 captured"]["ok"] and rows["bf16 captured"]["same_as_eager"] is False
    assert rows["int8 eager"] == {"ok": False, "why": "over its 60 s budget"}
    assert len(rows) == len(_gpu_decode.RUN_ORDER)
    table = "\n".join(_gpu_decode.decode_table(result, "NVIDIA H200"))
    assert "| bf16 captured | 1000.0 | 3 | 2.400 GB | 50.0% |" in table  # 2.4 GB x 1000 / 4.8 TB/s
    assert "| int4 captured | failed: over its 60 s budget |" in table
    assert "HBM bandwidth of 'CPU' not known" in "\n".join(_gpu_decode.decode_table(result, "CPU"))


def test_gpu_moe_part_is_reported_not_raised() -> None:
    """gpu_check's MoE section (issue 34): a table whose ways all ran is ok; a failed way,
    or a child killed at the section's cap, is a failed section that says which or why
    (reported in the table; green does not count it yet)."""
    sys.path.insert(0, BENCH)
    import gpu_check

    head = "MoE experts (cuda, torch.bfloat16): ...\n\n| way | tokens/s | x loop | max diff |\n|---|---|---|---|\n"  # fmt: skip
    good = gpu_check.moe_part({"ok": True, "result": {"table": head + "| loop | 9 | 1.00 | |"}})
    assert good["ok"] and good["note"] == "every way ran" and "| loop | 9 |" in good["table"]
    bad = head + "| grouped_mm | failed: RuntimeError: no kernel | | |\n| loop | 9 | | |"
    part = gpu_check.moe_part({"ok": True, "result": {"table": bad}})
    assert not part["ok"] and part["note"] == "failed: grouped_mm", part
    killed = gpu_check.moe_part({"ok": False, "why": "over its 60 s budget"})
    assert not killed["ok"] and "the section failed: over its 60 s budget" in killed["table"]
