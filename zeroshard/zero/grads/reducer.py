"""Bucketed gradient reduction, driven by autograd hooks and overlapped with backward.

Each segment of the :class:`~zeroshard.zero.layout.flat.FlatParams` layout is a bucket. A
``post_accumulate_grad`` hook on every trainable parameter drops its gradient into the
bucket; when a bucket is complete it is reduced asynchronously while backward goes on.
Buckets are launched in one fixed global order (by position in the model, last layers
first), so every rank issues the same collectives in the same order even when
gradients arrive in a different order or some parameters get none. At stage 3
(``count_unreached``) the parameters a backward's graph does not reach
(``zero/grads/reached.py``) count as arrived when it starts, so a rank that gets no gradient
for a bucket launches it when the others do, not when backward ends.

Two modes, chosen once from what is sharded:

* **full gradients** (stages 0 and 1): a flat gradient buffer the size of the group.
  In the common case (gradient dtype == parameter dtype) ``param.grad`` *is* a view of
  it, so autograd accumulates micro-steps in place and nothing is copied. Communication
  happens only on the accumulation boundary: an all-reduce per bucket (stage 0,
  2x bucket bytes) or an in-place reduce-scatter (stage 1, bucket bytes) that leaves
  each rank its averaged chunk.
* **sharded gradients** (stages 2 and 3): only this rank's chunks are kept. Every
  micro-step each gradient is copied into a pooled staging bucket and freed; the full
  bucket is reduce-scattered in place and the rank's chunk accumulated into the owned
  gradient shard. Memory: the shard plus the staging pool (about two buckets).

With expert parallelism (mixture-of-experts), a segment of kind 1 holds expert
parameters, which differ along the ``ep`` axis: its bucket is reduced over the
expert-data-parallel group (``expert_comm``: the ranks holding the same experts) instead,
and a rank's chunk of it is the one its rank in that group owns (``Segment.owner``). The
kind picks the group only: buckets of both kinds launch in the one global order and
every state and move is the same (``zero/grads/states.py``).

Either way :attr:`GradReducer.grad_chunks` ``[segment]`` is the reduced,
averaged gradient of this rank's chunk, what the sharded optimizer consumes, once
:meth:`GradReducer.finalize` ran. The reducer's states (backward phase, accumulation
window, buckets, slots) and their legal moves are tables in ``zero/grads/states.py``;
every change of state goes through them.

With the optimizer offloaded to a host apart from the device (``accum_device``), the
reduced chunks go there through :class:`~zeroshard.zero.grads.offload.HostOffload`
(``zero/grads/offload.py``: the device's fp32 accumulation before the boundary, the
host stager, the squares taken as chunks land, Twin-Flow's device segments). The
buckets, their order and their pooled buffers are ``zero/grads/buckets.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zeroshard import ArgumentError, InternalError, UsageError
from zeroshard.distributed.comm import Comm, Handle
from zeroshard.zero.grads import states
from zeroshard.zero.grads.buckets import (
    Bucket,
    Pool,
    make_buckets,
    reduced_segments,
    shard_chunks,
)
from zeroshard.zero.grads.offload import HostOffload
from zeroshard.zero.grads.reached import reached_leaves
from zeroshard.zero.grads.result import ReducedGrads
from zeroshard.zero.grads.states import BucketState, Event, Mode, Phase, Slot, Window
from zeroshard.zero.layout.flat import FlatParams


class GradReducer:
    """Reduce gradients bucket by bucket as backward produces them.

    Args:
        flat: the flat parameters.
        comm: the group gradients are reduced over: the ZeRO shard group (reduce-scatter)
            when ``flat`` is sharded, else every data-parallel replica (all-reduce).
        replicate: with hybrid sharding (MiCS / HSDP), the group of ranks holding the
            same shard: each reduced chunk is then all-reduced over it. None: no replicas.
        expert_comm: the group the segments of kind 1 (expert parameters of a
            mixture-of-experts layer, which differ along the expert-parallel axis) are
            reduced over: the expert-data-parallel ranks (their shard group, or all
            their replicas when unsharded). Their gradients are averaged over ``comm``'s
            ranks all the same (DeepSpeed's rule: an expert's gradient already sums the
            tokens every expert-parallel rank sent it). None: as ``comm``.
        dtype: gradient buffer / communication dtype.
        sharded: keep only this rank's gradient chunks (stages 2, 3).
        overlap: launch a bucket's collective as soon as it is complete; otherwise the
            collective runs synchronously at that point (no overlap, bounded memory).
        registration_index: position of each parameter in ``module.parameters()``,
            used to order buckets like backward produces them.
        predivide: divide gradients by this before communication and by
            ``ranks / predivide`` after, ``ranks`` being every rank whose gradients are
            averaged (DeepSpeed's gradient_predivide_factor). 1.0: the whole average
            is taken before, fused into the gradient's copy into its bucket (as DDP
            does), so no pass over the reduced gradients follows.
        on_bucket_ready: called with a segment index once all its gradients are in (the
            stage-3 gatherer frees that unit's parameters then).
        accum_device: with optimizer offload, the host (CPU) where the reduced chunks
            go: the owned gradient shard lives there, in fp32 (stages 2, 3: accumulated
            on the device before the boundary, see above; stages 0, 1: copied there at
            the boundary). Each bucket's chunk is moved through a double-buffered
            :class:`HostStager` as soon as its reduction completes, while backward goes
            on. None: no offload.
        device_segments: with offload to a separate host, Twin-Flow's leading segments
            (``offload_optimizer.ratio`` below 1), whose reduced chunks stay on the device
            for the optimizer's share stepped there.
        reduce_scatter_via: how sharded buckets are reduced (``Comm.reduce_scatter``'s
            ``via``): "native" (zero_optimization.reduce_scatter true), "all_reduce"
            (false) or None, the group's per-backend choice (sends plus a local sum
            on gloo). Point to point it receives into buffers of (N - 1) / N of a
            bucket, at most two in flight (then the oldest reduction is waited for).
    """

    def __init__(
        self,
        flat: FlatParams,
        comm: Comm,
        *,
        replicate: Comm | None = None,
        dtype: torch.dtype,
        sharded: bool,
        overlap: bool = True,
        registration_index: dict[int, int] | None = None,
        predivide: float = 1.0,
        on_bucket_ready=None,
        accum_device: torch.device | None = None,
        reduce_scatter_via: str | None = None,
        count_unreached: bool = False,
        expert_comm: Comm | None = None,
        device_segments: int = 0,
    ) -> None:
        self.flat, self.comm, self.dtype = flat, comm, dtype
        self.expert_comm = expert_comm if expert_comm is not None else comm
        self._count_unreached = count_unreached
        self._walk_missed: set[int] = set()  # counted as arrived by the last walk
        self._rs_via = reduce_scatter_via or comm.reduce_scatter_path(flat.device)
        self.replicate = replicate if replicate is not None and replicate.world_size > 1 else None
        if self.replicate is not None and not flat.partitioned:
            raise ArgumentError("internal: replicated reduction needs a sharded layout")
        # gradients are averaged over every rank that produced one
        self._contributors = comm.world_size * (self.replicate.world_size if self.replicate else 1)
        self._on_bucket_ready = on_bucket_ready
        self.sharded, self.overlap, self.predivide = sharded, overlap, predivide
        self.mode = (
            Mode.SHARDED if sharded else Mode.PARTITIONED if flat.partitioned else Mode.REPLICATED
        )
        self.phase = Phase.IDLE
        self.window = Window.EMPTY
        #: called with (machine, key) on every move: the transition-table test records them
        self.on_transition: Callable[[str, tuple], None] | None = None
        # divided by ``_pre`` on the way into the bucket, by ``_post`` after the reduction
        self._pre = predivide if predivide != 1.0 else float(self._contributors)
        self._post = self._contributors / self._pre
        self._hooks = []
        # (bucket, handle, phase): "reduce" over ``comm``, then "replicate" (hybrid only)
        self._pending: list[tuple[Bucket, Handle, str]] = []
        layout = flat.layout
        reduced = reduced_segments(flat)
        staging_numel = max((seg.numel for seg in reduced), default=0)
        self._staging = Pool(staging_numel, dtype, flat.device)
        # receive buffers of a point-to-point (or all-to-all) reduce-scatter
        scratch = max(
            c.reduce_scatter_scratch(staging_numel, self._rs_via) for c in (comm, self.expert_comm)
        )
        self._scratch = Pool(scratch, dtype, flat.device)
        # parameters that got a gradient on this rank in this window (data for the
        # step's unused-parameter check, not a state: the window never depends on it)
        self.arrived: set[int] = set()
        # full gradients: what each parameter's slot of the buffer holds
        self._slots = [Slot.EMPTY] * len(flat.params)
        own = flat.rank
        self.grad_full: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self._views: list[torch.Tensor | None] = [None] * len(flat.params)
        #: the offload path (``zero/grads/offload.py``); None: no offload
        self.offload = HostOffload.of(flat, accum_device, dtype, device_segments)
        # Twin-Flow: the segments whose reduced chunks stay on the device
        on_device = self.offload.on_device if self.offload is not None else frozenset()
        self.twin_shard: torch.Tensor | None = None
        if sharded or self.offload is not None:
            where = accum_device or flat.device
            # On a separate host the shard is accumulated in fp32, the dtype the CPU
            # optimizer reads: the moves stay in the gradient dtype (half the bytes over
            # the bus), and neither the norm nor the step converts every element again.
            host = torch.float32 if self.offload is not None else dtype
            away = [s for s in reduced if s.index not in on_device]
            self.grad_shard = torch.zeros(sum(s.chunk for s in away), dtype=host, device=where)
            self._chunks = shard_chunks(flat, self.grad_shard, away)
            here = [s for s in reduced if s.index in on_device]
            if sharded and here:  # in the gradient dtype, as without offload
                self.twin_shard = torch.zeros(
                    sum(s.chunk for s in here), dtype=dtype, device=flat.device
                )
                for s, c in enumerate(shard_chunks(flat, self.twin_shard, here)):
                    if c.numel():
                        self._chunks[s] = c
        if not sharded:
            self.grad_full = torch.zeros(layout.total_numel, dtype=dtype, device=flat.device)
            self._device_chunks = [
                self.grad_full[slice(*s.chunk_range(own))] for s in layout.segments
            ]
            if self.offload is None:
                self._chunks = self._device_chunks
            for s in on_device:  # Twin-Flow: reduced in place, read there
                self._chunks[s] = self._device_chunks[s]
            for pi, p in enumerate(flat.params):
                lo, hi = layout.param_range(pi)
                self._views[pi] = self.grad_full[lo:hi].view_as(p)
        self._buckets, self._bucket_of = make_buckets(flat, registration_index)
        self._next = 0
        self._zero_copy = not sharded and all(p.dtype == dtype for p in flat.params)
        # the owned shard can take a reduction's output: same device and dtype, no replicas
        self._direct_ok = (
            sharded
            and self.offload is None
            and self.replicate is None
            and self.grad_shard is not None
            and self.grad_shard.dtype == dtype
        )
        for pi, p in enumerate(flat.params):
            if flat.group_of[pi] < 0:  # frozen (stage 3 keeps them in the layout)
                continue
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(pi)))

    @property
    def grad_chunks(self) -> list[torch.Tensor]:
        """This rank's reduced gradient, one chunk per segment (see the module's
        docstring). With offload, a window still held on the device is landed on the
        host first (a FLUSH: between backwards only)."""
        if self.window is Window.ON_DEVICE:
            self.flush()
        return self._chunks

    # -- states -------------------------------------------------------------------------
    def _move_window(self, event: Event) -> None:
        """The window's move on ``event`` (every rank makes the same calls): its action
        runs in the state it leaves (a reduction's first micro-step writes the shard),
        then the state changes."""
        nxt, action = states.step("window", (self.mode, self.window, event), self.on_transition)
        self._run(action)
        self.window = nxt
        landed = action in (states.REDUCE, states.LAND) and nxt is not Window.ON_DEVICE
        if self.offload is not None and landed:  # every reduced chunk landed on the host
            assert self.grad_shard is not None  # offload: the host shard
            self.offload.squares_landed(self.grad_shard)

    def _move_phase(self, event: Event) -> None:
        self.phase = states.step("phase", (self.phase, event), self.on_transition)

    def _move_bucket(self, b: Bucket, event: Event) -> None:
        b.state = states.step("bucket", (b.state, event), self.on_transition)

    def _move_slot(self, pi: int, event: Event) -> Slot:
        """Slot ``pi``'s move; returns the state it left."""
        was = self._slots[pi]
        self._slots[pi] = states.step("slot", (was, event), self.on_transition)
        return was

    # -- backward -----------------------------------------------------------------------
    def begin(self, boundary: bool, roots: list[torch.Tensor] | None = None) -> None:
        """Called before each backward: whether this micro-step ends an accumulation,
        and the tensors backward starts from (for ``count_unreached``)."""
        reducing = self.sharded or boundary
        # offload: a micro-step before the boundary stays on the device, unless the host
        # already holds part of the window (a boundary micro-step came earlier): the
        # additions then stay on the host, in order
        holding = (
            self.offload is not None
            and self.sharded
            and not boundary
            and self.window in (Window.EMPTY, Window.ON_DEVICE)
        )
        event = Event.BEGIN_HOLDING if holding else Event.BEGIN_REDUCING
        self._move_phase(event if reducing else Event.BEGIN_LOCAL)
        if self.offload is not None:
            self.offload.forget_squares()  # the shard may change
        if holding:
            assert self.offload is not None and self.grad_shard is not None  # sharded offload
            self.offload.hold(self.grad_shard, self.twin_shard, self._chunks)
            self.twin_shard = None  # Twin-Flow: its share is read from the device's sum
        self._walk_missed = set()
        self._move_window(Event.BEGIN)
        if self._count_unreached and roots is not None and self.communicates_now:
            self._count_unreached_as_arrived(roots)

    def abandon(self) -> None:
        """The backward between :meth:`begin` and :meth:`finish` raised: no backward
        runs any more (a gradient arriving now is refused). The window keeps its state."""
        self._move_phase(Event.ABANDON)

    def _count_unreached_as_arrived(self, roots: list[torch.Tensor]) -> None:
        reached = reached_leaves(roots)
        if reached is None:  # a graph that hides parameters: wait for what arrives
            return
        for pi, p in enumerate(self.flat.params):
            if self.flat.group_of[pi] >= 0 and id(p) not in reached:
                self._arrive(self._bucket_of[pi], pi)
                self._walk_missed.add(pi)
        self._launch_in_order(upto=None)

    def _restate_owned(self) -> None:
        """Stage 1, another backward after the boundary's reduction (two losses, one
        step; or the boundary unset again before the step): the buffer holds this
        rank's averaged chunk and stale data elsewhere. Rewritten so the next reduction
        adds the new average to it: the chunk times the group's size (the next
        reduction sums it once and divides by that), zeros elsewhere (other ranks own
        those)."""
        owned = [c.mul(self.comm.world_size) for c in self._device_chunks]
        self._full_grads().zero_()
        for c, saved in zip(self._device_chunks, owned, strict=True):
            c.copy_(saved)

    def _rescale_apart(self) -> None:
        """Stage 0, another backward after the boundary's reduction: the buffer holds
        the window's average on every rank. A dense segment's next reduction sums it
        over every contributor and divides by their count, which gives it back; an
        expert segment's sums it over its expert-data-parallel group only (1/ep of the
        contributors), so it is multiplied by ep first (no communication)."""
        for seg in self.flat.layout.segments:
            n = self.comm_of(seg.index).world_size
            if n != self.comm.world_size:
                part = self._full_grads()[seg.start : seg.start + seg.numel]
                part.mul_(self.comm.world_size / n)

    @property
    def communicates_now(self) -> bool:
        return self.phase in (Phase.BACKWARD_REDUCING, Phase.BACKWARD_HOLDING)

    def _full_grads(self) -> torch.Tensor:
        assert self.grad_full is not None  # full-gradient mode (stages 0-1, or accumulating)
        return self.grad_full

    @staticmethod
    def _staged(b: Bucket) -> torch.Tensor:
        assert b.staging is not None  # sharded: a launched bucket holds its staging buffer
        return b.staging

    def _make_hook(self, pi: int):
        def hook(p: torch.Tensor) -> None:
            self._on_grad(pi, p)

        return hook

    def _on_grad(self, pi: int, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        if self.phase is Phase.IDLE:
            raise UsageError(
                "a gradient arrived outside engine.backward(): call engine.backward(loss) "
                "(which scales, accumulates and reduces across ranks), not loss.backward(), "
                "then engine.step()"
            )
        bucket = self._bucket_of[pi]
        if bucket.state in (BucketState.LAUNCHED, BucketState.REPLICATING, BucketState.DONE):
            name = f"parameter {pi} (shape {tuple(p.shape)})"
            if pi in self._walk_missed and pi in bucket.ready:
                raise InternalError(
                    f"{name} received a gradient that the walk of the autograd graph before "
                    f"backward (zero/grads/reached.py) did not foresee, so its bucket was "
                    f"reduced without it; a zeroshard bug (torch {torch.__version__}): please "
                    "report it"
                )
            raise UsageError(
                f"{name} received a gradient after its bucket was already reduced in this "
                "backward; a parameter must receive its gradient once per backward "
                "(reentrant checkpointing or a second backward through it?)"
            )
        self.arrived.add(pi)
        if not self.sharded:
            view = self._views[pi]
            assert view is not None  # full gradients: every parameter has its slot
            held = self._slots[pi]
            if p.grad.data_ptr() == view.data_ptr():  # autograd accumulated in place
                self._move_slot(pi, Event.ARRIVE if held is Slot.EMPTY else Event.ARRIVE_AGAIN)
            elif held is Slot.DIVIDED:  # a second gradient in this backward
                self._move_slot(pi, Event.ARRIVE_AGAIN)
                view.add_(p.grad.div(self._pre))
                p.grad = None  # the slot is divided: no in-place accumulation
            elif held is Slot.RAW:
                self._move_slot(pi, Event.ARRIVE_AGAIN)
                view.add_(p.grad)
                p.grad = view if self._zero_copy else None
            elif self.communicates_now and p.grad.dtype == view.dtype:
                # the window's only gradient: divided on the way in (one pass);
                # param.grad points at the slot once its bucket is launched
                self._move_slot(pi, Event.ARRIVE_DIVIDED)
                torch.div(p.grad, self._pre, out=view)
                p.grad = None
            else:  # first contribution of this accumulation window: overwrite
                self._move_slot(pi, Event.ARRIVE)
                view.copy_(p.grad)
                p.grad = view if self._zero_copy else None
        else:
            staging = self._staging_for(bucket)
            lo, hi = bucket.slots[pi]
            slot = staging[lo:hi].view_as(p.grad)
            if pi in bucket.filled:
                slot.add_(p.grad.div(self._pre))
            elif p.grad.dtype == slot.dtype:  # divided on the way in (one pass)
                torch.div(p.grad, self._pre, out=slot)
                bucket.filled.add(pi)
            else:
                slot.copy_(p.grad).div_(self._pre)
                bucket.filled.add(pi)
            p.grad = None
        if not self.communicates_now:
            return
        self._arrive(bucket, pi)
        if len(bucket.ready) == bucket.trainable:
            if self._on_bucket_ready is not None:
                self._on_bucket_ready(bucket.segment)
            self._launch_in_order(upto=None)

    def _arrive(self, bucket: Bucket, pi: int) -> None:
        self._move_bucket(bucket, Event.ARRIVE)
        bucket.ready.add(pi)

    def _launch_in_order(self, upto: int | None) -> None:
        """Launch complete buckets in global order (all of them when ``upto`` is None
        and the bucket is complete; everything when finishing)."""
        while self._next < len(self._buckets):
            b = self._buckets[self._next]
            if upto is None and len(b.ready) < b.trainable:
                return
            self._launch(b)
            self._next += 1

    def _launch(self, b: Bucket) -> None:
        g = self.flat
        seg = g.layout.segments[b.segment]
        self._move_bucket(b, Event.LAUNCH)
        if self.sharded:
            src = self._staging_for(b)[: seg.numel]
            for pi, (lo, hi) in b.slots.items():  # parameters that got no gradient
                if pi not in b.filled:
                    src[lo:hi].zero_()
            src[seg.used :].zero_()
        else:
            src = self._full_grads()[seg.start : seg.start + seg.numel]
            for pi, (lo, hi) in b.slots.items():
                was = self._move_slot(pi, Event.LAUNCH)
                if was is Slot.EMPTY:  # stale values: no gradient this window
                    src[lo:hi].zero_()
                elif was is Slot.DIVIDED:  # once: a later backward adds raw gradients
                    if self._zero_copy:
                        self.flat.params[pi].grad = self._views[pi]
                else:  # accumulated over micro-steps (or cast in): divided here
                    src[lo:hi].div_(self._pre)
        comm = self.comm_of(b.segment)
        if g.partitioned:
            if self._scratch.numel and comm.world_size > 1:
                b.scratch = self._take(self._scratch)
            # the window's first reduction of a sharded bucket lands in the owned shard
            # itself (no copy out of the staging bucket afterwards)
            b.direct = self.sharded and self._direct_ok and self.window is Window.EMPTY
            out = self._chunks[b.segment] if b.direct else self._own(b, src)
            handle = comm.reduce_scatter(
                out, src, async_op=True, via=self._rs_via, scratch=b.scratch
            )
        else:
            handle = comm.all_reduce(src, async_op=True)
        self._pending.append((b, handle, "reduce"))
        if not self.overlap:
            while any(entry[0] is b for entry in self._pending):
                self._complete_oldest()

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
        while (buf := pool.take()) is None and self._pending:
            self._complete_oldest()
        return buf if buf is not None else pool.make()

    def _complete_oldest(self) -> None:
        b, handle, phase = self._pending.pop(0)
        handle.wait()
        if b.scratch is not None:
            self._scratch.free.append(b.scratch)
            b.scratch = None
        g = self.flat
        seg = g.layout.segments[b.segment]
        if phase == "reduce" and self.replicate is not None:
            # hybrid sharding: the reduced chunk is summed across the replicas next
            own = self._own(b, self._staged(b) if self.sharded else self._full_grads()[seg.start :])
            self._pending.insert(0, (b, self.replicate.all_reduce(own, async_op=True), "replicate"))
            self._move_bucket(b, Event.REPLICATE)
            return
        self._move_bucket(b, Event.COMPLETE)
        accumulate = self.window is not Window.EMPTY  # the shard holds a micro-step
        post = self._post
        chunk = self._chunks[b.segment]
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
            self._staging.free.append(self._staged(b))
            b.staging = None
            b.filled.clear()
            return
        if post != 1.0:
            src = self._full_grads()[seg.start : seg.start + seg.numel]
            (src if not g.partitioned else self._device_chunks[b.segment]).div_(post)
        if self.offload is not None:  # offload at stages 0, 1: the boundary's chunk to host
            src = self._device_chunks[b.segment]
            self.offload.to_shard(b.segment, src, self._chunks[b.segment], accumulate=False)

    def _staging_for(self, b: Bucket) -> torch.Tensor:
        if b.staging is None:
            # double-buffered: a bucket fills while the previous one's reduction is in
            # flight; a third waits for the oldest reduction
            b.staging = staging = self._take(self._staging)
            if self.offload is not None:
                self.offload.wait_staging(staging)
        return b.staging

    def finish(self) -> None:
        """After backward: a reducing backward launches what is left (in order) and
        waits for everything. The window moves while the phase still says where the
        reductions go (the device's sum or the shard); the phase is IDLE afterwards,
        even when a reduction raised."""
        event = {
            Phase.BACKWARD_REDUCING: Event.FINISH_REDUCING,
            Phase.BACKWARD_HOLDING: Event.FINISH_HOLDING,
        }.get(self.phase, Event.FINISH_LOCAL)
        idle = states.step("phase", (self.phase, Event.FINISH), self.on_transition)
        try:
            self._move_window(event)
        finally:
            self.phase = idle

    def flush(self) -> None:
        """Reduce this window's local sums now (stages 0-1: every bucket, in order, on
        every rank); nothing to do once reduced, or with sharded gradients (reduced
        every backward). The pipeline engine calls it after its batch's backwards."""
        self._move_phase(Event.FLUSH)
        self._move_window(Event.FLUSH)

    def finalize(self) -> ReducedGrads:
        """Before a step reads :attr:`grad_chunks`: a window holding unreduced local
        sums is reduced first (the boundary set again after a backward without it); a
        window in which no reduction ran means zero gradients (the buffers hold the last
        window's). Decided by the window, which every rank moves together, not by this
        rank's arrivals: a rank whose backward reached no parameter still holds the
        others' reduced gradients. Returns them, for the optimizer's step."""
        self._move_phase(Event.FINALIZE)
        self._move_window(Event.FINALIZE)
        groups = (self.comm,) if self.replicate is None else (self.comm, self.replicate)
        return ReducedGrads(
            flat=self.flat,
            chunks=self._chunks,
            arrived=frozenset(self.arrived),
            groups=groups,
            squares=self.offload.landed(self._chunks) if self.offload is not None else None,
            squares_of=self.grad_shard,
            squares_version=self.offload.squares_version if self.offload is not None else None,
        )

    def _run(self, action: str) -> None:
        """Run a window move's action."""
        if action == states.RESTATE:
            self._restate_owned()
        elif action == states.REDUCE:
            self._reduce_rest()
        elif action == states.ZERO:
            twin_acc = self.offload.twin_acc(self.sharded) if self.offload is not None else None
            for buf in (self.grad_full, self.grad_shard, self.twin_shard, twin_acc):
                if buf is not None:
                    buf.zero_()
        elif action == states.RESCALE:
            self._rescale_apart()
        elif action == states.LAND:
            assert self.offload is not None  # device accumulation is for offload only
            self.offload.land(self._chunks)
        elif action == states.CLEAR:
            if self.offload is not None:
                self.offload.forget_squares()
            self.arrived.clear()
            self._slots = [Slot.EMPTY] * len(self.flat.params)
            for pi, p in enumerate(self.flat.params):
                if self.flat.group_of[pi] >= 0:
                    p.grad = None
        elif action != states.NONE:
            raise InternalError(f"gradient reducer: unknown action {action!r}")

    def landed_squares(self) -> list[torch.Tensor] | None:
        """Per segment, the fp32 sum of squares of this rank's gradient chunk, taken by
        the host as it landed (:func:`chunk_sum_of_squares` of each of
        :attr:`grad_chunks`, the same values); None when not all were taken so, or the
        chunks were changed since (clipping by tensor-parallel partial sums, tied
        pipeline parameters, a user's edit)."""
        shard, offload = self.grad_shard, self.offload
        if offload is None or shard is None or shard._version != offload.squares_version:
            return None
        return offload.landed(self._chunks)

    def _reduce_rest(self) -> None:
        """Launch every bucket not launched yet, in the global order, and wait for all."""
        self._launch_in_order(upto=len(self._buckets))
        while self._pending:
            self._complete_oldest()
        if self.offload is not None:
            self.offload.drain()
        for b in self._buckets:
            self._move_bucket(b, Event.RESET)
            b.ready.clear()
        self._next = 0

    # -- step boundary ------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Start a new accumulation window (after an optimizer step or a skipped one).

        Nothing is memset: the window's first gradient of each parameter overwrites its
        slot (``param.grad`` is unset so autograd hands over a fresh tensor), slots of
        parameters that get no gradient are zeroed when their bucket is reduced, and the
        owned shard is overwritten by the window's first reduction."""
        self._move_phase(Event.ZERO_GRAD)
        self._move_window(Event.ZERO_GRAD)

    def local_grad(self, pi: int) -> torch.Tensor:
        """Parameter ``pi``'s gradient accumulated on this rank in this window, not yet
        reduced (full-gradient mode only): a view to edit in place before the boundary's
        reduction (the pipeline engine sums tied parameters' copies into it). A
        parameter with no gradient yet gets zeros and counts as having one."""
        self._move_phase(Event.TIED)
        self._move_window(Event.TIED)
        view = self._views[pi]
        assert view is not None  # full gradients: every parameter has its slot
        if self._move_slot(pi, Event.TIED) is Slot.EMPTY:
            view.zero_()
        self.arrived.add(pi)
        return view

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def buffers(self) -> list[torch.Tensor]:
        """Persistent gradient buffers: the full buffer or the shard, plus the staging pool."""
        dev_acc = self.offload.dev_acc if self.offload is not None else None
        held = (self.grad_full, self.grad_shard, self.twin_shard, dev_acc)
        bufs = [b for b in held if b is not None]
        bufs += self._staging.free + self._scratch.free
        bufs += [b.scratch for b in self._buckets if b.scratch is not None]
        bufs += [b.staging for b in self._buckets if b.staging is not None]
        if self.offload is not None:
            bufs += self.offload.buffers()
        return bufs
