"""An fp8 linear matmul with dynamic scaling, for the layers torchao's ``Float8Linear``
cannot replace: the tensor-parallel column/row layers (whose scales must be the unsplit
tensor's) and Hugging Face's ``Conv1D`` (a Linear stored transposed).

Numerics are torchao 0.18's float8 training recipes, operation for operation, so a
tensor-parallel layer reproduces the unsplit torchao layer to float round-off
(``tests/test_fp8.py`` checks it):

* a tensor's scale is ``fp8_max / max(amax, 1e-12)`` (in float64, then float32; rounded
  down to a power of 2 in the rowwise recipes), its fp8 value
  ``clamp(x * scale, ±fp8_max)``; ``torch._scaled_mm`` multiplies by the reciprocals;
* ``tensorwise``: one scale per tensor; input and weight in e4m3, the output gradient in
  e5m2 (more range, for gradients); ``rowwise``: one scale per row of each operand along
  its inner dimension, e4m3 throughout; ``rowwise_with_gw_hp``: rowwise, the weight for
  the input gradient tensorwise, the weight gradient in high precision;
* the forward gemm accumulates with fast accumulation (``use_fast_accum``), the two
  backward gemms without; an inner dimension that is not a multiple of 16 (the token
  count, in the weight gradient) is zero-padded as the GPU kernels need.

Communication: with a tensor-parallel ``Comm``, every amax taken over a dimension the
group splits is max-all-reduced over it before the scale is made, so scales are global
(the unsplit tensor's), never per shard. Column-parallel (output features split): the
weight's amax in the tensorwise recipe and the output gradient's (one scalar or one per
token, in backward). Row-parallel (input features split): the input's and the weight's.
One scalar, or one value per token/feature, per all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from zeroshard.distributed.comm import Comm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_EPS = 1e-12  # torchao's floor on amax (no division by zero)


@dataclass(frozen=True)
class Recipe:
    """What one of torchao's recipe names does (``Float8LinearConfig.from_recipe_name``)."""

    name: str
    rowwise: bool  # input, weight and output gradient scaled per row, not per tensor
    grad_dtype: torch.dtype  # the output gradient's fp8 format
    pow2: bool  # scales rounded down to powers of 2
    grad_weight_hp: bool  # the weight gradient in high precision (weight for dgrad: tensorwise)


RECIPES = {
    "tensorwise": Recipe("tensorwise", False, E5M2, False, False),
    "rowwise": Recipe("rowwise", True, E4M3, True, False),
    "rowwise_with_gw_hp": Recipe("rowwise_with_gw_hp", True, E4M3, True, True),
}


class _Fp8(NamedTuple):
    """A 2-D fp8 tensor and its scale (0-d, or shaped like a keepdim amax when axiswise)."""

    data: torch.Tensor
    scale: torch.Tensor
    axiswise: bool

    def t(self) -> _Fp8:
        return _Fp8(self.data.t(), self.scale.t() if self.axiswise else self.scale, self.axiswise)


@dataclass(frozen=True)
class Split:
    """How a tensor-parallel layer splits its matmul: ``dim`` "in" (row-parallel: the
    input features) or "out" (column-parallel: the output features), over ``comm``."""

    comm: Comm
    dim: str


def _cast(x: torch.Tensor, dtype: torch.dtype, axis: int | None, pow2: bool,
          split: Comm | None = None, split_dim: int | None = None) -> _Fp8:  # fmt: skip
    """``x`` (2-D, high precision) to fp8 with a dynamic scale: per tensor (``axis``
    None) or per slice along ``axis``; an amax over ``split_dim`` (split over
    ``split``'s ranks) is max-all-reduced first."""
    with torch.no_grad():
        amax = x.abs().max() if axis is None else torch.amax(x.abs(), dim=axis, keepdim=True)
        reduced = axis is None or axis % 2 == split_dim
        if split is not None and split_dim is not None and reduced and split.world_size > 1:
            wide = amax.float()  # max is exact in any dtype; the wire takes fp32
            split.all_reduce(wide, op="max")
            amax = wide.to(amax.dtype)
        scale = amax_to_scale(amax, dtype, pow2)
    return _Fp8(scaled_to_fp8(x, scale, dtype), scale, axis is not None)


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, pow2: bool = False) -> torch.Tensor:
    """torchao's scale for an amax: ``fp8_max / max(amax, 1e-12)`` in float64, then
    float32 (rounded down to a power of 2 when ``pow2``)."""
    scale = (torch.finfo(dtype).max / torch.clamp(amax.double(), min=_EPS)).float()
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def scaled_to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``clamp(x * scale, ±fp8_max)`` in ``dtype`` (torchao's saturated cast)."""
    top = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-top, top).to(dtype)


def _pad_inner(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad the inner dimension to a multiple of 16 (the GPU kernels' rule)."""
    k = a.shape[1]
    if k % 16 == 0:
        return a, b
    pad = 16 - k % 16
    return F.pad(a.view(torch.uint8), (0, pad)).view(a.dtype), F.pad(
        b.view(torch.uint8), (0, 0, 0, pad)
    ).view(b.dtype)


def _mm(a: _Fp8, b: _Fp8, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """``a @ b`` through ``torch._scaled_mm`` (a row-major, b column-major)."""
    a_data, b_data = _pad_inner(a.data, b.data)
    if not (a_data.stride(1) == 1 and a_data.stride(0) > 1):
        a_data = a_data.contiguous()
    if b_data.stride(1) == 1 and b_data.stride(0) > 1:
        b_data = b_data.t().contiguous().t()
    a_scale, b_scale = a.scale, b.scale
    if not a.axiswise and b.axiswise:  # one operand tensorwise: repeat its scale
        a_scale = a_scale.repeat(a_data.shape[0]).reshape(-1, 1)
    elif a.axiswise and not b.axiswise:
        b_scale = b_scale.repeat(b_data.shape[1]).reshape(1, -1)
    inv_a, inv_b = a_scale.reciprocal(), b_scale.reciprocal()
    rowwise = a_scale.shape == (a_data.shape[0], 1) and b_scale.shape == (1, b_data.shape[1])
    post = None
    if rowwise and not fast_accum:  # torchao: the tensorwise kernel, scaled afterwards
        post = inv_a * inv_b
        inv_a = inv_b = inv_a.new_ones(())
    dtype = torch.bfloat16 if rowwise and out_dtype in (torch.float16, torch.float32) else out_dtype
    out = torch._scaled_mm(
        a_data, b_data, scale_a=inv_a, scale_b=inv_b, out_dtype=dtype, use_fast_accum=fast_accum
    )
    if post is not None:
        out = out * post
    return out.to(out_dtype)


class _Fp8Linear(torch.autograd.Function):
    """``x @ wᵀ`` with ``w`` (out, in): fp8 forward, fp8 input gradient, fp8 or high-
    precision weight gradient; saves the high-precision ``x`` and ``w`` (as torchao)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, recipe: Recipe, split: Split | None):
        ctx.save_for_backward(x, w)
        ctx.recipe, ctx.split = recipe, split
        comm = split.comm if split is not None else None
        k_split, n_split = _split_dims(split)
        x2 = x.reshape(-1, x.shape[-1])
        axis = -1 if recipe.rowwise else None
        xq = _cast(x2, E4M3, axis, recipe.pow2, comm, 1 if k_split else None)
        wt = w.t()  # (in, out)
        wq = _cast(wt, E4M3, 0 if recipe.rowwise else None, recipe.pow2, comm, _wt_split(k_split, n_split))  # fmt: skip
        out = _mm(xq, wq, x.dtype, fast_accum=True)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        recipe, split = ctx.recipe, ctx.split
        comm = split.comm if split is not None else None
        k_split, n_split = _split_dims(split)
        go = grad.reshape(-1, grad.shape[-1])
        wt = w.t()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            axis = -1 if recipe.rowwise else None
            gq = _cast(go, recipe.grad_dtype, axis, recipe.pow2, comm, 1 if n_split else None)
            w_axis = -1 if recipe.rowwise and not recipe.grad_weight_hp else None
            wq = _cast(wt, E4M3, w_axis, recipe.pow2, comm, _wt_split(k_split, n_split))
            grad_x = _mm(gq, wq.t(), grad.dtype, fast_accum=False).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            if recipe.grad_weight_hp:
                grad_w = torch.mm(go.t(), x2)
            else:
                axis = 0 if recipe.rowwise else None
                gq = _cast(go, recipe.grad_dtype, axis, recipe.pow2, comm, 1 if n_split else None)
                xq = _cast(x2, E4M3, axis, recipe.pow2, comm, 1 if k_split else None)
                grad_w = _mm(gq.t(), xq, grad.dtype, fast_accum=False)
        return grad_x, grad_w, None, None


class _Fp8LinearGathered(torch.autograd.Function):
    """``x @ wᵀ`` (tensorwise) with the weight already in fp8: ``w8`` (out, in) and its
    ``scale``, cast before the stage-3 all-gather with the whole weight's scale
    (``fp8/gather.py``). ``w`` is the Parameter itself, an input only so that its
    gradient (high precision, as :class:`_Fp8Linear` gives it) reaches it; its values
    are never read. ``w8`` is saved as a view of the unit's buffer, which the gatherer
    fills again (the same values: the same shard, the same amax) before this backward;
    ``scale`` is the gatherer's tensor, rewritten in place at each gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor):
        ctx.save_for_backward(x, w8)
        ctx.scale, ctx.recipe = scale, RECIPES["tensorwise"]
        x2 = x.reshape(-1, x.shape[-1])
        xq = _cast(x2, E4M3, None, False)
        out = _mm(xq, _Fp8(w8.t(), scale, False), x.dtype, fast_accum=True)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        x, w8 = ctx.saved_tensors
        recipe = ctx.recipe
        go = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            gq = _cast(go, recipe.grad_dtype, None, False)
            grad_x = _mm(gq, _Fp8(w8, ctx.scale, False), grad.dtype, fast_accum=False)
            grad_x = grad_x.reshape(x.shape)
        if ctx.needs_input_grad[1]:
            gq = _cast(go, recipe.grad_dtype, None, False)
            xq = _cast(x.reshape(-1, x.shape[-1]), E4M3, None, False)
            grad_w = _mm(gq.t(), xq, grad.dtype, fast_accum=False)
        return grad_x, grad_w, None, None


def fp8_linear_gathered(
    x: torch.Tensor, weight: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """``x @ weightᵀ`` as :func:`fp8_linear` computes it in the tensorwise recipe, with the
    weight given already cast: ``w8`` (e4m3, shaped as ``weight``) and its ``scale`` (0-d
    float32, the one :func:`amax_to_scale` gives for the whole weight's amax); the
    gradient of ``weight`` (the Parameter, whose values are not read) comes back in
    ``x``'s dtype."""
    return _Fp8LinearGathered.apply(x, weight, w8, scale)


def _split_dims(split: Split | None) -> tuple[bool, bool]:
    """(input features split, output features split)."""
    if split is None or split.comm.world_size == 1:
        return False, False
    return split.dim == "in", split.dim == "out"


def _wt_split(k_split: bool, n_split: bool) -> int | None:
    """The split dimension of the weight as (in, out)."""
    return 0 if k_split else 1 if n_split else None


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, recipe: Recipe, split: Split | None = None
) -> torch.Tensor:
    """``x @ weightᵀ`` (``weight`` as (out, in), any strides) in fp8, as torchao's
    ``Float8Linear`` computes it; ``split``: this is one tensor-parallel shard of the
    matmul, and its scales are taken over the whole (unsplit) tensors."""
    return _Fp8Linear.apply(x, weight, recipe, split)
