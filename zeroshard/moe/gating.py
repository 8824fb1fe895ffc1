"""Top-k gating as DeepSpeed-MoE computes it (GShard's and Switch Transformer's rules),
producing compact routes: for each token, the experts it goes to and their weights.
No communication: the capacity is local (with ``drop_tokens`` off nothing is dropped, so
no expert-parallel maximum is needed: the token exchange sends what was routed).

Everything runs in fp32. ``S`` tokens, ``E`` experts, ``gates = softmax(logits)``:

* **k = 1**: the first expert is the argmax of the gates (of the logits plus Gumbel
  noise with ``noisy_gate_policy="RSample"``); ``l_aux = E * sum_e(mean_s(gates) *
  fraction routed to e)``; over capacity (``ceil(S / E * capacity_factor)``, at least
  ``min_capacity``), each expert keeps its ``capacity`` tokens of largest uniform draw
  (``use_rts``, random token selection) or the first ones topk picks; the weight is the
  gate value, unnormalized.
* **k = 2**: the second expert is the argmax of the logits plus Gumbel noise
  (``top2_2nd_expert_sampling``, in training and evaluation alike, as DeepSpeed) with
  the first masked; ``l_aux = E * E * mean_e(...)`` of the first choices; capacity
  ``ceil(S / E * 2 * capacity_factor)``, dropped by position (first choices queue
  before second ones); the two weights normalized to sum to one.
* **k > 2**: the top-k gates; ``l_aux = E * E / k * mean_e(...)``; capacity
  ``ceil(S / E * k * capacity_factor)``, each expert keeping the tokens with the largest
  gate values (``drop_policy="probs"``) or its first ones (``"position"``); the kept
  weights normalized.

``exp_counts`` counts each expert's routes before drops (DeepSpeed's return value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zeroshard.moe.errors import ExpertParallelError


@dataclass
class Routes:
    """Where each token goes: ``experts[s, j]`` the j-th expert of token s (-1: dropped
    over capacity, or masked out), ``weights[s, j]`` its combine weight (fp32, 0 when
    dropped)."""

    experts: torch.Tensor  # [S, k] int64
    weights: torch.Tensor  # [S, k] fp32
    l_aux: torch.Tensor  # scalar fp32
    exp_counts: torch.Tensor  # [E]
    capacity: int | None  # per-expert capacity applied (None: no drops)


def capacity(tokens: int, experts: int, factor: float, min_capacity: int) -> int:
    """DeepSpeed's ``_capacity``: ``ceil(tokens / experts * factor)``, at least
    ``min_capacity``."""
    return max(math.ceil(tokens / experts * factor), min_capacity)


def gumbel_like(x: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise shaped like ``x`` (``-log(-log(U))``)."""
    u = torch.rand_like(x).clamp_(min=torch.finfo(x.dtype).tiny, max=1.0 - 1e-7)
    return -torch.log(-torch.log(u))


def multiplicative_jitter(x: torch.Tensor, epsilon: float = 1e-2) -> torch.Tensor:
    """Switch Transformer's input jitter: ``x`` times uniform noise in ``[1 - eps, 1 + eps]``."""
    return x * torch.empty_like(x).uniform_(1.0 - epsilon, 1.0 + epsilon)


def top1(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: torch.Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
) -> Routes:
    s, e = logits.shape
    gates = F.softmax(logits, dim=1)
    choose = logits + gumbel_like(logits) if noisy_gate_policy == "RSample" else gates
    first = torch.argmax(choose, dim=1)
    mask = F.one_hot(first, num_classes=e)
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(mask.dtype)
    exp_counts = mask.sum(0).detach()
    l_aux = torch.sum(gates.mean(0) * mask.float().mean(0)) * e
    if s < min_capacity:
        raise ExpertParallelError(
            f"MoE: {s} tokens, fewer than min_capacity ({min_capacity}); set min_capacity "
            "to 0 or give more tokens (DeepSpeed's rule for top-1 gating)"
        )
    cap = None
    if drop_tokens:
        cap = capacity(s, e, capacity_factor, min_capacity)
        score = mask * torch.rand_like(mask, dtype=torch.float32) if use_rts else mask
        keep = torch.topk(score, k=min(cap, s), dim=0).indices
        mask = mask * torch.zeros_like(mask).scatter_(0, keep, 1)
    kept = mask.sum(1) > 0
    weights = (gates * mask).sum(1)
    experts = torch.where(kept, first, torch.full_like(first, -1))
    return Routes(experts.unsqueeze(1), weights.unsqueeze(1), l_aux, exp_counts, cap)


def top2(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    second_sampling: bool = True,
) -> Routes:
    s, e = logits.shape
    gates = F.softmax(logits, dim=1)
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=e)
    if second_sampling:  # Gumbel-max: the second expert sampled from the rest
        logits = logits + gumbel_like(logits)
    second = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=e)
    loc1 = torch.cumsum(mask1, dim=0) - 1
    loc2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(0, keepdim=True)
    l_aux = torch.mean(gates.mean(0) * mask1.float().mean(0)) * e * e
    exp_counts = (mask1 + mask2).sum(0).detach()
    cap = None
    if drop_tokens:
        cap = capacity(s, e, 2 * capacity_factor, min_capacity)
        mask1 = mask1 * (loc1 < cap)
        mask2 = mask2 * (loc2 < cap)
    g1 = (gates * mask1).sum(1)
    g2 = (gates * mask2).sum(1)
    denom = torch.clamp(g1 + g2, min=torch.finfo(gates.dtype).eps)
    weights = torch.stack([g1 / denom, g2 / denom], dim=1)
    kept = torch.stack([mask1.sum(1) > 0, mask2.sum(1) > 0], dim=1)
    experts = torch.stack([first, second], dim=1)
    experts = torch.where(kept, experts, torch.full_like(experts, -1))
    return Routes(experts, weights, l_aux, exp_counts, cap)


def topk(
    logits: torch.Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    drop_policy: str = "probs",
) -> Routes:
    if drop_policy not in ("probs", "position"):
        raise ExpertParallelError(
            f"top-k gating: drop_policy {drop_policy!r} is not 'probs' or 'position'"
        )
    s, e = logits.shape
    gates = F.softmax(logits, dim=1)
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    exp_counts = mask.sum(0).detach()
    l_aux = torch.mean(gates.mean(0) * mask.float().mean(0)) * e * e / k
    cap = None
    if drop_tokens and drop_policy == "probs":  # each expert keeps its largest gates
        cap = capacity(s, e, capacity_factor * k, min_capacity)
        by_gate = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
        keep = torch.topk(by_gate, k=min(cap, s), dim=0, sorted=False).indices
        mask &= torch.zeros_like(mask).scatter_(0, keep, True)
    elif drop_tokens:  # each expert keeps its first tokens
        cap = capacity(s, e, capacity_factor * k, min_capacity)
        mask &= (torch.cumsum(mask, dim=0) - 1) < cap
    masked = gates * mask
    denom = torch.clamp(masked.sum(dim=-1, keepdim=True), min=torch.finfo(gates.dtype).eps)
    weights = (masked / denom).gather(1, top_idx)
    kept = mask.gather(1, top_idx)
    experts = torch.where(kept, top_idx, torch.full_like(top_idx, -1))
    return Routes(experts, weights, l_aux, exp_counts, cap)
