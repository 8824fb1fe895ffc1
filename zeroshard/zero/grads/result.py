"""What a finished accumulation window hands to the optimizer: this rank's reduced
gradient chunks, and which parameters got a gradient on this rank. No communication:
the reducer has reduced them (``zero/grads/reducer.py``); the step's one flags
all-reduce (unused parameters, non-finite values) runs over :attr:`ReducedGrads.groups`
in ``zero/optim/optimizer.py``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zeroshard.distributed.comm import Comm
from zeroshard.zero.layout.flat import FlatParams


@dataclass(frozen=True, kw_only=True)
class ReducedGrads:
    """The reduced, averaged gradient of this rank's chunks, valid until the next
    backward or ``zero_grad``.

    Attributes:
        flat: the flat parameters (layout, trainable groups).
        chunks: ``chunks[segment]``: this rank's chunk of that segment's gradient (empty
            for a segment of frozen parameters).
        arrived: trainable parameters that got a gradient on this rank in the window.
        groups: the groups the gradients were averaged over (the reduction's group, and
            the hybrid replicas' when there are any).
        squares: optimizer offload: per segment, the fp32 sum of squares of each chunk,
            taken by the host's landing thread as the chunk landed (during backward);
            None when not every chunk's was. Read through :meth:`landed_squares`.
        squares_of: the host shard the chunks are views of (offload), whose version
            counter was ``squares_version`` once every chunk had landed.
    """

    flat: FlatParams
    chunks: Sequence[torch.Tensor]
    arrived: frozenset[int]
    groups: tuple[Comm, ...]
    squares: Sequence[torch.Tensor] | None = None
    squares_of: torch.Tensor | None = None
    squares_version: int | None = None

    def landed_squares(self) -> list[torch.Tensor] | None:
        """:attr:`squares`, or None when there are none or the chunks were changed in
        place since they were taken (tensor-parallel partial sums, a user's edit): the
        shard's version counter moved on."""
        shard = self.squares_of
        if self.squares is None or shard is None or shard._version != self.squares_version:
            return None
        return list(self.squares)

    def pieces(self, a: int, b: int) -> list[torch.Tensor]:
        """The gradient at shard positions ``[a, b)``, one piece per segment: views of
        the chunks (zeros where a segment holds only frozen parameters)."""
        parts = []
        for seg in self.flat.layout.segments:
            lo, hi = max(a, seg.shard_start), min(b, seg.shard_start + seg.chunk)
            if lo < hi:
                chunk = self.chunks[seg.index]
                if chunk.numel():
                    parts.append(chunk[lo - seg.shard_start : hi - seg.shard_start])
                else:
                    parts.append(torch.zeros(hi - lo, dtype=chunk.dtype, device=chunk.device))
        return parts

    def range(self, a: int, b: int) -> torch.Tensor:
        """:meth:`pieces` as one tensor (a view when it lies in one segment)."""
        parts = self.pieces(a, b)
        return parts[0] if len(parts) == 1 else torch.cat(parts)
