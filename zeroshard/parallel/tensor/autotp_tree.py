"""Where AutoTP's plans apply in a module tree: models it knows found at any depth,
PEFT adapters around their layers, and the layers of a wrapper around them.

The discovery rule, in order (the first rule that names a layer decides it):

1. ``tensor_parallel.tp_plan`` entries, matched against names from the root.
2. Known models anywhere in the tree, outermost first: the built-in GPT, a transformers
   model with a ``tp_plan`` or ``config.base_model_tp_plan``, or one zeroshard has a
   plan for (GPT-2, BERT). Each one's plan applies under its own prefix (``m.``,
   ``base_model.model.``, ``_orig_mod.``), so a loss wrapper, a reward-model head, a
   PEFT model, ``torch.compile``'s module or a wrapper of a wrapper split the same
   layers the bare model would.
3. PEFT: a tuner layer answers to its own name. Its ``base_layer`` (LoRA) or
   ``original_module`` / ``modules_to_save`` copies take the wrapped layer's style.
   Around a column-parallel layer, LoRA's B splits its output like the base (fused
   parts included) and A stays whole, reading the base's input as converted for the
   TP region (its gradient summed over the group); around a row-parallel layer, A
   splits its input like the base and B stays whole; so ``base(x) + B(A(x))·s``
   equals the unsplit layer's output. Around a gathered column (an ``lm_head``), both stay whole: the
   base's output is whole, so the whole adapter adds to it with no communication
   (under Megatron-SP, B splits and gathers like the base). Other adapters (DoRA,
   IA3, LoHa, ...) around a split layer, LoRA on split MoE expert weights (peft's
   ``target_parameters``) and LoRA around a vocabulary-split embedding under
   Megatron-SP are refused by name.
4. The wrapper's own layers (outside every known model), as DeepSpeed's AutoTP treats
   layers outside its transformer layers: a head tied to a split embedding splits like
   it (gathered column); an untied ``lm_head`` / ``embed_out`` is a gathered column
   (DeepSpeed splits it too); every other Linear, Conv1D or Embedding (a reward or
   value head, a classifier, a projection) stays whole on every rank. Its input is the
   whole hidden state, so every TP rank computes the same gradient, and the global
   norm counts it once.
5. Refused, all named in one error: layers inside a known model that its plan does not
   cover, and layers inside repeated blocks (``nn.ModuleList`` elements) outside every
   known model, whose forward AutoTP cannot check (head counts, what reads a split
   output). The error suggests the ``tp_plan`` entries DeepSpeed's name rule gives
   them (row: ``o_proj``, ``out_proj``, ``down_proj``, ``dense_4h_to_h``, ``c_proj``,
   ``fc2``, ``wo``, ``w2``, an attention's ``dense``; kept whole: MoE ``gate``,
   ``q_a_proj``, ``kv_a_proj_with_mqa``; ``gate_up_proj`` packed; else column).
   Without any known model every layer needs a ``tp_plan`` entry.

No communication.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from torch import nn

from zeroshard import models
from zeroshard.parallel.tensor.autotp_plans import PlanEntry, Style, model_plan, parse_style
from zeroshard.parallel.tensor.linear import is_conv1d
from zeroshard.parallel.tensor.slices import TensorParallelError

ROW_NAMES = frozenset(
    {"o_proj", "out_proj", "down_proj", "dense_4h_to_h", "c_proj", "fc2", "wo", "w2"}
)
_ROW_DENSE_PARENTS = frozenset({"attention", "self_attention", "self_attn"})
KEEP_WHOLE_NAMES = frozenset({"gate", "q_a_proj", "kv_a_proj_with_mqa", "shared_expert_gate"})
HEAD_NAMES = frozenset({"lm_head", "embed_out"})
_REPLICATE = Style(kind="replicate")
_GATHERED = parse_style("column_gather", "")


def _is_layer(m: nn.Module) -> bool:
    return isinstance(m, (nn.Linear, nn.Embedding)) or is_conv1d(m)


def _is_pretrained(m: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" for c in type(m).__mro__)


def is_known_model(m: nn.Module) -> bool:
    """A model AutoTP has a plan for (its own attributes, not a wrapper's forwarding)."""
    if isinstance(m, models.GPT):
        return True
    return _is_pretrained(m) and bool(model_plan(m)[0])


@dataclass(frozen=True)
class KnownModel:
    prefix: str  # its name in the tree ("" for the root)
    module: nn.Module

    def holds(self, name: str) -> bool:
        return not self.prefix or name == self.prefix or name.startswith(self.prefix + ".")

    def describe(self) -> str:
        return f"{type(self.module).__name__} at {self.prefix or '(root)'!r}"


def find_known_models(model: nn.Module) -> list[KnownModel]:
    """Every known model in ``model``'s tree, outer ones before the ones inside them."""
    return [KnownModel(n, m) for n, m in model.named_modules() if is_known_model(m)]


def known_plan_entries(known: list[KnownModel]) -> list[PlanEntry]:
    """Each known model's plan, its patterns under the model's prefix."""
    out = []
    for k in known:
        plan, source = model_plan(k.module)
        where = f"{source} of {k.describe()}"
        for pattern, value in plan.items():
            style = parse_style(value, f"{where}[{pattern!r}]")
            out.append(PlanEntry(_under(k.prefix, pattern), style, where))
    return out


def _under(prefix: str, pattern: str) -> str:
    if not prefix:
        return pattern
    if pattern.startswith("re:"):
        return f"re:{re.escape(prefix + '.')}(?:{pattern[3:]})"
    return f"{prefix}.{pattern}"


def _tuner_base(m: nn.Module) -> str | None:
    """The child a PEFT tuner layer wraps (None: not a tuner layer)."""
    if not hasattr(type(m), "adapter_layer_names"):
        return None
    for attr in ("base_layer", "original_module"):
        if isinstance(m._modules.get(attr), nn.Module):
            return attr
    return None


@dataclass
class TreeNames:
    """Module names as the plans see them: a PEFT tuner layer's wrapped layer (and its
    ``modules_to_save`` copies) answers to the tuner layer's name."""

    logical: dict[str, str] = field(default_factory=dict)
    tuners: dict[str, nn.Module] = field(default_factory=dict)  # name -> tuner layer
    adapters: set[str] = field(default_factory=set)  # modules an adapter adds

    @classmethod
    def of(cls, model: nn.Module) -> TreeNames:
        out = cls(logical={"": ""})
        named = dict(model.named_modules())
        for name, m in named.items():
            if not name:
                continue
            parent_name, _, child = name.rpartition(".")
            parent, logical = named[parent_name], out.logical[parent_name]
            grand = named.get(parent_name.rpartition(".")[0]) if parent_name else None
            if child == _tuner_base(parent):
                out.logical[name] = logical  # the wrapped layer: the tuner layer's name
            elif (
                grand is not None
                and _tuner_base(grand) == "original_module"
                and (parent_name.endswith(".modules_to_save"))
            ):
                out.logical[name] = out.logical[parent_name.rpartition(".")[0]]
            else:
                out.logical[name] = f"{logical}.{child}" if logical else child
            if _tuner_base(m) is not None:
                out.tuners[name] = m
        for name, m in out.tuners.items():
            if _tuner_base(m) == "base_layer":
                for attr in getattr(type(m), "adapter_layer_names", ()):
                    out.adapters |= {n for n in named if n.startswith(f"{name}.{attr}.")}
        return out

    def param(self, name: str) -> str:
        owner, _, attr = name.rpartition(".")
        base = self.logical.get(owner, owner)
        return f"{base}.{attr}" if base else attr


def adapter_entries(
    names: TreeNames, mods: dict, params: dict, sequence_parallel: bool
) -> dict[str, PlanEntry]:
    """LoRA's A and B of each tuner layer, from the style its wrapped layer takes."""
    out = {}
    for name, m in names.tuners.items():
        if _tuner_base(m) != "base_layer":
            continue
        base_entry = mods.get(f"{name}.base_layer")
        style = base_entry.style if base_entry is not None else _REPLICATE
        split = style.kind in ("column", "row", "embedding", "experts") or any(
            n.startswith(f"{name}.base_layer.") and e.style.kind in ("column", "row")
            for n, e in params.items()
        )  # peft's target_parameters wraps a module whose 3-D weights are sliced
        lora_a, lora_b = m._modules.get("lora_A"), m._modules.get("lora_B")
        lora = isinstance(lora_a, nn.ModuleDict) and isinstance(lora_b, nn.ModuleDict)
        magnitude = m._modules.get("lora_magnitude_vector")
        variant = bool(getattr(m, "lora_variant", None)) or (
            isinstance(magnitude, nn.ModuleDict) and len(magnitude) > 0
        )
        if split and (not lora or variant):
            what = "a LoRA variant (DoRA, ...)" if lora else f"a {type(m).__name__} adapter"
            raise TensorParallelError(
                f"{name}: {what} around a layer split {style.kind}-wise is not built under "
                f"AutoTP (plain LoRA is); keep the layer whole with tp_plan={{"
                f"{names.logical[name]!r}: 'replicate'}} or use plain LoRA"
            )
        if not (isinstance(lora_a, nn.ModuleDict) and isinstance(lora_b, nn.ModuleDict)):
            continue
        base = m.get_submodule("base_layer")
        if split and not _is_layer(base):
            raise TensorParallelError(
                f"{name}: LoRA around a {type(base).__name__} split {style.kind}-wise is not "
                "built under AutoTP (Linear, Conv1D and Embedding are)"
            )
        if style.kind == "embedding" and sequence_parallel:
            raise TensorParallelError(
                f"{name}: LoRA around an embedding split over the vocabulary is not built "
                "under sequence_parallel (its output holds a share of the sequence); leave "
                "the embedding out of target_modules or turn sequence_parallel off"
            )
        source = f"LoRA around {name} ({style.kind})"
        a_style = b_style = _REPLICATE
        if style.kind == "column" and (not style.gather_output or sequence_parallel):
            # A reads the base's converted input (its gradient: a partial sum); B splits
            # its output features like the base (fused parts too). A gathered base's
            # whole output takes the whole adapter's with no communication, except
            # under Megatron-SP, where the base's input is the gathered sequence
            a_style = Style(kind="replicate", in_region=True, partial_grad=True)
            b_style = replace(style, in_region=True)
        elif style.kind == "row":
            a_style = Style(kind="row", input_is_parallel=style.input_is_parallel)
        for key in lora_a:
            out[f"{name}.lora_A.{key}"] = PlanEntry(f"{name}.lora_A.{key}", a_style, source)
            if key in lora_b:
                out[f"{name}.lora_B.{key}"] = PlanEntry(f"{name}.lora_B.{key}", b_style, source)
    return out


def outermost(known: list[KnownModel]) -> list[KnownModel]:
    """The known models no other known model holds."""
    return [k for k in known if not any(o is not k and o.holds(k.prefix) for o in known)]


def layer_owner(name: str, named: dict[str, nn.Module]) -> str:
    """The name of the module a layer belongs to, past any PEFT tuner layer wrapping it
    (an attention module, for its q/k/v projections)."""
    parent = name.rpartition(".")[0]
    while parent and name == f"{parent}.{_tuner_base(named[parent])}":
        name, parent = parent, parent.rpartition(".")[0]
    return parent


def check_user_entries(
    model: nn.Module, entries: list[PlanEntry], names: TreeNames, known: list[KnownModel]
) -> None:
    """A ``tp_plan`` entry written for a model as if it were the root (names without the
    wrapper's prefix) names nothing in the tree; refused, with the name it needs. (An
    entry that names nothing at all is let be: one config serves every pipeline stage.)"""
    if not entries:
        return
    candidates = [*names.logical, *names.logical.values()]
    candidates += [n for n, _ in model.named_parameters()]
    candidates += [names.param(n) for n, _ in model.named_parameters()]
    for e in entries:
        if any(e.matches(c) for c in candidates):
            continue
        for k in known:
            under = PlanEntry(_under(k.prefix, e.pattern), e.style, e.source)
            if k.prefix and any(under.matches(c) for c in candidates):
                raise TensorParallelError(
                    f"tp_plan[{e.pattern!r}] matches no module or parameter: its names are "
                    f"from the model given ({type(model).__name__}), a wrapper's prefix "
                    f"included; for {k.describe()} write {under.pattern!r}"
                )


def _covered(name: str, mods: dict) -> bool:
    parts = name.split(".")
    for i in range(1, len(parts)):
        e = mods.get(".".join(parts[:i]))
        if e is not None and e.style.kind in ("replicate", "experts"):
            return True
    return False


def leftover_entries(
    model: nn.Module, known: list[KnownModel], names: TreeNames, mods: dict
) -> tuple[dict[str, PlanEntry], dict[str, str]]:
    """Rule 4 for the wrapper's own layers; returns (entries, refused name -> hint)."""
    if not known:
        return {}, {}
    named = dict(model.named_modules())
    repeated = {  # the elements of every ModuleList: DeepSpeed's transformer layers
        f"{n}.{c}" if n else c
        for n, m in named.items()
        if isinstance(m, nn.ModuleList)
        for c in m._modules
    }
    split_weights = {
        id(named[n].weight): n
        for n, e in mods.items()
        if e.style.kind == "embedding" and isinstance(named[n], nn.Embedding)
    }
    out, refused = {}, {}
    for name, m in named.items():
        if (
            not _is_layer(m)
            or name in mods
            or name in names.adapters
            or any(k.holds(name) for k in known)
            or _covered(name, mods)
        ):
            continue
        logical = names.logical.get(name) or name
        tied = split_weights.get(id(getattr(m, "weight", None)))
        if not isinstance(m, nn.Embedding) and (
            tied is not None or logical.rpartition(".")[2] in HEAD_NAMES
        ):
            whole_tie = tied is None and _tied_elsewhere(m, named, name)
            style = _REPLICATE if whole_tie else _GATHERED
            why = f"tied to {tied}" if tied else "a language-model head outside the known models"
            out[name] = PlanEntry(name, style, f"AutoTP's rule for {why}")
        elif any(name.startswith(r + ".") for r in repeated):
            refused[name] = deepspeed_style(logical)
        else:
            out[name] = PlanEntry(name, _REPLICATE, "kept whole: a wrapper's own layer")
    return out, refused


def _tied_elsewhere(m: nn.Module, named: dict, name: str) -> bool:
    w = getattr(m, "weight", None)
    return any(
        getattr(o, "weight", None) is w for n, o in named.items() if n != name and o is not m
    )


def deepspeed_style(logical: str) -> str:
    """The style DeepSpeed's AutoTP name rule gives a Linear in a transformer layer."""
    parent, _, last = logical.rpartition(".")
    if last in KEEP_WHOLE_NAMES:
        return "replicate"
    if last in ROW_NAMES or (last == "dense" and parent.rpartition(".")[2] in _ROW_DENSE_PARENTS):
        return "row"
    if last == "gate_up_proj":
        return "packed_column"
    return "column"


def block_pattern(name: str) -> str:
    """``name`` with its repeated-block indices as ``*`` (``h.3.attn`` -> ``h.*.attn``)."""
    return re.sub(r"(?:^|(?<=\.))\d+(?=\.)", "*", name)


def suggested_plan(refused: dict[str, str]) -> dict[str, str]:
    """Refused layers grouped across repeated blocks, each with its style."""
    out: dict[str, str] = {}
    for name, style in refused.items():
        out.setdefault(block_pattern(name), style)
    return out
