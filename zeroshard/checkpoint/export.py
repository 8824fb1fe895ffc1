"""Consolidated weights: one safetensors file (or a sharded set with a Hugging Face
style index) whose keys load with ``model.load_state_dict``.

``export_checkpoint`` streams from a checkpoint directory: each tensor is assembled
from its pieces and written before the next is read, so peak memory is about one
tensor. ``save_16bit_model`` does the same from a live engine, gathering one parameter
at a time (stage 3: one all-gather per unit; rank 0 writes).
"""

from __future__ import annotations

import json
import math
import os

import torch

from zeroshard.checkpoint.format import write_text_atomic
from zeroshard.checkpoint.load import _Reader, read_manifest, resolve_path
from zeroshard.progress import progress
from zeroshard.safetensors_io import DTYPES, StreamWriter, dtype_size

DTYPE_ARGS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _plan(entries, max_shard_bytes: int | None) -> list[list]:
    shards, current, size = [], [], 0
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


def write_weights(out: str, entries, fetch, max_shard_bytes: int | None = None) -> list[str]:
    """Write ``entries`` (name, dtype, shape) to ``out`` (a ``.safetensors`` path, or a
    directory for several shards plus ``model.safetensors.index.json``), calling
    ``fetch(name)`` for each tensor in turn."""
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
        writer = StreamWriter(path + ".partial", shard, {"format": "pt"})
        desc = f"writing {os.path.basename(path)}"
        for name, dtype, shape in progress(shard, desc=desc, unit="tensor"):
            writer.write(name, fetch(name).to(dtype))
            weight_map[name] = os.path.basename(path)
            total += math.prod(shape) * dtype_size(dtype)
        writer.close()
        os.replace(path + ".partial", path)
    if len(paths) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_text_atomic(
            os.path.join(out, "model.safetensors.index.json"), json.dumps(index, indent=2)
        )
    return paths


def export_checkpoint(
    ckpt_dir: str, out: str, dtype: torch.dtype | None = None, max_shard_bytes: int | None = None
) -> list[str]:
    """Consolidate a checkpoint (a tag directory, or a directory with ``latest``)."""
    path = resolve_path(ckpt_dir, None)
    manifest = read_manifest(path)
    reader = _Reader(path, manifest)
    kinds = set(manifest["kinds"])
    entries, source = [], {}
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
        return reader.get(kind, real, 0, math.prod(shape), torch.float32).view(shape)

    return write_weights(out, entries, fetch, max_shard_bytes)


def save_16bit(engine, save_dir: str, filename: str = "model.safetensors") -> str | None:
    """Gather every tensor of the model and write it (rank 0) in the working dtype."""
    from zeroshard.zero import GatheredParameters

    module = engine.module
    named = dict(module.named_parameters(remove_duplicate=False))
    state = module.state_dict(keep_vars=True)
    shapes = {}
    for i, p in enumerate(engine.flat.params):
        shapes[id(p)] = engine.flat.shapes[i]
    entries = []
    for name, t in state.items():
        shape = list(shapes.get(id(t), t.shape))
        entries.append((name, t.dtype, shape))
    out = os.path.join(save_dir, filename)
    if engine.comm.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        writer = StreamWriter(out + ".partial", entries, {"format": "pt"})
    for name, dtype, _ in entries:
        t = named.get(name, state[name])
        with GatheredParameters([t] if isinstance(t, torch.nn.Parameter) else []):
            if engine.comm.rank == 0:
                writer.write(name, t.detach().to(dtype))
    if engine.comm.rank == 0:
        writer.close()
        os.replace(out + ".partial", out)
    engine.comm.barrier()
    return out if engine.comm.rank == 0 else None
