"""DeepSpeed's ``deepspeed.moe.sharded_moe`` gating functions in their dense form:
``(l_aux, combine_weights [S, E, C], dispatch_mask [S, E, C], exp_counts)``, as
DeepSpeed's tests and code written against them call them. The layer itself uses the
compact routes of ``gating.py``; these build the capacity-shaped tensors from them.

With ``drop_tokens`` off the capacity is the largest expert count, all-reduced (max)
over ``ep_group`` when one of several ranks is given (DeepSpeed's rule): one all-reduce
of an int64 scalar.
"""

from __future__ import annotations

import torch

from zeroshard import NotBuiltError
from zeroshard.distributed.comm import Comm
from zeroshard.moe import gating
from zeroshard.moe.layer import MOELayer, TopKGate

multiplicative_jitter = gating.multiplicative_jitter


def _capacity_without_drops(routes: gating.Routes, ep_group, tokens: int | None) -> int:
    most = routes.exp_counts.max().to(torch.int64).reshape(1)
    if ep_group is not None:
        Comm(ep_group, axis="ep").all_reduce(most, "max")
    cap = int(most.item())
    return min(cap, tokens) if tokens is not None else cap


def _dense(routes: gating.Routes, num_experts: int, cap: int, slot_major: bool):
    """``combine_weights`` and ``dispatch_mask`` ``[S, E, cap]``: a kept route of token
    s to expert e at its place in e's buffer (its rank among e's kept routes, in token
    order; with ``slot_major``, all first choices before the second ones: top-2)."""
    s, k = routes.experts.shape
    combine = torch.zeros(s, num_experts, cap, dtype=routes.weights.dtype)
    experts = routes.experts.t() if slot_major else routes.experts
    weights = routes.weights.t() if slot_major else routes.weights
    flat_e, flat_w = experts.reshape(-1), weights.reshape(-1)
    token = torch.arange(s).repeat_interleave(k) if not slot_major else torch.arange(s).repeat(k)
    seen = torch.zeros(num_experts, dtype=torch.long)
    for i in range(flat_e.numel()):  # routes in buffer order
        e = int(flat_e[i])
        if e < 0:
            continue
        combine[token[i], e, seen[e]] = flat_w[i]
        seen[e] += 1
    return combine, combine.bool()


def top1gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: torch.Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group=None,
    use_tutel: bool = False,
):
    if use_tutel:
        raise NotBuiltError("top1gating(use_tutel=True): Tutel is not built in zeroshard")
    r = gating.top1(
        logits, capacity_factor, min_capacity, used_token, noisy_gate_policy, drop_tokens, use_rts
    )
    cap = (
        r.capacity
        if r.capacity is not None
        else _capacity_without_drops(r, ep_group, logits.shape[0])
    )
    combine, mask = _dense(r, logits.shape[1], cap, slot_major=False)
    return r.l_aux, combine, mask, r.exp_counts


def top2gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group=None,
    top2_2nd_expert_sampling: bool = True,
):
    r = gating.top2(logits, capacity_factor, min_capacity, drop_tokens, top2_2nd_expert_sampling)
    cap = r.capacity if r.capacity is not None else _capacity_without_drops(r, ep_group, None)
    combine, mask = _dense(r, logits.shape[1], cap, slot_major=True)
    return r.l_aux, combine, mask, r.exp_counts


def topkgating(
    logits: torch.Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group=None,
    drop_policy: str = "probs",
):
    r = gating.topk(logits, k, capacity_factor, min_capacity, drop_tokens, drop_policy)
    cap = r.capacity if r.capacity is not None else _capacity_without_drops(r, ep_group, None)
    combine, mask = _dense(r, logits.shape[1], cap, slot_major=False)
    return r.l_aux, combine, mask, r.exp_counts


__all__ = [
    "MOELayer",
    "TopKGate",
    "multiplicative_jitter",
    "top1gating",
    "top2gating",
    "topkgating",
]
