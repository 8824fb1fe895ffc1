"""Cross-entropy over logits whose vocabulary is split across the tensor-parallel group.

Each rank holds logits for its vocabulary slice only (the output of a column-parallel
head without ``gather_output``); no rank materializes full-vocabulary logits.

Collectives, forward only, over the TP group, for N tokens: an all-reduce (max) of N
fp32 values, then one all-reduce (sum) of 2N fp32 values (the sum of exponentials and
the target logit, stacked). Backward issues none: the gradient of this rank's logits
is its slice of ``softmax - one_hot``, computed locally.
"""

from __future__ import annotations

import torch

from zeroshard.comm import Comm


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss ``log Σ exp(z) - z[target]`` with z split along the vocabulary."""

    @staticmethod
    def forward(ctx, logits, target, comm: Comm, vocab_start: int, ignore_index: int):
        z = logits.float()
        m = z.max(dim=-1).values
        comm.all_reduce(m, op="max")
        z = z - m.unsqueeze(-1)
        ez = z.exp()
        n_local = z.shape[-1]
        valid = target != ignore_index
        here = valid & (target >= vocab_start) & (target < vocab_start + n_local)
        idx = (target - vocab_start).masked_fill(~here, 0)
        picked = z.gather(-1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)
        sums = torch.stack([ez.sum(dim=-1), picked])
        comm.all_reduce(sums)
        loss = (sums[0].log() - sums[1]).masked_fill(~valid, 0.0)
        softmax = ez.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, idx, here, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, idx, here, valid = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, idx.unsqueeze(-1), -here.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    comm: Comm,
    *,
    vocab_start: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of ``logits`` (..., V/t: this rank's vocabulary slice) against
    ``target`` (...: ids into the whole vocabulary), like ``F.cross_entropy``.

    ``vocab_start`` is the first id of this rank's slice; by default the slices are
    equal and in rank order (as :class:`ColumnParallelLinear` and
    :class:`VocabParallelEmbedding` lay them out). ``reduction``: "mean" (over tokens
    whose target is not ``ignore_index``), "sum" or "none".
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree")
    start = comm.rank * logits.shape[-1] if vocab_start is None else vocab_start
    flat = _VocabParallelCrossEntropy.apply(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), comm, start, ignore_index
    )
    if reduction == "none":
        return flat.view(target.shape)
    if reduction == "sum":
        return flat.sum()
    return flat.sum() / (target != ignore_index).sum()
