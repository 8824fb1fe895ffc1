"""Saving a sharded checkpoint: every rank writes its own pieces, in parallel (with an
unsharded layout, an equal 1/N of the flat range each); rank 0 writes the JSON manifest
and publishes the directory atomically.

Communication: with pipeline stages, one object all-gather of each stage's part of the
manifest (each stage's first rank describes its own parameters; a tied layer is saved
by the first stage holding it); three all-reduces of a tiny int64 table on the engine's
device (through ``comm``): after rank 0 prepares the temporary directory (sharing its random save id),
after every rank wrote its file (a failure flag, the file size and its header's CRC-32
per rank), and after rank 0 published; one all-reduce (max) of each param group's step
count over the ZeRO shard group. A rank that fails raises only after telling the
others, so every rank raises :class:`CheckpointSaveError` instead of waiting forever;
only then, one small object gather of the reasons.

On disk (``save_dir/tag/``): ``zs_rankNNNNN.safetensors`` per rank and
``manifest.json``. Nothing is pickled. Each rank file records the CRC-32 of each of its
tensors and the save's id; the manifest records each file's size and header CRC-32
(``integrity.py`` checks them on load). The directory is written under a temporary name
private to this save (``.tmp-TAG.<save id>``), fsynced, then renamed under the
directory's publish lock, so concurrent jobs never mix their files; ``latest`` is
replaced (write + rename) last, so a process killed at any moment leaves ``latest``
naming a complete checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import replace

import torch

from zeroshard import NotBuiltError
from zeroshard.checkpoint.format import (
    MANIFEST,
    PARAMS_META,
    CheckpointError,
    CheckpointSaveError,
    exchange,
    file_name,
    fsync_dir,
    param_record,
    parameter_names,
    piece_key,
    raise_if_failed,
    split_of,
    write_text_atomic,
)
from zeroshard.checkpoint.model_config import describe_model
from zeroshard.checkpoint.paths import (
    LATEST,
    check_tag,
    clear_stale,
    make_tmp_dir,
    new_save_id,
    publish_lock,
    tmp_dir,
    trash_name,
)
from zeroshard.checkpoint.safetensors_io import DTYPE_NAMES, StreamWriter
from zeroshard.checkpoint.shards import OwnedPiece, ShardAccess
from zeroshard.distributed.mesh import AXES
from zeroshard.moe.marks import EXPERT_LIST_ATTR, is_expert
from zeroshard.monitor.progress import progress
from zeroshard.parallel.tensor.slices import tp_slice_of


def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {"rng:torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            out[f"rng:cuda:{i}"] = torch.cuda.get_rng_state(i)
    return out


def whole_tensors(engine, exclude_frozen: bool = False) -> dict[str, tuple[torch.Tensor, bool]]:
    """Tensors saved whole by rank 0, by name, with whether each is a buffer: parameters
    outside the flat layout (frozen, at stages 0-2; none with ``exclude_frozen``) and the
    persistent buffers."""
    in_flat = {id(p) for p in engine.flat.params}
    out = {}
    for name, p in engine.module.named_parameters():
        if id(p) not in in_flat and not exclude_frozen:
            if tp_slice_of(p) is not None or is_expert(p):
                what = "tensor-parallel slice" if tp_slice_of(p) is not None else "expert"
                raise NotBuiltError(
                    f"save_checkpoint: {name!r} is a frozen {what} outside ZeRO's layout "
                    "(stages 0-2); saving it is not built yet: use stage 3, where frozen "
                    "parameters are in the layout"
                )
            out[name] = (p.detach(), False)
    expert_buffers = {
        f"{prefix}.{n}" if prefix else n
        for prefix, m in engine.module.named_modules()
        if getattr(m, EXPERT_LIST_ATTR, None) and any(is_expert(p) for p in m.parameters())
        for n, _ in m.named_buffers()
    }
    for name, b in engine.module.state_dict(keep_vars=True).items():
        if not isinstance(b, torch.nn.Parameter) and torch.is_tensor(b):
            if name in expert_buffers:
                raise NotBuiltError(
                    f"save_checkpoint: {name!r} is a buffer of experts split over several "
                    "expert-parallel ranks; saving expert buffers is not built yet"
                )
            out[name] = (b.detach(), True)
    return out


def stage_ranks(engine) -> list[int]:
    """The ranks of this rank's pipeline stage (every rank without pipelining): they
    share the flat layout; each stage describes its own parameters in the manifest."""
    mesh = engine.mesh
    me = mesh.coord("pp")
    return [r for r in range(engine.comm.world_size) if mesh.coord("pp", r) == me]


def _not_saved_here(engine, exclude_frozen: bool = False) -> set[int]:
    """Flat parameters this stage leaves to another: a tied layer's copy on a pipeline
    stage after the first one holding it (the copies are equal); with ``exclude_frozen``,
    the frozen ones (stage 3 lays them out too)."""
    skip = set(getattr(engine, "checkpoint_skip", ()))
    if exclude_frozen:
        skip.update(i for i, g in enumerate(engine.flat.group_of) if g < 0)
    return skip


def _unserializable(obj, path: str) -> str | None:
    """Where in ``obj`` the first value JSON cannot encode sits (``None``: nowhere)."""
    try:
        json.dumps(obj)
        return None
    except (TypeError, ValueError, RecursionError):
        pass
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                return f"{path} key {k!r} ({type(k).__name__})"
            found = _unserializable(v, f"{path}[{k!r}]")
            if found:
                return found
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found = _unserializable(v, f"{path}[{i}]")
            if found:
                return found
    return f"{path} ({type(obj).__name__})"


def _manifest_text(manifest: dict) -> str:
    try:
        return json.dumps(manifest, indent=1)
    except (TypeError, ValueError, RecursionError) as exc:
        where = {
            "optimizer": "optimizer param groups",
            "scheduler": "lr scheduler state_dict()",
            "loss_scaler": "loss scaler state",
            "client_state": "client_state",
        }
        parts = []
        for key, label in where.items():
            found = _unserializable(manifest.get(key), key)
            if found:
                parts.append(f"{label}: {found}")
        detail = "; ".join(parts) or str(exc)
        raise TypeError(
            f"save_checkpoint: the manifest is not JSON-serializable ({detail}): {exc}"
        ) from exc


def save(
    engine,
    save_dir: str,
    tag: str,
    client_state: dict | None,
    save_latest: bool,
    exclude_frozen: bool = False,
) -> str:
    """Write ``save_dir/tag`` on every rank; publish it (rank 0) only if every rank
    succeeded. ``exclude_frozen``: leave out parameters that get no gradient (DeepSpeed's
    ``exclude_frozen_parameters``; load such a checkpoint with ``load_module_strict=False``,
    which keeps the model's own values for them). On any failure every rank raises :class:`CheckpointSaveError` (no rank
    is left waiting in a collective) and the previous checkpoints stay as they were."""
    comm, rank, device = engine.comm, engine.comm.rank, engine.device
    final = os.path.join(save_dir, str(tag))
    what = f"save_checkpoint({final!r})"

    # 1. every rank checks the tag; rank 0 makes a temporary directory private to this
    # save (a random id, shared in the exchange: every rank writes into the same one)
    error, save_id = None, 0
    try:
        check_tag(tag, "save_checkpoint: tag")
        if rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            if os.path.islink(final):
                raise CheckpointError(f"{final} is a symlink; refusing to replace it")
            clear_stale(save_dir, tag)
            save_id = new_save_id()
            make_tmp_dir(save_dir, tag, save_id)
    except Exception as exc:
        error = exc
    failed, values = exchange(comm, device, error, (save_id,))
    raise_if_failed(comm, failed, error, what, CheckpointSaveError)
    save_id = values[0][0]
    group_steps = _group_steps(engine)
    tmp = tmp_dir(save_dir, tag, save_id)

    # 2. every rank writes its own file; rank 0 builds the manifest (and its JSON text)
    error, size, crc, manifest = None, 0, 0, None
    try:
        try:
            client_json = json.dumps(client_state or {})
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"save_checkpoint: client_state must be JSON-serializable: {exc}"
            ) from exc
        access = ShardAccess(engine)
        names = parameter_names(engine)
        kinds = access.kinds()
        path = os.path.join(tmp, file_name(rank))
        crc = _write_rank_file(
            engine, access, names, kinds, path, f"{save_id:016x}", exclude_frozen
        )
        size = os.path.getsize(path)
        if rank == stage_ranks(engine)[0]:  # each pipeline stage describes its part
            manifest = _manifest(
                engine, access, names, kinds, [], client_json, tag, group_steps, exclude_frozen
            )
            _manifest_text(manifest)  # fails here, before any rank waits on rank 0
    except Exception as exc:
        error = exc
    failed, values = exchange(comm, device, error, (size, crc))
    if failed and rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    raise_if_failed(comm, failed, error, what, CheckpointSaveError)
    if engine.mesh.size("pp") > 1:  # every rank is here: no failure can strand one
        part = None if manifest is None else (manifest["params"], manifest["whole"])
        parts = comm.all_gather_object(part)
        if rank == 0:
            assert manifest is not None  # rank 0 is the first stage's first rank
            for got in parts:
                if got is not None:
                    manifest["params"].update(got[0])
                    manifest["whole"].update(got[1])

    # 3. rank 0 writes the manifest and publishes under the directory's lock: tag
    # directory, fsync, then `latest`
    error = None
    if rank == 0:
        assert manifest is not None  # rank 0 is the first stage's first rank
        try:
            manifest["save_id"] = f"{save_id:016x}"
            manifest["files"] = [
                {"name": file_name(r), "bytes": int(v[0]), "header_crc32": int(v[1])}
                for r, v in enumerate(values)
            ]
            write_text_atomic(os.path.join(tmp, MANIFEST), _manifest_text(manifest))
            os.remove(os.path.join(tmp, ".owner"))
            fsync_dir(tmp)
            with publish_lock(save_dir):
                _publish(tmp, final)
                fsync_dir(save_dir)  # the new directory entry is durable before `latest`
                if save_latest:
                    write_text_atomic(os.path.join(save_dir, LATEST), tag)
                    fsync_dir(save_dir)
                # the previous copy (or one a save killed between the two renames of an
                # overwrite left) goes to a private trash name, deleted outside the lock
                trash = None
                if os.path.isdir(final + ".old") and not os.path.islink(final + ".old"):
                    trash = trash_name(save_dir, tag)
                    os.rename(final + ".old", trash)
            if trash:
                shutil.rmtree(trash, ignore_errors=True)
        except Exception as exc:
            error = exc
            shutil.rmtree(tmp, ignore_errors=True)
    failed, _ = exchange(comm, device, error)
    raise_if_failed(comm, failed, error, what, CheckpointSaveError)
    return final


def _pieces_to_write(engine, access, rank: int) -> list[OwnedPiece]:
    """The pieces ``rank`` writes. Sharded layouts: its own, if it is in the first
    replica (hybrid sharding keeps identical shards in the others). Unsharded ones
    (stage 0, or one rank): every replica holds everything, so the flat range is split
    in equal parts over the replicas and each writes one, nothing written twice. Under
    tensor parallelism every TP rank writes its slices of the split parameters, and the
    first one the parameters every TP rank holds whole."""
    mesh = engine.mesh
    mine = access.pieces
    if mesh.coord("tp", rank) != 0:
        split = {i for i, p in enumerate(engine.flat.params) if tp_slice_of(p) is not None}
        mine = [p for p in mine if p.param in split]
    if engine.flat.partitioned:
        return mine if mesh.coord("zero_replicate", rank) == 0 else []
    layout = engine.flat.layout
    total = layout.shard_numel
    # dense segments split over every replica; expert ones over the replicas holding
    # the same experts (each expert-parallel rank writes its own experts)
    ranges = {}
    for kind, group in ((0, "replicas"), (1, "expert_replicas")):
        n, r = mesh.size(group), mesh.coord(group, rank)
        ranges[kind] = (r * total // n, (r + 1) * total // n)
    out = []
    for p in mine:
        a, b = ranges[layout.segments[p.segment].kind]
        lo, hi = max(a, p.shard_lo), min(b, p.shard_lo + p.hi - p.lo)
        if lo < hi:
            d = lo - p.shard_lo
            out.append(replace(p, lo=p.lo + d, hi=p.lo + d + hi - lo, shard_lo=lo))
    return out


def _write_rank_file(
    engine, access, names, kinds, path: str, save_id: str, exclude_frozen: bool
) -> int:
    """Write this rank's file; returns the CRC-32 of its header (which lists the CRC-32
    of every tensor)."""
    rank = engine.comm.rank
    entries: list = []
    sources: list = []
    records: dict = {}
    skip = _not_saved_here(engine, exclude_frozen)
    for piece in _pieces_to_write(engine, access, rank):
        if piece.param in skip:
            continue
        name = names[piece.param]
        records.setdefault(name, param_record(engine.flat, piece.param))
        for kind in kinds if piece.group >= 0 else ["param"]:
            dtype = engine.flat.dtype if kind == "param" else torch.float32
            entries.append((piece_key(kind, name, piece.lo), dtype, [piece.hi - piece.lo]))
            sources.append((kind, piece))
    extra = _rng_tensors()
    if rank == stage_ranks(engine)[0]:  # rank 0 without pipelining
        whole = whole_tensors(engine, exclude_frozen)
        extra.update({f"whole:{n}": t for n, (t, _) in whole.items()})
    for key, t in extra.items():
        entries.append((key, t.dtype, list(t.shape)))
    meta = {"rank": str(rank), "python_rng": json.dumps(random.getstate()), "zs_save": save_id}
    meta[PARAMS_META] = json.dumps(records, separators=(",", ":"))
    writer = StreamWriter(path, entries, meta, checksums=True)
    pieces = zip(sources, entries[: len(sources)], strict=True)
    shown = progress(pieces, desc="saving checkpoint", total=len(sources), enabled=rank == 0)
    for (kind, piece), (key, _, _) in shown:
        n = piece.hi - piece.lo
        writer.write(key, access.get(kind, piece.shard_lo, piece.shard_lo + n))
    for key, t in extra.items():
        writer.write(key, t)
    crc = writer.close()
    assert crc is not None  # checksums=True
    return crc


def _publish(tmp: str, final: str) -> None:
    """Rename the finished directory into place (under the publish lock). An existing
    one is first renamed to ``TAG.old``, which ``load`` falls back to if a kill lands
    between the renames; the caller removes ``TAG.old`` once ``latest`` is written."""
    if os.path.lexists(final):
        old = final + ".old"
        if os.path.islink(old):
            os.remove(old)
        elif os.path.lexists(old):  # a copy from an earlier killed overwrite: obsolete now
            shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)


def _group_steps(engine) -> list[int]:
    """Each param group's step count: the most any rank of the shard group took (a rank
    may hold none of a group's tensors, or only ones left without gradients). One
    all-reduce (max) of a few integers over the ZeRO shard group."""
    steps = [int(s) for s in ShardAccess(engine).group_steps()]
    if not steps:
        return steps
    t = torch.tensor(steps, dtype=torch.int64, device=engine.device)
    engine.mesh.comm("zero_shard").all_reduce(t, "max")
    return [int(v) for v in t.tolist()]


def _manifest(
    engine, access, names, kinds, sizes, client_json, tag, group_steps, exclude_frozen
) -> dict:
    flat, world = engine.flat, engine.comm.world_size
    layout = flat.layout
    params: dict = {}
    splits = [split_of(p) for p in flat.params]
    skip = _not_saved_here(engine, exclude_frozen)
    ranks = stage_ranks(engine)
    mesh = engine.mesh
    # experts' global names as each expert-parallel rank holds them
    by_ep = [parameter_names(engine, c) for c in range(mesh.size("ep"))]
    for i in range(len(splits)):
        if i in skip:
            continue
        # split parameters' pieces are of each rank's slice: [file, lo, hi, slice rank]
        for ep_names in by_ep:
            record = {**param_record(flat, i), "dtype": DTYPE_NAMES[flat.dtype], "pieces": []}
            params.setdefault(ep_names[i], record)
    for r in ranks:
        t = mesh.coord("tp", r)
        names = by_ep[mesh.coord("ep", r)]
        if flat.partitioned:  # the first replica's ranks write the shards
            first = mesh.coord("zero_replicate", r) == 0
            pieces = layout.pieces(mesh.coord("zero_shard", r)) if first else []
            spans = [
                (p.param, p.param_lo, p.param_hi)
                for p in pieces
                if t == 0 or splits[p.param] is not None
            ]
        else:  # split as _pieces_to_write splits it (every rank has the same pieces)
            spans = [(p.param, p.lo, p.hi) for p in _pieces_to_write(engine, access, r)]
        for i, lo, hi in spans:
            if i in skip:
                continue
            split = splits[i]
            if split is None:
                piece = [r, lo, hi]
            else:
                piece = [r, lo, hi, t if split[0] == "tp" else mesh.coord("ep", r)]
            params[names[i]]["pieces"].append(piece)
    whole = {  # in the file of the stage's first rank (rank 0 without pipelining)
        n: {"shape": list(t.shape), "dtype": DTYPE_NAMES[t.dtype], "buffer": is_buffer}
        | ({"rank": ranks[0]} if ranks[0] else {})
        for n, (t, is_buffer) in whole_tensors(engine, exclude_frozen).items()
    }
    opt = engine.optimizer  # None: an engine for inference (parameters only)
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
        for g in (opt.param_groups if opt is not None else [])
    ]
    for g, step in zip(groups, group_steps, strict=True):
        g["step"] = step
    sched = engine.lr_scheduler
    return {
        "format": "zeroshard-checkpoint",
        "version": 2,
        "tag": tag,
        "world_size": world,
        "mesh": {a: getattr(mesh.shape, a) for a in AXES},
        "zero_stage": engine.zero_optimization_stage(),
        "compute_dtype": DTYPE_NAMES[flat.dtype],
        "offload": {
            "optimizer": engine.placement.optimizer_offload,
            "param": engine.placement.param_offload,
        },
        "files": [{"name": file_name(r), "bytes": int(b)} for r, b in enumerate(sizes)],
        "params": params,
        "model": describe_model(engine.module),
        "aliases": _aliases(engine),
        "whole": whole,
        "kinds": kinds,
        "optimizer": {
            "type": type(opt.inner).__name__ if opt is not None else None,
            "groups": groups,
        },
        "scheduler": sched.state_dict()
        if sched is not None and hasattr(sched, "state_dict")
        else None,
        "loss_scaler": engine.loss_scaler.state_dict(),
        "counters": {
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps,
        },
        "client_state": json.loads(client_json),
    }


def _aliases(engine) -> dict[str, str]:
    """Other names of tied parameters (state_dict keeps both)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out
