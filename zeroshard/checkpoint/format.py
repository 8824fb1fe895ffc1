"""Checkpoint naming and small file helpers shared by save, load and export.

Each rank's file holds tensors named ``"{kind}:{parameter name}:{first element}"``
(a piece of a flattened parameter), ``"whole:{name}"`` (rank 0: tensors saved whole)
and ``"rng:..."`` (that rank's random-number-generator states).
"""

from __future__ import annotations

import os

MANIFEST = "manifest.json"


def file_name(rank: int) -> str:
    return f"zs_rank{rank:05d}.safetensors"


def piece_key(kind: str, name: str, lo: int) -> str:
    return f"{kind}:{name}:{lo}"


def parameter_names(engine) -> list[str]:
    """The name of each flat parameter (the first name a tied parameter has)."""
    names = {}
    for name, p in engine.module.named_parameters():
        names.setdefault(id(p), name)
    return [names[id(p)] for p in engine.flat.params]


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: str, text: str) -> None:
    """Write ``path`` so that readers see the old or the new content, never a mix."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
