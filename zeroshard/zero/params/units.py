"""Stage 3's units: gathering and releasing them, under the live-parameter cap. The
gatherer (``gatherer.py``) decides when; this module does it and keeps each unit's state
(``states.py``: every state change goes through :meth:`Units.move`).

Communication (Ψ = parameter bytes of the non-persistent units): one asynchronous
all-gather over the ZeRO shard group per unit gathered (its chunk from every rank, the
unit's bytes in all; a unit of expert parameters: over the expert shard group), on
demand or prefetched (a unit with a codec, ``codec.py``, gathered by the hooks travels
encoded instead, after what the codec reduces first: fp8, one float32 all-reduce (max));
the persistent units' all-gathers at start-up and after each optimizer step; and, while
gathers are checked for agreement (the first forward and backward, or always with
``enable_sanity_checks``), one all-reduce (max) of two int64 before each gather.
``GatheredParameters(modifier_rank=r)`` writes the gathered values back into this rank's
shard (no collective here).

Agreement: ranks must gather the same units in the same order. During the first forward
and the first backward (and always with ``zero_optimization.enable_sanity_checks``)
each gather is preceded by one all-reduce (max) of two int64 (this unit's index, and its
negation): ranks that would gather different units raise, on every rank, an error naming
both modules and the remedy (a leaf module), instead of gloo aborting or NCCL hanging.

Live parameters (``stage3_max_live_parameters``, DeepSpeed's semantics): the cap is the
number of gathered elements of non-persistent units (in flight or complete, padding
included) held at once. Every live unit is *needed*, *speculative* or *kept*:

* needed: used by a forward that is running (its module's, or one that read it through
  ``module.name``), held by ``GatheredParameters``, or gathered during backward and
  waiting for its gradients (frozen units: until backward ends);
* speculative: prefetched and not yet asked for, e.g. ahead of a pass whose order
  differs from the recorded one. Those still unused are freed when the pass that
  prefetched them ends;
* kept: used by a finished forward and kept for reuse (``gatherer.py``).

The units needed now are always gathered, whatever the cap. Before an on-demand gather
that would take the live count over the cap, kept units are freed (the one whose next
use along the trace is furthest first), then speculative ones (most recently
prefetched first), until it fits or none are left. Before a prefetch that would take it
over, kept units used later than the prefetched unit are freed (furthest first);
prefetching stops at the first unit that still does not fit. A unit that turns from
needed to kept when the live count is over the cap frees kept units (furthest first)
until it is under. So at every moment ``live <= max(cap, numel of the needed units)``,
and a cap smaller than two units gathers one unit at a time.

Freeing keeps tensor objects alive: the unit buffer's storage is resized to zero and
the parameters point at an empty placeholder, so tensors autograd saved during forward
(views of the buffer) see the re-gathered values in backward.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from zeroshard import UsageError, ZeroshardError
from zeroshard.distributed.comm import Comm, Handle
from zeroshard.zero.layout.flat import FlatParams
from zeroshard.zero.params import states
from zeroshard.zero.params.codec import UnitCodec
from zeroshard.zero.params.edits import take_edits
from zeroshard.zero.params.hooks import set_encoded, set_gathered
from zeroshard.zero.params.states import IN_FLIGHT, LIVE, SPECULATIVE, Event, UnitState

E, U = Event, UnitState


class GatherMismatchError(ZeroshardError, RuntimeError):
    """Ranks would gather different stage-3 units (raised on every rank)."""


class Units:
    """Every unit's buffer, state and all-gather in flight; the live count and its cap;
    the gatherer's counters (:meth:`stats`, described in :meth:`reset_stats`)."""

    peak_live_numel: int
    gathers: int
    prefetched: int
    prefetch_hits: int
    evicted: int
    kept: int
    reused: int

    def __init__(
        self,
        flat: FlatParams,
        comm: Comm,
        persistent: Iterable[int],
        *,
        max_live_numel: int,
        check_every_pass: bool = False,
        expert_comm: Comm | None = None,
        codecs: Mapping[int, UnitCodec] | None = None,
    ) -> None:
        self.flat, self.comm = flat, comm
        #: units that travel encoded when the hooks gather them (``codec.py``)
        self.codecs = dict(codecs or {})
        self._encoded: set[int] = set()  # live units gathered encoded now
        self._received: dict[int, torch.Tensor] = {}  # their all-gathers' outputs in flight
        self.expert_comm = expert_comm or comm  # for the units of expert parameters
        self.persistent = set(persistent)
        self.max_live_numel = max_live_numel
        layout = flat.layout
        n = len(layout.segments)
        self.numel = [seg.numel for seg in layout.segments]
        self.placeholder = torch.empty(0, dtype=flat.dtype, device=flat.device)
        for s, codec in self.codecs.items():
            for pi in layout.segments[s].params:
                set_encoded(flat.params[pi], codec.gathered_as)
        # an encoded unit's parameters: their whole shape, one element of storage
        self._stand_in = torch.zeros((), dtype=flat.dtype, device=flat.device)
        self.buffers = [torch.empty(k, dtype=flat.dtype, device=flat.device) for k in self.numel]
        #: each parameter's view of its unit's buffer
        self.views: list[torch.Tensor] = []
        for pi, p in enumerate(flat.params):
            lo, hi = layout.param_range(pi)
            seg = layout.segments[layout.param_segment[pi]]
            self.views.append(self.buffers[seg.index][lo - seg.start : hi - seg.start].view_as(p))
        #: the module each unit belongs to (for errors; set by the gatherer's hooks)
        self.names = ["(no module)"] * n
        #: forwards using each unit now (plus GatheredParameters blocks holding it)
        self.users = [0] * n
        self.state = [U.NEW] * n
        # the units in each state, in the order they entered it (kept by move() only)
        self._members: dict[UnitState, dict[int, None]] = {st: {} for st in UnitState}
        self._members[U.NEW] = dict.fromkeys(range(n))
        self._handles: dict[int, Handle] = {}  # all-gathers in flight, in launch order
        self._reads: dict[int, torch.Tensor] = {}  # NVMe: pool buffers under an all-gather
        self._prefetch_order = [0] * n  # when each speculative unit was prefetched
        self._prefetches = 0
        self._next_use = [0] * n  # a kept unit's next use: its position in the trace
        # gathers are checked for agreement until the first backward ends (gatherer.py)
        self.check_every, self.checking = check_every_pass, True
        #: gathered elements of non-persistent units right now (in flight included)
        self.live_numel = 0
        self.reset_stats()

    # -- states -------------------------------------------------------------------------
    def move(self, s: int, event: Event) -> None:
        """Unit ``s`` takes ``event`` (``states.UNIT``); the live count and the counters
        follow its state."""
        old = self.state[s]
        new: UnitState = states.step("unit", (old, event))
        self.state[s] = new
        del self._members[old][s]
        self._members[new][s] = None
        if s in self.persistent:
            return
        if (old in LIVE) != (new in LIVE):
            self.live_numel += self.numel[s] if new in LIVE else -self.numel[s]
            self.peak_live_numel = max(self.peak_live_numel, self.live_numel)
        if event in (E.FETCH, E.PREFETCH):
            self.gathers += 1
        if event is E.PREFETCH:
            self.prefetched += 1
            self._prefetches += 1
            self._prefetch_order[s] = self._prefetches
        elif event is E.CLAIM:
            self.prefetch_hits += 1
        elif event is E.REUSE:
            self.reused += 1
        elif event is E.KEEP:
            self.kept += 1
        elif event is E.EVICT:
            self.evicted += 1

    def in_state(self, *wanted: UnitState) -> list[int]:
        """The units in any of ``wanted``, each state's in the order they entered it."""
        return [s for st in wanted for s in self._members[st]]

    def is_live(self, s: int) -> bool:
        return self.state[s] in LIVE or self.state[s] in (U.REFRESHING, U.PERSISTENT)

    # -- gather -------------------------------------------------------------------------
    def gather(self, units: Iterable[int], values: bool = False) -> None:
        """Gather ``units`` now, whatever the cap; first free kept units (the furthest next
        use first), then speculative ones, while the live count would exceed it.
        ``values``: the parameters' values are wanted (``GatheredParameters``, teardown),
        so units with a codec are gathered in the compute dtype, not encoded."""
        units = [s for s in dict.fromkeys(units) if s not in self.persistent]
        if values:
            for s in units:
                if s in self._encoded:
                    self._decode_for_values(s)
        for s in units:
            if self.state[s] in SPECULATIVE:  # a prefetch issued it already
                self.move(s, E.CLAIM)
            elif self.state[s] is U.KEPT:  # kept since its forward: no all-gather
                self.move(s, E.REUSE)
        need = sum(self.numel[s] for s in units if self.state[s] is U.RELEASED)
        while self.live_numel + need > self.max_live_numel and not self.make_room(need):
            speculative = self.in_state(*SPECULATIVE)
            if not speculative:
                break
            self.free(max(speculative, key=self._prefetch_order.__getitem__), E.EVICT)
        for s in units:
            if self.state[s] is U.RELEASED:
                self.launch(s, E.FETCH, encoded=not values)
        for s in units:
            self.wait(s)

    def _decode_for_values(self, s: int) -> None:
        """Unit ``s`` is live encoded and its values are wanted: free it to gather it
        again in the compute dtype, unless a running forward or backward holds it."""
        if self.state[s] in (U.KEPT, *SPECULATIVE):
            self.free(s, E.EVICT if self.state[s] is U.KEPT else E.RELEASE)
            return
        raise UsageError(
            f"GatheredParameters on the parameters of {self.names[s]!r} while its forward "
            f"or backward runs: they are gathered {self.codecs[s].gathered_as} there, not "
            "as values; use GatheredParameters outside the model's passes"
        )

    def launch(self, s: int, event: Event, encoded: bool = True) -> bool:
        """Start unit ``s``'s all-gather (``event``: FETCH, PREFETCH or REFRESH); whether
        it started (a prefetch does not wait for a pool buffer). A unit with a codec
        travels encoded unless ``encoded`` is False (its values are wanted)."""
        if self.comm.world_size > 1 and (self.check_every or self.checking):
            self._agree(s)
        store = self.flat.store
        chunk = store.lend(s)  # a view in memory, or a pool buffer read from NVMe
        while chunk is None:  # every pool buffer is under an all-gather in flight
            if event is E.PREFETCH:  # (same decision on every rank: counts, not timing)
                return False
            self.wait(next(o for o in self._handles if o in self._reads))
            chunk = store.lend(s)
        self._reads[s] = chunk
        seg = self.flat.layout.segments[s]
        comm = self.expert_comm if seg.kind else self.comm
        codec = self.codecs.get(s) if encoded else None
        # uploaded as stored (an fp32 master shard on the host), cast on the device
        chunk = chunk.to(self.flat.device, non_blocking=True).to(self.flat.dtype)
        if codec is not None:  # this rank's part of the parameter: the chunk's first `valid`
            valid = min(max(seg.used - seg.owner(self.flat.rank) * seg.chunk, 0), seg.chunk)
            chunk = codec.encode(chunk, valid, comm)
            buf = self._received[s] = codec.receive(seg.numel)
            self._encoded.add(s)
        else:
            buf = self.buffers[s]
            nbytes = buf.numel() * buf.element_size()
            if buf.untyped_storage().nbytes() != nbytes:  # a same-size resize_ reallocates
                buf.untyped_storage().resize_(nbytes)
        with torch.autograd._unsafe_preserve_version_counter(buf):
            self._handles[s] = comm.all_gather(buf, chunk, async_op=True)
        self.move(s, event)
        return True

    def _agree(self, s: int) -> None:
        """Check that every rank gathers unit ``s`` now (see the module docstring)."""
        mine = torch.tensor([s, -s], dtype=torch.int64, device=self.flat.device)
        self.comm.all_reduce(mine, op="max")
        top, neg_low = mine.tolist()
        if top == s and -neg_low == s:
            return
        other = top if top != s else -neg_low
        raise GatherMismatchError(
            f"ZeRO-3: ranks are about to gather different parameters: this rank those of "
            f"{self.names[s]!r}, another rank those of {self.names[other]!r}. "
            "The model ran different modules on different ranks (data-dependent control "
            "flow: routing, early exit). Mark the module whose inside varies as a leaf, "
            "gathered whole on every rank: zeroshard.utils.set_z3_leaf_modules(model, "
            "[TheModuleClass]) before initialize, or the config's "
            'zero_optimization.leaf_module {"classes": [...]}; for an MoE, its MoE block'
        )

    def wait(self, s: int) -> None:
        """Land unit ``s``'s all-gather in flight, if any: its parameters view it."""
        if self.state[s] not in IN_FLIGHT:
            return
        encoded = s in self._encoded
        target = self._received.pop(s) if encoded else self.buffers[s]
        with torch.autograd._unsafe_preserve_version_counter(target):
            self._handles.pop(s).wait()
        read = self._reads.pop(s, None)
        if read is not None:  # the all-gather has consumed it
            self.flat.store.give_back(read)
        self.move(s, E.LAND)
        for pi in self.flat.layout.segments[s].params:
            p = self.flat.params[pi]
            set_gathered(p, True)  # first: a released parameter refuses a new .data
            if encoded:  # the whole shape for autograd; the values refused (codec.py)
                p.data = self._stand_in.expand(self.flat.shapes[pi])
                set_gathered(p, False)
            else:
                p.data = self.views[pi]
        if encoded:
            self.codecs[s].landed()

    def refresh_persistent(self) -> None:
        """All-gather the persistent units (at start-up and after each optimizer step)."""
        for s in self.persistent:
            self.launch(s, E.REFRESH)
        for s in self.persistent:
            self.wait(s)

    # -- release ------------------------------------------------------------------------
    def free(self, s: int, event: Event = E.RELEASE) -> None:
        """Release unit ``s`` (``event``: RELEASE, or EVICT to make room), once its
        all-gather in flight has landed."""
        self.wait(s)
        self.move(s, event)
        encoded = s in self._encoded
        for pi in self.flat.layout.segments[s].params:
            p = self.flat.params[pi]
            if encoded:  # released already (its values refused): its .data may change now
                set_gathered(p, True)
            p.data = self.placeholder
            set_gathered(p, False)
        self.buffers[s].untyped_storage().resize_(0)
        if s in self._encoded:
            self._encoded.discard(s)
            self.codecs[s].release()

    def free_if_idle(self, s: int) -> None:
        """Free unit ``s`` unless it is persistent or still in use by a running forward."""
        if s not in self.persistent and self.users[s] == 0 and self.state[s] in LIVE:
            self.free(s)

    def free_all(self) -> None:
        """Drop every use and free every live unit (kept and speculative ones included)."""
        for s in range(len(self.state)):
            if self.is_live(s):
                self.users[s] = 0
                self.free_if_idle(s)

    def release_speculative(self) -> None:
        """Free the units prefetched and never asked for (in the order prefetched)."""
        for s in sorted(self.in_state(*SPECULATIVE), key=self._prefetch_order.__getitem__):
            self.free(s)

    def release_kept(self) -> None:
        """Free every unit kept for reuse (after a step: the shards have changed)."""
        for s in self.in_state(U.KEPT):
            self.free(s)

    def keep(self, s: int, next_use: int) -> None:
        """Keep unit ``s`` gathered until its next use, position ``next_use`` of the trace;
        over the cap, kept units go (it was needed until now)."""
        self.move(s, E.KEEP)
        self._next_use[s] = next_use
        self.make_room(0)

    def make_room(self, need: int, before: int = -1) -> bool:
        """Free kept units whose next use comes after position ``before`` of the trace,
        the furthest first, until ``need`` more elements fit under the cap; whether
        they do."""
        while self.live_numel + need > self.max_live_numel:
            s = max(self.in_state(U.KEPT), key=self._next_use.__getitem__, default=None)
            if s is None or self._next_use[s] <= before:
                return False
            self.free(s, E.EVICT)
        return True

    # -- edits and teardown -------------------------------------------------------------
    def write_back(self, s: int) -> None:
        """This rank's chunk of unit ``s``'s buffer into its shard (the elements that
        differ: ``zero/params/edits.py``)."""
        seg, rank = self.flat.layout.segments[s], self.flat.rank
        chunk = self.flat.store.chunk(s)  # a view in memory, a copy from NVMe
        lo = seg.owner(rank) * seg.chunk
        take_edits(chunk, self.buffers[s][lo : lo + seg.chunk])
        self.flat.store.write_chunk(s, chunk)

    def detach(self) -> None:
        """Teardown: give each parameter its whole value back, one unit at a time (one
        all-gather per unit), as a plain tensor of its own."""
        self.free_all()
        for s in range(len(self.buffers)):
            self.gather((s,), values=True)  # persistent units are whole already
            seg = self.flat.layout.segments[s]
            whole = [self.views[pi].detach().clone() for pi in seg.params]
            if s not in self.persistent:
                self.free(s)
            for pi, value in zip(seg.params, whole, strict=True):
                self.flat.params[pi].data = value
            self.move(s, E.DETACH)
        self.buffers = []

    # -- instrumentation ----------------------------------------------------------------
    def reset_stats(self) -> None:
        """Restart the counters; the peak restarts from what is live now."""
        #: highest ``live_numel`` since the last reset
        self.peak_live_numel = self.live_numel
        #: all-gathers issued for non-persistent units (on demand and prefetched)
        self.gathers = 0
        #: of those, issued by prefetching
        self.prefetched = 0
        #: on-demand requests for a unit a prefetch had already issued
        self.prefetch_hits = 0
        #: speculative or kept units freed to stay under the live-parameter cap
        self.evicted = 0
        #: units kept gathered after their forward for a use within the reuse distance
        self.kept = 0
        #: on-demand requests served by a kept unit (an all-gather saved each)
        self.reused = 0

    def stats(self) -> dict[str, int]:
        return {
            "live_numel": self.live_numel,
            "peak_live_numel": self.peak_live_numel,
            "gathers": self.gathers,
            "prefetched": self.prefetched,
            "prefetch_hits": self.prefetch_hits,
            "evicted": self.evicted,
            "kept": self.kept,
            "reused": self.reused,
        }
