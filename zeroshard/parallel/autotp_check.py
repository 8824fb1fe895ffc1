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
from zeroshard.comm import Comm
from zeroshard.parallel.autotp_plans import PlanEntry, Style
from zeroshard.parallel.gpt_attention import LocalHeadsAttention
from zeroshard.parallel.linear import is_conv1d
from zeroshard.parallel.sequence import is_transformers_model
from zeroshard.parallel.slices import TPSlice, even_slice


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


def match_plan(model: nn.Module, entries: list[PlanEntry]):
    """The first matching plan entry of each module and parameter name."""

    def first(name):
        return next((e for e in entries if e.matches(name)), None)

    mods = {n: e for n, _ in model.named_modules() if n and (e := first(n)) is not None}
    params = {n: e for n, _ in model.named_parameters() if (e := first(n)) is not None}
    return mods, params


def check_plan(
    model, comm, mods, params, sequence_parallel
) -> dict[int, tuple[str, TPSlice | None]]:
    """Every refusal, before anything changes; returns id(param) -> (owner, slice)."""
    t = comm.world_size
    named = dict(model.named_modules())
    covering = [n for n, e in mods.items() if e.style.kind in ("replicate", "experts")]
    unknown, kept_whole = [], []
    plans: dict[int, tuple[str, TPSlice | None]] = {}

    def claim(p, owner, spec):
        prev = plans.get(id(p))
        if prev is not None and prev[1] != spec:
            raise ValueError(
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
                unknown.append(f"{name} ({type(m).__name__} {tuple(m.weight.shape)})")
            kept_whole.append((name, m))
            continue
        _check_layer(name, m, entry, named, model, t)
        for attr, spec in planned_slices(m, entry.style, comm).items():
            claim(getattr(m, attr), name, spec)
    if unknown:
        shown = ", ".join(unknown[:4]) + (
            f" and {len(unknown) - 4} more" if len(unknown) > 4 else ""
        )
        first = unknown[0].split(" ")[0]
        raise ValueError(
            f"AutoTP does not know how to split {shown}: add a tp_plan entry naming the layer "
            f"(a name or pattern) and a style, e.g. tp_plan={{{first!r}: 'replicate'}} "
            "(or 'column' / 'row' / 'embedding')"
        )
    for name, entry in params.items():
        p = model.get_parameter(name)
        if entry.style.kind in ("column", "row"):
            spec = param_slice(p, entry.style, comm)
            if p.shape[spec.dim] % (t * entry.style.parts):
                raise ValueError(
                    f"{name}: dim {spec.dim} of size {p.shape[spec.dim]} does not split over {t} "
                    f"ranks in {entry.style.parts} part(s)"
                )
            claim(p, name, spec)
    for name, m in kept_whole:  # a layer kept whole must not share a weight that is split
        for attr, p in m.named_parameters(recurse=False):
            owner = plans.get(id(p))
            if owner is not None and owner[1] is not None:
                raise ValueError(
                    f"{name}.{attr} is the same tensor as {owner[0]}'s, which is split; give "
                    f"{name} the matching tp_plan style"
                )
    if sequence_parallel:
        if any(mods[c].style.kind == "experts" for c in covering):
            raise ValueError(
                "sequence_parallel with mixture-of-experts layers is not built; turn it off"
            )
        if not isinstance(model, models.GPT) and not is_transformers_model(model):
            raise ValueError(
                f"Megatron-SP knows the built-in GPT and transformers models, not "
                f"{type(model).__name__}; turn sequence_parallel off"
            )
        if not isinstance(model, models.GPT):
            extra = [n for n, m in named.items() if isinstance(m, nn.Embedding)
                     and (mods.get(n) is None or mods[n].style.kind != "embedding")]  # fmt: skip
            if extra:
                raise ValueError(
                    f"Megatron-SP: {', '.join(extra)} would see the whole sequence while the "
                    "activations are split along it (learned position or token-type embeddings "
                    "are not supported under sequence_parallel); turn sequence_parallel off"
                )
    return plans


def _check_layer(name, m, entry: PlanEntry, named, model, t: int) -> None:
    style = entry.style
    where = f"{name} ({entry.source}: {entry.pattern!r})"
    if isinstance(m, nn.Embedding) != (style.kind == "embedding"):
        raise ValueError(f"{where}: style {style.kind!r} does not fit a {type(m).__name__}")
    if style.gather_output and style.parts > 1:
        raise ValueError(f"{where}: a gathered output cannot have fused parts")
    if isinstance(m, nn.Embedding):
        rows = m.num_embeddings
    elif is_conv1d(m):
        rows = m.weight.shape[1] if style.kind == "column" else m.weight.shape[0]
    else:
        rows = m.weight.shape[0] if style.kind == "column" else m.weight.shape[1]
    if (style.kind == "embedding" or style.gather_output) and rows % t:
        raise ValueError(
            f"{name}: a vocabulary of {rows} does not divide by the tensor-parallel size {t}; "
            f"pad it to a multiple of {t} (transformers: model.resize_token_embeddings(n, "
            f"pad_to_multiple_of={t}); the built-in GPT: GPTConfig(vocab_size=...))"
        )
    if style.parts < 1 or rows % style.parts:
        raise ValueError(f"{where}: {rows} features do not form {style.parts} equal parts")
    part = rows // style.parts
    parent = named[name.rpartition(".")[0]] if "." in name else model
    hd = head_dim_of(parent)
    if hd and part % hd == 0 and (part // hd) % t:
        heads = part // hd
        cfg = getattr(parent, "config", None)
        kv, n_q = (
            getattr(cfg, "num_key_value_heads", None),
            getattr(cfg, "num_attention_heads", None),
        )
        what = "key/value heads" if kv == heads and kv != n_q else "attention heads"
        raise ValueError(
            f"{name}: {heads} {what} (head_dim {hd}) do not divide by the tensor-parallel "
            f"size {t}; use an autotp_size that divides {heads}"
        )
    if part % t:
        raise ValueError(
            f"{where}: {part} features per part do not split evenly over {t} ranks; use an "
            f"autotp_size that divides {part}"
        )
