"""What zeroshard says about itself when it answers as DeepSpeed: the version and git
details of ``deepspeed.__version__`` / ``deepspeed.git_version_info``, the start-up line
DeepSpeed's ``initialize`` logs ("DeepSpeed info: version=..., git-hash=...,
git-branch=..."), ``torch_info`` and ``deepspeed.utils.torch.required_torch_version``.
No communication.
"""

from __future__ import annotations

import functools
import os
import subprocess

import torch

from zeroshard import __version__ as zeroshard_version

#: the DeepSpeed release whose API zeroshard answers as (with zeroshard's version attached)
DEEPSPEED_VERSION = f"0.18.0+zeroshard.{zeroshard_version}"


@functools.cache
def git_info() -> tuple[str, str]:
    """``(hash, branch)`` of the zeroshard checkout this code runs from, or
    ``("unknown", "unknown")`` for an installed copy (as DeepSpeed reports a build
    without git)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = [
            subprocess.run(
                ["git", "-C", here, *args],
                capture_output=True,
                text=True,
                timeout=5,
                check=True,
            ).stdout.strip()
            for args in (["rev-parse", "--short", "HEAD"], ["rev-parse", "--abbrev-ref", "HEAD"])
        ]
    except (OSError, subprocess.SubprocessError):
        return "unknown", "unknown"
    return out[0] or "unknown", out[1] or "unknown"


def startup_line() -> str:
    """The line DeepSpeed's ``initialize`` logs on rank 0."""
    git_hash, git_branch = git_info()
    return (
        f"DeepSpeed info: version={DEEPSPEED_VERSION}, git-hash={git_hash}, git-branch={git_branch}"
    )


def _major_minor(version: str | None) -> str:
    if not version:
        return "0.0"
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 else "0.0"


def torch_info() -> dict[str, str]:
    """``deepspeed.git_version_info.torch_info``: the torch, CUDA and NCCL versions this
    process runs with ("0.0" for what it lacks, as a CPU-only DeepSpeed build says)."""
    nccl = "0.0"
    if torch.cuda.is_available():
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version()[:2])
        except (AttributeError, RuntimeError):
            nccl = "0.0"
    return {
        "version": _major_minor(torch.__version__),
        "bf16_support": str(bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())),
        "cuda_version": _major_minor(torch.version.cuda),
        "nccl_version": nccl,
        "hip_version": _major_minor(getattr(torch.version, "hip", None)),
    }


def _as_tuple(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def required_torch_version(min_version: float | str | None = None, max_version=None) -> bool:
    """Whether the torch in use is within ``[min_version, max_version]`` (major.minor)."""
    have = _as_tuple(torch.__version__)[:2]
    if min_version is not None and have < _as_tuple(str(min_version))[:2]:
        return False
    return not (max_version is not None and have > _as_tuple(str(max_version))[:2])
