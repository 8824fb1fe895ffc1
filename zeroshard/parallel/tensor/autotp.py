"""AutoTP: shard a model's layers for tensor parallelism with no change to its code.

:func:`apply_tensor_parallel` reads a plan (``autotp_plans.py``: the user's ``tp_plan``
first, then the plan of every model it knows found anywhere in the tree, under its
prefix, PEFT adapters and a wrapper's own layers by ``autotp_tree.py``'s rule), checks
the whole model before touching it, then swaps each planned layer for its
tensor-parallel form in place, keeping parameter names:

* ``nn.Linear`` / transformers ``Conv1D`` -> :class:`ColumnParallelLinear` or
  :class:`RowParallelLinear`; fused outputs (``qkv``, ``gate_up``) are split part by
  part so each rank holds whole heads of q, k and v;
* ``nn.Embedding`` -> :class:`VocabParallelEmbedding`; a head tied to it shares the
  same local slice;
* parameters named by the plan (transformers' 3-D expert weights) are sliced in place;
  an ``experts`` module gets ``f`` on its inputs and ``g`` on its output (hooks);
* attention modules get their local head counts (``num_heads``, ``n_head``,
  ``split_size``, ...), and the built-in GPT's attention becomes
  :class:`LocalHeadsAttention`.

It refuses, naming the module and the fix: heads, key/value heads, features or a
vocabulary that do not divide by the TP size; a Linear, Conv1D or Embedding the plan
does not cover; tied weights planned two different ways.

Collectives: none while sharding (each rank slices its own copy of the whole model,
so every rank must start from the same weights). In training, per transformer layer
of b·s·h activations: 2 all-reduces forward (attention and MLP outputs, ``g``) and 2
backward (their inputs' gradients, ``f``), or under ``sequence_parallel`` the same
bytes as 2 all-gathers + 2 reduce-scatters each way; the embedding adds an all-reduce
(reduce-scatter) forward, a gathered head an all-gather of b·s·V forward and an
all-reduce of its input's gradient backward. :func:`sync_partial_grads` all-reduces
the gradients of replicated parameters that see only part of the data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn
from torch.utils.hooks import RemovableHandle

from zeroshard import models
from zeroshard.distributed.comm import Comm
from zeroshard.models.gpt_attention import adapt_gpt_attention
from zeroshard.moe.marks import is_expert
from zeroshard.parallel.sequence.attention import prepare_megatron_sp
from zeroshard.parallel.tensor.autotp_check import (
    check_plan,
    head_dim_of,
    is_linear_like,
    match_plan,
    planned_slices,
)
from zeroshard.parallel.tensor.autotp_plans import PlanEntry, Style, parse_style, user_plan_entries
from zeroshard.parallel.tensor.autotp_tree import (
    KnownModel,
    TreeNames,
    adapter_entries,
    check_user_entries,
    find_known_models,
    known_plan_entries,
    layer_owner,
    leftover_entries,
    outermost,
)
from zeroshard.parallel.tensor.collectives import TPInput, copy_to_tp, reduce_from_tp
from zeroshard.parallel.tensor.linear import (
    ColumnParallelLinear,
    RegionInputLinear,
    RowParallelLinear,
)
from zeroshard.parallel.tensor.slices import (
    TensorParallelError,
    TPSlice,
    has_partial_grad,
    mark_partial_grad,
    sliced_parameter,
    tp_slice_of,
)
from zeroshard.parallel.tensor.vocab import VocabParallelEmbedding, causal_lm_loss

_HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "num_key_value_heads",
                "num_kv_heads")  # fmt: skip
_WIDTHS = ("split_size", "all_head_size")  # local widths some attention forwards read


@dataclass
class TPSharding:
    """What :func:`apply_tensor_parallel` did, by parameter name (tied names included)."""

    slices: dict[str, TPSlice]  # sharded parameters: which slice of the whole tensor
    partial_grad: list[str]  # replicated, gradient summed over the TP group
    replicated: list[str]  # replicated, identical gradients on every TP rank
    hooks: list[RemovableHandle] = field(default_factory=list)

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()


def _convert(m: nn.Module, style: Style, comm: Comm, sp: bool, tp_input: TPInput) -> nn.Module:
    if style.kind == "replicate":  # in_region: whole, reading its neighbours' input
        return RegionInputLinear(m, tp_input)
    if style.kind == "embedding":
        assert isinstance(m, nn.Embedding)  # check_plan refused any other module
        return VocabParallelEmbedding.from_embedding(m, comm, sequence_parallel=sp)
    if style.kind == "column":
        weight = planned_slices(m, style, comm)["weight"]
        assert weight is not None  # a column-split weight always has its slice
        parts = None if style.parts == 1 else weight.parts
        return ColumnParallelLinear.from_linear(
            m,
            comm,
            gather_output=style.gather_output,
            sequence_parallel=sp,
            parts=parts,
            tp_input=tp_input,
            input_in_region=style.in_region,
        )
    return RowParallelLinear.from_linear(
        m, comm, input_is_parallel=style.input_is_parallel, sequence_parallel=sp
    )


def _expert_entries(model: nn.Module) -> list[PlanEntry]:
    """Experts split over several expert-parallel ranks stay whole in every tensor-
    parallel rank (the dense layers around them are split): their modules and
    parameters are replicated, over any plan (experts split by both is not built)."""
    out = []
    for name, m in model.named_modules():
        own = list(m.parameters())
        if name and own and all(is_expert(p) for p in own):
            out.append(PlanEntry(name, parse_style("replicate", name), "expert parallelism"))
    for name, p in model.named_parameters():
        if is_expert(p):
            out.append(PlanEntry(name, parse_style("replicate", name), "expert parallelism"))
    return out


def _experts_hooks(m: nn.Module, comm: Comm) -> list[RemovableHandle]:
    """transformers' experts take (hidden_states, top_k_index, top_k_weights): both float
    inputs are replicated into the TP region (f), the partial outputs summed (g)."""

    def pre(module, args, kwargs):
        args = list(args)
        for i in (0, 2):
            if i < len(args):
                args[i] = copy_to_tp(args[i], comm)
        for key in ("hidden_states", "top_k_weights"):
            if key in kwargs:
                kwargs[key] = copy_to_tp(kwargs[key], comm)
        return tuple(args), kwargs

    def post(module, args, kwargs, output):
        return reduce_from_tp(output, comm)

    return [
        m.register_forward_pre_hook(pre, with_kwargs=True),
        m.register_forward_hook(post, with_kwargs=True),
    ]


def apply_tensor_parallel(
    model: nn.Module,
    comm: Comm,
    *,
    tp_plan: dict | None = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> TPSharding:
    """Split ``model`` in place over ``comm`` (the tensor-parallel group).

    ``tp_plan`` maps module/parameter-name patterns to styles and overrides the model's
    plan. ``sequence_parallel`` turns on Megatron-SP: activations outside the
    tensor-parallel regions hold 1/t of the sequence (dim 1); inputs stay whole.
    ``loss_parallel`` (transformers causal LMs) keeps the head's vocabulary split: its
    logits are this rank's slice and the model's ``loss_function`` becomes the
    vocab-parallel cross-entropy, so no rank holds full-vocabulary logits.
    """
    known = find_known_models(model)
    lm = None
    if loss_parallel:
        head, lm = _causal_lm_head(model, known)
        tp_plan = {head: "column", **(tp_plan or {})}
    names = TreeNames.of(model)
    user = user_plan_entries(tp_plan)
    check_user_entries(model, user, names, known)
    experts = _expert_entries(model)
    mods, params = match_plan(model, experts + user + known_plan_entries(known), names)
    left, refused = leftover_entries(model, known, names, mods)
    mods.update(left)
    mods.update(adapter_entries(names, mods, params, sequence_parallel))
    plans = check_plan(model, comm, mods, params, sequence_parallel, known=known, refused=refused)
    t = comm.world_size
    named = dict(model.named_modules())
    roots = outermost(known)
    # id(old) -> (old, new); holding old keeps its id from being reused by a new tensor
    new_of: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    hooks: list[RemovableHandle] = []
    attention_parents = set()
    tp_input = TPInput(comm, sequence_parallel=sequence_parallel)
    for name, entry in mods.items():
        m, style = named[name], entry.style
        if style.kind == "experts":
            hooks += _experts_hooks(m, comm)
            continue
        if (style.kind == "replicate" and not style.in_region) or not (
            is_linear_like(m) or isinstance(m, nn.Embedding)
        ):
            continue
        new = _convert(m, style, comm, sequence_parallel, tp_input)
        for attr in ("weight", "bias"):
            old = getattr(m, attr, None)
            if old is None:
                continue
            if id(old) in new_of:  # tied to a layer converted already: share its slice
                setattr(new, attr, new_of[id(old)][1])
            else:
                new_of[id(old)] = (old, getattr(new, attr))
        parent_name, _, child = name.rpartition(".")
        setattr(named[parent_name], child, new)
        attn = layer_owner(name, named)  # past a PEFT tuner layer around it
        if style.kind == "column" and head_dim_of(named[attn]):
            attention_parents.add(attn)  # it reads head counts: make them local
    for name, entry in params.items():
        if entry.style.kind not in ("column", "row"):
            continue
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        old = getattr(owner, attr)
        spec = plans[id(old)][1]
        assert spec is not None  # column and row parameters are split
        new_p = sliced_parameter(old, spec)
        new_of[id(old)] = (old, new_p)
        setattr(owner, attr, new_p)
    for m in model.modules():  # any other holder of a replaced parameter (ties)
        for attr, p in list(m._parameters.items()):
            if p is not None and id(p) in new_of and new_of[id(p)][0] is p:
                m._parameters[attr] = new_of[id(p)][1]
    for parent_name in attention_parents:
        _localize_heads(named[parent_name], t)
    gpts = [k for k in roots if isinstance(k.module, models.GPT)]
    for k in gpts:
        adapt_gpt_attention(k.module)  # n_head is local already
    if sequence_parallel:
        for k in roots:
            hooks += prepare_megatron_sp(k.module, comm)
        for parent_name in attention_parents:
            if not any(k.holds(parent_name) for k in gpts):  # it sizes heads from the sequence
                hooks.append(
                    named[parent_name].register_forward_pre_hook(
                        _gather_entry(tp_input), with_kwargs=True
                    )
                )
    for name, entry in list(mods.items()) + list(params.items()):
        if entry.style.partial_grad:
            if name in params:
                mark_partial_grad(model.get_parameter(name))
            else:
                for p in model.get_submodule(name).parameters():
                    mark_partial_grad(p)
    if sequence_parallel:
        for p in model.parameters():
            if tp_slice_of(p) is None:
                mark_partial_grad(p)  # it acts on this rank's share of the sequence
    if lm is not None:
        lm.loss_function = causal_lm_loss(comm)
    return _summary(model, hooks)


def _causal_lm_head(model: nn.Module, known: list[KnownModel]) -> tuple[str, nn.Module]:
    """The head of the one transformers causal LM in the tree, and that model."""
    lms = [
        k
        for k in outermost(known)
        if type(k.module).__name__.endswith("ForCausalLM") and hasattr(k.module, "loss_function")
    ]
    if len(lms) != 1:
        found = ", ".join(k.describe() for k in lms) or f"none in {type(model).__name__}"
        raise TensorParallelError(
            f"loss_parallel: needs exactly one transformers causal LM computing its loss "
            f"through its loss_function (found: {found}; the built-in GPT computes "
            "cross-entropy on whole logits inside its forward); leave loss_parallel off"
        )
    k = lms[0]
    head = k.module.get_output_embeddings()  # type: ignore[operator]
    local = next(n for n, m in k.module.named_modules() if m is head)
    return (f"{k.prefix}.{local}" if k.prefix else local), k.module


def _gather_entry(tp_input: TPInput):
    """Under Megatron-SP, an attention module's input is all-gathered along the sequence
    on entry (its q, k and v projections then find it converted already)."""

    def hook(module, args, kwargs):
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = tp_input(kwargs["hidden_states"])
        elif args:
            args = (tp_input(args[0]), *args[1:])
        return args, kwargs

    return hook


def _localize_heads(m: nn.Module, t: int) -> None:
    for attr in _HEAD_COUNTS + _WIDTHS:
        v = getattr(m, attr, None)
        if isinstance(v, int) and not isinstance(v, bool):
            setattr(m, attr, v // t)


def _summary(model: nn.Module, hooks) -> TPSharding:
    slices, partial, replicated = {}, [], []
    for name, p in model.named_parameters(remove_duplicate=False):
        spec = tp_slice_of(p)
        if spec is not None:
            slices[name] = spec
        elif has_partial_grad(p):
            partial.append(name)
        else:
            replicated.append(name)
    return TPSharding(slices=slices, partial_grad=partial, replicated=replicated, hooks=hooks)


def sync_partial_grads(model: nn.Module, comm: Comm) -> None:
    """Sum over the TP group the gradients of replicated parameters that saw only part
    of the data (Megatron-SP norms and biases; transformers' ``replicate_sum_grad``):
    one all-reduce of their total size. Call after backward, before the data-parallel
    reduction, clipping or the step."""
    seen, grads = set(), []
    for p in model.parameters():
        if has_partial_grad(p) and p.grad is not None and id(p) not in seen:
            seen.add(id(p))
            grads.append(p.grad)
    comm.all_reduce_many(grads)
