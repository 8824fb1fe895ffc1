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

import torch

from zeroshard.checkpoint.format import exchange, raise_if_failed, write_text_atomic
from zeroshard.checkpoint.load import PieceReader, read_manifest, resolve_path, scan_files
from zeroshard.checkpoint.safetensors_io import DTYPES, StreamWriter, dtype_size
from zeroshard.checkpoint.save import CheckpointSaveError
from zeroshard.monitor.progress import progress

MODEL_KEY = "zeroshard_model"  # safetensors metadata: the model's description (JSON)
DTYPE_ARGS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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
) -> list[str]:
    """Consolidate a checkpoint (a tag directory, or a directory with ``latest``), after
    checking every file (checksums unless ``verify=False``; non-finite values unless
    ``allow_nonfinite``, as :func:`load_checkpoint`)."""
    entries, fetch, manifest = open_checkpoint(
        ckpt_dir, dtype, verify=verify, allow_nonfinite=allow_nonfinite
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
):
    """``(entries, fetch, manifest)`` of a checked checkpoint: entries are (name, dtype,
    shape) of every whole tensor, ``fetch(name)`` assembles one from its pieces."""
    path = resolve_path(ckpt_dir, None)
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
    for alias, name in manifest.get("aliases", {}).items():
        e = next(x for x in entries if x[0] == name)
        entries.append((alias, e[1], e[2]))
        source[alias] = source[name]
    for name, entry in manifest["whole"].items():
        saved = DTYPES[entry["dtype"]]
        want = dtype if dtype is not None and saved.is_floating_point else saved
        entries.append((name, want, entry["shape"]))
        source[name] = ("whole", None, name)

    def fetch(name: str) -> torch.Tensor:
        how, kind, real = source[name]
        if how == "whole":
            return reader.whole(real)
        shape = manifest["params"][real]["shape"]
        assert kind is not None  # pieces name their kind
        return reader.get(kind, real, 0, math.prod(shape), torch.float32).view(shape)

    return entries, fetch, manifest


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
