"""The built-in GPT's attention, reading its sizes from its own projections.

``zeroshard.models.Attention`` takes its width from the input (``x.shape[-1]``), so it
cannot run with this rank's share of the heads (tensor parallelism) or with a
sequence-parallel attention core. :class:`LocalHeadsAttention` adopts the same
``qkv`` and ``proj`` submodules (parameter names are unchanged) and computes the same
function with ``n_head`` local heads, the width taken from ``qkv``'s output, and a
pluggable ``core`` (causal scaled-dot-product attention by default; Ulysses or ring
attention under sequence parallelism). Given a layer's key/value cache (generation,
``zeroshard/inference/kv_cache.py``), it attends over the cached keys and values of its
local heads, as the built-in ``Attention`` does.

No communication of its own (its projections and core may communicate).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from zeroshard import ArgumentError
from zeroshard.models.gpt import Attention

# core(q, k, v, dropout_p) -> out, all (batch, heads, seq, head_dim), causal
AttentionCore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def causal_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float
) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)


class LocalHeadsAttention(nn.Module):
    """Causal self-attention over ``n_head`` heads, whatever share of the model's that is."""

    def __init__(self, attn: Attention, n_head: int, core: AttentionCore = causal_sdpa):
        super().__init__()
        self.qkv = attn.qkv
        self.proj = attn.proj
        self.dropout = attn.dropout
        self.n_head = n_head
        self.core = core

    def forward(self, x: torch.Tensor, kv=None) -> torch.Tensor:
        y = self.qkv(x)
        b, s, three_d = y.shape
        d = three_d // 3
        q, k, v = (
            z.view(b, s, self.n_head, d // self.n_head).transpose(1, 2) for z in y.split(d, 2)
        )
        drop = self.dropout if self.training else 0.0
        if kv is None:
            o = self.core(q, k, v, drop)
        elif self.core is not causal_sdpa:
            raise ArgumentError(
                "a key/value cache with sequence-parallel attention is not supported; "
                "generate without sequence parallelism"
            )
        else:  # generation: this rank's heads of every cached position, with the mask
            k, v, mask = kv.update(k, v)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop)
        return self.proj(o.transpose(1, 2).reshape(b, s, d))


def adapt_gpt_attention(model: nn.Module) -> list[LocalHeadsAttention]:
    """Replace every built-in ``Attention`` in ``model`` with a :class:`LocalHeadsAttention`
    of the same ``n_head`` (existing ones are returned as they are)."""
    out = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LocalHeadsAttention):
                out.append(child)
            elif isinstance(child, Attention):
                new = LocalHeadsAttention(child, child.n_head)
                setattr(parent, name, new)
                out.append(new)
    return out
