"""Launching and completing the gradient reducer's bucket reductions, in one global order.

Buckets (``zero/grads/buckets.py``) launch in one fixed global order (by position in the
model, last layers first), so every rank issues the same collectives in the same order
even when gradients arrive in a different order or some parameters get none; a bucket
launches once it and every bucket before it are complete. Collectives, all through
:class:`~zeroshard.distributed.comm.Comm`, asynchronous (``overlap``) or waited for at
once:

* full gradients (stages 0 and 1), on the accumulation boundary only: an all-reduce per
  bucket (stage 0, 2x bucket bytes) or an in-place reduce-scatter (stage 1, bucket
  bytes) that leaves each rank its averaged chunk;
* sharded gradients (stages 2 and 3), every micro-step: each gradient is copied into a
  pooled staging bucket and freed; the full bucket is reduce-scattered in place and the
  rank's chunk accumulated into the owned gradient shard (the window's first reduction
  lands in the shard itself when it can). Memory: the shard plus the staging pool
  (about two buckets);
* with hybrid sharding (MiCS / HSDP), each reduced chunk is then all-reduced over its
  replicas (``replicate``).

With expert parallelism (mixture-of-experts), a segment of kind 1 holds expert
parameters, which differ along the ``ep`` axis: its bucket is reduced over the
expert-data-parallel group (``expert_comm``: the ranks holding the same experts) instead,
and a rank's chunk of it is the one its rank in that group owns (``Segment.owner``). The
kind picks the group only: buckets of both kinds launch in the one global order and
every state and move is the same (``zero/grads/states.py``).

At most two reductions are in flight (each holds a staging bucket and, point to point,
a receive buffer of (N - 1) / N of a bucket); a third waits for the oldest. With offload
the reduced chunks go on through :class:`~zeroshard.zero.grads.offload.HostOffload`.
The reducer (``zero/grads/reducer.py``) moves :attr:`BucketLauncher.phase` and
:attr:`BucketLauncher.window` (``zero/grads/states.py``); the launcher reads them to know
where a reduction goes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zeroshard.distributed.comm import Comm, Handle
from zeroshard.zero.grads import states
from zeroshard.zero.grads.buckets import Bucket, Pool, make_buckets, reduced_segments
from zeroshard.zero.grads.buffers import GradBuffers
from zeroshard.zero.grads.offload import HostOffload
from zeroshard.zero.grads.states import Event, Phase, Slot, Window
from zeroshard.zero.layout.flat import FlatParams


class BucketLauncher:
    """The buckets' reductions of one reducer (see the module's docstring).

    Args:
        flat: the flat parameters.
        comm, expert_comm, replicate: the groups (as :class:`GradReducer`'s).
        bufs: where the reduced gradients go.
        offload: the offload path, or None.
        dtype: the gradient dtype (staging and receive buffers).
        sharded, overlap: as :class:`GradReducer`'s.
        pre, post: gradients are divided by ``pre`` on their way into a bucket, by
            ``post`` after the reduction.
        rs_via: how sharded buckets are reduced (``Comm.reduce_scatter``'s ``via``).
        registration_index: each parameter's position, for the buckets' order.
    """

    def __init__(
        self,
        flat: FlatParams,
        comm: Comm,
        expert_comm: Comm,
        replicate: Comm | None,
        bufs: GradBuffers,
        offload: HostOffload | None,
        *,
        dtype: torch.dtype,
        sharded: bool,
        overlap: bool,
        pre: float,
        post: float,
        rs_via: str,
        registration_index: dict[int, int] | None,
    ) -> None:
        self.flat, self.comm, self.expert_comm, self.replicate = flat, comm, expert_comm, replicate
        self.bufs, self.offload = bufs, offload
        self.sharded, self.overlap, self.pre, self.post = sharded, overlap, pre, post
        self.rs_via = rs_via
        #: the reducer's states, moved by the reducer only (``zero/grads/states.py``)
        self.phase = Phase.IDLE
        self.window = Window.EMPTY
        self.on_transition: Callable[[str, tuple], None] | None = None
        # (bucket, handle, phase): "reduce" over ``comm``, then "replicate" (hybrid only)
        self.pending: list[tuple[Bucket, Handle, str]] = []
        staging_numel = max((seg.numel for seg in reduced_segments(flat)), default=0)
        self.staging = Pool(staging_numel, dtype, flat.device)
        # receive buffers of a point-to-point (or all-to-all) reduce-scatter
        scratch = max(c.reduce_scatter_scratch(staging_numel, rs_via) for c in (comm, expert_comm))
        self.scratch = Pool(scratch, dtype, flat.device)
        self.buckets, self.bucket_of = make_buckets(flat, registration_index)
        self.next = 0
        # the owned shard can take a reduction's output: same device and dtype, no replicas
        self.direct_ok = (
            sharded
            and offload is None
            and replicate is None
            and bufs.grad_shard is not None
            and bufs.grad_shard.dtype == dtype
        )

    def stage_grad(self, bucket: Bucket, pi: int, p: torch.Tensor) -> None:
        """Sharded gradients: parameter ``pi``'s gradient into its bucket's staging
        buffer, divided on the way in; ``p.grad`` is freed."""
        grad = p.grad
        assert grad is not None  # the hook returns early without one
        staging = self.staging_for(bucket)
        lo, hi = bucket.slots[pi]
        slot = staging[lo:hi].view_as(grad)
        if pi in bucket.filled:
            slot.add_(grad.div(self.pre))
        elif grad.dtype == slot.dtype:  # divided on the way in (one pass)
            torch.div(grad, self.pre, out=slot)
            bucket.filled.add(pi)
        else:
            slot.copy_(grad).div_(self.pre)
            bucket.filled.add(pi)
        p.grad = None

    def arrive(self, bucket: Bucket, pi: int) -> None:
        self.move_bucket(bucket, Event.ARRIVE)
        bucket.ready.add(pi)

    def move_bucket(self, b: Bucket, event: Event) -> None:
        b.state = states.step("bucket", (b.state, event), self.on_transition)

    @staticmethod
    def _staged(b: Bucket) -> torch.Tensor:
        assert b.staging is not None  # sharded: a launched bucket holds its staging buffer
        return b.staging

    def launch_in_order(self, upto: int | None) -> None:
        """Launch complete buckets in global order (all of them when ``upto`` is None
        and the bucket is complete; everything when finishing)."""
        while self.next < len(self.buckets):
            b = self.buckets[self.next]
            if upto is None and len(b.ready) < b.trainable:
                return
            self._launch(b)
            self.next += 1

    def _launch(self, b: Bucket) -> None:
        g = self.flat
        seg = g.layout.segments[b.segment]
        self.move_bucket(b, Event.LAUNCH)
        if self.sharded:
            src = self.staging_for(b)[: seg.numel]
            for pi, (lo, hi) in b.slots.items():  # parameters that got no gradient
                if pi not in b.filled:
                    src[lo:hi].zero_()
            src[seg.used :].zero_()
        else:
            src = self.bufs.full()[seg.start : seg.start + seg.numel]
            for pi, (lo, hi) in b.slots.items():
                was = self.bufs.move_slot(pi, Event.LAUNCH, self.on_transition)
                if was is Slot.EMPTY:  # stale values: no gradient this window
                    src[lo:hi].zero_()
                elif was is Slot.DIVIDED:  # once: a later backward adds raw gradients
                    if self.bufs.zero_copy:
                        self.flat.params[pi].grad = self.bufs.views[pi]
                else:  # accumulated over micro-steps (or cast in): divided here
                    src[lo:hi].div_(self.pre)
        comm = self.comm_of(b.segment)
        if g.partitioned:
            if self.scratch.numel and comm.world_size > 1:
                b.scratch = self._take(self.scratch)
            # the window's first reduction of a sharded bucket lands in the owned shard
            # itself (no copy out of the staging bucket afterwards)
            b.direct = self.sharded and self.direct_ok and self.window is Window.EMPTY
            out = self.bufs.chunks[b.segment] if b.direct else self._own(b, src)
            handle = comm.reduce_scatter(
                out, src, async_op=True, via=self.rs_via, scratch=b.scratch
            )
        else:
            handle = comm.all_reduce(src, async_op=True)
        self.pending.append((b, handle, "reduce"))
        if not self.overlap:
            while any(entry[0] is b for entry in self.pending):
                self.complete_oldest()

    def comm_of(self, segment: int) -> Comm:
        """The group segment ``segment``'s gradients are reduced over (by its kind)."""
        return self.expert_comm if self.flat.layout.segments[segment].kind else self.comm

    def _own(self, b: Bucket, src: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of bucket ``b``'s segment-sized buffer ``src``."""
        seg = self.flat.layout.segments[b.segment]
        lo = seg.owner(self.flat.rank) * seg.chunk
        return src[lo : lo + seg.chunk]

    def _take(self, pool: Pool) -> torch.Tensor:
        """A buffer of ``pool``; with all of them in flight, the oldest pending
        reduction is completed first (it gives its buffer back)."""
        while (buf := pool.take()) is None and self.pending:
            self.complete_oldest()
        return buf if buf is not None else pool.make()

    def complete_oldest(self) -> None:
        b, handle, phase = self.pending.pop(0)
        handle.wait()
        if b.scratch is not None:
            self.scratch.free.append(b.scratch)
            b.scratch = None
        g = self.flat
        seg = g.layout.segments[b.segment]
        if phase == "reduce" and self.replicate is not None:
            # hybrid sharding: the reduced chunk is summed across the replicas next
            own = self._own(b, self._staged(b) if self.sharded else self.bufs.full()[seg.start :])
            self.pending.insert(0, (b, self.replicate.all_reduce(own, async_op=True), "replicate"))
            self.move_bucket(b, Event.REPLICATE)
            return
        self.move_bucket(b, Event.COMPLETE)
        accumulate = self.window is not Window.EMPTY  # the shard holds a micro-step
        post = self.post
        chunk = self.bufs.chunks[b.segment]
        if self.sharded:
            reduced = chunk if b.direct else self._own(b, self._staged(b))
            if post != 1.0:
                reduced.div_(post)
            if b.direct:  # already in place
                pass
            elif self.phase is Phase.BACKWARD_HOLDING:  # offload, before the boundary
                assert self.offload is not None  # device accumulation is for offload only
                self.offload.add(b.segment, reduced, accumulate)
            elif self.window is Window.ON_DEVICE:  # offload, the boundary: sum to host
                assert self.offload is not None  # device accumulation is for offload only
                self.offload.add_and_move(b.segment, reduced, chunk)
            elif self.offload is not None:
                self.offload.stage(b.segment, reduced, chunk, accumulate, b.staging)
            elif accumulate:
                chunk.add_(reduced)
            else:
                chunk.copy_(reduced)
            self.staging.free.append(self._staged(b))
            b.staging = None
            b.filled.clear()
            return
        if post != 1.0:
            src = self.bufs.full()[seg.start : seg.start + seg.numel]
            (src if not g.partitioned else self.bufs.device_chunks[b.segment]).div_(post)
        if self.offload is not None:  # offload at stages 0, 1: the boundary's chunk to host
            src = self.bufs.device_chunks[b.segment]
            self.offload.to_shard(b.segment, src, self.bufs.chunks[b.segment], accumulate=False)

    def staging_for(self, b: Bucket) -> torch.Tensor:
        if b.staging is None:
            # double-buffered: a bucket fills while the previous one's reduction is in
            # flight; a third waits for the oldest reduction
            b.staging = staging = self._take(self.staging)
            if self.offload is not None:
                self.offload.wait_staging(staging)
        return b.staging

    def reduce_rest(self) -> None:
        """Launch every bucket not launched yet, in the global order, and wait for all."""
        self.launch_in_order(upto=len(self.buckets))
        while self.pending:
            self.complete_oldest()
        if self.offload is not None:
            self.offload.drain()
        for b in self.buckets:
            self.move_bucket(b, Event.RESET)
            b.ready.clear()
        self.next = 0

    def buffers(self) -> list[torch.Tensor]:
        """The staging and receive pools' buffers, free or held by a bucket."""
        bufs = self.staging.free + self.scratch.free
        bufs += [b.scratch for b in self.buckets if b.scratch is not None]
        bufs += [b.staging for b in self.buckets if b.staging is not None]
        return bufs
