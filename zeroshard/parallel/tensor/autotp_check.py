"""Checks a tensor-parallel plan against a model before anything changes.

Which plan entry each module and parameter takes (the first that matches), which slice
each parameter will hold, and every refusal: heads, key/value heads, features or a
vocabulary that do not divide by the TP size (naming the module and the fix), a
Linear, Conv1D or Embedding no entry covers (naming it and the ``tp_plan`` entry to
add), tied weights planned two ways, and what Megatron-SP cannot split.

No communication.
"""

from __future__ import annotations

import torch
from torch import nn

from zeroshard import models
from zeroshard.distributed.comm import Comm
from zeroshard.models.gpt_attention import LocalHeadsAttention
from zeroshard.parallel.tensor.autotp_plans import PlanEntry, Style
from zeroshard.parallel.tensor.autotp_tree import (
    KnownModel,
    TreeNames,
    block_pattern,
    layer_owner,
    outermost,
    suggested_plan,
)
from zeroshard.parallel.tensor.linear import is_conv1d
from zeroshard.parallel.tensor.slices import TensorParallelError, TPSlice, even_slice


def is_linear_like(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or is_conv1d(m)


def head_dim_of(m: nn.Module | None) -> int | None:
    """Width of one attention head of ``m`` (None: not an attention module we know)."""
    if isinstance(m, (models.Attention, LocalHeadsAttention)):
        return m.qkv.out_features // 3 // m.n_head
    for attr in ("head_dim", "attention_head_size"):
        v = getattr(m, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def planned_slices(m: nn.Module, style: Style, comm: Comm) -> dict[str, TPSlice | None]:
    """The slice each of ``m``'s own parameters will hold (None: replicated)."""

    def sl(shape, dim, parts=1):
        return even_slice(shape, dim, comm.rank, comm.world_size, parts)

    if style.kind == "embedding":
        return {"weight": sl(m.weight.shape, 0)}
    transposed = is_conv1d(m)  # weight stored (in, out)
    out: dict[str, TPSlice | None] = {}
    if style.kind == "column":
        out["weight"] = sl(m.weight.shape, 1 if transposed else 0, style.parts)
        if m.bias is not None:
            out["bias"] = sl(m.bias.shape, 0, style.parts)
    else:
        out["weight"] = sl(m.weight.shape, 0 if transposed else 1)
        if m.bias is not None:
            out["bias"] = None
    return out


def param_slice(p: torch.Tensor, style: Style, comm: Comm) -> TPSlice:
    dim = p.dim() - (2 if style.kind == "column" else 1)
    parts = style.parts if style.kind == "column" else 1
    return even_slice(p.shape, dim, comm.rank, comm.world_size, parts)


def match_plan(model: nn.Module, entries: list[PlanEntry], names: TreeNames):
    """The first plan entry matching each module and parameter, by its name from the
    root or the name the plans see (a PEFT-wrapped layer answers to its wrapper's)."""

    def first(*candidates):
        return next((e for e in entries if any(e.matches(c) for c in candidates)), None)

    mods = {
        n: e
        for n, _ in model.named_modules()
        if n and (e := first(n, names.logical.get(n, n))) is not None
    }
    params = {
        n: e for n, _ in model.named_parameters() if (e := first(n, names.param(n))) is not None
    }
    return mods, params


def check_plan(
    model,
    comm,
    mods,
    params,
    sequence_parallel,
    *,
    known: list[KnownModel] | None = None,
    refused: dict[str, str] | None = None,
) -> dict[int, tuple[str, TPSlice | None]]:
    """Every refusal, before anything changes; returns id(param) -> (owner, slice).
    ``known``: the models whose plans apply; ``refused``: layers of repeated blocks
    outside them, with the style DeepSpeed's name rule would give each."""
    t = comm.world_size
    known, refused = known or [], refused or {}
    named = dict(model.named_modules())
    covering = [n for n, e in mods.items() if e.style.kind in ("replicate", "experts")]
    unknown, kept_whole = [], []
    plans: dict[int, tuple[str, TPSlice | None]] = {}

    def claim(p, owner, spec):
        prev = plans.get(id(p))
        if prev is not None and prev[1] != spec:
            raise TensorParallelError(
                f"{owner} and {prev[0]} share a weight but their tp_plan styles split it "
                "differently; give tied layers the same style (embedding + column_gather)"
            )
        plans[id(p)] = (owner, spec)

    for name, m in named.items():
        if not (is_linear_like(m) or isinstance(m, nn.Embedding)):
            continue
        entry = mods.get(name)
        if entry is None or entry.style.kind in ("replicate", "experts"):
            if entry is None and not any(name.startswith(c + ".") for c in covering):
                unknown.append((name, m))
            kept_whole.append((name, m))
            continue
        _check_layer(name, m, entry, named, model, t)
        for attr, spec in planned_slices(m, entry.style, comm).items():
            claim(getattr(m, attr), name, spec)
    if unknown:
        raise TensorParallelError(_unknown_layers(unknown, known, refused))
    for name, entry in params.items():
        p = model.get_parameter(name)
        if entry.style.kind in ("column", "row"):
            spec = param_slice(p, entry.style, comm)
            if p.shape[spec.dim] % (t * entry.style.parts):
                raise TensorParallelError(
                    f"{name}: dim {spec.dim} of size {p.shape[spec.dim]} does not split over {t} "
                    f"ranks in {entry.style.parts} part(s)"
                )
            claim(p, name, spec)
    for name, m in kept_whole:  # a layer kept whole must not share a weight that is split
        for attr, p in m.named_parameters(recurse=False):
            owner = plans.get(id(p))
            if owner is not None and owner[1] is not None:
                raise TensorParallelError(
                    f"{name}.{attr} is the same tensor as {owner[0]}'s, which is split; give "
                    f"{name} the matching tp_plan style"
                )
    if sequence_parallel:
        _check_sequence_parallel(model, known, mods, covering)
        gpts = [k for k in known if isinstance(k.module, models.GPT)]  # own position hook
        extra = [n for n, m in named.items() if isinstance(m, nn.Embedding)
                 and not any(k.holds(n) for k in gpts)
                 and (mods.get(n) is None or mods[n].style.kind != "embedding")]  # fmt: skip
        if extra:
            raise TensorParallelError(
                f"Megatron-SP: {', '.join(extra)} would see the whole sequence while the "
                "activations are split along it (learned position or token-type embeddings "
                "are not supported under sequence_parallel); turn sequence_parallel off"
            )
    return plans


def _check_sequence_parallel(model, known, mods, covering) -> None:
    if any(mods[c].style.kind == "experts" for c in covering):
        raise TensorParallelError(
            "sequence_parallel with mixture-of-experts layers is not built; turn it off"
        )
    if not known:
        raise TensorParallelError(
            f"Megatron-SP knows the built-in GPT and transformers models, not "
            f"{type(model).__name__}; turn sequence_parallel off"
        )
    outside = [n for n, _ in model.named_parameters() if not any(k.holds(n) for k in known)]
    if outside:
        raise TensorParallelError(
            f"Megatron-SP: the wrapper's own parameters ({', '.join(outside[:4])}) sit outside "
            f"{', '.join(k.describe() for k in known)}; which share of the sequence they see "
            "is not known, so their gradients cannot be summed right; turn sequence_parallel off"
        )


def _unknown_layers(unknown, known, refused: dict[str, str]) -> str:
    """One message naming every layer AutoTP cannot split (blocks grouped), and the fix."""
    groups: dict[str, list] = {}
    for name, m in unknown:
        groups.setdefault(block_pattern(name), []).append((name, m))
    listed = []
    for pattern, members in groups.items():
        name, m = members[0]
        shape = f"{type(m).__name__} {tuple(m.weight.shape)}"
        many = f", {len(members)} layers" if len(members) > 1 else ""
        listed.append(f"{pattern if many else name} ({shape}{many})")
    shown = ", ".join(listed[:12]) + (f" and {len(listed) - 12} more" if len(listed) > 12 else "")
    ours = {n: s for n, s in refused.items() if n in {u for u, _ in unknown}}
    if ours:
        example = dict(list(suggested_plan(ours).items())[:6])
        fix = (
            f"tp_plan={example!r} (DeepSpeed's AutoTP name rule), or 'replicate' to keep them whole"
        )
    else:
        fix = f"tp_plan={{{unknown[0][0]!r}: 'replicate'}} (or 'column' / 'row' / 'embedding')"
    if known:
        where = (
            f" (plans applied: {', '.join(k.describe() for k in outermost(known))}; layers "
            "their plans do not cover, and layers of repeated blocks outside them, are not "
            "split by guess)"
        )
    else:
        where = (
            " (no model in this tree has a plan AutoTP knows: the built-in GPT, transformers "
            "GPT-2 or BERT, or a model with a tp_plan / config.base_model_tp_plan)"
        )
    return (
        f"AutoTP does not know how to split {shown}{where}: add a tp_plan entry naming each "
        f"layer (a name or pattern from the root) and a style, e.g. {fix}"
    )


def _check_layer(name, m, entry: PlanEntry, named, model, t: int) -> None:
    style = entry.style
    where = f"{name} ({entry.source}: {entry.pattern!r})"
    if isinstance(m, nn.Embedding) != (style.kind == "embedding"):
        raise TensorParallelError(
            f"{where}: style {style.kind!r} does not fit a {type(m).__name__}"
        )
    if style.gather_output and style.parts > 1:
        raise TensorParallelError(f"{where}: a gathered output cannot have fused parts")
    if isinstance(m, nn.Embedding):
        rows = m.num_embeddings
    elif is_conv1d(m):
        rows = m.weight.shape[1] if style.kind == "column" else m.weight.shape[0]
    else:
        rows = m.weight.shape[0] if style.kind == "column" else m.weight.shape[1]
    if (style.kind == "embedding" or style.gather_output) and rows % t:
        raise TensorParallelError(
            f"{name}: a vocabulary of {rows} does not divide by the tensor-parallel size {t}; "
            f"pad it to a multiple of {t} (transformers: model.resize_token_embeddings(n, "
            f"pad_to_multiple_of={t}); the built-in GPT: GPTConfig(vocab_size=...))"
        )
    if style.parts < 1 or rows % style.parts:
        raise TensorParallelError(f"{where}: {rows} features do not form {style.parts} equal parts")
    part = rows // style.parts
    parent = named[layer_owner(name, named)]
    hd = head_dim_of(parent)
    if hd and part % hd == 0 and (part // hd) % t:
        heads = part // hd
        cfg = getattr(parent, "config", None)
        kv, n_q = (
            getattr(cfg, "num_key_value_heads", None),
            getattr(cfg, "num_attention_heads", None),
        )
        what = "key/value heads" if kv == heads and kv != n_q else "attention heads"
        raise TensorParallelError(
            f"{name}: {heads} {what} (head_dim {hd}) do not divide by the tensor-parallel "
            f"size {t}; use an autotp_size that divides {heads}"
        )
    if part % t:
        raise TensorParallelError(
            f"{where}: {part} features per part do not split evenly over {t} ranks; use an "
            f"autotp_size that divides {part}"
        )
