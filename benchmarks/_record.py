"""Append a benchmark's result section to ``benchmarks/RESULTS.md`` (no communication)."""

from __future__ import annotations

import datetime
import os
import platform

import torch


def append_section(path: str, name: str, command: str, body: str, cores: bool = True) -> None:
    """``## <date> <name>: [N cores, ]torch X, Python Y``, the command that made it, the body."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    where = f"{os.cpu_count()} cores, " if cores else ""
    head = (
        f"## {stamp} {name}: {where}torch {torch.__version__}, Python {platform.python_version()}"
    )
    with open(path, "a") as f:
        f.write(f"\n{head}\n\n`{command}`\n\n{body}\n")
