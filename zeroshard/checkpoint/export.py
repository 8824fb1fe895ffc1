"""Consolidated weights: one safetensors file (or a sharded set with a Hugging Face
style index) whose keys load with ``model.load_state_dict``.

``export_checkpoint`` streams from a checkpoint directory: each tensor is assembled
from its pieces and written before the next is read, so peak memory is about one
tensor. ``save_16bit_model`` does the same from a live engine, gathering one parameter
at a time (stage 3: one all-gather per unit; rank 0 writes).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil

import torch
from safetensors import safe_open

from zeroshard import ArgumentError
from zeroshard.checkpoint import sources
from zeroshard.checkpoint.ds_checkpoint import DeepSpeedReader, deepspeed_path, open_deepspeed
from zeroshard.checkpoint.format import (
    CheckpointError,
    exchange,
    raise_if_failed,
    write_text_atomic,
)
from zeroshard.checkpoint.load import PieceReader, read_manifest, resolve_path, scan_files
from zeroshard.checkpoint.safetensors_io import DTYPES, StreamWriter, dtype_size, read_header
from zeroshard.checkpoint.save import CheckpointSaveError
from zeroshard.monitor.progress import progress

MODEL_KEY = "zeroshard_model"  # safetensors metadata: the model's description (JSON)
DTYPE_ARGS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def size_bytes(text: str) -> int:
    """A shard size as written on a command line or in ``max_shard_size``: ``"5GB"``,
    ``"500MiB"``, ``"1000"`` (bytes)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ArgumentError(f"not a size: {text!r} (e.g. 5GB, 500MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _plan(entries, max_shard_bytes: int | None) -> list[list]:
    shards: list[list] = []
    current: list = []
    size = 0
    for e in entries:
        nbytes = math.prod(e[2]) * dtype_size(e[1])
        if current and max_shard_bytes and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(e)
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def write_weights(
    out: str, entries, fetch, max_shard_bytes: int | None = None, metadata: dict | None = None
) -> list[str]:
    """Write ``entries`` (name, dtype, shape) to ``out`` (a ``.safetensors`` path, or a
    directory for several shards plus ``model.safetensors.index.json``), calling
    ``fetch(name)`` for each tensor in turn; ``metadata`` goes into every file's header
    (the model's description under ``zeroshard_model``)."""
    metadata = metadata or {"format": "pt"}
    shards = _plan(entries, max_shard_bytes)
    if len(shards) == 1 and out.endswith(".safetensors"):
        paths = [out]
    else:
        os.makedirs(out, exist_ok=True)
        n = len(shards)
        paths = [os.path.join(out, f"model-{i + 1:05d}-of-{n:05d}.safetensors") for i in range(n)]
        if n == 1:
            paths = [os.path.join(out, "model.safetensors")]
    weight_map, total = {}, 0
    for path, shard in zip(paths, shards, strict=True):
        partial = _partial(path)
        writer = StreamWriter(partial, shard, metadata)
        try:
            desc = f"writing {os.path.basename(path)}"
            for name, dtype, shape in progress(shard, desc=desc, unit="tensor"):
                writer.write(name, fetch(name).to(dtype))
                weight_map[name] = os.path.basename(path)
                total += math.prod(shape) * dtype_size(dtype)
            writer.close()
            os.replace(partial, path)
        except BaseException:
            _discard(writer, partial)
            raise
    if len(paths) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_text_atomic(
            os.path.join(out, "model.safetensors.index.json"), json.dumps(index, indent=2)
        )
    return paths


def _metadata(module) -> dict[str, str]:
    """safetensors header metadata: the format, and the model's description if known."""
    from zeroshard.checkpoint.model_config import describe_model

    description = describe_model(module)
    meta = {"format": "pt"}
    if description is not None:
        meta[MODEL_KEY] = json.dumps(description)
    return meta


def _partial(path: str) -> str:
    """A temporary name private to this writer (concurrent writers never share one)."""
    return f"{path}.{os.getpid()}.partial"


def _discard(writer: StreamWriter | None, partial: str) -> None:
    if writer is not None:
        writer.abort()
    with contextlib.suppress(OSError):
        os.remove(partial)


def export_checkpoint(
    ckpt_dir: str,
    out: str,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
    *,
    verify: bool = True,
    allow_nonfinite: bool = False,
    tag: str | None = None,
    deepspeed: bool | None = None,
) -> list[str]:
    """Consolidate a checkpoint (a tag directory, a directory with ``latest``, or the
    ``tag`` directory in ``ckpt_dir``), after checking every file (checksums unless
    ``verify=False``; non-finite values unless ``allow_nonfinite``, as
    :func:`load_checkpoint`). ``deepspeed``: True requires a DeepSpeed checkpoint, False
    one of ours, None takes either."""
    entries, fetch, manifest = open_checkpoint(
        ckpt_dir,
        dtype,
        verify=verify,
        allow_nonfinite=allow_nonfinite,
        tag=tag,
        deepspeed=deepspeed,
    )
    metadata = {"format": "pt"}
    if manifest.get("model"):
        metadata[MODEL_KEY] = json.dumps(manifest["model"])
    return write_weights(out, entries, fetch, max_shard_bytes, metadata)


def open_checkpoint(
    ckpt_dir: str,
    dtype: torch.dtype | None = None,
    *,
    verify: bool = True,
    allow_nonfinite: bool = False,
    tag: str | None = None,
    deepspeed: bool | None = None,
):
    """``(entries, fetch, manifest)`` of a checked checkpoint (ours, or DeepSpeed's: see
    :func:`export_checkpoint`): entries are (name, dtype, shape) of every whole tensor,
    ``fetch(name)`` assembles one from its pieces."""
    ds_path = deepspeed_path(ckpt_dir, tag) if deepspeed is not False else None
    if deepspeed and ds_path is None:
        raise CheckpointError(
            f"{ckpt_dir}: not a DeepSpeed checkpoint (no 'latest' naming a directory with "
            "mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt)"
        )
    reader: PieceReader | DeepSpeedReader
    if ds_path is not None:
        manifest, reader = open_deepspeed(
            ds_path, verify=verify, allow_nonfinite=allow_nonfinite, training=False
        )
    else:
        path = resolve_path(ckpt_dir, tag)
        manifest = read_manifest(path, root=ckpt_dir)
        scan_files(
            path,
            manifest,
            range(len(manifest["files"])),
            verify=verify,
            allow_nonfinite=allow_nonfinite,
        )
        reader = PieceReader(path, manifest)
    kinds = set(manifest["kinds"])
    entries: list = []
    source: dict[str, tuple[str, str | None, str]] = {}
    for name, entry in manifest["params"].items():
        saved = DTYPES[entry["dtype"]]
        # trainable parameters come from the fp32 masters when the checkpoint has them
        kind = "master" if "master" in kinds and entry["group"] >= 0 else "param"
        want = dtype or (torch.float32 if kind == "master" else saved)
        entries.append((name, want, entry["shape"]))
        source[name] = ("piece", kind, name)
    for name, entry in manifest["whole"].items():
        saved = DTYPES[entry["dtype"]]
        want = dtype if dtype is not None and saved.is_floating_point else saved
        entries.append((name, want, entry["shape"]))
        source[name] = ("whole", None, name)
    for alias, name in manifest.get("aliases", {}).items():  # tied names, each written too
        e = next(x for x in entries if x[0] == name)
        entries.append((alias, e[1], e[2]))
        source[alias] = source[name]

    def fetch(name: str) -> torch.Tensor:
        how, kind, real = source[name]
        if how == "whole":
            return reader.whole(real)
        shape = manifest["params"][real]["shape"]
        assert kind is not None  # pieces name their kind
        return reader.get(kind, real, 0, math.prod(shape), torch.float32).view(shape)

    return entries, fetch, manifest


def export_safetensors(
    src: str,
    out: str,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
    *,
    allow_nonfinite: bool = False,
) -> list[str]:
    """Safetensors weights (a Hugging Face folder, a Trainer checkpoint, an export; see
    :mod:`sources`) written as :func:`export_checkpoint` writes a checkpoint: cast to
    ``dtype`` (floating tensors), sharded above ``max_shard_bytes``, the model's
    description in the header (recorded, or from ``config.json``); a folder ``out`` gets
    the source's ``config.json`` and ``generation_config.json`` too, so it is itself a
    Hugging Face folder. Every header is checked (tensors tile the data exactly) and,
    unless ``allow_nonfinite``, every value is finite."""
    files = sources.safetensors_files(src)
    entries, where, metadata = [], {}, {"format": "pt"}
    for file in files:
        try:
            header = read_header(file)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from exc
        meta = header.pop("__metadata__", None) or {}
        if "zeroshard_quant" in meta:
            raise CheckpointError(f"{file}: quantized weights (save_quantized): nothing to convert")
        if MODEL_KEY in meta:
            metadata[MODEL_KEY] = meta[MODEL_KEY]
        for name, info in header.items():
            saved = DTYPES[info["dtype"]]
            want = dtype if dtype is not None and saved.is_floating_point else saved
            entries.append((name, want, list(info["shape"])))
            where[name] = file
    if MODEL_KEY not in metadata:
        described = sources.hf_description(src)
        if described is not None:
            metadata[MODEL_KEY] = json.dumps(described)

    def fetch(name: str) -> torch.Tensor:
        with safe_open(where[name], framework="pt") as f:
            t = f.get_tensor(name)
        if not allow_nonfinite and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(
                f"{where[name]}: tensor {name!r} holds NaN/inf (--allow-nonfinite keeps it)"
            )
        return t

    paths = write_weights(out, entries, fetch, max_shard_bytes, metadata)
    if not out.endswith(".safetensors"):
        folder = src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src))
        for name in ("config.json", "generation_config.json"):
            if os.path.isfile(os.path.join(folder, name)):
                shutil.copyfile(os.path.join(folder, name), os.path.join(out, name))
                paths.append(os.path.join(out, name))
    return paths


def save_16bit(engine, save_dir: str, filename: str = "model.safetensors") -> str | None:
    """Gather every tensor of the model and write it (rank 0) in the working dtype.

    Every rank joins every gather even after rank 0 failed to write (it stops writing,
    not gathering), and the outcome is exchanged before returning: a failure on any rank
    raises :class:`CheckpointSaveError` on every rank, and no ``.partial`` file stays.
    Communication: the gathers (stage 3: one all-gather per parameter) and two tiny
    all-reduces (after rank 0 opened the file, at the end)."""
    from zeroshard.moe.whole import gather_global, global_shapes
    from zeroshard.zero import GatheredParameters

    comm, module, ep = engine.comm, engine.module, engine.mesh.comm("ep")
    named = dict(module.named_parameters(remove_duplicate=False))
    state = module.state_dict(keep_vars=True)
    shapes = {}
    for i, p in enumerate(engine.flat.params):
        shapes[id(p)] = engine.flat.shapes[i]
    entries = []
    for name, t in state.items():
        shape = list(shapes.get(id(t), t.shape))
        # experts: one entry per global expert (or the whole fused tensor)
        for whole_name, whole_shape in global_shapes(module, name, t, shape):
            entries.append((whole_name, t.dtype, whole_shape))
    out = os.path.join(save_dir, filename)
    partial = _partial(out)
    what = f"save_16bit_model({out!r})"
    writer, error = None, None
    if comm.rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            writer = StreamWriter(partial, entries, _metadata(module))
        except Exception as exc:
            error = exc
    failed, _ = exchange(comm, engine.device, error)
    raise_if_failed(comm, failed, error, what, CheckpointSaveError)
    for name, t in state.items():
        t = named.get(name, t)
        with GatheredParameters([t] if isinstance(t, torch.nn.Parameter) else []):
            for whole_name, value in gather_global(module, ep, name, t):
                if writer is not None and error is None:
                    try:
                        writer.write(whole_name, value.to(t.dtype))
                    except Exception as exc:  # keep joining the gathers; report at the end
                        error = exc
    if writer is not None:
        try:
            if error is None:
                writer.close()
                os.replace(partial, out)
        except Exception as exc:
            error = exc
        if error is not None:
            _discard(writer, partial)
    failed, _ = exchange(comm, engine.device, error)
    raise_if_failed(comm, failed, error, what, CheckpointSaveError)
    return out if comm.rank == 0 else None
