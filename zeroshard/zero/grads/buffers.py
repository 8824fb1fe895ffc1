"""The gradient reducer's buffers: where each mode keeps gradients and what each
parameter's slot holds. No communication here: the reducer (``zero/grads/reducer.py``)
and its launcher (``zero/grads/launch.py``) reduce into these.

* full gradients (stages 0-1): ``grad_full``, a flat buffer the size of the group, with
  one view per parameter (``param.grad`` *is* that view when the gradient dtype is the
  parameter's: ``zero_copy``) and a :class:`~zeroshard.zero.grads.states.Slot` per
  parameter saying what its view holds;
* sharded gradients (stages 2-3), or any offload: ``grad_shard``, this rank's chunks end
  to end (fp32 on a host apart from the device); with Twin-Flow at stages 2-3 the device
  segments' chunks in ``twin_shard`` instead, in the gradient dtype.

``chunks[segment]`` is what the step reads: this rank's chunk of each segment, in
whichever buffer holds it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zeroshard.zero.grads import states
from zeroshard.zero.grads.buckets import reduced_segments, shard_chunks
from zeroshard.zero.grads.states import Event, Slot
from zeroshard.zero.layout.flat import FlatParams


class GradBuffers:
    """The gradient buffers of one reducer (see the module's docstring).

    Args:
        flat: the flat parameters.
        dtype: the gradient dtype.
        sharded: keep only this rank's chunks (stages 2, 3).
        accum_device: where the owned shard lives (None: the device).
        offloaded: the shard is on a host apart from the device (then in fp32).
        on_device: Twin-Flow's segments, whose chunks stay on the device.
    """

    def __init__(
        self,
        flat: FlatParams,
        dtype: torch.dtype,
        sharded: bool,
        accum_device: torch.device | None,
        offloaded: bool,
        on_device: frozenset[int],
    ) -> None:
        self.flat = flat
        layout = flat.layout
        reduced = reduced_segments(flat)
        # full gradients: what each parameter's slot of the buffer holds
        self.slots = [Slot.EMPTY] * len(flat.params)
        own = flat.rank
        self.grad_full: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.views: list[torch.Tensor | None] = [None] * len(flat.params)
        self.twin_shard: torch.Tensor | None = None
        self.chunks: list[torch.Tensor] = []
        self.device_chunks: list[torch.Tensor] = []
        if sharded or offloaded:
            where = accum_device or flat.device
            # On a separate host the shard is accumulated in fp32, the dtype the CPU
            # optimizer reads: the moves stay in the gradient dtype (half the bytes over
            # the bus), and neither the norm nor the step converts every element again.
            kind = torch.float32 if offloaded else dtype
            away = [s for s in reduced if s.index not in on_device]
            self.grad_shard = torch.zeros(sum(s.chunk for s in away), dtype=kind, device=where)
            self.chunks = shard_chunks(flat, self.grad_shard, away)
            here = [s for s in reduced if s.index in on_device]
            if sharded and here:  # in the gradient dtype, as without offload
                self.twin_shard = torch.zeros(
                    sum(s.chunk for s in here), dtype=dtype, device=flat.device
                )
                for s, c in enumerate(shard_chunks(flat, self.twin_shard, here)):
                    if c.numel():
                        self.chunks[s] = c
        if not sharded:
            self.grad_full = torch.zeros(layout.total_numel, dtype=dtype, device=flat.device)
            self.device_chunks = [
                self.grad_full[slice(*s.chunk_range(own))] for s in layout.segments
            ]
            if not offloaded:
                self.chunks = self.device_chunks
            for s in on_device:  # Twin-Flow: reduced in place, read there
                self.chunks[s] = self.device_chunks[s]
            for pi, p in enumerate(flat.params):
                lo, hi = layout.param_range(pi)
                self.views[pi] = self.grad_full[lo:hi].view_as(p)
        self.zero_copy = not sharded and all(p.dtype == dtype for p in flat.params)

    def full(self) -> torch.Tensor:
        assert self.grad_full is not None  # full-gradient mode (stages 0-1, or accumulating)
        return self.grad_full

    def view(self, pi: int) -> torch.Tensor:
        view = self.views[pi]
        assert view is not None  # full gradients: every parameter has its slot
        return view

    def move_slot(
        self, pi: int, event: Event, on_step: Callable[[str, tuple], None] | None
    ) -> Slot:
        """Slot ``pi``'s move; returns the state it left."""
        was = self.slots[pi]
        self.slots[pi] = states.step("slot", (was, event), on_step)
        return was

    def restate_owned(self, world: int) -> None:
        """Stage 1, another backward after the boundary's reduction (two losses, one
        step; or the boundary unset again before the step): the buffer holds this
        rank's averaged chunk and stale data elsewhere. Rewritten so the next reduction
        adds the new average to it: the chunk times the group's size ``world`` (the next
        reduction sums it once and divides by that), zeros elsewhere (other ranks own
        those)."""
        owned = [c.mul(world) for c in self.device_chunks]
        self.full().zero_()
        for c, saved in zip(self.device_chunks, owned, strict=True):
            c.copy_(saved)

    def rescale_apart(self, world: int, world_of: Callable[[int], int]) -> None:
        """Stage 0, another backward after the boundary's reduction: the buffer holds
        the window's average on every rank. A dense segment's next reduction sums it
        over every contributor and divides by their count, which gives it back; an
        expert segment's sums it over its expert-data-parallel group only (1/ep of the
        contributors: ``world_of(segment)`` ranks of ``world``), so it is multiplied by
        ep first (no communication)."""
        for seg in self.flat.layout.segments:
            n = world_of(seg.index)
            if n != world:
                part = self.full()[seg.start : seg.start + seg.numel]
                part.mul_(world / n)

    def clear(self) -> None:
        """A new window: every slot empty, every trainable ``param.grad`` unset."""
        self.slots = [Slot.EMPTY] * len(self.flat.params)
        for pi, p in enumerate(self.flat.params):
            if self.flat.group_of[pi] >= 0:
                p.grad = None

    def arrive(
        self,
        pi: int,
        p: torch.Tensor,
        pre: float,
        communicates: bool,
        on_step: Callable[[str, tuple], None] | None,
    ) -> None:
        """Full gradients: parameter ``pi``'s gradient ``p.grad`` into its slot, divided
        by ``pre`` on the way in when it is the window's only one and ``communicates``
        (a reducing backward); ``p.grad`` then points at the slot, or is unset."""
        grad = p.grad
        assert grad is not None  # the hook returns early without one
        view = self.view(pi)
        held = self.slots[pi]
        if grad.data_ptr() == view.data_ptr():  # autograd accumulated in place
            self.move_slot(pi, Event.ARRIVE if held is Slot.EMPTY else Event.ARRIVE_AGAIN, on_step)
        elif held is Slot.DIVIDED:  # a second gradient in this backward
            self.move_slot(pi, Event.ARRIVE_AGAIN, on_step)
            view.add_(grad.div(pre))
            p.grad = None  # the slot is divided: no in-place accumulation
        elif held is Slot.RAW:
            self.move_slot(pi, Event.ARRIVE_AGAIN, on_step)
            view.add_(grad)
            p.grad = view if self.zero_copy else None
        elif communicates and grad.dtype == view.dtype:
            # the window's only gradient: divided on the way in (one pass);
            # param.grad points at the slot once its bucket is launched
            self.move_slot(pi, Event.ARRIVE_DIVIDED, on_step)
            torch.div(grad, pre, out=view)
            p.grad = None
        else:  # first contribution of this accumulation window: overwrite
            self.move_slot(pi, Event.ARRIVE, on_step)
            view.copy_(grad)
            p.grad = view if self.zero_copy else None
