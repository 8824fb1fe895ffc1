"""Megatron tensor parallelism: the conjugate collectives.

Tiny autograd Functions over a :class:`~zeroshard.distributed.comm.Comm` for the tensor-parallel
(TP) group of ``t`` ranks:

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

:class:`TPInput` applies ``f`` (or the sequence all-gather) once to an input that
several column layers read (q, k, v; gate, up). The layers are in ``linear.py``
(column, row) and ``vocab.py`` (embedding, cross-entropy). Each Function issues only
the collective named above, on the tensor it is given.
"""

from __future__ import annotations

import weakref

import torch

from zeroshard.distributed.comm import Comm
from zeroshard.parallel.tensor.slices import TensorParallelError

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
        raise TensorParallelError(f"dim {dim} of size {shape[dim]} does not divide by {w} ranks")
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
        raise TensorParallelError(f"dim {dim} of size {x.shape[dim]} does not divide by {w} ranks")
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


# -- entering a tensor-parallel region ------------------------------------------------


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
            src = self._src
            if (
                src is not None
                and src() is x
                and self._key == (x._version, torch.is_grad_enabled())
            ):
                return out
        if self.sequence_parallel:
            out = gather_from_sequence(x, self.comm, self.seq_dim)
        else:
            out = copy_to_tp(x, self.comm)
        self._src, self._out = weakref.ref(x, self._forget), out
        self._key = (x._version, torch.is_grad_enabled())
        return out
