"""Loading a checkpoint into an engine of any world size, stage and offload.

Each rank reads only the slices it now owns, straight from whichever files hold them
(memory-mapped safetensors slices), and writes them wherever its layout keeps them.
Nothing is unpickled: only ``manifest.json`` and ``*.safetensors`` are ever opened. A
DeepSpeed checkpoint directory (``ds_checkpoint.py``) is read through torch's restricted
unpickler into the same manifest terms and loaded by the same code.

Everything is validated (``validate.py``: manifest and its values, files, headers,
pieces, model names and shapes, optimizer state kinds; ``coverage.py``: the manifest
lists every tensor of the files and agrees with what they recorded, every parameter the
engine trains has its optimizer state and every state kind its optimizer needs;
``integrity.py``: every byte against its checksum and no non-finite values, each rank
scanning an equal share of the files) before anything is written into the engine. A failed
load raises :class:`CheckpointError` naming the file or parameters and leaves the engine
untouched.

Communication: one all-reduce of a tiny int64 table (did validation fail on any rank?)
before writing, so every rank raises or every rank loads; at stages 0-2 the loaded
chunks are re-assembled into whole parameters (one all-gather per segment, as after a
step); a barrier at the end.
"""

from __future__ import annotations

import json
import math
import os
import random

import torch
from safetensors import safe_open

from zeroshard.checkpoint.ds_checkpoint import deepspeed_path, open_deepspeed
from zeroshard.checkpoint.format import (
    exchange,
    parameter_names,
    piece_key,
    raise_if_failed,
    saved_split,
    split_of,
)
from zeroshard.checkpoint.safetensors_io import DTYPE_NAMES, DTYPES
from zeroshard.checkpoint.shards import ShardAccess

# the checks live in validate.py; re-exported so imports from here keep working
from zeroshard.checkpoint.validate import (
    CheckpointError,
    check_model,
    read_manifest,
    resolve_path,
    resolve_tag,
    scan_files,
    validate,
)
from zeroshard.monitor.progress import progress
from zeroshard.parallel.tensor.slices import TPSlice, assemble


def _held_slice(p: torch.Tensor) -> TPSlice | None:
    """The slice of a whole tensor ``p`` holds (tensor-parallel, or a fused expert
    tensor's experts); None when it is held whole."""
    split = split_of(p)
    return split[1] if split is not None else None


def _same_split(saved: dict, entry: dict, spec: TPSlice) -> bool:
    """Whether a tensor-parallel save was split as ``spec`` splits (same size and parts)."""
    return (
        tuple(entry["shape"]) == spec.full_shape
        and saved["dim"] == spec.dim
        and tuple(saved["parts"]) == spec.parts
        and saved["world"] == spec.world
    )


class PieceReader:
    """Slices of pieces, from whichever rank files hold them."""

    def __init__(self, path: str, manifest: dict) -> None:
        self.path, self.manifest = path, manifest
        self._open: dict[int, object] = {}
        self._cached: tuple = (None, None)  # (kind, name), whole tensor

    def _file(self, rank: int):
        if rank not in self._open:
            name = self.manifest["files"][rank]["name"]
            self._open[rank] = safe_open(os.path.join(self.path, name), framework="pt")
        return self._open[rank]

    def get(
        self, kind: str, name: str, a: int, b: int, dtype: torch.dtype, spec: TPSlice | None = None
    ) -> torch.Tensor:
        """Elements ``[a, b)`` of parameter ``name``'s flattened ``kind``, as the loading
        rank holds it: whole (``spec`` None) or its slice ``spec`` (tensor-parallel, or a
        fused expert tensor's experts). A split save is read straight from the slice of
        the same rank when the split agrees, else assembled whole and re-split."""
        if name not in self.manifest["params"]:  # saved whole (frozen, at stages 0-2)
            whole = self.whole(name)
            return (spec.take(whole) if spec else whole).reshape(-1)[a:b].to(dtype)
        entry = self.manifest["params"][name]
        saved = saved_split(entry)
        if saved is None and spec is None:
            return self._read(kind, name, a, b, dtype, None)
        if saved is not None and spec is not None and _same_split(saved, entry, spec):
            return self._read(kind, name, a, b, dtype, spec.rank)
        key = (kind, name)
        if self._cached[0] != key:  # one whole tensor at a time: pieces come in order
            self._cached = (key, self._whole_kind(kind, name))
        whole = self._cached[1]
        return (spec.take(whole) if spec else whole).reshape(-1)[a:b].to(dtype)

    def _read(self, kind, name, a: int, b: int, dtype, tp_rank: int | None) -> torch.Tensor:
        """Elements ``[a, b)`` of the pieces of ``name`` (of tensor-parallel rank
        ``tp_rank``'s slice when the save was split)."""
        out = torch.zeros(b - a, dtype=dtype)
        filled = 0
        for rank, lo, hi, *tp in self.manifest["params"][name]["pieces"]:
            s, e = max(a, lo), min(b, hi)
            if s >= e or (tp and tp[0] != tp_rank):
                continue
            part = self._file(rank).get_slice(piece_key(kind, name, lo))[s - lo : e - lo]
            out[s - a : e - a] = part.to(dtype)
            filled += e - s
        if filled != b - a:
            raise CheckpointError(f"{self.path}: pieces of {kind} {name!r} do not cover [{a}, {b})")
        return out

    def _whole_kind(self, kind: str, name: str) -> torch.Tensor:
        """The whole ``kind`` of parameter ``name`` (saved slices assembled), fp32 for
        optimizer states, the saved dtype for parameters."""
        entry = self.manifest["params"][name]
        dtype = DTYPES[entry["dtype"]] if kind == "param" else torch.float32
        shape, saved = entry["shape"], saved_split(entry)
        if saved is None:
            return self._read(kind, name, 0, math.prod(shape), dtype, None).view(shape)
        split = TPSlice(
            full_shape=tuple(shape), dim=saved["dim"], parts=tuple(saved["parts"]), rank=0,
            world=saved["world"],
        )  # fmt: skip
        n = math.prod(split.local_shape)
        slices = [
            self._read(kind, name, 0, n, dtype, r).view(split.local_shape)
            for r in range(saved["world"])
        ]
        return assemble(slices, split)

    def whole(self, name: str) -> torch.Tensor:
        if name in self.manifest["params"]:  # saved as pieces (stage 3, or whole by TP)
            return self._whole_kind("param", name)
        rank = self.manifest["whole"][name].get("rank", 0)  # a pipeline stage's first rank
        return self._file(rank).get_tensor(f"whole:{name}")

    def rank_tensors(self, rank: int) -> tuple[dict, dict]:
        f = self._file(rank)
        keys = f.keys()
        return {k: f.get_tensor(k) for k in keys if k.startswith("rng:")}, f.metadata() or {}


def load_checkpoint(
    engine,
    load_dir: str,
    tag: str | None = None,
    *,
    strict: bool = True,
    optimizer_states: bool = True,
    scheduler_states: bool = True,
    module_only: bool = False,
    verify: bool = True,
    allow_nonfinite: bool = False,
) -> tuple[str, dict]:
    """Find, check and load a checkpoint into ``engine``; every rank raises (naming the
    file or parameters) or every rank loads. Returns ``(path, client_state)``.

    ``verify``: compare every tensor's bytes with the checksums recorded at save time
    (the ranks split the files; each byte is read once more, at ~2 GB/s per rank).
    ``allow_nonfinite``: accept NaN/inf values in the saved tensors (refused by
    default: a checkpoint of a diverged run).

    ``load_dir`` may also be a DeepSpeed ZeRO-1/2/3 checkpoint (``latest`` and
    ``global_stepN/``, or the tag directory): its trained parameters, optimizer state,
    scheduler, loss scale and counters load the same way, at any world size and stage;
    ``verify`` then checks the CRC-32 of every zip member of its files."""
    comm = engine.comm
    # an engine without an optimizer (inference) takes the parameters only, as DeepSpeed's
    optimizer_states = optimizer_states and engine.optimizer is not None
    with_opt = optimizer_states and not module_only
    error, path, manifest, names, reader = None, None, None, None, None
    try:
        ds_path = deepspeed_path(load_dir, tag)
        if ds_path is not None:
            path = ds_path
            manifest, reader = open_deepspeed(
                path, comm.rank, comm.world_size, verify=verify,
                allow_nonfinite=allow_nonfinite, training=not module_only,
            )  # fmt: skip
        else:
            path = resolve_path(load_dir, tag)
            manifest = read_manifest(path, root=load_dir)
            mine = range(comm.rank, len(manifest["files"]), comm.world_size)
            scan_files(path, manifest, mine, verify=verify, allow_nonfinite=allow_nonfinite)
        names = validate(
            engine, path, manifest, strict=strict, with_opt=with_opt, training=not module_only
        )
    except Exception as exc:  # raised on every rank below, never on one alone
        error = (
            exc
            if isinstance(exc, CheckpointError)
            else CheckpointError(f"{load_dir}: {type(exc).__name__}: {exc}")
        )
    failed, _ = exchange(comm, engine.device, error)
    raise_if_failed(comm, failed, error, f"load_checkpoint({load_dir!r})", None)
    assert path is not None and manifest is not None  # else raise_if_failed raised
    client = load(
        engine,
        path,
        manifest,
        optimizer_states=optimizer_states,
        scheduler_states=scheduler_states,
        module_only=module_only,
        names=names,
        reader=reader,
    )
    return path, client


def load(
    engine,
    path: str,
    manifest: dict,
    *,
    optimizer_states: bool,
    scheduler_states: bool,
    module_only: bool,
    names: set[str] | None = None,
    reader=None,
):
    """Write a checked checkpoint into ``engine`` (see :func:`load_checkpoint`).
    ``names``: the tensors to load (default: all, after :func:`validate`); ``reader``:
    where the pieces come from (default: the safetensors files of ``path``)."""
    with_opt = optimizer_states and not module_only
    if names is None:
        names = validate(
            engine, path, manifest, strict=True, with_opt=with_opt, training=not module_only
        )
    reader = PieceReader(path, manifest) if reader is None else reader
    access = ShardAccess(engine)
    flat_names = parameter_names(engine)
    kinds = set(manifest["kinds"])
    state_kinds = [k for k in manifest["kinds"] if k not in ("param", "master")]
    dtype = engine.flat.dtype
    # fp32 parameters take the fp32 masters when the checkpoint has them (exact resume)
    param_kind = "master" if "master" in kinds and dtype == torch.float32 else "param"
    with torch.no_grad():
        rank0 = engine.comm.rank == 0
        for piece in progress(access.pieces, desc="loading checkpoint", enabled=rank0):
            name, a = flat_names[piece.param], piece.shard_lo
            if name not in names:  # load_module_strict=False: keep this one as it is
                continue
            saved = manifest["params"].get(name)  # None: saved whole (frozen at stages 0-2)
            trained = saved is not None and saved["group"] >= 0  # saved with its states
            kind = param_kind if trained else "param"
            spec = _held_slice(engine.flat.params[piece.param])  # None: held whole
            access.set("param", a, reader.get(kind, name, piece.lo, piece.hi, dtype, spec))
            if piece.group < 0:
                continue
            if access.has_master():
                src = "master" if "master" in kinds and trained else "param"
                access.set(
                    "master", a, reader.get(src, name, piece.lo, piece.hi, torch.float32, spec)
                )
            if with_opt and trained:
                # every saved kind, not only those the live optimizer holds already (a
                # fresh SGD has no momentum_buffer until its first step)
                for key in state_kinds:
                    values = reader.get(key, name, piece.lo, piece.hi, torch.float32, spec)
                    access.set(key, a, values)
        in_flat = {id(p) for p in engine.flat.params}
        for n, p in engine.module.named_parameters():
            if id(p) not in in_flat and n in names:
                saved = manifest["params"].get(n)
                if param_kind == "master" and saved is not None and saved["group"] >= 0:
                    # trained, now outside the layout (an engine without an optimizer)
                    whole = reader.get("master", n, 0, p.numel(), p.dtype, _held_slice(p))
                    p.copy_(whole.view_as(p))
                else:
                    p.copy_(reader.whole(n))
        buffers = dict(engine.module.named_buffers())
        for n in manifest["whole"]:
            if n in buffers and n in names:
                buffers[n].copy_(reader.whole(n))
    engine.params.after_step()  # stages 0-2: re-assemble whole parameters
    engine.params.settle()  # whole before load_checkpoint returns (overlap_param_gather)
    if not module_only:
        _load_training_state(engine, reader, manifest, access, with_opt, scheduler_states)
    engine.comm.barrier()
    return manifest.get("client_state", {})


def _load_training_state(engine, reader, manifest, access, with_opt, scheduler_states) -> None:
    if with_opt:
        groups = manifest["optimizer"]["groups"]
        for ours, saved in zip(engine.optimizer.param_groups, groups, strict=True):
            for k, v in saved.items():
                if k != "step" and k in ours:
                    ours[k] = tuple(v) if isinstance(ours[k], tuple) else v
        access.set_group_steps([g["step"] for g in groups])
        if manifest["loss_scaler"]:  # empty: a DeepSpeed save with a static scale
            engine.loss_scaler.load_state_dict(manifest["loss_scaler"])
    sched = engine.lr_scheduler
    if scheduler_states and sched is not None and manifest.get("scheduler") is not None:
        sched.load_state_dict(manifest["scheduler"])
    for k, v in manifest["counters"].items():
        setattr(engine, k, v)
    rank = engine.comm.rank
    same_ranks = manifest["world_size"] == engine.comm.world_size
    if same_ranks and manifest.get("rng", True):  # same ranks: same random streams
        rng, meta = reader.rank_tensors(rank)
        torch.set_rng_state(rng["rng:torch"])
        if torch.cuda.is_available():
            for k, v in rng.items():
                if k.startswith("rng:cuda:") and int(k.split(":")[2]) < torch.cuda.device_count():
                    torch.cuda.set_rng_state(v, int(k.split(":")[2]))
        state = json.loads(meta["python_rng"])
        random.setstate((state[0], tuple(state[1]), state[2]))


__all__ = [
    "DTYPE_NAMES",
    "CheckpointError",
    "check_model",
    "load",
    "load_checkpoint",
    "read_manifest",
    "resolve_path",
    "resolve_tag",
    "scan_files",
    "validate",
]
