"""Bucketed gradient reduction, driven by autograd hooks and overlapped with backward.

Each segment of the :class:`~zeroshard.zero.layout.flat.FlatParams` layout is a bucket. A
``post_accumulate_grad`` hook on every trainable parameter drops its gradient into the
bucket; when a bucket is complete it is reduced asynchronously while backward goes on,
in one fixed global order on every rank (``zero/grads/launch.py``: which collectives,
their volume). At stage 3 (``count_unreached``) the parameters a backward's graph does
not reach (``zero/grads/reached.py``) count as arrived when it starts, so a rank that
gets no gradient for a bucket launches it when the others do, not when backward ends.

Two modes, chosen once from what is sharded (``zero/grads/buffers.py``: the buffers):

* **full gradients** (stages 0 and 1): a flat gradient buffer the size of the group.
  In the common case (gradient dtype == parameter dtype) ``param.grad`` *is* a view of
  it, so autograd accumulates micro-steps in place and nothing is copied. Communication
  happens only on the accumulation boundary (an all-reduce or a reduce-scatter per
  bucket).
* **sharded gradients** (stages 2 and 3): only this rank's chunks are kept; every
  micro-step's gradients are reduce-scattered bucket by bucket through a pooled
  staging buffer (``zero/grads/buckets.py``) and accumulated into the owned shard.

With expert parallelism, expert segments reduce over their own group (``launch.py``).

Either way :attr:`GradReducer.grad_chunks` ``[segment]`` is the reduced,
averaged gradient of this rank's chunk, what the sharded optimizer consumes, once
:meth:`GradReducer.finalize` ran. The reducer's states (backward phase, accumulation
window, buckets, slots) and their legal moves are tables in ``zero/grads/states.py``;
every change of state goes through them.

With the optimizer offloaded to a host apart from the device (``accum_device``), the
reduced chunks go there through :class:`~zeroshard.zero.grads.offload.HostOffload`
(``zero/grads/offload.py``: the device's fp32 accumulation before the boundary, the
host stager, the squares taken as chunks land, Twin-Flow's device segments).

The reducer composes those parts and calls down into them: it owns the hooks, the
arrivals and the moves of the window and the phase; :class:`BucketLauncher` launches
and completes the reductions, :class:`GradBuffers` holds the gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zeroshard import ArgumentError, InternalError, UsageError
from zeroshard.distributed.comm import Comm
from zeroshard.zero.grads import states
from zeroshard.zero.grads.buffers import GradBuffers
from zeroshard.zero.grads.launch import BucketLauncher
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
            on the device before the boundary, see ``offload.py``; stages 0, 1: copied
            there at the boundary). Each bucket's chunk is moved through a
            double-buffered :class:`~zeroshard.offload.staging.HostStager` as soon as its
            reduction completes, while backward goes on. None: no offload.
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
        rs_via = reduce_scatter_via or comm.reduce_scatter_path(flat.device)
        self.replicate = replicate if replicate is not None and replicate.world_size > 1 else None
        if self.replicate is not None and not flat.partitioned:
            raise ArgumentError("internal: replicated reduction needs a sharded layout")
        # gradients are averaged over every rank that produced one
        contributors = comm.world_size * (self.replicate.world_size if self.replicate else 1)
        self._on_bucket_ready = on_bucket_ready
        self.sharded, self.overlap, self.predivide = sharded, overlap, predivide
        self.mode = (
            Mode.SHARDED if sharded else Mode.PARTITIONED if flat.partitioned else Mode.REPLICATED
        )
        # divided by ``_pre`` on the way into the bucket, by ``post`` after the reduction
        self._pre = predivide if predivide != 1.0 else float(contributors)
        post = contributors / self._pre
        self._hooks = []
        # parameters that got a gradient on this rank in this window (data for the
        # step's unused-parameter check, not a state: the window never depends on it)
        self.arrived: set[int] = set()
        #: the offload path (``zero/grads/offload.py``); None: no offload
        self.offload = HostOffload.of(flat, accum_device, dtype, device_segments)
        # Twin-Flow: the segments whose reduced chunks stay on the device
        on_device = self.offload.on_device if self.offload is not None else frozenset()
        #: the gradient buffers (``zero/grads/buffers.py``)
        offloaded = self.offload is not None
        self.bufs = GradBuffers(flat, dtype, sharded, accum_device, offloaded, on_device)
        #: the buckets' reductions (``zero/grads/launch.py``); it reads phase and window
        self.launcher = BucketLauncher(
            flat,
            comm,
            self.expert_comm,
            self.replicate,
            self.bufs,
            self.offload,
            dtype=dtype,
            sharded=sharded,
            overlap=overlap,
            pre=self._pre,
            post=post,
            rs_via=rs_via,
            registration_index=registration_index,
        )
        for pi, p in enumerate(flat.params):
            if flat.group_of[pi] < 0:  # frozen (stage 3 keeps them in the layout)
                continue
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(pi)))

    # the states live where the launcher reads them; only the reducer moves them
    @property
    def phase(self) -> Phase:
        return self.launcher.phase

    @phase.setter
    def phase(self, value: Phase) -> None:
        self.launcher.phase = value

    @property
    def window(self) -> Window:
        return self.launcher.window

    @window.setter
    def window(self, value: Window) -> None:
        self.launcher.window = value

    @property
    def on_transition(self) -> Callable[[str, tuple], None] | None:
        """Called with (machine, key) on every move: the transition-table test records them."""
        return self.launcher.on_transition

    @on_transition.setter
    def on_transition(self, value: Callable[[str, tuple], None] | None) -> None:
        self.launcher.on_transition = value

    @property
    def grad_full(self) -> torch.Tensor | None:
        return self.bufs.grad_full

    @property
    def grad_shard(self) -> torch.Tensor | None:
        return self.bufs.grad_shard

    @property
    def twin_shard(self) -> torch.Tensor | None:
        return self.bufs.twin_shard

    @property
    def grad_chunks(self) -> list[torch.Tensor]:
        """This rank's reduced gradient, one chunk per segment (see the module's
        docstring). With offload, a window still held on the device is landed on the
        host first (a FLUSH: between backwards only)."""
        if self.window is Window.ON_DEVICE:
            self.flush()
        return self.bufs.chunks

    def comm_of(self, segment: int) -> Comm:
        """The group segment ``segment``'s gradients are reduced over (by its kind)."""
        return self.launcher.comm_of(segment)

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
            self.offload.hold(self.grad_shard, self.twin_shard, self.bufs.chunks)
            self.bufs.twin_shard = None  # Twin-Flow: its share is read from the device's sum
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
                self.launcher.arrive(self.launcher.bucket_of[pi], pi)
                self._walk_missed.add(pi)
        self.launcher.launch_in_order(upto=None)

    @property
    def communicates_now(self) -> bool:
        return self.phase in (Phase.BACKWARD_REDUCING, Phase.BACKWARD_HOLDING)

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
        bucket = self.launcher.bucket_of[pi]
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
            self.bufs.arrive(pi, p, self._pre, self.communicates_now, self.on_transition)
        else:
            self.launcher.stage_grad(bucket, pi, p)
        if not self.communicates_now:
            return
        self.launcher.arrive(bucket, pi)
        if len(bucket.ready) == bucket.trainable:
            if self._on_bucket_ready is not None:
                self._on_bucket_ready(bucket.segment)
            self.launcher.launch_in_order(upto=None)

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
        chunks, offload = self.bufs.chunks, self.offload
        return ReducedGrads(
            flat=self.flat,
            chunks=chunks,
            arrived=frozenset(self.arrived),
            groups=groups,
            squares=offload.landed(chunks) if offload is not None else None,
            squares_of=self.grad_shard,
            squares_version=offload.squares_version if offload is not None else None,
        )

    def _run(self, action: str) -> None:
        """Run a window move's action."""
        if action == states.RESTATE:
            self.bufs.restate_owned(self.comm.world_size)
        elif action == states.REDUCE:
            self.launcher.reduce_rest()
        elif action == states.ZERO:
            twin_acc = self.offload.twin_acc(self.sharded) if self.offload is not None else None
            for buf in (self.grad_full, self.grad_shard, self.twin_shard, twin_acc):
                if buf is not None:
                    buf.zero_()
        elif action == states.RESCALE:
            self.bufs.rescale_apart(self.comm.world_size, lambda s: self.comm_of(s).world_size)
        elif action == states.LAND:
            assert self.offload is not None  # device accumulation is for offload only
            self.offload.land(self.bufs.chunks)
        elif action == states.CLEAR:
            if self.offload is not None:
                self.offload.forget_squares()
            self.arrived.clear()
            self.bufs.clear()
        elif action != states.NONE:
            raise InternalError(f"gradient reducer: unknown action {action!r}")

    def landed_squares(self) -> list[torch.Tensor] | None:
        """Per segment, the fp32 sum of squares of this rank's gradient chunk, taken by
        the host as it landed (:func:`~zeroshard.zero.grads.buckets.chunk_sum_of_squares`
        of each of :attr:`grad_chunks`, the same values); None when not all were taken
        so, or the chunks were changed since (clipping by tensor-parallel partial sums,
        tied pipeline parameters, a user's edit)."""
        shard, offload = self.grad_shard, self.offload
        if offload is None or shard is None or shard._version != offload.squares_version:
            return None
        return offload.landed(self.bufs.chunks)

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
        view = self.bufs.view(pi)
        if self.bufs.move_slot(pi, Event.TIED, self.on_transition) is Slot.EMPTY:
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
        bufs += self.launcher.buffers()
        if self.offload is not None:
            bufs += self.offload.buffers()
        return bufs
