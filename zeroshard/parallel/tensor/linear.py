"""Column- and row-parallel linear layers (Megatron), from scratch or from unsplit ones.

* :class:`ColumnParallelLinear`: output features split; forward issues no collective
  (``f``'s all-reduce of the input gradient, b·s·in elements, comes in backward), or
  an all-gather of the input along the sequence under Megatron-SP (reduce-scatter of
  its gradient in backward); with ``gather_output``, an all-gather of the b·s·out
  output forward.
* :class:`RowParallelLinear`: input features split; forward all-reduces the b·s·out
  output (or reduce-scatters it along the sequence under Megatron-SP, all-gather of
  its gradient backward), then adds the bias once.

:class:`RegionInputLinear` keeps a Linear whole but reads the converted input of the
column layers beside it (no collective of its own).

Both parallel layers take an ``nn.Linear`` or Hugging Face ``Conv1D`` (weight stored (in, out)) with
``from_linear``, keeping this rank's slice of its weights in the same orientation,
so parameter names and layouts stay those of the unsplit model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from zeroshard.distributed.comm import Comm
from zeroshard.parallel.tensor.collectives import (
    TPInput,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    split_to_tp,
)
from zeroshard.parallel.tensor.slices import (
    TensorParallelError,
    TPSlice,
    even_slice,
    mark_partial_grad,
    mark_sharded,
    sliced_parameter,
)


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D``: a linear layer whose weight is stored (in, out)."""
    return (
        type(module).__name__ == "Conv1D"
        and hasattr(module, "nf")
        and tuple(module.weight.shape) == (module.nx, module.nf)  # type: ignore[arg-type]
    )


def _spec(shape, dim: int, parts, comm: Comm) -> TPSlice:
    return even_slice(shape, dim, comm.rank, comm.world_size, parts)


def _linear_parts(layer: nn.Module) -> tuple[nn.Parameter, nn.Parameter | None, bool]:
    if isinstance(layer, nn.Linear):
        return layer.weight, layer.bias, False  # type: ignore[return-value]  # torch types Linear.bias as a Tensor
    if is_conv1d(layer):
        return layer.weight, layer.bias, True  # type: ignore[return-value]
    raise TypeError(f"expected nn.Linear or Conv1D, got {type(layer).__name__}")


class _ParallelLinear(nn.Module):
    def __init__(self, comm: Comm, *, sequence_parallel: bool, seq_dim: int, transposed: bool):
        super().__init__()
        self.comm = comm
        self.sequence_parallel = sequence_parallel
        self.seq_dim = seq_dim
        self.transposed = transposed  # weight stored (in, out), as in Hugging Face's Conv1D

    #: replaces ``x @ weightᵀ`` when set, called with the weight as (out, in) (the fp8
    #: matmul with global scales, zeroshard/fp8); the bias is added after it
    linear_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.linear_fn is not None:
            w = cast(torch.Tensor, self.weight)
            y = self.linear_fn(x, w.t() if self.transposed else w)
            return y if bias is None else y + bias.to(y.dtype)
        if self.transposed:
            y = torch.matmul(x, self.weight)  # type: ignore[arg-type]
            return y if bias is None else y + bias
        return F.linear(x, self.weight, bias)  # type: ignore[arg-type]


class ColumnParallelLinear(_ParallelLinear):
    """``y = x Wᵀ + b`` with W's output features split over the TP group.

    The input is replicated (or, with ``sequence_parallel``, split along ``seq_dim``
    and all-gathered here); layers sharing ``tp_input`` convert a common input once;
    with ``input_in_region`` the input was converted already (it comes from a
    :class:`RegionInputLinear`). The output is this rank's features, or all of them with
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
        input_in_region: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(
            comm, sequence_parallel=sequence_parallel, seq_dim=seq_dim, transposed=transposed
        )
        self.input_in_region = input_in_region
        if tp_input is not None and (
            tp_input.comm is not comm or tp_input.sequence_parallel != sequence_parallel
        ):
            raise TensorParallelError("tp_input must have this layer's comm and sequence_parallel")
        self.tp_input = tp_input or TPInput(
            comm, sequence_parallel=sequence_parallel, seq_dim=seq_dim
        )
        shape = (in_features, out_features) if transposed else (out_features, in_features)
        spec = _spec(shape, 1 if transposed else 0, parts, comm)
        if gather_output and len(spec.parts) > 1:
            raise TensorParallelError("gather_output with fused parts would reorder the outputs")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        bound = 1 / math.sqrt(in_features)  # nn.Linear's default init, on the whole fan-in
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
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
        new.weight = sliced_parameter(
            weight, _spec(weight.shape, int(transposed), kw.get("parts"), comm)
        )
        if bias is not None:
            new.bias = sliced_parameter(bias, _spec(bias.shape, 0, kw.get("parts"), comm))
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x if self.input_in_region else self.tp_input(x), self.bias)
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
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
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
        new.weight = sliced_parameter(weight, _spec(weight.shape, int(not transposed), None, comm))
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


class RegionInputLinear(nn.Module):
    """A whole (unsplit) ``nn.Linear`` that reads the tensor-parallel region's input:
    its input passes through the ``tp_input`` its column-parallel neighbours share, so
    it sees their converted tensor (no collective of its own when they converted it
    first). Downstream column layers read its output with ``input_in_region``; its
    weight's gradient is then a partial sum over the TP group (mark it so).

    LoRA's A around a column-parallel layer: ``B_local(A(x))`` adds to the base's local
    output features, and the input gradient joins the base's in one ``f``.
    """

    def __init__(self, layer: nn.Module, tp_input: TPInput):
        super().__init__()
        if not isinstance(layer, nn.Linear):
            raise TypeError(f"expected nn.Linear, got {type(layer).__name__}")
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.weight, self.bias = layer.weight, layer.bias
        self.tp_input = tp_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.tp_input(x), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features} (whole, region input)"
