"""Token dispatch and combine across the expert-parallel group (GShard's all-to-all).

Each routed copy of a token (a *row*: a token and one of its experts) is sent to the
rank holding that expert, run through it there with the rows other ranks sent, and sent
back to be weighted and summed into its token. Compact: only routed rows move (no
capacity padding), ``Comm.all_to_all`` with per-rank split sizes.

Communication per MoE layer, on the ``ep`` axis (ledger op ``all_to_all``, which counts
a rank's whole send buffer, its own part included):

* forward: the rows' counts per expert (``ep x local`` int64: ``8 * E`` bytes), the
  rows out (``R_sent * hidden * dtype`` bytes) and their outputs back
  (``R_received * hidden * dtype``);
* backward: the same two row exchanges reversed (the counts are not resent).

So a rank files ``2 * (R_sent + R_received) * hidden * dtype + 8 * E`` bytes per layer
and training step, where ``R_sent`` is the rows it routed (``tokens x k`` with no
drops) and ``R_received`` the rows its experts got. Over an expert-parallel group the
two totals are equal: ``4 * k * tokens * hidden * dtype + 8 * E * ep`` for the group's
tokens; of a rank's rows, ``(ep - 1) / ep`` leave it under even routing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from zeroshard.distributed.comm import Comm


class _AllToAll(torch.autograd.Function):
    """GShard's all-to-all dispatch / combine (Lepikhin et al. 2020, Algorithm 2) as a
    differentiable collective: forward sends part j of the rows to rank j
    (``in_splits``) and receives ``out_splits``; backward sends the gradients back along
    the same routes (the splits swapped)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, out_splits: list[int], in_splits: list[int]):
        ctx.comm, ctx.out_splits, ctx.in_splits = comm, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm.all_to_all(out, x.contiguous(), output_splits=out_splits, input_splits=in_splits)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        ctx.comm.all_to_all(
            back,
            grad.contiguous(),
            output_splits=ctx.in_splits,
            input_splits=ctx.out_splits,
        )
        return back, None, None, None


def all_to_all(x: torch.Tensor, comm: Comm, out_splits: list[int], in_splits: list[int]):
    """Differentiable all-to-all of rows (see :class:`_AllToAll`)."""
    return _AllToAll.apply(x, comm, out_splits, in_splits)


@dataclass
class Plan:
    """How one layer's rows travel, computed once per forward."""

    order: torch.Tensor  # route positions (into [tokens * k]) of kept rows, by expert
    sent: list[int]  # rows to each rank of the group
    received: list[int]  # rows from each rank
    regroup: torch.Tensor | None  # received rows -> (local expert, source rank) order
    counts: list[int]  # rows per local expert, in regrouped order


def plan(experts: torch.Tensor, num_experts: int, comm: Comm | None) -> Plan:
    """The plan for routes ``experts`` (``[tokens, k]`` global expert ids, -1 dropped):
    one all-to-all of the counts per expert when ``comm`` spans several ranks."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    order = order[flat[order] >= 0]  # dropped routes (-1) sort first: cut them
    counts = torch.bincount(flat[order], minlength=num_experts)
    ep = comm.world_size if comm is not None else 1
    local = num_experts // ep
    if ep == 1:
        return Plan(order, [int(order.numel())], [int(order.numel())], None, counts.tolist())
    assert comm is not None
    theirs = torch.empty_like(counts)
    comm.all_to_all(theirs, counts)  # theirs[j * local + e]: rank j's rows for my expert e
    by_source = theirs.view(ep, local)
    sent = counts.view(ep, local).sum(1).tolist()
    received = by_source.sum(1).tolist()
    expert_of_row = torch.arange(local, device=flat.device).repeat(ep)
    expert_of_row = torch.repeat_interleave(expert_of_row, by_source.reshape(-1))
    regroup = torch.argsort(expert_of_row, stable=True)
    return Plan(order, sent, received, regroup, by_source.sum(0).tolist())


def run_experts(
    tokens: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    comm: Comm | None,
    compute: Callable[[torch.Tensor, list[int]], torch.Tensor],
) -> tuple[torch.Tensor, Plan]:
    """Every route's expert output, ``[tokens, k, out]`` (zeros for dropped routes),
    and the plan it followed: the rows go to their experts' ranks, ``compute(rows,
    counts)`` runs this rank's experts on the rows it got (sorted by local expert,
    ``counts`` each), the outputs come back."""
    s, k = experts.shape
    p = plan(experts, num_experts, comm)
    rows = tokens.index_select(0, torch.div(p.order, k, rounding_mode="floor"))
    if p.regroup is not None:
        assert comm is not None
        rows = all_to_all(rows, comm, p.received, p.sent).index_select(0, p.regroup)
    out = compute(rows, p.counts)
    if p.regroup is not None:
        assert comm is not None
        back = torch.empty_like(p.regroup)
        back[p.regroup] = torch.arange(p.regroup.numel(), device=back.device)
        out = all_to_all(out.index_select(0, back), comm, p.sent, p.received)
    routes = out.new_zeros(s * k, out.shape[-1]).index_copy(0, p.order, out)
    return routes.view(s, k, out.shape[-1]), p
