"""Weights into an inference model, and quantized weights out. No collectives.

:func:`load_weights` takes a zeroshard checkpoint (a tag directory, or a directory with
``latest``: tensors assembled piece by piece, checked as ``zeroshard convert`` checks
them), a safetensors file, or a directory of them (``model.safetensors`` or a sharded set
with its index), float or quantized. :func:`save_quantized` writes one safetensors file:
float tensors as they are, quantized layers in their portable form (``quantize.py``),
with the header metadata ``zeroshard_quant`` (bits, group size, symmetry, layer names,
and ``group_sizes``: the layers with a group size of their own)
and ``zeroshard_model`` (the model's description, when known).
"""

from __future__ import annotations

import json
import os

from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from zeroshard.checkpoint import sources
from zeroshard.checkpoint.export import MODEL_KEY
from zeroshard.checkpoint.model_config import ModelConfigError, build_model, describe_model
from zeroshard.inference.config import InferenceError
from zeroshard.inference.quantize import QuantLinear, linear_weight_bias

QUANT_KEY = "zeroshard_quant"


is_checkpoint = sources.is_checkpoint  # a zeroshard checkpoint, else safetensors weights


def _safetensors_files(path: str) -> list[str]:
    return sources.safetensors_files(path)


def read_metadata(path: str) -> dict[str, str]:
    """The header metadata of the first safetensors file at ``path``, or of a checkpoint's
    manifest (its ``model`` as ``zeroshard_model``)."""
    if is_checkpoint(path):
        from zeroshard.checkpoint.load import read_manifest, resolve_path

        manifest = read_manifest(resolve_path(path, None), root=path)
        model = manifest.get("model")
        return {MODEL_KEY: json.dumps(model)} if model else {}
    with safe_open(_safetensors_files(path)[0], framework="pt") as f:
        return dict(f.metadata() or {})


def model_description(path: str) -> dict:
    """What model the weights at ``path`` hold: the description recorded with them
    (zeroshard checkpoints and exports), else the Hugging Face ``config.json`` beside them
    (``save_pretrained``, a Trainer's folders); a :class:`ModelConfigError` naming what is
    missing else."""
    meta = read_metadata(path)
    if MODEL_KEY in meta:
        return json.loads(meta[MODEL_KEY])
    described = sources.hf_description(path)
    if described is None:
        if is_checkpoint(path):
            raise ModelConfigError(
                f"{path}: no model config recorded (checkpoints record the built-in GPT's "
                "and Hugging Face models' configs since issue 19; older ones do not) and no "
                "config.json beside it: build the model yourself and load the weights with "
                "init_inference(model, checkpoint=...)"
            )
        raise sources.no_model_config(path)
    return described


def model_from(path: str) -> nn.Module:
    """Build the model a checkpoint, export or Hugging Face folder describes, with its
    weights (quantized layers included)."""
    model = build_model(model_description(path), path)
    load_weights(model, path)
    return model


def quantized_shells(model: nn.Module, spec: dict) -> None:
    """Replace the layers named in ``spec['layers']`` by empty :class:`QuantLinear`s of
    the recorded format, ready for ``load_state_dict``."""
    for name in spec["layers"]:
        module = model.get_submodule(name)
        if isinstance(module, QuantLinear):
            continue
        wb = linear_weight_bias(module)
        if wb is None:
            raise InferenceError(
                f"quantized weights name {name!r}, not a Linear layer of this model"
            )
        weight, bias = wb
        group = spec.get("group_sizes", {}).get(name, spec["group_size"])
        shell = QuantLinear(weight.shape[1], weight.shape[0], bits=spec["bits"],
                            group_size=group, symmetric=spec["symmetric"],
                            bias=bias is not None, device=weight.device, name=name)  # fmt: skip
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, shell)


def load_weights(model: nn.Module, path: str) -> None:
    """Load a checkpoint or safetensors weights into ``model`` (strict: every tensor of
    the model must be there, nothing else)."""
    if is_checkpoint(path):
        from zeroshard.checkpoint.export import open_checkpoint

        entries, fetch, _ = open_checkpoint(path)
        state = {name: fetch(name) for name, _, _ in entries}
    else:
        state = {}
        meta: dict[str, str] = {}
        for file in _safetensors_files(path):
            with safe_open(file, framework="pt") as f:
                meta.update(f.metadata() or {})
                for name in f.keys():  # noqa: SIM118  (safe_open has no __iter__)
                    state[name] = f.get_tensor(name)
        if QUANT_KEY in meta:
            quantized_shells(model, json.loads(meta[QUANT_KEY]))
    result = model.load_state_dict(state, strict=False)
    missing = _untied(model, result.missing_keys, state)
    if missing or result.unexpected_keys:
        raise InferenceError(
            f"{path}: weights do not match the model: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )


def _untied(model: nn.Module, missing: list[str], loaded: dict) -> list[str]:
    """``missing`` less the names of tensors tied to one that was loaded (Hugging Face
    folders store a tied head once, under the embedding's name)."""
    names: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:  # fmt: skip
        names.setdefault(id(t), []).append(name)
    tied = {n: group for group in names.values() if len(group) > 1 for n in group}
    return [k for k in missing if not any(other in loaded for other in tied.get(k, ()))]


def save_quantized(model: nn.Module, path: str) -> str:
    """One safetensors file with the model's weights, quantized layers portable."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    formats = {(m.bits, m.symmetric) for m in layers.values()}
    if len(formats) > 1:
        raise InferenceError(f"save_quantized: layers use several formats {sorted(formats)}")
    groups = [m.group_size for m in layers.values() if m.bits == 4]
    group = max(set(groups), key=groups.count) if groups else 128  # the most common one
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    seen: dict[int, str] = {}
    for k in list(state):  # safetensors stores no shared tensors: keep a tie's first name
        ptr = state[k].data_ptr() if state[k].numel() else None
        if ptr is not None and ptr in seen:
            state[k] = state[k].clone()
        elif ptr is not None:
            seen[ptr] = k
    meta = {"format": "pt"}
    if layers:
        bits, sym = formats.pop()
        spec: dict = {"bits": bits, "group_size": group, "symmetric": sym, "layers": list(layers)}
        others = {n: m.group_size for n, m in layers.items() if bits == 4 and m.group_size != group}
        if others:  # layers whose inputs the group size did not divide (fit_group_size)
            spec["group_sizes"] = others
        meta[QUANT_KEY] = json.dumps(spec)
    description = describe_model(model)
    if description is not None:
        meta[MODEL_KEY] = json.dumps(description)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(state, path, metadata=meta)
    return path
