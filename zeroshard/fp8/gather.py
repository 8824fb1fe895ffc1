"""The fp8 all-gather of ZeRO-3 weights (``fp8.enable_fsdp_float8_all_gather``, torchao's
and torchtitan's name; torchao's FSDP2 float8 all-gather, on zeroshard's flat units).

Each eligible fp8 Linear layer's weight is laid out alone in its stage-3 unit and gets
a :class:`Fp8WeightCodec` (the ``UnitCodec`` of ``zero/params/codec.py``). When the module
hooks gather that unit, every rank casts its shard (in bf16, the compute dtype) to
e4m3 with the scale the tensorwise fp8 matmul would take from the whole weight: the
shards' amaxes are max-all-reduced first, so the cast of a shard is the shard of the
cast, bit for bit. The all-gather then moves 1 byte per element instead of 2, and the
layer's forward hands the gathered fp8 weight and its scale straight to the fp8 matmul
(``scaled_mm.fp8_linear_gathered``: no second cast). Its backward casts the output
gradient and the input as torchao does and gives the weight a bf16 gradient, which the
reducer reduce-scatters as before (unchanged). The weight's values are never whole in
bf16 on a rank: reading them inside forward raises (``GatheredParameters`` outside the
passes gathers them in bf16).

Communication, per gather of such a unit (forward, and again before its backward unless
the unit is kept): one all-reduce (max) of one float32 over the unit's shard group, one
all-gather of ``numel`` bytes (padding included) instead of ``2 x numel``.

Eligible: torchao ``Float8Linear`` layers whose weight no other module holds (a weight
tied to an embedding is read in bf16 there): those the ``fp8`` section converted, and
those converted before initialize() (accelerate's fp8) with torchao's tensorwise recipe.
The others gather in bf16, each named once at start-up.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import MethodType
from typing import Any, cast

import torch
from torch import nn

from zeroshard.distributed.comm import Comm
from zeroshard.fp8.convert import Fp8Error, Fp8Model, torchao_float8
from zeroshard.fp8.scaled_mm import E4M3, amax_to_scale, fp8_linear_gathered, scaled_to_fp8

KEY = "fp8.enable_fsdp_float8_all_gather"


class Fp8WeightCodec:
    """One weight's fp8 all-gather: the gathered e4m3 buffer (``numel`` elements with the
    unit's padding, storage freed between gathers) and its scale (one float32, rewritten
    in place at each gather, so a backward sees the one its gather made)."""

    gathered_as = f"in fp8 ({KEY})"

    def __init__(self, shape: tuple[int, ...], padded: int, device: torch.device) -> None:
        self.shape, self.numel = shape, math.prod(shape)
        self.data = torch.empty(padded, dtype=E4M3, device=device)
        self.data.untyped_storage().resize_(0)
        self.scale = torch.ones((), dtype=torch.float32, device=device)
        self.ready = False

    def encode(self, chunk: torch.Tensor, valid: int, comm: Comm) -> torch.Tensor:
        with torch.no_grad():
            amax = chunk[:valid].abs().max() if valid else chunk.new_zeros(())
            wide = amax.float().reshape(1)  # max is exact in any dtype; the wire takes fp32
            comm.all_reduce(wide, op="max")
            self.scale.copy_(amax_to_scale(wide[0].to(chunk.dtype), E4M3))
            return scaled_to_fp8(chunk, self.scale, E4M3).view(torch.uint8)

    def receive(self, numel: int) -> torch.Tensor:
        if numel != self.data.numel():
            raise Fp8Error(f"{KEY}: a unit of {numel} elements for a buffer of {self.data.numel()}")  # fmt: skip
        if self.data.untyped_storage().nbytes() != numel:
            self.data.untyped_storage().resize_(numel)
        return self.data.view(torch.uint8)

    def landed(self) -> None:
        self.ready = True

    def release(self) -> None:
        self.ready = False
        self.data.untyped_storage().resize_(0)

    def weight(self) -> torch.Tensor | None:
        """The gathered fp8 weight (a view of the buffer), or None when not gathered in
        fp8 now (released, or gathered in bf16 by ``GatheredParameters``)."""
        return self.data[: self.numel].view(self.shape) if self.ready else None


def _forward(self: nn.Module, x: torch.Tensor, *, codec: Fp8WeightCodec) -> torch.Tensor:
    """torchao ``Float8Linear.forward`` with the weight gathered in fp8 (its own forward
    when the weight is gathered in bf16: the same numbers, cast after the gather)."""
    w8 = codec.weight()
    if w8 is None:
        return type(self).forward(self, x)
    if torch.is_autocast_enabled():  # as torchao's forward
        x = x.to(torch.get_autocast_gpu_dtype())
    y = fp8_linear_gathered(x, cast(torch.Tensor, self.weight), w8, codec.scale)
    bias = cast(torch.Tensor | None, self.bias)
    return y if bias is None else y + bias.to(y.dtype)


@dataclass
class Fp8AllGather:
    """Which weights gather in fp8, and (after :meth:`attach`) their codecs by unit."""

    layers: dict[str, nn.Module] = field(default_factory=dict)
    kept: list[tuple[str, str]] = field(default_factory=list)  # (name, why) gathered in bf16
    codecs: dict[int, Fp8WeightCodec] = field(default_factory=dict)
    _patched: list[nn.Module] = field(default_factory=list, repr=False)

    @property
    def weight_ids(self) -> frozenset[int]:
        """ids of the weights to lay out alone in their units."""
        return frozenset(id(m.weight) for m in self.layers.values())

    def summary(self) -> str:
        parts = [f"{KEY}: {len(self.layers)} Linear weight(s) gathered in fp8 (1 byte per element)"]  # fmt: skip
        if self.kept:
            parts.append("gathered in bf16: " + "; ".join(f"{n} ({w})" for n, w in self.kept))
        return "zeroshard: " + "; ".join(parts)

    def attach(self, params: Sequence[torch.Tensor], param_segment: Iterable[int], segments: Sequence[Any], persistent: Iterable[int], device: torch.device) -> dict[int, Fp8WeightCodec]:  # fmt: skip
        """A codec for each weight's unit (``params``/``param_segment``/``segments``: the
        flat layout's), and each layer's forward taking the fp8 weight from it."""
        index = {id(p): s for p, s in zip(params, param_segment, strict=True)}
        persistent = set(persistent)
        for name, m in self.layers.items():
            w = cast(torch.Tensor, m.weight)
            s = index.get(id(w))
            if s is None or s in persistent or len(segments[s].params) != 1:
                raise Fp8Error(f"{KEY}: the weight of {name!r} is not laid out alone in a unit of its own")  # fmt: skip
            codec = Fp8WeightCodec(tuple(w.shape), segments[s].numel, device)
            self.codecs[s] = codec
            m.forward = MethodType(functools.partial(_forward, codec=codec), m)
            self._patched.append(m)
        return dict(self.codecs)

    def undo(self) -> None:
        """Every patched layer's own forward back."""
        for m in self._patched:
            m.__dict__.pop("forward", None)
        self._patched.clear()


def _not_tensorwise(m: nn.Module) -> str | None:
    """Why a ``Float8Linear`` converted before initialize() (accelerate's fp8) cannot
    take the fp8 all-gather, or None: it must compute as torchao's tensorwise recipe
    (``fp8_linear_gathered``'s numerics), its own fp8 all-gather switch aside."""
    w = cast(torch.Tensor, m.weight)
    if w.shape[0] % 16 or w.shape[1] % 16:
        return f"converted before initialize(); matmul {w.shape[1]} -> {w.shape[0]}: fp8 kernels need dimensions divisible by 16"  # fmt: skip
    recipe = torchao_float8().Float8LinearConfig.from_recipe_name("tensorwise")
    want = dataclasses.replace(recipe, pad_inner_dim=True)
    got = dataclasses.replace(cast(Any, m).config, enable_fsdp_float8_all_gather=False, pad_inner_dim=True)  # fmt: skip
    return None if got == want else "converted before initialize() with another recipe than torchao's tensorwise"  # fmt: skip


def plan_fp8_all_gather(module: nn.Module, report: Fp8Model) -> Fp8AllGather:
    """The layers whose weights gather in fp8 (see the module docstring); the others
    named with why. Raises :class:`Fp8Error` when there is none."""
    owners: dict[int, list[str]] = {}
    for name, m in module.named_modules():
        for attr, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append(f"{name}.{attr}" if name else attr)
    plan = Fp8AllGather()
    for name in [*report.torchao, *report.before]:
        m = module.get_submodule(name)
        w = cast(torch.Tensor, m.weight)
        others = [o for o in owners.get(id(w), []) if o != f"{name}.weight"]
        why = _not_tensorwise(m) if name in report.before else None
        if others:
            plan.kept.append((name, f"its weight is also {', '.join(others)} (tied), read in bf16 there"))  # fmt: skip
        elif why:
            plan.kept.append((name, why))
        else:
            plan.layers[name] = m
    plan.kept += [(n, "tensor-parallel or Conv1D layer") for n in report.hand]
    if not plan.layers:
        why = "; ".join(f"{n} ({w})" for n, w in plan.kept) or "no fp8 Linear layer"
        raise Fp8Error(f"{KEY}: no Linear layer's weight can be gathered in fp8: {why}")
    return plan
