"""Saving a sharded checkpoint: every rank writes its own pieces, in parallel (with an
unsharded layout, an equal 1/N of the flat range each); rank 0 writes the JSON manifest
and publishes the directory atomically.

Communication: three all-reduces of a tiny int64 table on the engine's device (through
``comm``): after rank 0 prepares the temporary directory, after every rank wrote its file
(a failure flag and the file size per rank), and after rank 0 published. A rank that
fails raises only after telling the others, so every rank raises
:class:`CheckpointSaveError` instead of waiting forever; only then, one small object
gather of the reasons.

On disk (``save_dir/tag/``): ``zs_rankNNNNN.safetensors`` per rank and
``manifest.json``. Nothing is pickled. The directory is written under a temporary name,
fsynced, then renamed; ``latest`` is replaced (write + rename) last, so a process killed
at any moment leaves ``latest`` naming a complete checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import replace

import torch

from zeroshard.checkpoint.format import (
    MANIFEST,
    exchange,
    file_name,
    fsync_dir,
    parameter_names,
    piece_key,
    raise_if_failed,
    write_text_atomic,
)
from zeroshard.checkpoint.shards import OwnedPiece, ShardAccess
from zeroshard.parallel.mesh import AXES
from zeroshard.progress import progress
from zeroshard.safetensors_io import DTYPE_NAMES, StreamWriter


def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {"rng:torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            out[f"rng:cuda:{i}"] = torch.cuda.get_rng_state(i)
    return out


def whole_tensors(engine) -> dict[str, tuple[torch.Tensor, bool]]:
    """Tensors saved whole by rank 0, by name, with whether each is a buffer: parameters
    outside the flat layout (frozen, at stages 0-2) and the persistent buffers."""
    in_flat = {id(p) for p in engine.flat.params}
    out = {}
    for name, p in engine.module.named_parameters():
        if id(p) not in in_flat:
            out[name] = (p.detach(), False)
    for name, b in engine.module.state_dict(keep_vars=True).items():
        if not isinstance(b, torch.nn.Parameter) and torch.is_tensor(b):
            out[name] = (b.detach(), True)
    return out


class CheckpointSaveError(RuntimeError):
    """A save that failed on some rank; raised on every rank, and nothing was published."""


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


def save(engine, save_dir: str, tag: str, client_state: dict | None, save_latest: bool) -> str:
    """Write ``save_dir/tag`` on every rank; publish it (rank 0) only if every rank
    succeeded. On any failure every rank raises :class:`CheckpointSaveError` (no rank
    is left waiting in a collective) and the previous checkpoints stay as they were."""
    comm, rank, device = engine.comm, engine.comm.rank, engine.device
    final = os.path.join(save_dir, tag)
    tmp = os.path.join(save_dir, f".tmp-{tag}")
    what = f"save_checkpoint({final!r})"

    # 1. rank 0 makes a clean temporary directory (a killed save may have left one)
    error = None
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except Exception as exc:
            error = exc
    failed, _ = exchange(comm, device, error)
    raise_if_failed(comm, failed, error, what, CheckpointSaveError)

    # 2. every rank writes its own file; rank 0 builds the manifest (and its JSON text)
    error, size, manifest = None, 0, None
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
        _write_rank_file(engine, access, names, kinds, path)
        size = os.path.getsize(path)
        if rank == 0:
            manifest = _manifest(engine, access, names, kinds, [], client_json, tag)
            _manifest_text(manifest)  # fails here, before any rank waits on rank 0
    except Exception as exc:
        error = exc
    failed, values = exchange(comm, device, error, (size,))
    if failed and rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    raise_if_failed(comm, failed, error, what, CheckpointSaveError)

    # 3. rank 0 writes the manifest and publishes: tag directory, fsync, then `latest`
    error = None
    if rank == 0:
        try:
            manifest["files"] = [
                {"name": file_name(r), "bytes": int(v[0])} for r, v in enumerate(values)
            ]
            write_text_atomic(os.path.join(tmp, MANIFEST), _manifest_text(manifest))
            fsync_dir(tmp)
            _publish(tmp, final)
            fsync_dir(save_dir)  # the new directory entry is durable before `latest` names it
            if save_latest:
                write_text_atomic(os.path.join(save_dir, "latest"), tag)
                fsync_dir(save_dir)
            # a save killed between the two renames of an overwrite leaves TAG.old
            shutil.rmtree(final + ".old", ignore_errors=True)
        except Exception as exc:
            error = exc
            shutil.rmtree(tmp, ignore_errors=True)
    failed, _ = exchange(comm, device, error)
    raise_if_failed(comm, failed, error, what, CheckpointSaveError)
    return final


def _pieces_to_write(engine, access, rank: int) -> list[OwnedPiece]:
    """The pieces ``rank`` writes. Sharded layouts: its own, if it is in the first
    replica (hybrid sharding keeps identical shards in the others). Unsharded ones
    (stage 0, or one rank): every rank holds everything, so the flat range is split in
    ``world`` equal parts and each rank writes one, in parallel, nothing written twice."""
    world = engine.comm.world_size
    if engine.flat.partitioned:
        return access.pieces if engine.mesh.coord("zero_replicate", rank) == 0 else []
    if world == 1:
        return access.pieces
    total = engine.flat.layout.shard_numel
    a, b = rank * total // world, (rank + 1) * total // world
    out = []
    for p in access.pieces:
        lo, hi = max(a, p.shard_lo), min(b, p.shard_lo + p.hi - p.lo)
        if lo < hi:
            d = lo - p.shard_lo
            out.append(replace(p, lo=p.lo + d, hi=p.lo + d + hi - lo, shard_lo=lo))
    return out


def _write_rank_file(engine, access, names, kinds, path: str) -> None:
    rank = engine.comm.rank
    entries, sources = [], []
    for piece in _pieces_to_write(engine, access, rank):
        name = names[piece.param]
        for kind in kinds if piece.group >= 0 else ["param"]:
            dtype = engine.flat.dtype if kind == "param" else torch.float32
            entries.append((piece_key(kind, name, piece.lo), dtype, [piece.hi - piece.lo]))
            sources.append((kind, piece))
    extra = _rng_tensors()
    if rank == 0:
        extra.update({f"whole:{n}": t for n, (t, _) in whole_tensors(engine).items()})
    for key, t in extra.items():
        entries.append((key, t.dtype, list(t.shape)))
    meta = {"rank": str(rank), "python_rng": json.dumps(random.getstate())}
    writer = StreamWriter(path, entries, meta)
    pieces = zip(sources, entries[: len(sources)], strict=True)
    shown = progress(pieces, desc="saving checkpoint", total=len(sources), enabled=rank == 0)
    for (kind, piece), (key, _, _) in shown:
        n = piece.hi - piece.lo
        writer.write(key, access.get(kind, piece.shard_lo, piece.shard_lo + n))
    for key, t in extra.items():
        writer.write(key, t)
    writer.close()


def _publish(tmp: str, final: str) -> None:
    """Rename the finished directory into place. An existing one is first renamed to
    ``TAG.old`` (which ``load`` falls back to if a kill lands between the renames); the
    caller removes ``TAG.old`` once ``latest`` is written."""
    if os.path.exists(final):
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)


def _manifest(engine, access, names, kinds, sizes, client_json, tag) -> dict:
    flat, world = engine.flat, engine.comm.world_size
    layout = flat.layout
    params: dict = {}
    for i in range(len(flat.params)):
        params[names[i]] = {
            "shape": list(flat.shapes[i]),
            "dtype": DTYPE_NAMES[flat.dtype],
            "group": flat.group_of[i],
            "pieces": [],
        }
    mesh = engine.mesh
    for r in range(world):
        if flat.partitioned:  # the first replica's ranks write the shards
            first = mesh.coord("zero_replicate", r) == 0
            pieces = layout.pieces(mesh.coord("zero_shard", r)) if first else []
            spans = [(p.param, p.param_lo, p.param_hi) for p in pieces]
        else:  # split as _pieces_to_write splits it (every rank has the same pieces)
            spans = [(p.param, p.lo, p.hi) for p in _pieces_to_write(engine, access, r)]
        for i, lo, hi in spans:
            params[names[i]]["pieces"].append([r, lo, hi])
    whole = {
        n: {"shape": list(t.shape), "dtype": DTYPE_NAMES[t.dtype], "buffer": is_buffer}
        for n, (t, is_buffer) in whole_tensors(engine).items()
    }
    opt = engine.optimizer
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
        for g in opt.param_groups
    ]
    for g, step in zip(groups, access.group_steps(), strict=True):
        g["step"] = step
    sched = engine.lr_scheduler
    return {
        "format": "zeroshard-checkpoint",
        "version": 1,
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
        "aliases": _aliases(engine),
        "whole": whole,
        "kinds": kinds,
        "optimizer": {"type": type(opt.inner).__name__, "groups": groups},
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
