"""The gradient reducer's side of optimizer offload: where reduced chunks go when the
optimizer steps on a host apart from the device. No collectives here: the reducer
(``zero/grads/reducer.py``) reduces, this module moves the reduced chunks (device to
host, through ``offload/staging.py``'s :class:`HostStager`) and adds them up.

With the optimizer offloaded to a host apart from the device (``accum_device``), the
sharded modes accumulate on the device and cross to the host once per window: a
micro-step that is not an accumulation boundary (phase BACKWARD_HOLDING) adds its
reduced chunks into an fp32 buffer of the shard's size on the device (window ON_DEVICE;
the same fp32 additions, in the same order, the host would make: exact), and the
boundary's micro-step adds its own and moves the sum, bucket by bucket, while its
backward goes on. A read before that (``flush``, ``finalize``, :attr:`grad_chunks`)
lands the sum first (action LAND). Host traffic per window: one fp32 shard, instead of
one gradient-dtype shard per micro-step plus a host pass adding it. Device memory: that
fp32 buffer, made at the first micro-step that is not a boundary (never with
accumulation 1). The host's thread that lands each chunk (``HostStager``) also takes
its fp32 sum of squares then, while backward goes on: the step's global norm adds those
up (:meth:`ReducedGrads.landed_squares`) instead of reading the shard again. With
Twin-Flow (``device_segments``) the leading segments, whose optimizer steps on the
device, keep their reduced chunks there instead; only the others cross. Stages 2-3: a
shard of their own in the gradient dtype, as without offload, until micro-steps first
accumulate on the device: from then on they are read from that fp32 sum itself (the
same values the host's share gets) and their shard is dropped. Stage 1: the reduced
chunk in the full gradient buffer.

:class:`HostOffload` owns the stager, the device's fp32 sum (``dev_acc``), the squares
taken as chunks land and the Twin-Flow split; the reducer composes one (None: no
offload) and hands it the chunks to write, it never calls back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zeroshard.distributed.device import host_apart
from zeroshard.offload.staging import HostStager
from zeroshard.zero.grads.buckets import chunk_sum_of_squares, reduced_segments, shard_chunks
from zeroshard.zero.layout.flat import FlatParams


class HostOffload:
    """Reduced gradient chunks on their way to the host (see the module's docstring).

    Args:
        flat: the flat parameters (the device, the segments).
        dtype: the gradient dtype: the moves cross in it.
        device_segments: Twin-Flow's leading segments, whose reduced chunks stay on the
            device (their optimizer steps there).
    """

    def __init__(self, flat: FlatParams, dtype: torch.dtype, device_segments: int) -> None:
        self.flat = flat
        chunk = max((s.chunk for s in reduced_segments(flat)), default=0)
        self.stager = HostStager(flat.device, chunk, dtype)
        self.staging_events: dict[int, object] = {}  # staging buffer id -> copy event
        # Twin-Flow: the segments whose reduced chunks stay on the device (their
        # optimizer steps there); the others cross to the host
        self.on_device = frozenset(range(device_segments))
        # stages 2-3: micro-steps before the boundary add into ``dev_acc``, an fp32 shard
        # on the device (made at the first one), moved to the host once
        self.dev_acc: torch.Tensor | None = None
        self.dev_acc_chunks: list[torch.Tensor] = []
        # per segment, the sum of squares of its host chunk as it landed, valid while the
        # shard's version counter is the one recorded once all had landed
        self.squares: list[torch.Tensor | None] = [None] * len(flat.layout.segments)
        self.squares_version: int | None = None

    @staticmethod
    def of(
        flat: FlatParams,
        accum_device: torch.device | None,
        dtype: torch.dtype,
        device_segments: int,
    ) -> HostOffload | None:
        """The offload path when ``accum_device`` is a host apart from the device, else None."""
        if accum_device is not None and (accum_device != flat.device or host_apart(flat.device)):
            return HostOffload(flat, dtype, device_segments)
        return None

    # -- the device's fp32 sum -----------------------------------------------------------
    def hold(
        self, shard: torch.Tensor, twin_shard: torch.Tensor | None, chunks: list[torch.Tensor]
    ) -> None:
        """The first micro-step held on the device: make the fp32 sum of the shard's (and
        Twin-Flow's shard's) size. With Twin-Flow the device's share of ``chunks`` is read
        from it from now on (exact, as the host's share): the caller drops its shard."""
        if self.dev_acc is not None:
            return
        numel = shard.numel() + (twin_shard.numel() if twin_shard is not None else 0)
        self.dev_acc = torch.empty(numel, dtype=shard.dtype, device=self.flat.device)
        self.dev_acc_chunks = shard_chunks(self.flat, self.dev_acc)
        if twin_shard is not None:
            for s in self.on_device:
                if chunks[s].numel():
                    chunks[s] = self.dev_acc_chunks[s]

    def twin_acc(self, sharded: bool) -> torch.Tensor | None:
        """The device's fp32 sum when Twin-Flow's share is read from it, else None."""
        return self.dev_acc if self.on_device and sharded else None

    def add(self, s: int, reduced: torch.Tensor, accumulate: bool) -> None:
        """A micro-step before the boundary: segment ``s``'s reduced chunk into the sum."""
        acc = self.dev_acc_chunks[s]
        (acc.add_ if accumulate else acc.copy_)(reduced)

    def add_and_move(self, s: int, reduced: torch.Tensor, chunk: torch.Tensor) -> None:
        """The boundary's micro-step: its reduced chunk into the sum, the sum to ``chunk``."""
        acc = self.dev_acc_chunks[s]
        acc.add_(reduced)
        self.to_shard(s, acc, chunk, accumulate=False)

    def land(self, chunks: list[torch.Tensor]) -> None:
        """Move the window's sum held on the device into the host shard (which holds
        nothing of this window: device accumulation starts only so)."""
        for s, (chunk, acc) in enumerate(zip(chunks, self.dev_acc_chunks, strict=True)):
            if chunk.numel():
                self.to_shard(s, acc, chunk, accumulate=False)
        self.stager.drain()

    # -- moves to the host ---------------------------------------------------------------
    def to_shard(self, s: int, src: torch.Tensor, chunk: torch.Tensor, accumulate: bool) -> object:
        """Segment ``s``'s reduced chunk ``src`` (on the device) into the owned shard's
        ``chunk``: through the host stager (returns its copy's event), or, for a segment
        Twin-Flow keeps on the device, added or copied there (stage 1: it is there)."""
        if s in self.on_device:
            if chunk.data_ptr() != src.data_ptr():
                (chunk.add_ if accumulate else chunk.copy_)(src)
            return None
        return self.stager.submit(src, chunk, accumulate=accumulate, then=self._square(s))

    def stage(
        self, s: int, reduced: torch.Tensor, chunk: torch.Tensor, accumulate: bool, staging: object
    ) -> None:
        """A reduced chunk read out of the staging buffer ``staging``: to the shard; the
        buffer is reused only once the copy's event has passed (:meth:`wait_staging`)."""
        event = self.to_shard(s, reduced, chunk, accumulate=accumulate)
        if event is not None:
            self.staging_events[id(staging)] = event

    def wait_staging(self, staging: torch.Tensor) -> None:
        """A staging buffer taken again: its last chunk may still be on its way to the host."""
        event = self.staging_events.pop(id(staging), None)
        if event is not None:
            rt = self.stager.rt
            rt.wait_event(rt.current_stream(self.flat.device), event)

    def drain(self) -> None:
        self.stager.drain()

    def buffers(self) -> list[torch.Tensor]:
        return self.stager.buffers()

    # -- the squares taken as chunks land ------------------------------------------------
    def _square(self, s: int) -> Callable[[torch.Tensor], None]:
        """What the landing thread runs once segment ``s``'s chunk has landed."""

        def then(chunk: torch.Tensor) -> None:
            self.squares[s] = chunk_sum_of_squares(chunk)

        return then

    def forget_squares(self) -> None:
        """The shard may change: the squares taken are no longer known to match it."""
        self.squares_version = None

    def squares_landed(self, shard: torch.Tensor) -> None:
        """Every reduced chunk has landed (and its square was taken): remember the
        shard's version, which any later in-place change of it moves on."""
        self.squares_version = shard._version

    def landed(self, chunks: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Per segment, the square the landing thread took (an empty chunk: zero); None
        unless every reduced chunk's was taken since the window's last change."""
        if self.squares_version is None:
            return None
        out = []
        for s, (sq, chunk) in enumerate(zip(self.squares, chunks, strict=True)):
            if not chunk.numel() or s in self.on_device:  # (Twin-Flow: read on the device)
                out.append(chunk_sum_of_squares(chunk))
            elif sq is None:
                return None
            else:
                out.append(sq)
        return out
