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

Either way :attr:`GradReducer.grad_chunks` ``[segment]`` is the reduced,
averaged gradient of this rank's chunk, what the sharded optimizer consumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zeroshard import ArgumentError, InternalError, UsageError
from zeroshard.distributed.comm import Comm, Handle
from zeroshard.distributed.device import host_apart
from zeroshard.offload.staging import HostStager
from zeroshard.zero.grads.reached import reached_leaves
from zeroshard.zero.layout.flat import FlatParams

# reductions in flight at once, at most: each holds a staging bucket (stages 2-3) and a
# receive buffer (point-to-point reduce-scatter); more wait for the oldest
_IN_FLIGHT = 2


class _Pool:
    """Buffers of one size, at most :data:`_IN_FLIGHT` of them: with none free and all
    made, ``take`` completes the oldest pending reduction (which gives its back)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.numel, self.dtype, self.device = numel, dtype, device
        self.free: list[torch.Tensor] = []
        self.made = 0

    def take(self, reducer: GradReducer) -> torch.Tensor:
        while not self.free and self.made >= _IN_FLIGHT and reducer._pending:
            reducer._complete_oldest()
        if self.free:
            return self.free.pop()
        self.made += 1
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)


@dataclass(eq=False)
class _Bucket:
    segment: int
    order_key: int
    slots: dict[int, tuple[int, int]]  # param index -> (lo, hi) within the segment
    trainable: int  # how many of its parameters receive gradients
    ready: set[int] = field(default_factory=set)
    launched: bool = False
    staging: torch.Tensor | None = None
    scratch: torch.Tensor | None = None  # the reduce-scatter's receive buffer, if any
    direct: bool = False  # reduced straight into the owned gradient shard
    filled: set[int] = field(default_factory=set)


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
            there every micro-step; stages 0, 1: copied there at the boundary). Each
            bucket's chunk is moved through a double-buffered :class:`HostStager` as
            soon as its reduction completes, while backward goes on. None: no offload.
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
        # divided by ``_pre`` on the way into the bucket, by ``_post`` after the reduction
        self._pre = predivide if predivide != 1.0 else float(self._contributors)
        self._post = self._contributors / self._pre
        self._boundary = True
        self._in_backward = False  # between begin() and finish(): engine.backward runs
        self._hooks = []
        # (bucket, handle, phase): "reduce" over ``comm``, then "replicate" (hybrid only)
        self._pending: list[tuple[_Bucket, Handle, str]] = []
        layout = flat.layout
        # segments with a trainable parameter: the only ones reduced and stored (stage 3
        # keeps frozen parameters in segments of their own)
        reduced = [seg for seg in layout.segments if any(flat.group_of[p] >= 0 for p in seg.params)]
        staging_numel = max((seg.numel for seg in reduced), default=0)
        self._staging = _Pool(staging_numel, dtype, flat.device)
        # receive buffers of a point-to-point (or all-to-all) reduce-scatter
        scratch = max(
            c.reduce_scatter_scratch(staging_numel, self._rs_via) for c in (comm, self.expert_comm)
        )
        self._scratch = _Pool(scratch, dtype, flat.device)
        self._accumulated = False  # whether grad_shard already holds a micro-step
        self._reduced = False  # whether full gradients were reduced in this window
        self._window_filled: set[int] = set()  # params that got a gradient in this window
        # full-gradient slots already divided by ``_pre`` (their window's only gradient
        # arrived at the boundary and was divided while copied in), until their bucket
        # launches; ``param.grad`` is pointed at the slot then
        self._scaled: set[int] = set()
        own = flat.rank
        self.grad_full: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self._views: list[torch.Tensor | None] = [None] * len(flat.params)
        self._stager: HostStager | None = None
        self._staging_events: dict[int, object] = {}  # staging buffer id -> copy event
        if accum_device is not None and (accum_device != flat.device or host_apart(flat.device)):
            chunk = max((s.chunk for s in reduced), default=0)
            self._stager = HostStager(flat.device, chunk, dtype)
        if sharded or self._stager is not None:
            where = accum_device or flat.device
            # On a separate host the shard is accumulated in fp32, the dtype the CPU
            # optimizer reads: the moves stay in the gradient dtype (half the bytes over
            # the bus), and neither the norm nor the step converts every element again.
            host = torch.float32 if self._stager is not None else dtype
            self.grad_shard = torch.zeros(sum(s.chunk for s in reduced), dtype=host, device=where)
            self.grad_chunks = [self.grad_shard[:0]] * len(layout.segments)  # frozen: none
            start = 0
            for seg in reduced:
                self.grad_chunks[seg.index] = self.grad_shard[start : start + seg.chunk]
                start += seg.chunk
        if not sharded:
            self.grad_full = torch.zeros(layout.total_numel, dtype=dtype, device=flat.device)
            self._device_chunks = [
                self.grad_full[slice(*s.chunk_range(own))] for s in layout.segments
            ]
            if self._stager is None:
                self.grad_chunks = self._device_chunks
            for pi, p in enumerate(flat.params):
                lo, hi = layout.param_range(pi)
                self._views[pi] = self.grad_full[lo:hi].view_as(p)
        reg = registration_index or {}
        self._buckets: list[_Bucket] = []
        self._bucket_of: list[_Bucket] = [None] * len(flat.params)  # type: ignore[list-item]
        for seg in reduced:
            slots = {p: (lo, hi) for p, lo, hi in layout.segment_param_pieces(seg.index)}
            key = min((reg.get(id(flat.params[p]), 1 << 30) for p in seg.params), default=0)
            trainable = sum(flat.group_of[p] >= 0 for p in seg.params)
            bucket = _Bucket(seg.index, key, slots, trainable)
            self._buckets.append(bucket)
            for pi in seg.params:
                self._bucket_of[pi] = bucket
        # Last layers first: a bucket is complete when its earliest parameter's grad lands.
        self._buckets.sort(key=lambda b: (-b.order_key, b.segment))
        self._next = 0
        self._zero_copy = not sharded and all(p.dtype == dtype for p in flat.params)
        # the owned shard can take a reduction's output: same device and dtype, no replicas
        self._direct_ok = (
            sharded
            and self._stager is None
            and self.replicate is None
            and self.grad_shard is not None
            and self.grad_shard.dtype == dtype
        )
        for pi, p in enumerate(flat.params):
            if flat.group_of[pi] < 0:  # frozen (stage 3 keeps them in the layout)
                continue
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(pi)))

    # -- backward -----------------------------------------------------------------------
    def begin(self, boundary: bool, roots: list[torch.Tensor] | None = None) -> None:
        """Called before each backward: whether this micro-step ends an accumulation,
        and the tensors backward starts from (for ``count_unreached``)."""
        self._boundary = boundary
        self._in_backward = True
        self._walk_missed = set()
        if self._reduced and self.flat.partitioned and not self.sharded:
            self._restate_owned()
        if self._count_unreached and roots is not None and self.communicates_now:
            self._count_unreached_as_arrived(roots)

    def _count_unreached_as_arrived(self, roots: list[torch.Tensor]) -> None:
        reached = reached_leaves(roots)
        if reached is None:  # a graph that hides parameters: wait for what arrives
            return
        for pi, p in enumerate(self.flat.params):
            if self.flat.group_of[pi] >= 0 and id(p) not in reached:
                self._bucket_of[pi].ready.add(pi)
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
        self._reduced = False  # raw again: gradients accumulate into it until reduced

    @property
    def communicates_now(self) -> bool:
        return self.sharded or self._boundary

    def _full_grads(self) -> torch.Tensor:
        assert self.grad_full is not None  # full-gradient mode (stages 0-1, or accumulating)
        return self.grad_full

    @staticmethod
    def _staged(b: _Bucket) -> torch.Tensor:
        assert b.staging is not None  # sharded: a launched bucket holds its staging buffer
        return b.staging

    def _make_hook(self, pi: int):
        def hook(p: torch.Tensor) -> None:
            self._on_grad(pi, p)

        return hook

    def _on_grad(self, pi: int, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        if not self._in_backward:
            raise UsageError(
                "a gradient arrived outside engine.backward(): call engine.backward(loss) "
                "(which scales, accumulates and reduces across ranks), not loss.backward(), "
                "then engine.step()"
            )
        bucket = self._bucket_of[pi]
        if bucket.launched:
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
        if not self.sharded:
            view = self._views[pi]
            assert view is not None  # full gradients: every parameter has its slot
            if p.grad.data_ptr() != view.data_ptr():  # a fresh gradient tensor
                if pi in self._scaled:  # a second gradient in this backward
                    view.add_(p.grad.div(self._pre))
                    p.grad = None  # the slot is divided: no in-place accumulation
                elif pi in self._window_filled:
                    view.add_(p.grad)
                    p.grad = view if self._zero_copy else None
                elif self.communicates_now and p.grad.dtype == view.dtype:
                    # the window's only gradient: divided on the way in (one pass);
                    # param.grad points at the slot once its bucket is launched
                    torch.div(p.grad, self._pre, out=view)
                    self._scaled.add(pi)
                    p.grad = None
                else:  # first contribution of this accumulation window: overwrite
                    view.copy_(p.grad)
                    p.grad = view if self._zero_copy else None
            self._window_filled.add(pi)
        else:
            self._window_filled.add(pi)
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
        bucket.ready.add(pi)
        if len(bucket.ready) == bucket.trainable:
            if self._on_bucket_ready is not None:
                self._on_bucket_ready(bucket.segment)
            self._launch_in_order(upto=None)

    def _launch_in_order(self, upto: int | None) -> None:
        """Launch complete buckets in global order (all of them when ``upto`` is None
        and the bucket is complete; everything when finishing)."""
        while self._next < len(self._buckets):
            b = self._buckets[self._next]
            if upto is None and len(b.ready) < b.trainable:
                return
            self._launch(b)
            self._next += 1

    def _launch(self, b: _Bucket) -> None:
        g = self.flat
        seg = g.layout.segments[b.segment]
        b.launched = True
        if self.sharded:
            src = self._staging_for(b)[: seg.numel]
            for pi, (lo, hi) in b.slots.items():  # parameters that got no gradient
                if pi not in b.filled:
                    src[lo:hi].zero_()
            src[seg.used :].zero_()
        else:
            src = self._full_grads()[seg.start : seg.start + seg.numel]
            for pi, (lo, hi) in b.slots.items():
                if pi not in self._window_filled:  # stale values: no gradient this window
                    src[lo:hi].zero_()
                elif pi in self._scaled:  # once: a later backward adds raw gradients
                    self._scaled.discard(pi)
                    if self._zero_copy:
                        self.flat.params[pi].grad = self._views[pi]
                else:  # accumulated over micro-steps (or cast in): divided here
                    src[lo:hi].div_(self._pre)
        comm = self.comm_of(b.segment)
        if g.partitioned:
            if self._scratch.numel and comm.world_size > 1:
                b.scratch = self._scratch.take(self)
            # the window's first reduction of a sharded bucket lands in the owned shard
            # itself (no copy out of the staging bucket afterwards)
            b.direct = self.sharded and self._direct_ok and not self._accumulated
            out = self.grad_chunks[b.segment] if b.direct else self._own(b, src)
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

    def _own(self, b: _Bucket, src: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of bucket ``b``'s segment-sized buffer ``src``."""
        seg = self.flat.layout.segments[b.segment]
        lo = seg.owner(self.flat.rank) * seg.chunk
        return src[lo : lo + seg.chunk]

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
            return
        post = self._post
        chunk = self.grad_chunks[b.segment]
        if self.sharded:
            reduced = chunk if b.direct else self._own(b, self._staged(b))
            if post != 1.0:
                reduced.div_(post)
            if b.direct:  # already in place
                pass
            elif self._stager is not None:
                event = self._stager.submit(reduced, chunk, accumulate=self._accumulated)
                if event is not None:
                    self._staging_events[id(b.staging)] = event
            elif self._accumulated:
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
        if self._stager is not None:  # offload at stages 0, 1: the boundary's chunk to host
            self._stager.submit(self._device_chunks[b.segment], chunk, accumulate=False)

    def _staging_for(self, b: _Bucket) -> torch.Tensor:
        if b.staging is None:
            # double-buffered: a bucket fills while the previous one's reduction is in
            # flight; a third waits for the oldest reduction
            b.staging = self._staging.take(self)
            event = self._staging_events.pop(id(b.staging), None)
            if event is not None and self._stager is not None:
                # its last chunk may still be on its way to the host
                rt = self._stager.rt
                rt.wait_event(rt.current_stream(self.flat.device), event)
        return b.staging

    def finish(self) -> None:
        """After backward: launch what is left (in order) and wait for everything."""
        self._in_backward = False
        if not self.communicates_now:
            return
        self._launch_in_order(upto=len(self._buckets))
        while self._pending:
            self._complete_oldest()
        if self._stager is not None:
            self._stager.drain()
        for b in self._buckets:
            b.ready.clear()
            b.launched = False
        self._next = 0
        if self.sharded:
            self._accumulated = True
        else:
            self._reduced = True

    # -- step boundary ------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Start a new accumulation window (after an optimizer step or a skipped one).

        Nothing is memset: the window's first gradient of each parameter overwrites its
        slot (``param.grad`` is unset so autograd hands over a fresh tensor), slots of
        parameters that get no gradient are zeroed when their bucket is reduced, and the
        owned shard is overwritten by the window's first reduction."""
        self._accumulated = self._reduced = False
        self._window_filled.clear()
        self._scaled.clear()
        for pi, p in enumerate(self.flat.params):
            if self.flat.group_of[pi] >= 0:
                p.grad = None

    def local_grad(self, pi: int) -> torch.Tensor:
        """Parameter ``pi``'s gradient accumulated on this rank in this window, not yet
        reduced (full-gradient mode only): a view to edit in place before the boundary's
        reduction (the pipeline engine sums tied parameters' copies into it). A
        parameter with no gradient yet gets zeros and counts as having one."""
        if self.sharded:
            raise InternalError("internal: local_grad needs full (unsharded) gradients")
        view = self._views[pi]
        assert view is not None  # full gradients: every parameter has its slot
        if pi not in self._window_filled:
            view.zero_()
            self._window_filled.add(pi)
        return view

    def grad_pieces(self, a: int, b: int) -> list[torch.Tensor]:
        """This rank's reduced gradient at shard positions ``[a, b)``, one piece per
        segment: views of the chunks (zeros where a segment holds only frozen
        parameters)."""
        parts = []
        for seg in self.flat.layout.segments:
            lo, hi = max(a, seg.shard_start), min(b, seg.shard_start + seg.chunk)
            if lo < hi:
                chunk = self.grad_chunks[seg.index]
                if chunk.numel():
                    parts.append(chunk[lo - seg.shard_start : hi - seg.shard_start])
                else:
                    parts.append(torch.zeros(hi - lo, dtype=chunk.dtype, device=chunk.device))
        return parts

    def grad_range(self, a: int, b: int) -> torch.Tensor:
        """:meth:`grad_pieces` as one tensor (a view when it lies in one segment)."""
        parts = self.grad_pieces(a, b)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def unused_everywhere(self, bad: bool = False, extra=None) -> tuple[set[int], bool]:
        """Trainable parameters that got no gradient on any rank in this accumulation
        window, and whether ``bad`` holds on any rank: one all-reduce (max) of a byte per
        trainable parameter, plus one, over every rank that reduces gradients (and over
        ``extra.comm``, the tensor-parallel group, when given). Torch skips a parameter
        whose ``grad`` is None; a parameter used on some ranks only is stepped, its
        gradient averaged with zeros, as DDP does. Expert parameters (segments of kind 1)
        differ along the expert-parallel axis: theirs is a second all-reduce, over
        ``expert_comm`` (the ranks holding the same experts)."""
        flat = self.flat
        layout = flat.layout
        trainable = [pi for pi in range(len(flat.params)) if flat.group_of[pi] >= 0]
        experts = [pi for pi in trainable if layout.segments[layout.param_segment[pi]].kind]
        if self.expert_comm is self.comm:
            experts = []
        dense = [pi for pi in trainable if pi not in set(experts)]
        filled = self._window_filled
        flags = torch.tensor([*(pi in filled for pi in dense), bad], dtype=torch.uint8)
        flags = flags.to(flat.device)
        tp = extra.comm if extra is not None else None
        for comm in (self.comm, self.replicate, tp):
            if comm is not None:
                comm.all_reduce(flags, op="max")
        *used, any_bad = flags.tolist()
        unused = {pi for pi, u in zip(dense, used, strict=True) if not u}
        if experts:
            mine = torch.tensor([pi in filled for pi in experts], dtype=torch.uint8)
            mine = mine.to(flat.device)
            for comm in (self.expert_comm, self.replicate, tp):
                if comm is not None:
                    comm.all_reduce(mine, op="max")
            unused |= {pi for pi, u in zip(experts, mine.tolist(), strict=True) if not u}
        return unused, bool(any_bad)

    def ensure_defined(self) -> None:
        """Before a step: a window in which no reduction ran means zero gradients (the
        buffers hold the last window's). Decided by the reductions, which every rank
        runs together, not by this rank's arrivals: a rank whose backward reached no
        parameter still holds the others' reduced gradients."""
        if not (self._reduced or self._accumulated):
            for buf in (self.grad_full, self.grad_shard):
                if buf is not None:
                    buf.zero_()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def buffers(self) -> list[torch.Tensor]:
        """Persistent gradient buffers: the full buffer or the shard, plus the staging pool."""
        bufs = [b for b in (self.grad_full, self.grad_shard) if b is not None]
        bufs += self._staging.free + self._scratch.free
        bufs += [b.scratch for b in self._buckets if b.scratch is not None]
        bufs += [b.staging for b in self._buckets if b.staging is not None]
        if self._stager is not None:
            bufs += self._stager.buffers()
        return bufs
