"""Opening a DeepSpeed checkpoint for ``load_checkpoint`` and ``zeroshard convert``.

``load_checkpoint(DIR)`` and ``zeroshard convert DIR OUT`` take a DeepSpeed checkpoint
directory (``DIR/latest`` + ``DIR/global_stepN/``, or the tag directory itself) wherever
they take one of ours: :func:`deepspeed_path` tells them apart, :func:`open_deepspeed`
reads it (``ds_files``: restricted unpickling, files present and consistent),
describes it in zeroshard's manifest terms (``ds_layout``) and checks that manifest as
ours are checked (``validate.check_manifest``). The engine-side checks
(``validate.validate``: names, shapes, param groups, state kinds) then run unchanged.

Communication: none here. Each rank reads every file's structure (memory-mapped) and
scans an equal share of the files' bytes (CRC-32 of every zip member, non-finite
values); ``load.py`` exchanges the outcome.
"""

from __future__ import annotations

from zeroshard.checkpoint.ds_files import deepspeed_path, is_deepspeed_dir, read, scan
from zeroshard.checkpoint.ds_layout import DeepSpeedReader, describe
from zeroshard.checkpoint.validate import check_manifest


def open_deepspeed(
    path: str,
    rank: int = 0,
    world: int = 1,
    *,
    verify: bool = True,
    allow_nonfinite: bool = False,
    training: bool = True,
) -> tuple[dict, DeepSpeedReader]:
    """The manifest and reader of DeepSpeed tag directory ``path`` (``deepspeed_path``),
    after reading every file and scanning this rank's share (``rank`` of ``world``) of
    their bytes. ``training``: the training state will be restored (refuses DeepSpeed
    state zeroshard has no counterpart for). Raises ``CheckpointError`` naming the file."""
    files = read(path)
    count = len(files.model_files) + len(files.optim_files)
    scan(files, range(rank, count, world), verify=verify, allow_nonfinite=allow_nonfinite)
    manifest, reader = describe(files, training=training)
    stage = f"ZeRO-{files.stage}" if files.stage else "stage-0"
    check_manifest(manifest, f"{path} (a DeepSpeed {stage} checkpoint)")
    return manifest, reader


__all__ = ["DeepSpeedReader", "deepspeed_path", "is_deepspeed_dir", "open_deepspeed"]
