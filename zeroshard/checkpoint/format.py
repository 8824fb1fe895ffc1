"""Checkpoint naming and small file helpers shared by save, load and export.

Each rank's file holds tensors named ``"{kind}:{parameter name}:{first element}"``
(a piece of a flattened parameter), ``"whole:{name}"`` (rank 0: tensors saved whole)
and ``"rng:..."`` (that rank's random-number-generator states). Its header metadata
``zs_params`` repeats, for each parameter it holds pieces of, what the manifest records
about it (:func:`param_record`: whole shape, param group, tensor- or expert-parallel
split), so the manifest can be checked against the files without the model.

Expert parameters of MoE layers are saved under their global names: a per-expert
module's parameters under the global expert index (``deepspeed_experts.{g}``), a fused
expert tensor as its whole ``[experts, ...]`` shape, split along the expert dim over the
expert-parallel ranks (recorded as ``"ep"``, as a tensor-parallel split is as ``"tp"``),
so a save at one expert-parallel size loads at any other and consolidates each expert
once.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import TYPE_CHECKING

from zeroshard import ZeroshardError

if TYPE_CHECKING:
    from zeroshard.parallel.tensor.slices import TPSlice

MANIFEST = "manifest.json"


class CheckpointError(ZeroshardError, ValueError):
    """A checkpoint that cannot be loaded; the message names the file or parameters."""


class CheckpointSaveError(ZeroshardError, RuntimeError):
    """A save that failed on some rank; raised on every rank, and nothing was published."""


def file_name(rank: int) -> str:
    return f"zs_rank{rank:05d}.safetensors"


def piece_key(kind: str, name: str, lo: int) -> str:
    return f"{kind}:{name}:{lo}"


#: rank file metadata: {parameter name: param_record} of the parameters it holds pieces of
PARAMS_META = "zs_params"


#: the keys of a parameter record that name a split (the parallel axis it spans)
SPLIT_KEYS = ("tp", "ep")


def expert_slice(p) -> TPSlice | None:
    """For a fused expert tensor: which slice of the whole ``[num_experts, ...]`` tensor
    this rank holds (split along the expert dim over the ``ep`` ranks); else None."""
    from zeroshard.moe.marks import expert_shard
    from zeroshard.parallel.tensor.slices import TPSlice

    shard = expert_shard(p)
    if shard is None or shard.fused_dim is None:
        return None
    full = list(p.shape)
    full[shard.fused_dim] = shard.num_experts
    return TPSlice(
        full_shape=tuple(full),
        dim=shard.fused_dim,
        parts=(shard.num_experts,),
        rank=shard.ep_rank,
        world=shard.ep,
    )


def split_of(p) -> tuple[str, TPSlice] | None:
    """``(axis, TPSlice)`` of a parameter that holds a slice of a whole tensor: a
    tensor-parallel slice (``"tp"``) or a fused expert tensor's experts (``"ep"``);
    None when it is held whole."""
    from zeroshard.parallel.tensor.slices import tp_slice_of

    spec = tp_slice_of(p)
    if spec is not None:
        return "tp", spec
    spec = expert_slice(p)
    return ("ep", spec) if spec is not None else None


def saved_split(entry: dict) -> dict | None:
    """The split a manifest entry records (``tp`` or ``ep``), if any."""
    return next((entry[k] for k in SPLIT_KEYS if entry.get(k) is not None), None)


def param_record(flat, i: int) -> dict:
    """What a checkpoint records about flat parameter ``i``: its whole shape (a
    tensor-parallel slice's, or a fused expert tensor's, full shape), its param group
    (-1: frozen, saved without optimizer state) and, when split, the split (dim, fused
    parts, size of the axis it spans)."""
    split = split_of(flat.params[i])
    if split is None:
        return {"shape": list(flat.shapes[i]), "group": flat.group_of[i]}
    axis, spec = split
    return {
        "shape": list(spec.full_shape),
        "group": flat.group_of[i],
        axis: {"dim": spec.dim, "parts": list(spec.parts), "world": spec.world},
    }


def parameter_names(engine, ep_rank: int | None = None) -> list[str]:
    """The name of each flat parameter (the first name a tied parameter has), experts
    under their global names as expert-parallel rank ``ep_rank`` holds them (default:
    this rank)."""
    from zeroshard.moe.marks import global_names

    rename = global_names(engine.module, ep_rank)
    names: dict[int, str] = {}
    for name, p in engine.module.named_parameters():
        names.setdefault(id(p), rename.get(name, name))
    return [names[id(p)] for p in engine.flat.params]


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: str, text: str) -> None:
    """Write ``path`` so that readers see the old or the new content, never a mix (the
    temporary file's name is private to this call: concurrent writers do not share it)."""
    tmp = f"{path}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def exchange(
    comm, device, error: BaseException | None, values: tuple[int, ...] = ()
) -> tuple[list[int], list[list[int]]]:
    """Share, in one all-reduce of a small int64 tensor on ``device``, whether each rank
    failed and a few integers per rank. Returns (failed ranks, each rank's values).
    Every rank calls it at the same point, failed or not, so none is left waiting."""
    import torch

    width = 1 + len(values)
    table = torch.zeros(comm.world_size, width, dtype=torch.int64, device=device)
    row = [1 if error is not None else 0, *values]
    table[comm.rank] = torch.tensor(row, dtype=torch.int64, device=device)
    comm.all_reduce(table)
    rows = table.cpu().tolist()
    return [r for r, v in enumerate(rows) if v[0]], [v[1:] for v in rows]


def raise_if_failed(comm, failed: list[int], error: BaseException | None, what: str, exc_type):
    """After :func:`exchange`: if any rank failed, raise on every rank. The failing rank
    re-raises its own error when ``exc_type`` is None; the others (and, with
    ``exc_type``, all ranks) raise ``exc_type`` naming the failed ranks and why."""
    if not failed:
        return
    # only on failure: one small object gather so every rank can say why
    text = None if error is None else f"{type(error).__name__}: {error}"
    texts = comm.all_gather_object(text)
    if error is not None and exc_type is None:
        raise error
    cls = exc_type or CheckpointError
    why = "; ".join(f"rank {r}: {texts[r]}" for r in failed)
    raise cls(f"{what} failed on rank(s) {failed}: {why}") from error
