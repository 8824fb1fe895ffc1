"""Loading a checkpoint into an engine of any world size, stage and offload.

Each rank reads only the slices it now owns, straight from whichever files hold them
(memory-mapped safetensors slices), and writes them wherever its layout keeps them.
Nothing is unpickled: only ``manifest.json`` and ``*.safetensors`` are ever opened.

Communication: at stages 0-2 the loaded chunks are re-assembled into whole parameters
(one all-gather per segment, as after a step); a barrier at the end.
"""

from __future__ import annotations

import json
import os
import random

import torch
from safetensors import safe_open

from zeroshard.checkpoint.format import MANIFEST, parameter_names, piece_key
from zeroshard.checkpoint.shards import ShardAccess
from zeroshard.safetensors_io import DTYPE_NAMES, DTYPES, read_header


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or parameters."""


def resolve_tag(load_dir: str, tag: str | None) -> str:
    """The tag to load: ``tag``, else the one ``latest`` names."""
    if tag is not None:
        return tag
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        found = sorted(os.listdir(load_dir)) if os.path.isdir(load_dir) else []
        raise CheckpointError(
            f"{load_dir}: no 'latest' file and no {MANIFEST}, so no checkpoint to load "
            f"(it holds {found[:5]}{'...' if len(found) > 5 else ''}; pass tag=, and note "
            ".pt/.bin pickles are never loaded)"
        )
    with open(latest) as f:
        tag = f.read().strip()
    if not os.path.isdir(os.path.join(load_dir, tag)) and os.path.isdir(
        os.path.join(load_dir, tag + ".old")
    ):
        return tag + ".old"  # killed between the two renames of an overwrite
    return tag


def resolve_path(load_dir: str, tag: str | None) -> str:
    """A checkpoint directory: ``load_dir/tag``, ``load_dir`` itself if it is one, or
    the one ``load_dir/latest`` names."""
    if tag is None and os.path.isfile(os.path.join(load_dir, MANIFEST)):
        return load_dir
    return os.path.join(load_dir, resolve_tag(load_dir, tag))


def read_manifest(path: str) -> dict:
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not os.path.isfile(mpath):
        found = sorted(os.listdir(path))
        raise CheckpointError(
            f"{mpath}: missing; {path} is not a complete zeroshard checkpoint "
            f"(it holds {found[:5]}{'...' if len(found) > 5 else ''}; .pt/.bin pickles are never loaded)"
        )
    with open(mpath) as f:
        manifest = json.load(f)
    if manifest.get("format") != "zeroshard-checkpoint":
        raise CheckpointError(f"{mpath}: not a zeroshard checkpoint manifest")
    for entry in manifest["files"]:
        fpath = os.path.join(path, entry["name"])
        if not os.path.isfile(fpath):
            raise CheckpointError(f"{fpath}: missing (the manifest lists it)")
        if os.path.getsize(fpath) != entry["bytes"]:
            raise CheckpointError(
                f"{fpath}: {os.path.getsize(fpath)} bytes, the manifest says {entry['bytes']} (truncated?)"
            )
        read_header(fpath)
    return manifest


class _Reader:
    """Slices of pieces, from whichever rank files hold them."""

    def __init__(self, path: str, manifest: dict) -> None:
        self.path, self.manifest = path, manifest
        self._open: dict[int, object] = {}

    def _file(self, rank: int):
        if rank not in self._open:
            name = self.manifest["files"][rank]["name"]
            self._open[rank] = safe_open(os.path.join(self.path, name), framework="pt")
        return self._open[rank]

    def get(self, kind: str, name: str, a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
        """Elements ``[a, b)`` of parameter ``name``'s flattened ``kind``."""
        if name not in self.manifest["params"]:  # saved whole (frozen, at stages 0-2)
            return self.whole(name).reshape(-1)[a:b].to(dtype)
        out = torch.zeros(b - a, dtype=dtype)
        filled = 0
        for rank, lo, hi in self.manifest["params"][name]["pieces"]:
            s, e = max(a, lo), min(b, hi)
            if s >= e:
                continue
            part = self._file(rank).get_slice(piece_key(kind, name, lo))[s - lo : e - lo]
            out[s - a : e - a] = part.to(dtype)
            filled += e - s
        if filled != b - a:
            raise CheckpointError(f"{self.path}: pieces of {kind} {name!r} do not cover [{a}, {b})")
        return out

    def whole(self, name: str) -> torch.Tensor:
        if name in self.manifest["params"]:  # saved as pieces (stage 3)
            entry = self.manifest["params"][name]
            n = 1
            for d in entry["shape"]:
                n *= d
            return self.get("param", name, 0, n, DTYPES[entry["dtype"]]).view(entry["shape"])
        return self._file(0).get_tensor(f"whole:{name}")

    def rank_tensors(self, rank: int) -> tuple[dict, dict]:
        f = self._file(rank)
        return {k: f.get_tensor(k) for k in f if k.startswith("rng:")}, f.metadata() or {}


def check_model(manifest: dict, engine, path: str) -> None:
    """Parameter and buffer names and shapes must match the model; say which do not."""
    from zeroshard.checkpoint.save import whole_tensors

    ours = {n: list(engine.flat.shapes[i]) for i, n in enumerate(parameter_names(engine))}
    ours.update({n: list(t.shape) for n, (t, _) in whole_tensors(engine).items()})
    theirs = {n: v["shape"] for n, v in manifest["params"].items()}
    theirs.update({n: v["shape"] for n, v in manifest["whole"].items()})
    missing = sorted(set(ours) - set(theirs))
    unexpected = sorted(set(theirs) - set(ours))
    shapes = sorted(n for n in set(ours) & set(theirs) if ours[n] != theirs[n])
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {missing[:8]}")
    if unexpected:
        problems.append(f"not in the model: {unexpected[:8]}")
    if shapes:
        problems.append(
            "shape mismatch: "
            + ", ".join(f"{n} {theirs[n]} vs model {ours[n]}" for n in shapes[:8])
        )
    if problems:
        raise CheckpointError(
            f"{path}: the checkpoint does not fit this model; " + "; ".join(problems)
        )


def load(
    engine,
    path: str,
    manifest: dict,
    *,
    optimizer_states: bool,
    scheduler_states: bool,
    module_only: bool,
):
    check_model(manifest, engine, path)
    reader = _Reader(path, manifest)
    access = ShardAccess(engine)
    names = parameter_names(engine)
    kinds = set(manifest["kinds"])
    dtype = engine.flat.dtype
    # fp32 parameters take the fp32 masters when the checkpoint has them (exact resume)
    param_kind = "master" if "master" in kinds and dtype == torch.float32 else "param"
    with_opt = optimizer_states and not module_only
    if with_opt and len(manifest["optimizer"]["groups"]) != len(engine.optimizer.param_groups):
        raise CheckpointError(
            f"{path}: {len(manifest['optimizer']['groups'])} optimizer param groups saved, "
            f"the engine has {len(engine.optimizer.param_groups)}; load with load_optimizer_states=False"
        )
    with torch.no_grad():
        for piece in access.pieces:
            name, a = names[piece.param], piece.shard_lo
            saved = manifest["params"].get(name)  # None: saved whole (frozen at stages 0-2)
            kind = param_kind if saved is not None and saved["group"] >= 0 else "param"
            access.set("param", a, reader.get(kind, name, piece.lo, piece.hi, dtype))
            if piece.group < 0:
                continue
            if access.has_master():
                src = "master" if "master" in kinds else "param"
                access.set("master", a, reader.get(src, name, piece.lo, piece.hi, torch.float32))
            if with_opt:
                for key in access.state_keys():
                    if key in kinds:
                        access.set(key, a, reader.get(key, name, piece.lo, piece.hi, torch.float32))
        in_flat = {id(p) for p in engine.flat.params}
        for n, p in engine.module.named_parameters():
            if id(p) not in in_flat:
                p.copy_(reader.whole(n))
        buffers = dict(engine.module.named_buffers())
        for n in manifest["whole"]:
            if n in buffers:
                buffers[n].copy_(reader.whole(n))
    engine.params.after_step()  # stages 0-2: re-assemble whole parameters
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
        engine.loss_scaler.load_state_dict(manifest["loss_scaler"])
    sched = engine.lr_scheduler
    if scheduler_states and sched is not None and manifest.get("scheduler") is not None:
        sched.load_state_dict(manifest["scheduler"])
    for k, v in manifest["counters"].items():
        setattr(engine, k, v)
    rank = engine.comm.rank
    if manifest["world_size"] == engine.comm.world_size:  # same ranks: same random streams
        rng, meta = reader.rank_tensors(rank)
        torch.set_rng_state(rng["rng:torch"])
        if torch.cuda.is_available():
            for k, v in rng.items():
                if k.startswith("rng:cuda:") and int(k.split(":")[2]) < torch.cuda.device_count():
                    torch.cuda.set_rng_state(v, int(k.split(":")[2]))
        state = json.loads(meta["python_rng"])
        random.setstate((state[0], tuple(state[1]), state[2]))


__all__ = ["DTYPE_NAMES", "CheckpointError", "load", "read_manifest", "resolve_tag"]
