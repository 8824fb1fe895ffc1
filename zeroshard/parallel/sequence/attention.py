"""Sequence parallelism: Megatron-SP regions, Ulysses all-to-all attention, ring attention.

Three ways to split the sequence dimension (batch-first activations, sequence dim 1):

* **Megatron-SP** (with tensor parallelism, over the TP group): outside the tensor-
  parallel regions (norms, dropout, residual adds) each rank keeps 1/t of the
  sequence. The column/row layers switch ``f``/``g`` for all-gather/reduce-scatter
  along the sequence (``tensor/collectives.py``); this module provides what the model needs
  around them (:func:`prepare_megatron_sp`): positions for this rank's share of the
  sequence, an attention function whose mask is not sized from the local sequence.
  Per transformer layer: forward 2 all-gathers + 2 reduce-scatters of b·s·h, backward
  the same (the bytes of TP's 2 + 2 all-reduces).
* **Ulysses** (over the SP group of ``sp`` ranks, each holding s/sp tokens of every
  sequence): before attention, one all-to-all each for q, k and v scatters heads and
  gathers the sequence; after it, one all-to-all of the output restores the split.
  Per layer, forward: 4 all-to-alls of b·s·h/sp elements (k and v smaller under
  grouped-query attention); backward the same.
* **Ring attention** (context parallelism, ``ring.py``): each rank holds two
  load-balanced chunks; keys and values travel the ring with point-to-point sends.

Hugging Face models get Ulysses and ring attention through transformers' attention
registry: :func:`apply_ulysses` / :func:`apply_ring_attention` register
``"zeroshard_ulysses"`` / ``"zeroshard_ring"`` and set the model's
``config._attn_implementation``; no model code changes. The built-in GPT's attention
modules are swapped for :class:`~zeroshard.models.gpt_attention.LocalHeadsAttention`.

Inputs: every rank passes its own share of each sequence (:func:`shard_sequence`);
positions are supplied by hooks. Labels must be shifted for the whole sequence before
sharding (Hugging Face: pass ``shift_labels``). Each rank's loss covers its tokens
only: the engine averages (or sums, with a global token count) gradients over the SP
ranks as it does over data-parallel ranks. Padding masks are refused (causal or full
attention only).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from zeroshard import UsageError, models
from zeroshard.distributed.comm import Comm
from zeroshard.models.gpt_attention import LocalHeadsAttention, adapt_gpt_attention
from zeroshard.parallel.sequence.ring import SequenceParallelError, ring_attention, zigzag_positions

SEQ_DIM = 1
ATTENTIONS = (models.Attention, LocalHeadsAttention)
_COMMS: weakref.WeakKeyDictionary[nn.Module, Comm] = weakref.WeakKeyDictionary()


# -- sharding inputs ----------------------------------------------------------------------


def local_positions(
    local_len: int, comm: Comm, *, load_balanced: bool = False, device=None
) -> torch.Tensor:
    """Global positions of this rank's ``local_len`` tokens (contiguous chunks in rank
    order, or ring attention's load-balanced chunks)."""
    if load_balanced:
        return zigzag_positions(local_len * comm.world_size, comm.rank, comm.world_size, device)
    start = comm.rank * local_len
    return torch.arange(start, start + local_len, device=device)


def shard_sequence(
    x: torch.Tensor, comm: Comm, *, dim: int = SEQ_DIM, load_balanced: bool = False
) -> torch.Tensor:
    """This rank's share of ``x`` along ``dim`` (for inputs, labels, masks)."""
    n = x.shape[dim]
    if n % comm.world_size:
        raise SequenceParallelError(
            f"sequence length {n} does not divide by {comm.world_size} ranks"
        )
    pos = local_positions(n // comm.world_size, comm, load_balanced=load_balanced, device=x.device)
    return x.index_select(dim, pos)


# -- Ulysses ------------------------------------------------------------------------------


def _all_to_all(x: torch.Tensor, comm: Comm, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    w = comm.world_size
    shape = list(x.shape)
    if shape[scatter_dim] % w:
        raise SequenceParallelError(
            f"dim {scatter_dim} of size {shape[scatter_dim]} does not divide by {w}"
        )
    parts = x.reshape(*shape[:scatter_dim], w, shape[scatter_dim] // w, *shape[scatter_dim + 1 :])
    send = parts.movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all(recv.view(-1), send.view(-1))  # recv[j]: rank j's tokens, my heads
    out = recv.movedim(0, gather_dim)
    shape[scatter_dim] //= w
    shape[gather_dim] *= w
    return out.reshape(shape)


class _SeqAllToAll(torch.autograd.Function):
    """All-to-all that scatters ``scatter_dim`` and gathers ``gather_dim``; backward is
    the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, comm: Comm, scatter_dim: int, gather_dim: int):
        ctx.comm, ctx.dims = comm, (scatter_dim, gather_dim)
        return _all_to_all(x, comm, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.comm, gather_dim, scatter_dim), None, None, None


def seq_all_to_all(x: torch.Tensor, comm: Comm, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    if comm.world_size == 1:
        return x
    return _SeqAllToAll.apply(x, comm, scatter_dim, gather_dim)


def _sdpa(q, k, v, *, causal: bool, scale: float | None, dropout_p: float) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # grouped-query attention: each kv head serves ``groups`` query heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=scale, dropout_p=dropout_p
    )


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm: Comm,
    *,
    causal: bool = True,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention over the whole sequence from this rank's share of it.

    ``q`` (b, h, s/sp, d), ``k`` and ``v`` (b, h_kv, s/sp, d) -> (b, h, s/sp, d). Heads
    and kv heads must divide by sp.
    """
    for name, n in (("heads", q.shape[1]), ("key/value heads", k.shape[1])):
        if n % comm.world_size:
            raise SequenceParallelError(
                f"Ulysses splits attention heads over {comm.world_size} sequence-parallel ranks: "
                f"{n} {name} do not divide; choose a sequence_parallel_size that divides {n}"
            )
    q, k, v = (seq_all_to_all(x, comm, 1, 2) for x in (q, k, v))
    out = _sdpa(q, k, v, causal=causal, scale=scale, dropout_p=dropout_p)
    return seq_all_to_all(out, comm, 2, 1)


# -- Hugging Face attention functions -------------------------------------------------------


def _comm_for(module: nn.Module, kind: str) -> Comm:
    comm = _COMMS.get(module)
    if comm is None:
        raise UsageError(
            f"{type(module).__name__} runs {kind} attention but its model was not prepared "
            "by zeroshard's sequence parallelism (apply_ulysses / apply_ring_attention)"
        )
    return comm


def _check_mask(mask, module: nn.Module, kwargs: dict) -> None:
    for key in ("sliding_window", "softcap"):
        if kwargs.get(key) is not None:
            raise SequenceParallelError(
                f"{type(module).__name__}: zeroshard's sequence-parallel attention does not apply "
                f"{key} (config.{key} = {kwargs[key]}); set it to None or turn sequence "
                "parallelism off for this model"
            )
    if mask is None:
        return
    if mask.dtype == torch.bool or not mask.is_floating_point():
        full = bool(mask.all())
    else:
        full = not bool(mask.any())  # additive: zeros everywhere
    if not full:
        raise SequenceParallelError(
            f"{type(module).__name__}: zeroshard's sequence-parallel attention supports causal or "
            "full attention without padding; pack sequences instead of padding them"
        )


def _is_causal(module: nn.Module, is_causal: bool | None) -> bool:
    return is_causal if is_causal is not None else getattr(module, "is_causal", True)


def _hf_local(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
              is_causal=None, **kwargs):  # fmt: skip
    _check_mask(attention_mask, module, kwargs)
    out = _sdpa(query, key, value, causal=_is_causal(module, is_causal), scale=scaling,
                dropout_p=dropout)  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def _hf_ulysses(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                is_causal=None, **kwargs):  # fmt: skip
    _check_mask(attention_mask, module, kwargs)
    out = ulysses_attention(query, key, value, _comm_for(module, "Ulysses"),
                            causal=_is_causal(module, is_causal), scale=scaling,
                            dropout_p=dropout)  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def _hf_ring(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
             is_causal=None, **kwargs):  # fmt: skip
    _check_mask(attention_mask, module, kwargs)
    if dropout:
        raise SequenceParallelError(
            f"{type(module).__name__}: ring attention does not apply attention dropout"
        )
    out = ring_attention(query, key, value, _comm_for(module, "ring"),
                         scale=scaling, causal=_is_causal(module, is_causal))  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


_HF_FUNCTIONS = {"zeroshard_sdpa": _hf_local, "zeroshard_ulysses": _hf_ulysses,
                 "zeroshard_ring": _hf_ring}  # fmt: skip


def _use_hf_attention(model: nn.Module, name: str, comm: Comm) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(name, _HF_FUNCTIONS[name])
    for m in model.modules():
        _COMMS[m] = comm
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)  # type: ignore[operator]
    else:
        model.config._attn_implementation = name  # type: ignore[union-attr]


def is_transformers_model(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model.config, "_attn_implementation")


def _position_hook(positions: Callable[[int, torch.device], torch.Tensor]):
    """A pre-hook giving a Hugging Face model ``position_ids`` when the caller does not."""

    def hook(module, args, kwargs):
        if kwargs.get("position_ids") is not None:
            return None
        ref = kwargs.get("input_ids", args[0] if args else None)
        if ref is None:
            ref = kwargs.get("inputs_embeds")
        if ref is None:
            return None
        kwargs["position_ids"] = positions(ref.shape[SEQ_DIM], ref.device).unsqueeze(0)
        return args, kwargs

    return hook


def _check_heads(model: nn.Module, comm: Comm, what: str) -> None:
    cfg = model.config
    for key in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(cfg, key, None)
        if isinstance(n, int) and n % comm.world_size:
            raise SequenceParallelError(
                f"{what}: config.{key} = {n} does not divide by sequence_parallel_size "
                f"{comm.world_size}; choose a sequence_parallel_size that divides {n}"
            )


# -- applying it ----------------------------------------------------------------------------


def _gpt_position_hook(comm: Comm, load_balanced: bool):
    def hook(module, args):
        pos = args[0]
        return (
            local_positions(pos.shape[0], comm, load_balanced=load_balanced, device=pos.device),
        )

    return hook


def _apply_context(model: nn.Module, comm: Comm, kind: str) -> list[RemovableHandle]:
    load_balanced = kind == "ring"
    if isinstance(model, models.GPT):
        for attn in model.modules():  # heads are this rank's already under tensor parallelism
            n = getattr(attn, "n_head", 0) if isinstance(attn, ATTENTIONS) else 0
            if kind == "ulysses" and n % comm.world_size:
                raise SequenceParallelError(
                    f"Ulysses: the GPT's {n} heads do not divide by sequence_parallel_size "
                    f"{comm.world_size}; choose a sequence_parallel_size that divides {n}"
                )
        for attn in adapt_gpt_attention(model):
            attn.core = _gpt_core(comm, kind)
        return [model.pos_emb.register_forward_pre_hook(_gpt_position_hook(comm, load_balanced))]
    if not is_transformers_model(model):
        raise TypeError(
            f"{kind} attention knows the built-in GPT and Hugging Face models, not "
            f"{type(model).__name__}"
        )
    if kind == "ulysses":
        _check_heads(model, comm, "Ulysses")
    _use_hf_attention(model, f"zeroshard_{kind}", comm)

    def positions(n: int, device) -> torch.Tensor:
        return local_positions(n, comm, load_balanced=load_balanced, device=device)

    return [model.register_forward_pre_hook(_position_hook(positions), with_kwargs=True)]


def _gpt_core(comm: Comm, kind: str):
    if kind == "ulysses":
        return lambda q, k, v, p: ulysses_attention(q, k, v, comm, dropout_p=p)

    def ring(q, k, v, p):
        if p:
            raise SequenceParallelError(
                "ring attention does not apply attention dropout; set dropout 0"
            )
        return ring_attention(q, k, v, comm)

    return ring


def apply_ulysses(model: nn.Module, comm: Comm) -> list[RemovableHandle]:
    """Ulysses sequence parallelism over ``comm`` (the SP group). Returns the hooks."""
    return _apply_context(model, comm, "ulysses")


def apply_ring_attention(model: nn.Module, comm: Comm) -> list[RemovableHandle]:
    """Ring attention over ``comm`` (the context-parallel group), load-balanced causal
    chunks (:func:`shard_sequence` with ``load_balanced=True``). Returns the hooks."""
    return _apply_context(model, comm, "ring")


def prepare_megatron_sp(model: nn.Module, comm: Comm) -> list[RemovableHandle]:
    """What a tensor-parallel model needs around its layers under Megatron-SP over
    ``comm`` (the TP group): the built-in GPT's position embedding returns this rank's
    share of the sequence; a Hugging Face model gets whole-sequence ``position_ids``
    (its own default would be sized from the local embeddings) and an attention
    function that does not build a mask from the local sequence. Returns the hooks."""
    if isinstance(model, models.GPT):

        def hook(module, args):
            pos = args[0]
            n = pos.shape[0] // comm.world_size
            return (pos.narrow(0, comm.rank * n, n),)

        return [model.pos_emb.register_forward_pre_hook(hook)]
    if not is_transformers_model(model):
        raise TypeError(
            f"Megatron-SP knows the built-in GPT and Hugging Face models, not {type(model).__name__}"
        )
    _use_hf_attention(model, "zeroshard_sdpa", comm)
    return [
        model.register_forward_pre_hook(
            _position_hook(lambda n, device: torch.arange(n, device=device)), with_kwargs=True
        )
    ]
