"""Saving a sharded checkpoint: every rank writes its own pieces, in parallel; rank 0
writes the JSON manifest and publishes the directory atomically.

Communication: one barrier before the manifest and one after publishing, plus an
all-reduce of one integer per rank (file sizes, recorded for truncation checks).

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

import torch

from zeroshard.checkpoint.format import (
    MANIFEST,
    file_name,
    fsync_dir,
    parameter_names,
    piece_key,
    write_text_atomic,
)
from zeroshard.checkpoint.shards import ShardAccess
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


def save(engine, save_dir: str, tag: str, client_state: dict | None, save_latest: bool) -> str:
    comm, rank = engine.comm, engine.comm.rank
    try:
        client_json = json.dumps(client_state or {})
    except TypeError as exc:
        raise TypeError(f"save_checkpoint: client_state must be JSON-serializable: {exc}") from exc
    final = os.path.join(save_dir, tag)
    tmp = os.path.join(save_dir, f".tmp-{tag}")
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save killed earlier
        os.makedirs(tmp)
    comm.barrier()

    access = ShardAccess(engine)
    names = parameter_names(engine)
    kinds = access.kinds()
    entries, sources = [], []
    for piece in access.pieces:
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
    path = os.path.join(tmp, file_name(rank))
    writer = StreamWriter(path, entries, meta)
    for (kind, piece), (key, _, _) in zip(sources, entries[: len(sources)], strict=True):
        n = piece.hi - piece.lo
        writer.write(key, access.get(kind, piece.shard_lo, piece.shard_lo + n))
    for key, t in extra.items():
        writer.write(key, t)
    writer.close()

    sizes = torch.zeros(comm.world_size, dtype=torch.int64)
    sizes[rank] = os.path.getsize(path)
    comm.all_reduce(sizes)
    if rank == 0:
        manifest = _manifest(engine, access, names, kinds, sizes.tolist(), client_json, tag)
        write_text_atomic(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1))
        fsync_dir(tmp)
        _publish(tmp, final)
        if save_latest:
            write_text_atomic(os.path.join(save_dir, "latest"), tag)
        fsync_dir(save_dir)
    comm.barrier()
    return final


def _publish(tmp: str, final: str) -> None:
    """Rename the finished directory into place (keeping an old one until then)."""
    old = None
    if os.path.exists(final):
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    if old:
        shutil.rmtree(old, ignore_errors=True)


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
    owners = range(world) if flat.sharded else [0]
    for r in owners:
        for piece in layout.pieces(r):
            params[names[piece.param]]["pieces"].append([r, piece.param_lo, piece.param_hi])
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
