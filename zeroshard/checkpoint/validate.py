"""Checks that run before a checkpoint is loaded, and the error they raise.

Finds the checkpoint directory (``tag`` or the one ``latest`` names; tags and ``latest``
must be plain names, and no symlink may lead out of the directory: ``paths.py``) and
checks, without writing anything: the manifest's structure and the ranges of its values,
every file's size, safetensors header layout and save id, that every piece the manifest
lists is in its file with the right shape and dtype (and, ``coverage.py``, that it lists
every tensor the files hold, as they recorded it), that the checkpoint fits the model
(names, shapes, dtype kinds) and that the live optimizer can take every saved state kind
and finds every one it needs;
:func:`scan_files` reads the bytes (``integrity.py``: checksums, non-finite values).
Failures raise :class:`CheckpointError` naming the file or parameters.

Communication: none; ``load.py`` exchanges the outcome across ranks.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random

from zeroshard.checkpoint.coverage import check_files_agree, check_optimizer_fits, dtype_problems
from zeroshard.checkpoint.format import (
    MANIFEST,
    CheckpointError,
    parameter_names,
    piece_key,
    saved_split,
    split_of,
)
from zeroshard.checkpoint.integrity import check_order, check_save_id, check_values, scan_file
from zeroshard.checkpoint.paths import LATEST, inside, tag_problem
from zeroshard.checkpoint.safetensors_io import DTYPES, read_header, read_header_raw
from zeroshard.checkpoint.shards import ShardAccess

log = logging.getLogger("zeroshard")

#: elementwise state each built-in optimizer can take (others: what they hold already,
#: or everything a checkpoint of the same optimizer type saved)
_STATE_KINDS = {
    "Adam": {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
    "AdamW": {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
    "SwappedAdam": {"exp_avg", "exp_avg_sq"},
    "SGD": {"momentum_buffer"},
}


def resolve_tag(load_dir: str, tag: str | None) -> str:
    """The tag to load: ``tag``, else the one ``latest`` names; ``TAG.old`` when a save
    was killed between the two renames of an overwrite (``TAG`` missing)."""
    if tag is not None:
        tag = str(tag)
        problem = tag_problem(tag)
        if problem:
            raise CheckpointError(f"{load_dir}: tag {tag!r} is not allowed: {problem}")
    else:
        latest = os.path.join(load_dir, LATEST)
        if not os.path.isfile(latest):
            found = sorted(os.listdir(load_dir)) if os.path.isdir(load_dir) else []
            raise CheckpointError(
                f"{load_dir}: no 'latest' file and no {MANIFEST}, so no checkpoint to load "
                f"(it holds {found[:5]}{'...' if len(found) > 5 else ''}; pass tag=, and note "
                "a .pt/.bin file is read only as part of a DeepSpeed checkpoint directory)"
            )
        if not inside(load_dir, latest):
            raise CheckpointError(f"{latest}: a symlink leading out of {load_dir}; refused")
        with open(latest, encoding="utf-8", errors="replace") as f:
            tag = f.read(4096).strip()
        problem = tag_problem(tag)
        if problem:
            raise CheckpointError(f"{latest}: holds {tag!r}, which is not a plain tag ({problem})")
    if not os.path.isdir(os.path.join(load_dir, tag)) and os.path.isdir(
        os.path.join(load_dir, tag + ".old")
    ):
        return tag + ".old"  # killed between the two renames of an overwrite
    return tag


def resolve_path(load_dir: str, tag: str | None) -> str:
    """A checkpoint directory: ``load_dir/tag``, ``load_dir`` itself if it is one, or
    the one ``load_dir/latest`` names. A tag directory that is a symlink leading out of
    ``load_dir`` is refused."""
    if tag is None and os.path.isfile(os.path.join(load_dir, MANIFEST)):
        return load_dir
    path = os.path.join(load_dir, resolve_tag(load_dir, tag))
    if os.path.lexists(path) and not inside(load_dir, path):
        raise CheckpointError(f"{path}: a symlink leading out of {load_dir}; refused")
    return path


def read_manifest(path: str, root: str | None = None) -> dict:
    """The manifest of checkpoint directory ``path``, after checking it and every file
    it lists (inside ``root``, default ``path``, with no symlink leading out; size,
    header layout, written by the same save, every listed piece present with its shape
    and dtype). Raises :class:`CheckpointError` naming the file at fault. The bytes
    themselves are checked by :func:`scan_files`."""
    root = path if root is None else root
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not os.path.isfile(mpath):
        found = sorted(os.listdir(path))
        raise CheckpointError(
            f"{mpath}: missing; {path} is not a complete zeroshard checkpoint "
            f"(it holds {found[:5]}{'...' if len(found) > 5 else ''}; a .pt/.bin file is read "
            "only as part of a DeepSpeed checkpoint directory)"
        )
    if not inside(root, mpath):
        raise CheckpointError(f"{mpath}: a symlink leading out of {root}; refused")
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{mpath}: unreadable manifest (corrupt JSON?): {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != "zeroshard-checkpoint":
        raise CheckpointError(f"{mpath}: not a zeroshard checkpoint manifest")
    check_manifest(manifest, mpath)
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
        if not inside(root, fpath):
            raise CheckpointError(f"{fpath}: a symlink leading out of {root}; refused")
        if os.path.getsize(fpath) != entry["bytes"]:
            raise CheckpointError(
                f"{fpath}: {os.path.getsize(fpath)} bytes, the manifest says {entry['bytes']} (truncated?)"
            )
        try:
            header = read_header(fpath)
            check_order(fpath, header)
            check_save_id(fpath, header, manifest)
        except (OSError, ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
            msg = str(exc)  # read_header's messages start with the path already
            if not msg.startswith(fpath):
                msg = f"{fpath}: corrupt safetensors header ({msg})"
            raise CheckpointError(msg) from exc
        headers.append(header)
    _check_pieces(path, manifest, headers)
    check_files_agree(path, manifest, headers)
    return manifest


def check_manifest(manifest: dict, where: str) -> None:
    """The structure and value ranges of a manifest (ours, or one describing a DeepSpeed
    checkpoint); raises :class:`CheckpointError` naming ``where``."""
    try:
        _check_structure(manifest)
        check_values(manifest)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise CheckpointError(f"{where}: malformed manifest ({type(exc).__name__}: {exc})") from exc


def scan_files(
    path: str, manifest: dict, indices, *, verify: bool = True, allow_nonfinite: bool = False
) -> None:
    """Read the rank files ``indices`` of a checked checkpoint (:func:`read_manifest`)
    once: checksums (``verify``) and non-finite values (unless ``allow_nonfinite``).
    A checkpoint saved without checksums (format version 1) is not verified (logged)."""
    if verify and manifest.get("version", 1) < 2:
        log.warning("zeroshard: %s was saved without checksums (version 1); not verified", path)
    for i in indices:
        entry = manifest["files"][i]
        fpath = os.path.join(path, entry["name"])
        try:
            header, raw = read_header_raw(fpath)
            scan_file(
                fpath,
                header,
                raw,
                entry.get("header_crc32"),
                verify=verify,
                allow_nonfinite=allow_nonfinite,
            )
        except (OSError, ValueError) as exc:
            msg = str(exc)
            raise CheckpointError(msg if msg.startswith(fpath) else f"{fpath}: {msg}") from exc


def _check_structure(m: dict) -> None:
    """Types of everything load and export read from the manifest."""
    if not isinstance(m["files"], list) or not m["files"]:
        raise CheckpointError("'files' must be a non-empty list")
    for e in m["files"]:
        if not isinstance(e["name"], str) or not isinstance(e["bytes"], int):
            raise CheckpointError(f"bad 'files' entry {e!r}")
    nfiles = len(m["files"])
    kinds = m["kinds"]
    if not isinstance(kinds, list) or "param" not in kinds:
        raise CheckpointError("'kinds' must be a list holding 'param'")
    for name, e in m["params"].items():
        if e["dtype"] not in DTYPES or not isinstance(e["group"], int):
            raise CheckpointError(f"params[{name!r}]: bad dtype or group")
        if not all(isinstance(d, int) and d >= 0 for d in e["shape"]):
            raise CheckpointError(f"params[{name!r}]: bad shape {e['shape']!r}")
        _check_tiling(name, e, nfiles)
    for name, e in m["whole"].items():
        if e["dtype"] not in DTYPES or not all(isinstance(d, int) for d in e["shape"]):
            raise CheckpointError(f"whole[{name!r}]: bad dtype or shape")
    for alias, name in m.get("aliases", {}).items():
        if name not in m["params"] and name not in m["whole"]:
            raise CheckpointError(f"alias {alias!r} names {name!r}, which is not saved")
    if not isinstance(m["optimizer"]["groups"], list):
        raise CheckpointError("'optimizer.groups' must be a list")
    for g in m["optimizer"]["groups"]:
        float(g["step"])
    ngroups = len(m["optimizer"]["groups"])
    for name, e in m["params"].items():
        if e["group"] >= ngroups:
            raise CheckpointError(
                f"params[{name!r}]: group {e['group']}, but {ngroups} groups saved"
            )
    if not isinstance(m["counters"], dict) or not isinstance(m["loss_scaler"], dict):
        raise CheckpointError("'counters' and 'loss_scaler' must be objects")
    int(m["world_size"])


def _check_tiling(name: str, e: dict, nfiles: int) -> None:
    """The pieces of a parameter tile it exactly; a tensor-parallel save's tile each TP
    rank's slice (``tp``: its split dim, fused parts and TP size)."""
    numel, split = math.prod(e["shape"]), saved_split(e)
    world = 1
    if split is not None:
        world = split["world"]
        ok = isinstance(world, int) and world >= 1 and isinstance(split["dim"], int)
        ok = (
            ok
            and 0 <= split["dim"] < len(e["shape"])
            and sum(split["parts"]) == e["shape"][split["dim"]]
        )
        if not ok or any(p % world for p in split["parts"]):
            raise CheckpointError(f"params[{name!r}]: bad split {split!r}")
    for t in range(world):
        covered = 0
        mine = [p for p in e["pieces"] if (p[3] if len(p) > 3 else 0) == t]
        for rank, lo, hi, *_ in sorted(mine, key=lambda x: x[1]):
            if not (0 <= rank < nfiles) or lo != covered or hi <= lo:
                raise CheckpointError(f"params[{name!r}]: pieces {e['pieces']!r} do not tile it")
            covered = hi
        if covered != numel // world:
            raise CheckpointError(f"params[{name!r}]: pieces cover {covered} of {numel // world}")


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
        for rank, lo, hi, *_ in e["pieces"]:
            for kind in kinds if e["group"] >= 0 else ["param"]:
                dtype = e["dtype"] if kind == "param" else "F32"
                need(rank, piece_key(kind, name, lo), [hi - lo], dtype)
    for name, e in manifest["whole"].items():
        need(e.get("rank", 0), f"whole:{name}", e["shape"], e["dtype"])


def check_model(manifest: dict, engine, path: str, strict: bool = True) -> set[str]:
    """Parameter and buffer names and shapes must match the model; say which do not.

    A shape mismatch is always an error; missing or unexpected names are an error when
    ``strict``, else a warning. Returns the names to load (in both)."""
    from zeroshard.checkpoint.save import whole_tensors

    ours = {}
    # slices (tensor-parallel, fused experts): whole shapes; experts of every
    # expert-parallel rank, under their global names
    for ep_rank in range(engine.mesh.size("ep")):
        for i, n in enumerate(parameter_names(engine, ep_rank)):
            split = split_of(engine.flat.params[i])
            ours[n] = list(split[1].full_shape if split else engine.flat.shapes[i])
    whole = whole_tensors(engine)
    ours.update({n: list(t.shape) for n, (t, _) in whole.items()})
    theirs = {n: v["shape"] for n, v in manifest["params"].items()}
    theirs.update({n: v["shape"] for n, v in manifest["whole"].items()})
    missing = sorted(set(ours) - set(theirs))
    unexpected = sorted(set(theirs) - set(ours))
    if engine.mesh.size("pp") > 1:  # the other stages' parameters
        unexpected = []
    shapes = sorted(n for n in set(ours) & set(theirs) if ours[n] != theirs[n])
    dtypes = dtype_problems(manifest, {n: t.dtype for n, (t, _) in whole.items()})
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
    if dtypes:
        problems.append(
            "dtype mismatch: " + ", ".join(dtypes[:8]) + ("..." if len(dtypes) > 8 else "")
        )
    if shapes or dtypes or (problems and strict):
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
    live = type(engine.optimizer.inner)
    held = {k for k in access.kinds() if k not in ("param", "master")}
    known = [_STATE_KINDS[c.__name__] for c in live.__mro__ if c.__name__ in _STATE_KINDS]
    ok = held | (known[0] if known else set())
    if not known and live.__name__ == manifest["optimizer"].get("type"):
        ok |= set(manifest["kinds"])  # the same client optimizer: it made these
    return ok


def validate(
    engine, path: str, manifest: dict, *, strict: bool, with_opt: bool, training: bool
) -> set[str]:
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
        check_optimizer_fits(engine, path, manifest, names)
    same_ranks = manifest["world_size"] == engine.comm.world_size
    if training and same_ranks and manifest.get("rng", True):  # DeepSpeed's save none
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


__all__ = [
    "CheckpointError",
    "check_manifest",
    "check_model",
    "read_manifest",
    "resolve_path",
    "resolve_tag",
    "scan_files",
    "validate",
]
