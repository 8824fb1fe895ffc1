"""Megatron tensor parallelism: the conjugate collectives and the layers built on them.

The collectives are tiny autograd Functions over a :class:`~zeroshard.comm.Comm` for
the tensor-parallel (TP) group of ``t`` ranks:

* :func:`copy_to_tp` is Megatron's ``f``: identity forward, all-reduce backward;
* :func:`reduce_from_tp` is Megatron's ``g``: all-reduce forward, identity backward;
* :func:`gather_from_sequence` (Megatron-SP's ``g-bar`` in backward): all-gather along
  the sequence dim forward, reduce-scatter backward; it replaces ``f`` in front of a
  column-parallel layer when the activations are split along the sequence;
* :func:`reduce_scatter_to_sequence`: reduce-scatter along the sequence forward,
  all-gather backward; it replaces ``g`` after a row-parallel layer under Megatron-SP;
* :func:`gather_from_tp` / :func:`split_to_tp`: all-gather along the last dim forward
  and take this rank's slice backward, and the reverse (a column layer's gathered
  output; a row layer fed a replicated input).

Layers (each can be built from an unsplit ``nn.Linear``, Hugging Face ``Conv1D`` or
``nn.Embedding`` with ``from_*``, taking this rank's slice of its weights):

* :class:`ColumnParallelLinear`: output features split; forward issues no collective
  (``f``'s all-reduce of the input gradient, b·s·in elements, comes in backward), or
  an all-gather of the input along the sequence under Megatron-SP;
* :class:`RowParallelLinear`: input features split; forward all-reduces the b·s·out
  output (or reduce-scatters it along the sequence under Megatron-SP), then adds the
  bias once;
* :class:`VocabParallelEmbedding`: vocabulary rows split; ids outside this rank's
  range are masked to zero, then the b·s·h output is all-reduced (reduce-scattered
  along the sequence under Megatron-SP).

The vocab-parallel cross-entropy lives in ``vocab_loss.py``.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from zeroshard.comm import Comm
from zeroshard.parallel.slices import TPSlice, mark_partial_grad, mark_sharded

# -- tensor helpers along one dim -----------------------------------------------------


def _gather_along(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    w = comm.world_size
    if w == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((w, *x.shape))
    comm.all_gather(out.view(-1), x.view(-1))
    out = out.movedim(0, dim)  # (..., w, n, ...): merge w into dim
    shape = list(x.shape)
    shape[dim] *= w
    return out.reshape(shape)


def _reduce_scatter_along(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's chunk along ``dim``."""
    w = comm.world_size
    if w == 1:
        return x
    shape = list(x.shape)
    if shape[dim] % w:
        raise ValueError(f"dim {dim} of size {shape[dim]} does not divide by {w} ranks")
    chunks = x.reshape(*shape[:dim], w, shape[dim] // w, *shape[dim + 1 :]).movedim(dim, 0)
    chunks = chunks.contiguous()
    shape[dim] //= w
    out = x.new_empty(shape)
    comm.reduce_scatter(out.view(-1), chunks.view(-1))
    return out


def _split_along(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` (no communication)."""
    w = comm.world_size
    if w == 1:
        return x
    if x.shape[dim] % w:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not divide by {w} ranks")
    n = x.shape[dim] // w
    return x.narrow(dim, comm.rank * n, n).contiguous()


# -- the conjugate collectives ----------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()  # autograd may hand the same tensor to other branches
        ctx.comm.all_reduce(grad)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        out = x.contiguous().clone()
        comm.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromSequence(torch.autograd.Function):
    """Megatron-SP: all-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return _gather_along(x, comm, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter_along(grad, ctx.comm, ctx.dim), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Megatron-SP: reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return _reduce_scatter_along(x, comm, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_along(grad, ctx.comm, ctx.dim), None, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward; this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return _gather_along(x, comm, x.dim() - 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _split_along(grad, ctx.comm, grad.dim() - 1), None


class _SplitToTP(torch.autograd.Function):
    """This rank's slice along the last dim forward; all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return _split_along(x, comm, x.dim() - 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_along(grad, ctx.comm, grad.dim() - 1), None


def copy_to_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _CopyToTP.apply(x, comm) if comm.world_size > 1 else x


def reduce_from_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _ReduceFromTP.apply(x, comm) if comm.world_size > 1 else x


def gather_from_sequence(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    return _GatherFromSequence.apply(x, comm, dim) if comm.world_size > 1 else x


def reduce_scatter_to_sequence(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    return _ReduceScatterToSequence.apply(x, comm, dim) if comm.world_size > 1 else x


def gather_from_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _GatherFromTP.apply(x, comm) if comm.world_size > 1 else x


def split_to_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _SplitToTP.apply(x, comm) if comm.world_size > 1 else x


# -- layers -----------------------------------------------------------------------------


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D``: a linear layer whose weight is stored (in, out)."""
    return (
        type(module).__name__ == "Conv1D"
        and hasattr(module, "nf")
        and tuple(module.weight.shape) == (module.nx, module.nf)
    )


def _slice_param(p: torch.Tensor, spec: TPSlice) -> nn.Parameter:
    with torch.no_grad():
        new = nn.Parameter(spec.take(p.detach()), requires_grad=p.requires_grad)
    mark_sharded(new, spec)
    return new


def _spec(shape, dim: int, parts, comm: Comm) -> TPSlice:
    shape = tuple(shape)
    parts = (shape[dim],) if parts is None else tuple(parts)
    return TPSlice(full_shape=shape, dim=dim, parts=parts, rank=comm.rank, world=comm.world_size)


def _linear_parts(layer: nn.Module) -> tuple[nn.Parameter, nn.Parameter | None, bool]:
    if isinstance(layer, nn.Linear):
        return layer.weight, layer.bias, False
    if is_conv1d(layer):
        return layer.weight, layer.bias, True
    raise TypeError(f"expected nn.Linear or Conv1D, got {type(layer).__name__}")


class _ParallelLinear(nn.Module):
    def __init__(self, comm: Comm, *, sequence_parallel: bool, seq_dim: int, transposed: bool):
        super().__init__()
        self.comm = comm
        self.sequence_parallel = sequence_parallel
        self.seq_dim = seq_dim
        self.transposed = transposed  # weight stored (in, out), as in Hugging Face's Conv1D

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.transposed:
            y = torch.matmul(x, self.weight)
            return y if bias is None else y + bias
        return F.linear(x, self.weight, bias)


class TPInput:
    """Brings an activation into a tensor-parallel region: ``f``, or under Megatron-SP the
    all-gather along the sequence.

    Column layers (and region hooks) that share one ``TPInput`` and read the same
    tensor (q, k and v of one input; gate and up) convert it once: one ``f`` means one
    all-reduce of the summed input gradient in backward, one all-gather serves all of
    them. A tensor this ``TPInput`` produced passes through unchanged. The converted
    tensor is forgotten as soon as its source tensor is freed.
    """

    def __init__(self, comm: Comm, *, sequence_parallel: bool = False, seq_dim: int = 1):
        self.comm, self.sequence_parallel, self.seq_dim = comm, sequence_parallel, seq_dim
        self._src: weakref.ref | None = None
        self._out: torch.Tensor | None = None
        self._key: tuple[int, bool] = (-1, False)

    def _forget(self, ref: weakref.ref) -> None:
        if ref is self._src:
            self._src = self._out = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self._out
        if out is not None:
            if out is x:
                return x
            if self._src() is x and self._key == (x._version, torch.is_grad_enabled()):
                return out
        if self.sequence_parallel:
            out = gather_from_sequence(x, self.comm, self.seq_dim)
        else:
            out = copy_to_tp(x, self.comm)
        self._src, self._out = weakref.ref(x, self._forget), out
        self._key = (x._version, torch.is_grad_enabled())
        return out


class ColumnParallelLinear(_ParallelLinear):
    """``y = x Wᵀ + b`` with W's output features split over the TP group.

    The input is replicated (or, with ``sequence_parallel``, split along ``seq_dim``
    and all-gathered here); layers sharing ``tp_input`` convert a common input once. The output is this rank's features, or all of them with
    ``gather_output``. ``parts`` names fused outputs (e.g. q, k, v sizes): each part
    is split on its own, so every rank holds whole heads of each.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Comm,
        *,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        parts: tuple[int, ...] | None = None,
        transposed: bool = False,
        tp_input: TPInput | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(
            comm, sequence_parallel=sequence_parallel, seq_dim=seq_dim, transposed=transposed
        )
        if tp_input is not None and (
            tp_input.comm is not comm or tp_input.sequence_parallel != sequence_parallel
        ):
            raise ValueError("tp_input must have this layer's comm and sequence_parallel")
        self.tp_input = tp_input or TPInput(
            comm, sequence_parallel=sequence_parallel, seq_dim=seq_dim
        )
        shape = (in_features, out_features) if transposed else (out_features, in_features)
        spec = _spec(shape, 1 if transposed else 0, parts, comm)
        if gather_output and len(spec.parts) > 1:
            raise ValueError("gather_output with fused parts would reorder the outputs")
        self.in_features, self.out_features, self.gather_output = (
            in_features,
            out_features,
            gather_output,
        )
        bound = 1 / math.sqrt(in_features)  # nn.Linear's default init, on the whole fan-in
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(spec.local_shape, **kw).uniform_(-bound, bound))
        mark_sharded(self.weight, spec)
        self.bias = None
        if bias:
            bspec = _spec((out_features,), 0, spec.parts, comm)
            self.bias = nn.Parameter(torch.empty(bspec.local_shape, **kw).uniform_(-bound, bound))
            mark_sharded(self.bias, bspec)

    @classmethod
    def from_linear(cls, layer: nn.Module, comm: Comm, **kw) -> ColumnParallelLinear:
        """This rank's share of an unsplit ``nn.Linear`` or ``Conv1D`` (weights copied)."""
        weight, bias, transposed = _linear_parts(layer)
        in_f, out_f = weight.shape[::-1] if not transposed else weight.shape
        new = cls(in_f, out_f, comm, bias=bias is not None, transposed=transposed,
                  device="meta", **kw)  # fmt: skip
        new.weight = _slice_param(
            weight, _spec(weight.shape, int(transposed), kw.get("parts"), comm)
        )
        if bias is not None:
            new.bias = _slice_param(bias, _spec(bias.shape, 0, kw.get("parts"), comm))
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(self.tp_input(x), self.bias)
        return gather_from_tp(y, self.comm) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features} (÷{self.comm.world_size}), "
            f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(_ParallelLinear):
    """``y = x Wᵀ + b`` with W's input features split over the TP group.

    The input is this rank's features (or, with ``input_is_parallel=False``, a
    replicated input this layer slices). Partial products are all-reduced (or, with
    ``sequence_parallel``, reduce-scattered along ``seq_dim``); the bias is added
    once, after the reduction.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Comm,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        transposed: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(
            comm, sequence_parallel=sequence_parallel, seq_dim=seq_dim, transposed=transposed
        )
        shape = (in_features, out_features) if transposed else (out_features, in_features)
        spec = _spec(shape, 0 if transposed else 1, None, comm)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        bound = 1 / math.sqrt(in_features)
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(spec.local_shape, **kw).uniform_(-bound, bound))
        mark_sharded(self.weight, spec)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **kw).uniform_(-bound, bound))
            if sequence_parallel:
                mark_partial_grad(self.bias)  # it sees only this rank's tokens

    @classmethod
    def from_linear(cls, layer: nn.Module, comm: Comm, **kw) -> RowParallelLinear:
        """This rank's share of an unsplit ``nn.Linear`` or ``Conv1D`` (weights copied)."""
        weight, bias, transposed = _linear_parts(layer)
        in_f, out_f = weight.shape[::-1] if not transposed else weight.shape
        new = cls(in_f, out_f, comm, bias=bias is not None, transposed=transposed,
                  device="meta", **kw)  # fmt: skip
        new.weight = _slice_param(weight, _spec(weight.shape, int(not transposed), None, comm))
        if bias is not None:
            new.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
            if new.sequence_parallel:
                mark_partial_grad(new.bias)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = split_to_tp(x, self.comm)
        y = self._matmul(x, None)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.comm, self.seq_dim)
        else:
            y = reduce_from_tp(y, self.comm)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features} (÷{self.comm.world_size}), out={self.out_features}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


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
        spec = _spec((num_embeddings, embedding_dim), 0, None, comm)
        self.comm, self.sequence_parallel, self.seq_dim = comm, sequence_parallel, seq_dim
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start = spec.ranges()[0][0]
        self.vocab_end = spec.ranges()[0][1]
        self.padding_idx = padding_idx
        self.weight = nn.Parameter(torch.empty(spec.local_shape, device=device, dtype=dtype))
        nn.init.normal_(self.weight)
        mark_sharded(self.weight, spec)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, comm: Comm, **kw) -> VocabParallelEmbedding:
        """This rank's rows of an unsplit ``nn.Embedding`` (weights copied)."""
        if emb.max_norm is not None or emb.scale_grad_by_freq or emb.sparse:
            raise ValueError(
                "VocabParallelEmbedding does not support max_norm, scale_grad_by_freq or sparse"
            )
        new = cls(emb.num_embeddings, emb.embedding_dim, comm, padding_idx=emb.padding_idx,
                  device="meta", **kw)  # fmt: skip
        new.weight = _slice_param(emb.weight, _spec(emb.weight.shape, 0, None, comm))
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
