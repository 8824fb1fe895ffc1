"""Loading a checkpoint into an engine of any world size, stage and offload.

Each rank reads only the slices it now owns, straight from whichever files hold them
(memory-mapped safetensors slices), and writes them wherever its layout keeps them.
Nothing is unpickled: only ``manifest.json`` and ``*.safetensors`` are ever opened.

Everything is validated before anything is written into the engine: the manifest's
structure, every file's size and safetensors header, that every piece the manifest
lists is in its file with the right shape and dtype, that the checkpoint fits the
model and that the live optimizer can take every saved state kind. A failed load
raises :class:`CheckpointError` naming the file or parameters and leaves the engine
untouched.

Communication: one all-reduce of a tiny int64 table (did validation fail on any rank?)
before writing, so every rank raises or every rank loads; at stages 0-2 the loaded
chunks are re-assembled into whole parameters (one all-gather per segment, as after a
step); a barrier at the end.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random

import torch
from safetensors import safe_open

from zeroshard.checkpoint.format import (
    MANIFEST,
    exchange,
    parameter_names,
    piece_key,
    raise_if_failed,
)
from zeroshard.checkpoint.shards import ShardAccess
from zeroshard.safetensors_io import DTYPE_NAMES, DTYPES, read_header

log = logging.getLogger("zeroshard")

#: elementwise state each built-in optimizer can take (others: what they hold already,
#: or everything a checkpoint of the same optimizer type saved)
_STATE_KINDS = {
    "Adam": {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
    "AdamW": {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
    "SwappedAdam": {"exp_avg", "exp_avg_sq"},
    "SGD": {"momentum_buffer"},
}


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
    """The manifest of checkpoint directory ``path``, after checking it and every file
    it lists (size, header, every listed piece present with its shape and dtype).
    Raises :class:`CheckpointError` naming the file at fault."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not os.path.isfile(mpath):
        found = sorted(os.listdir(path))
        raise CheckpointError(
            f"{mpath}: missing; {path} is not a complete zeroshard checkpoint "
            f"(it holds {found[:5]}{'...' if len(found) > 5 else ''}; .pt/.bin pickles are never loaded)"
        )
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{mpath}: unreadable manifest (corrupt JSON?): {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != "zeroshard-checkpoint":
        raise CheckpointError(f"{mpath}: not a zeroshard checkpoint manifest")
    try:
        _check_structure(manifest)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise CheckpointError(f"{mpath}: malformed manifest ({type(exc).__name__}: {exc})") from exc
    headers = []
    for entry in manifest["files"]:
        fpath = os.path.join(path, entry["name"])
        if os.path.basename(entry["name"]) != entry["name"] or not entry["name"].endswith(
            ".safetensors"
        ):
            raise CheckpointError(
                f"{mpath}: file name {entry['name']!r} is not a safetensors file here"
            )
        if not os.path.isfile(fpath):
            raise CheckpointError(f"{fpath}: missing (the manifest lists it)")
        if os.path.getsize(fpath) != entry["bytes"]:
            raise CheckpointError(
                f"{fpath}: {os.path.getsize(fpath)} bytes, the manifest says {entry['bytes']} (truncated?)"
            )
        try:
            header = read_header(fpath)
            _check_header(header)
        except (OSError, ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
            msg = str(exc)  # read_header's messages start with the path already
            if not msg.startswith(fpath):
                msg = f"{fpath}: corrupt safetensors header ({msg})"
            raise CheckpointError(msg) from exc
        headers.append(header)
    _check_pieces(path, manifest, headers)
    return manifest


def _check_structure(m: dict) -> None:
    """Types of everything load and export read from the manifest."""
    if not isinstance(m["files"], list) or not m["files"]:
        raise ValueError("'files' must be a non-empty list")
    for e in m["files"]:
        if not isinstance(e["name"], str) or not isinstance(e["bytes"], int):
            raise ValueError(f"bad 'files' entry {e!r}")
    nfiles = len(m["files"])
    kinds = m["kinds"]
    if not isinstance(kinds, list) or "param" not in kinds:
        raise ValueError("'kinds' must be a list holding 'param'")
    for name, e in m["params"].items():
        if e["dtype"] not in DTYPES or not isinstance(e["group"], int):
            raise ValueError(f"params[{name!r}]: bad dtype or group")
        if not all(isinstance(d, int) and d >= 0 for d in e["shape"]):
            raise ValueError(f"params[{name!r}]: bad shape {e['shape']!r}")
        covered = 0
        for rank, lo, hi in sorted(e["pieces"], key=lambda x: x[1]):
            if not (0 <= rank < nfiles) or lo != covered or hi <= lo:
                raise ValueError(f"params[{name!r}]: pieces {e['pieces']!r} do not tile it")
            covered = hi
        if covered != math.prod(e["shape"]):
            raise ValueError(f"params[{name!r}]: pieces cover {covered} of {math.prod(e['shape'])}")
    for name, e in m["whole"].items():
        if e["dtype"] not in DTYPES or not all(isinstance(d, int) for d in e["shape"]):
            raise ValueError(f"whole[{name!r}]: bad dtype or shape")
    for alias, name in m.get("aliases", {}).items():
        if name not in m["params"]:
            raise ValueError(f"alias {alias!r} names {name!r}, which is not saved")
    if not isinstance(m["optimizer"]["groups"], list):
        raise ValueError("'optimizer.groups' must be a list")
    for g in m["optimizer"]["groups"]:
        float(g["step"])
    if not isinstance(m["counters"], dict) or not isinstance(m["loss_scaler"], dict):
        raise ValueError("'counters' and 'loss_scaler' must be objects")
    int(m["world_size"])


def _check_header(header: dict) -> None:
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    for k, v in header.items():
        if k == "__metadata__":
            continue
        if v["dtype"] not in DTYPES or len(v["data_offsets"]) != 2:
            raise ValueError(f"tensor {k!r}: bad dtype or offsets")
        a, b = v["data_offsets"]
        want = math.prod(v["shape"]) * torch.empty((), dtype=DTYPES[v["dtype"]]).element_size()
        if b - a != want or a < 0:
            raise ValueError(f"tensor {k!r}: {b - a} bytes for shape {v['shape']}")


def _check_pieces(path: str, manifest: dict, headers: list[dict]) -> None:
    """Every tensor the manifest promises is in its file, with its shape and dtype."""
    kinds = manifest["kinds"]

    def need(rank: int, key: str, shape: list, dtype: str) -> None:
        entry = headers[rank].get(key)
        if entry is None or list(entry["shape"]) != list(shape) or entry["dtype"] != dtype:
            fpath = os.path.join(path, manifest["files"][rank]["name"])
            got = "absent" if entry is None else f"{entry['dtype']} {entry['shape']}"
            raise CheckpointError(
                f"{fpath}: tensor {key!r} should be {dtype} {list(shape)} (the manifest says), "
                f"found {got}"
            )

    for name, e in manifest["params"].items():
        for rank, lo, hi in e["pieces"]:
            for kind in kinds if e["group"] >= 0 else ["param"]:
                dtype = e["dtype"] if kind == "param" else "F32"
                need(rank, piece_key(kind, name, lo), [hi - lo], dtype)
    for name, e in manifest["whole"].items():
        need(0, f"whole:{name}", e["shape"], e["dtype"])


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
        keys = f.keys()
        return {k: f.get_tensor(k) for k in keys if k.startswith("rng:")}, f.metadata() or {}


def check_model(manifest: dict, engine, path: str, strict: bool = True) -> set[str]:
    """Parameter and buffer names and shapes must match the model; say which do not.

    A shape mismatch is always an error; missing or unexpected names are an error when
    ``strict``, else a warning. Returns the names to load (in both)."""
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
        problems.append(
            f"missing from the checkpoint: {missing[:8]}{'...' if len(missing) > 8 else ''}"
        )
    if unexpected:
        problems.append(f"not in the model: {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    if shapes:
        problems.append(
            "shape mismatch: "
            + ", ".join(f"{n} {theirs[n]} vs model {ours[n]}" for n in shapes[:8])
        )
    if shapes or (problems and strict):
        raise CheckpointError(
            f"{path}: the checkpoint does not fit this model; " + "; ".join(problems)
        )
    if problems:
        log.warning(
            "zeroshard: load_checkpoint(%s, load_module_strict=False): %s",
            path,
            "; ".join(problems),
        )
    return set(ours) & set(theirs)


def _accepted_kinds(engine, access: ShardAccess, manifest: dict) -> set[str]:
    live = type(engine.optimizer.inner).__name__
    ok = set(access.state_keys()) | _STATE_KINDS.get(live, set())
    if live not in _STATE_KINDS and live == manifest["optimizer"].get("type"):
        ok |= set(manifest["kinds"])  # the same client optimizer: it made these
    return ok


def validate(engine, path: str, manifest: dict, *, strict: bool, with_opt: bool, training: bool):
    """Everything a load needs, checked before anything is written. Returns the names
    to load."""
    names = check_model(manifest, engine, path, strict)
    if with_opt:
        groups = manifest["optimizer"]["groups"]
        if len(groups) != len(engine.optimizer.param_groups):
            raise CheckpointError(
                f"{path}: {len(groups)} optimizer param groups saved, the engine has "
                f"{len(engine.optimizer.param_groups)}; load with load_optimizer_states=False"
            )
        access = ShardAccess(engine)
        saved = [k for k in manifest["kinds"] if k not in ("param", "master")]
        refused = sorted(set(saved) - _accepted_kinds(engine, access, manifest))
        if refused:
            raise CheckpointError(
                f"{path}: the checkpoint holds optimizer state {refused} "
                f"(saved by {manifest['optimizer'].get('type')}), which this engine's "
                f"{type(engine.optimizer.inner).__name__} cannot take; load with "
                "load_optimizer_states=False"
            )
    if training and manifest["world_size"] == engine.comm.world_size:
        rank = engine.comm.rank
        fpath = os.path.join(path, manifest["files"][rank]["name"])
        header = read_header(fpath)
        ours = random.getstate()
        try:
            if "rng:torch" not in header:
                raise KeyError("rng:torch")
            state = json.loads(header["__metadata__"]["python_rng"])
            random.setstate((state[0], tuple(state[1]), state[2]))  # the real check
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise CheckpointError(
                f"{fpath}: no usable random-number-generator state ({exc})"
            ) from exc
        finally:
            random.setstate(ours)
    return names


def load_checkpoint(
    engine,
    load_dir: str,
    tag: str | None = None,
    *,
    strict: bool = True,
    optimizer_states: bool = True,
    scheduler_states: bool = True,
    module_only: bool = False,
) -> tuple[str, dict]:
    """Find, check and load a checkpoint into ``engine``; every rank raises (naming the
    file or parameters) or every rank loads. Returns ``(path, client_state)``."""
    comm = engine.comm
    with_opt = optimizer_states and not module_only
    error, path, manifest, names = None, None, None, None
    try:
        path = resolve_path(load_dir, tag)
        manifest = read_manifest(path)
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
    client = load(
        engine,
        path,
        manifest,
        optimizer_states=optimizer_states,
        scheduler_states=scheduler_states,
        module_only=module_only,
        names=names,
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
):
    """Write a checked checkpoint into ``engine`` (see :func:`load_checkpoint`).
    ``names``: the tensors to load (default: all, after :func:`validate`)."""
    with_opt = optimizer_states and not module_only
    if names is None:
        names = validate(
            engine, path, manifest, strict=True, with_opt=with_opt, training=not module_only
        )
    reader = _Reader(path, manifest)
    access = ShardAccess(engine)
    flat_names = parameter_names(engine)
    kinds = set(manifest["kinds"])
    state_kinds = [k for k in manifest["kinds"] if k not in ("param", "master")]
    dtype = engine.flat.dtype
    # fp32 parameters take the fp32 masters when the checkpoint has them (exact resume)
    param_kind = "master" if "master" in kinds and dtype == torch.float32 else "param"
    with torch.no_grad():
        for piece in access.pieces:
            name, a = flat_names[piece.param], piece.shard_lo
            if name not in names:  # load_module_strict=False: keep this one as it is
                continue
            saved = manifest["params"].get(name)  # None: saved whole (frozen at stages 0-2)
            trained = saved is not None and saved["group"] >= 0  # saved with its states
            kind = param_kind if trained else "param"
            access.set("param", a, reader.get(kind, name, piece.lo, piece.hi, dtype))
            if piece.group < 0:
                continue
            if access.has_master():
                src = "master" if "master" in kinds and trained else "param"
                access.set("master", a, reader.get(src, name, piece.lo, piece.hi, torch.float32))
            if with_opt and trained:
                # every saved kind, not only those the live optimizer holds already (a
                # fresh SGD has no momentum_buffer until its first step)
                for key in state_kinds:
                    access.set(key, a, reader.get(key, name, piece.lo, piece.hi, torch.float32))
        in_flat = {id(p) for p in engine.flat.params}
        for n, p in engine.module.named_parameters():
            if id(p) not in in_flat and n in names:
                p.copy_(reader.whole(n))
        buffers = dict(engine.module.named_buffers())
        for n in manifest["whole"]:
            if n in buffers and n in names:
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


__all__ = [
    "DTYPE_NAMES",
    "CheckpointError",
    "load",
    "load_checkpoint",
    "read_manifest",
    "resolve_tag",
]
