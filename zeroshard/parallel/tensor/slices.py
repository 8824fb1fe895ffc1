"""Which slice of a whole tensor a tensor-parallel parameter holds: pure index math.

A tensor-parallel (TP) parameter is this rank's slice of a whole tensor along one dim.
When several tensors were fused along that dim (a ``qkv`` projection is q, k and v
stacked; a gated MLP's ``gate_up`` is gate and up), each fused *part* is split
evenly by the TP size and this rank holds its slice of every part, concatenated in
part order. The slice is then not contiguous in the whole tensor: :meth:`TPSlice.ranges`
lists where each piece comes from, :meth:`TPSlice.take` cuts a rank's tensor from a
whole one and :func:`assemble` puts every rank's tensors back together.

Sharded parameters carry their :class:`TPSlice` (read it with :func:`tp_slice_of`).
Replicated parameters whose gradient is a partial sum across the TP group (they act on
this rank's share of the sequence under Megatron-SP, or on its share of the heads)
are marked too (:func:`has_partial_grad`): their gradients must be summed over the TP
group before anything else reads them. Everything else is replicated with identical
gradients on every TP rank.

No communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zeroshard import ZeroshardError

_SLICE_ATTR = "zeroshard_tp_slice"
_PARTIAL_ATTR = "zeroshard_tp_partial_grad"


class TensorParallelError(ZeroshardError, ValueError):
    """A model, plan or tensor that tensor parallelism cannot split as asked."""


@dataclass(frozen=True, kw_only=True)
class TPSlice:
    """This rank's slice of a whole tensor of ``full_shape``, split along ``dim``.

    ``parts`` are the sizes along ``dim`` of the fused tensors in the whole tensor (one
    part when nothing is fused); each is split evenly over ``world`` ranks.
    """

    full_shape: tuple[int, ...]
    dim: int
    parts: tuple[int, ...]
    rank: int
    world: int

    def __post_init__(self) -> None:
        if not 0 <= self.dim < len(self.full_shape):
            raise TensorParallelError(
                f"split dim {self.dim} out of range for shape {self.full_shape}"
            )
        if sum(self.parts) != self.full_shape[self.dim]:
            raise TensorParallelError(
                f"fused parts {self.parts} do not add up to dim {self.dim} of {self.full_shape}"
            )
        bad = [p for p in self.parts if p % self.world]
        if bad:
            raise TensorParallelError(
                f"parts {self.parts} do not divide by the TP size {self.world}"
            )
        if not 0 <= self.rank < self.world:
            raise TensorParallelError(f"rank {self.rank} out of range for TP size {self.world}")

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] //= self.world
        return tuple(shape)

    def ranges(self) -> list[tuple[int, int]]:
        """``[(start, stop), ...]`` along ``dim`` in the whole tensor, one per part;
        this rank's tensor is these pieces concatenated in order."""
        out, base = [], 0
        for size in self.parts:
            step = size // self.world
            out.append((base + self.rank * step, base + (self.rank + 1) * step))
            base += size
        return out

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the whole tensor ``full`` (a new contiguous tensor)."""
        if tuple(full.shape) != self.full_shape:
            raise TensorParallelError(
                f"expected a whole tensor of shape {self.full_shape}, got {full.shape}"
            )
        pieces = [full.narrow(self.dim, a, b - a) for a, b in self.ranges()]
        return torch.cat(pieces, dim=self.dim).contiguous()


def even_slice(shape, dim: int, rank: int, world: int, parts=None) -> TPSlice:
    """Rank ``rank``'s slice of a ``shape`` tensor split along ``dim`` over ``world``
    ranks; ``parts``: the fused tensors' sizes along ``dim`` (a count of equal parts or
    their sizes; default one part)."""
    shape = tuple(shape)
    if parts is None:
        parts = (shape[dim],)
    elif isinstance(parts, int):
        parts = (shape[dim] // parts,) * parts
    return TPSlice(full_shape=shape, dim=dim, parts=tuple(parts), rank=rank, world=world)


def sliced_parameter(p: torch.Tensor, spec: TPSlice) -> nn.Parameter:
    """A new parameter holding ``spec``'s slice of the whole tensor ``p``, marked."""
    with torch.no_grad():
        new = nn.Parameter(spec.take(p.detach()), requires_grad=p.requires_grad)
    mark_sharded(new, spec)
    return new


def assemble(locals_: Sequence[torch.Tensor], spec: TPSlice) -> torch.Tensor:
    """The whole tensor from every rank's slice (``locals_`` in TP rank order)."""
    if len(locals_) != spec.world:
        raise TensorParallelError(f"expected {spec.world} slices, got {len(locals_)}")
    full = locals_[0].new_empty(spec.full_shape)
    for r, local in enumerate(locals_):
        s = TPSlice(
            full_shape=spec.full_shape, dim=spec.dim, parts=spec.parts, rank=r, world=spec.world
        )
        offset = 0
        for a, b in s.ranges():
            full.narrow(spec.dim, a, b - a).copy_(local.narrow(spec.dim, offset, b - a))
            offset += b - a
    return full


def mark_sharded(param: torch.Tensor, spec: TPSlice) -> None:
    if tuple(param.shape) != spec.local_shape:
        raise TensorParallelError(f"parameter of shape {tuple(param.shape)} is not a {spec}")
    setattr(param, _SLICE_ATTR, spec)


def mark_partial_grad(param: torch.Tensor) -> None:
    setattr(param, _PARTIAL_ATTR, True)


def tp_slice_of(param: torch.Tensor) -> TPSlice | None:
    """The :class:`TPSlice` of a tensor-parallel parameter; None if it is replicated."""
    return getattr(param, _SLICE_ATTR, None)


def has_partial_grad(param: torch.Tensor) -> bool:
    """True for a replicated parameter whose gradient must be summed over the TP group."""
    return bool(getattr(param, _PARTIAL_ATTR, False))
