"""The vocabulary split across the tensor-parallel group: embedding and cross-entropy.

* :class:`VocabParallelEmbedding`: vocabulary rows split; ids outside this rank's
  range are masked to zero, then the b·s·h output is all-reduced (reduce-scattered
  along the sequence under Megatron-SP).
* :func:`vocab_parallel_cross_entropy`: each rank holds logits for its vocabulary
  slice only (a column-parallel head without ``gather_output``); no rank materializes
  full-vocabulary logits. Forward, for N tokens: an all-reduce (max) of N fp32 values,
  then one all-reduce (sum) of 2N (the sum of exponentials and the target logit,
  stacked). Backward issues none: the gradient of this rank's logits is its slice of
  ``softmax - one_hot``, computed locally. :func:`causal_lm_loss` wraps it as a
  transformers ``loss_function``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zeroshard.distributed.comm import Comm
from zeroshard.parallel.tensor.collectives import reduce_from_tp, reduce_scatter_to_sequence
from zeroshard.parallel.tensor.slices import (
    TensorParallelError,
    even_slice,
    mark_sharded,
    sliced_parameter,
)


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
        raise TensorParallelError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if logits.shape[:-1] != target.shape:
        raise TensorParallelError(
            f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree"
        )
    start = comm.rank * logits.shape[-1] if vocab_start is None else vocab_start
    flat = _VocabParallelCrossEntropy.apply(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), comm, start, ignore_index
    )
    if reduction == "none":
        return flat.view(target.shape)
    if reduction == "sum":
        return flat.sum()
    return flat.sum() / (target != ignore_index).sum()


class VocabParallelEmbedding(nn.Module):
    """An embedding table whose vocabulary rows are split over the TP group.

    Each rank looks up the ids in its range (others give zeros), then the partial
    embeddings are all-reduced, or with ``sequence_parallel`` reduce-scattered along
    ``seq_dim`` so each rank keeps its share of the sequence.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        comm: Comm,
        *,
        padding_idx: int | None = None,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        spec = even_slice((num_embeddings, embedding_dim), 0, comm.rank, comm.world_size)
        self.comm, self.sequence_parallel, self.seq_dim = comm, sequence_parallel, seq_dim
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start = spec.ranges()[0][0]
        self.vocab_end = spec.ranges()[0][1]
        self.padding_idx = padding_idx
        # nn.Embedding's other options, read by code that looks a table up itself (a PEFT
        # LoRA embedding around this one); from_embedding refuses any other value
        self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse = (
            None,
            2.0,
            False,
            False,
        )
        self.weight = nn.Parameter(torch.empty(spec.local_shape, device=device, dtype=dtype))
        nn.init.normal_(self.weight)
        mark_sharded(self.weight, spec)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, comm: Comm, **kw) -> VocabParallelEmbedding:
        """This rank's rows of an unsplit ``nn.Embedding`` (weights copied)."""
        if emb.max_norm is not None or emb.scale_grad_by_freq or emb.sparse:
            raise TensorParallelError(
                "VocabParallelEmbedding does not support max_norm, scale_grad_by_freq or sparse"
            )
        new = cls(emb.num_embeddings, emb.embedding_dim, comm, padding_idx=emb.padding_idx,
                  device="meta", **kw)  # fmt: skip
        new.weight = sliced_parameter(
            emb.weight, even_slice(emb.weight.shape, 0, comm.rank, comm.world_size)
        )
        return new

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        pad = self.padding_idx
        pad = (
            pad - self.vocab_start
            if pad is not None and self.vocab_start <= pad < self.vocab_end
            else None
        )
        out = F.embedding(local, self.weight, padding_idx=pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.comm, self.seq_dim)
        return reduce_from_tp(out, self.comm)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings} (rows {self.vocab_start}:{self.vocab_end}), "
            f"{self.embedding_dim}, sequence_parallel={self.sequence_parallel}"
        )


def causal_lm_loss(comm: Comm):
    """A transformers ``loss_function`` for causal LMs whose head keeps its vocabulary
    split (``logits`` are this rank's slice): same arguments and normalization as
    transformers' ``ForCausalLMLoss``."""

    def loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
             shift_labels=None, **kwargs):  # fmt: skip
        if shift_labels is None:
            labels = F.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:]
        total = vocab_parallel_cross_entropy(
            logits, shift_labels.to(logits.device), comm, ignore_index=ignore_index, reduction="sum"
        )
        if num_items_in_batch is None:
            return total / (shift_labels != ignore_index).sum()
        return total / num_items_in_batch

    return loss
