"""The last green ``make gpu-check`` and what changed on the device path since.

    python3 benchmarks/_gpu_green.py          # CI prints it (standard library only, fast)

``benchmarks/GPU_LAST_GREEN.json`` holds the commit, card, torch/CUDA versions and date of
the last run of ``benchmarks/gpu_check.py`` that passed everything; ``gpu_check.py``
writes it. This prints it with the device-touching files changed since that commit
(``git diff --name-only``): the files whose GPU behaviour no GPU has checked yet. A file is
device-touching when it is one of the GPU checks themselves or a ``zeroshard/`` file that
mentions CUDA, pinned memory, streams or events. Always exits 0: it informs, CI decides
nothing on it. No communication.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GREEN = os.path.join(HERE, "GPU_LAST_GREEN.json")
CHECKS = (
    "tests/test_cuda.py",
    "benchmarks/gpu_check.py",
    "benchmarks/bench_offload_gpu.py",
    "benchmarks/cuda_env.py",
)
_DEVICE = re.compile(r"cuda|pin_memory|non_blocking|Stream|record_event|Event\(")


def device_touching(path: str, root: str = ROOT) -> bool:
    """Whether ``path`` (relative to the repo) is on the device path (see the docstring).
    A deleted ``zeroshard/`` file counts: its removal changes what runs on the GPU."""
    if path in CHECKS:
        return True
    if not (path.startswith("zeroshard/") and path.endswith(".py")):
        return False
    full = os.path.join(root, path)
    if not os.path.exists(full):
        return True
    with open(full, encoding="utf-8", errors="replace") as f:
        return bool(_DEVICE.search(f.read()))


def _git(*args: str, root: str = ROOT) -> str | None:
    try:
        run = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return run.stdout.strip() if run.returncode == 0 else None


def changed_since(commit: str, root: str = ROOT) -> list[str] | None:
    """Device-touching files that differ between ``commit`` and the working tree (None:
    git cannot tell, e.g. no repository or an unknown commit)."""
    names = _git("diff", "--name-only", commit, root=root)
    if names is None:
        return None
    return [p for p in names.splitlines() if p and device_touching(p, root)]


def report(path: str = GREEN, root: str = ROOT) -> str:
    """The lines CI prints."""
    if not os.path.exists(path):
        return (
            f"gpu-check: no green run recorded ({os.path.relpath(path, root)} missing): "
            "nothing of the CUDA path is verified on a GPU by this tree"
        )
    try:
        with open(path) as f:
            green = json.load(f)
        commit = str(green["commit"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"gpu-check: {os.path.relpath(path, root)} unreadable ({exc})"
    lines = [
        f"gpu-check: last green {commit[:12]} on {green.get('card', '?')} (torch "
        f"{green.get('torch', '?')}, CUDA {green.get('cuda', '?')}, {green.get('date', '?')})"
    ]
    changed = changed_since(commit, root)
    if changed is None:
        lines.append("gpu-check: git cannot compare this tree with that commit")
    elif changed:
        lines.append(
            f"gpu-check: {len(changed)} device-touching file(s) changed since, unverified:"
        )
        lines += [f"  {p}" for p in changed]
    else:
        lines.append("gpu-check: no device-touching file changed since")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(), flush=True)
