"""Stage 3: parameters live as shards and are gathered per unit around their use
(:class:`ParamGatherer`; stages 0-2 keep them whole: ``whole.py``).

A *unit* is one segment of the flat layout: the parameters a module owns directly
(``recurse=False``), trainable and frozen ones apart. Parameters below
``stage3_param_persistence_threshold`` elements are packed into *persistent* segments
that stay gathered on every rank. A *leaf* module (``leaves.py``: an MoE block, say) is
gathered as a whole at its pre-forward, all of its descendants' units together, so
data-dependent control flow inside it cannot make ranks gather different units.

Communication (Ψ = parameter bytes of the non-persistent units):

* forward: a module's pre-forward hook all-gathers the units of its own parameters
  (shared ones included, e.g. tied embeddings) into that unit's buffer; the post-forward
  hook frees the buffer, unless it keeps the unit for reuse (below). The next units in
  the order recorded on the first forward are prefetched asynchronously up to
  ``stage3_prefetch_bucket_size`` elements (Ψ).
* backward: an identity autograd function on each module's outputs gathers its units
  again just before that module's backward (no all-gather for a unit still kept),
  prefetching along the order recorded on the first backward; a unit is freed as soon as
  all its gradients have landed (the gradient reducer then reduce-scatters them, Ψ, in
  a process group of its own: where a parameter gets a gradient on some ranks only, the
  reductions interleave with these gathers differently on each rank).
* step: the persistent segments are all-gathered after each optimizer step.

Reuse (``stage3_max_reuse_distance``, DeepSpeed's semantics): once the first forward
and backward have been recorded, the *trace* is the forward order followed by the
backward order. At a module's post-forward, with grad enabled, a unit of its that no
running forward still uses is *kept* gathered instead of freed if its next use along
the trace, after the furthest unit this forward has used, comes before units of
``stage3_max_reuse_distance`` elements have been gathered in between. With DeepSpeed's
default (1e9) a model under about 5e8 parameters (its first unit is next used last in
backward, about 2Ψ elements later) stays gathered from its forward through its
backward, so the backward all-gathers nothing but what the cap evicted: stage 3 moves
4Ψ + 4Ψ instead of 3 x 4Ψ, at the price of holding the gathered parameters between the
passes; in a larger model, the units within about half the distance of the turn from
forward to backward. 0 frees every unit after its forward. Units still kept are freed when backward
ends, and after an optimizer step (a forward without a backward, then a step: the
shards changed). A forward under ``no_grad`` (evaluation) keeps nothing, and what it
finds kept it frees after use.

Live parameters (``stage3_max_live_parameters``, DeepSpeed's semantics): the cap is the
number of gathered elements of non-persistent units (in flight or complete, padding
included) held at once. Every live unit is *needed*, *speculative* or *kept*:

* needed: used by a forward that is running (its module's, or one that read it through
  ``module.name``), held by ``GatheredParameters``, or gathered during backward and
  waiting for its gradients (frozen units: until backward ends);
* speculative: prefetched and not yet asked for, e.g. ahead of a pass whose order
  differs from the recorded one. Those still unused are freed when the pass that
  prefetched them ends;
* kept: used by a finished forward and kept for reuse (above).

The units needed now are always gathered, whatever the cap. Before an on-demand gather
that would take the live count over the cap, kept units are freed (the one whose next
use along the trace is furthest first), then speculative ones (most recently
prefetched first), until it fits or none are left. Before a prefetch that would take it
over, kept units used later than the prefetched unit are freed (furthest first);
prefetching stops at the first unit that still does not fit. A unit that turns from
needed to kept when the live count is over the cap frees kept units (furthest first)
until it is under. So at every moment ``live <= max(cap, numel of the needed units)``,
and a cap smaller than two units gathers one unit at a time.
:attr:`ParamGatherer.peak_live_numel` records the highest live count since
:meth:`ParamGatherer.reset_stats` (with counters of the gathers issued, prefetched,
prefetches used, units evicted, units kept for reuse and requests they served).

Freeing keeps tensor objects alive: the unit buffer's storage is resized to zero and
the parameters point at an empty placeholder, so tensors autograd saved during forward
(views of the buffer) see the re-gathered values in backward. A released parameter
answers its metadata for the whole parameter and refuses every other torch op, its
``.data`` included (``hooks.RELEASED_READS``), naming itself and ``GatheredParameters``,
instead of computing on the placeholder. Persistent parameters are whole on every rank:
edits made to them outside forward are written into this rank's shard when the next
step starts (``zero/params/edits.py``), as at stages 0-2.

Agreement: ranks must gather the same units in the same order. During the first forward
and the first backward (and always with ``zero_optimization.enable_sanity_checks``)
each gather is preceded by one all-reduce (max) of two int64 (this unit's index, and its
negation): ranks that would gather different units raise, on every rank, an error naming
both modules and the remedy (a leaf module), instead of gloo aborting or NCCL hanging.
With more than one rank, modules carry FSDP2's ``_is_fsdp_managed_module`` marker, so
Hugging Face ``generate()`` keeps every rank running forwards until all are done
(``synced_gpus``), as it does for DeepSpeed ZeRO-3 and FSDP.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable

import torch
from torch import nn

from zeroshard import UsageError, ZeroshardError
from zeroshard.distributed.comm import Comm, Handle
from zeroshard.zero.layout.flat import FlatParams
from zeroshard.zero.params.edits import WholeEdits, moved, take_edits, view_again
from zeroshard.zero.params.hooks import (
    AccessTrackingDict,
    guard,
    set_gathered,
    unguard,
    wrap_outputs,
)
from zeroshard.zero.params.regions import find_regions
from zeroshard.zero.params.whole import replica_source, segments_of


class GatherMismatchError(ZeroshardError, RuntimeError):
    """Ranks would gather different stage-3 units (raised on every rank)."""


def _outermost(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """The modules of ``modules`` that are not inside another of them."""
    modules = list(dict.fromkeys(modules))
    inner = {id(d) for m in modules for d in m.modules() if d is not m}
    return [m for m in modules if id(m) not in inner]


class _Trace:
    """The units in the order recorded on the first forward, then on the first backward,
    as one sequence: where each unit is used, and how many elements are gathered up to
    each position (DeepSpeed's parameter trace, per unit)."""

    def __init__(self, fwd: list[int], bwd: list[int], numel: list[int]) -> None:
        self.fwd_len = len(fwd)
        self.uses: dict[int, list[int]] = {}
        self._before = [0]  # elements of the units at positions < i
        for i, s in enumerate([*fwd, *bwd]):
            self.uses.setdefault(s, []).append(i)
            self._before.append(self._before[-1] + numel[s])

    def next_use(self, s: int, after: int) -> tuple[int, int] | None:
        """The first position after ``after`` that uses unit ``s``, and the elements of
        the units used in between; None if it is not used again."""
        uses = self.uses.get(s, [])
        i = bisect_right(uses, after)
        if i == len(uses):
            return None
        pos = uses[i]
        return pos, self._before[pos] - self._before[max(after + 1, 0)]


class ParamGatherer:
    """Gathers and frees stage-3 parameter units from module hooks. ``comm`` and
    ``replicas`` as for :class:`WholeParams`."""

    def __init__(
        self,
        flat: FlatParams,
        comm: Comm,
        replicas: Comm,
        module: nn.Module,
        *,
        persistent: Iterable[int],
        prefetch_numel: int,
        max_live_numel: int,
        max_reuse_numel: int = 0,
        leaves: Iterable[nn.Module] = (),
        check_every_pass: bool = False,
        expert_comm: Comm | None = None,
        expert_replicas: Comm | None = None,
    ) -> None:
        self.flat, self.comm, self.replicas = flat, comm, replicas
        # units of expert parameters (kind 1) are gathered over the expert shard group
        self.expert_comm = expert_comm or comm
        self.expert_replicas = expert_replicas or replicas
        # passes whose gathers are checked for agreement (first forward and backward)
        self._check_every, self._check_left = check_every_pass, 2
        self._unit_name = ["(no module)"] * len(flat.layout.segments)  # for errors
        self.persistent = set(persistent)
        self.prefetch_numel, self.max_live_numel = prefetch_numel, max_live_numel
        self.max_reuse_numel = max_reuse_numel
        layout = flat.layout
        self._numel = [seg.numel for seg in layout.segments]
        self._placeholder = torch.empty(0, dtype=flat.dtype, device=flat.device)
        self.unit_buffers = [
            torch.empty(seg.numel, dtype=flat.dtype, device=flat.device) for seg in layout.segments
        ]
        self._views: list[torch.Tensor] = []
        for pi, p in enumerate(flat.params):
            lo, hi = layout.param_range(pi)
            seg = layout.segments[layout.param_segment[pi]]
            unit = self.unit_buffers[seg.index]
            self._views.append(unit[lo - seg.start : hi - seg.start].view_as(p))
        self._handles: dict[int, Handle] = {}
        self._reads: dict[int, torch.Tensor] = {}  # NVMe: pool buffers under an all-gather
        self._gathered: set[int] = set()
        self._users = [0] * len(layout.segments)
        # prefetched and not yet asked for, in launch order: the only units freed to make
        # room under the cap (every other live unit is needed: see the module docstring)
        self._speculative: dict[int, None] = {}
        # kept for reuse after their forward: unit -> position of its next use in the
        # recorded trace (_Trace.next_use); not needed, so freed to make room under the cap
        self._kept: dict[int, int] = {}
        #: gathered elements of non-persistent units right now (in flight included)
        self.live_numel = 0
        self.reset_stats()
        self._fwd_order: list[int] | None = None
        self._bwd_order: list[int] | None = None
        self._recording_fwd: list[int] = []
        self._recording_bwd: list[int] = []
        self._cursor = -1  # position in the recorded order reached by the running pass
        self._trace: _Trace | None = None  # both orders joined, once both are recorded
        self._root = module
        self.in_backward = False
        for s in range(len(layout.segments)):
            if s not in self.persistent:
                self._free(s)
        self.refresh_persistent()
        # module -> units of the parameters it owns directly (shared parameters included),
        # plus units of parameters it was seen using from other modules (see _on_access)
        self._segment_of = {id(p): layout.param_segment[pi] for pi, p in enumerate(flat.params)}
        self.units_of: dict[nn.Module, tuple[int, ...]] = {}
        self._stack: list[nn.Module] = []  # modules whose forward is running
        self._hooks: list = []
        self._leaves = list(leaves)
        self._install_hooks(regions=())
        self._synced = comm.world_size > 1  # see the module docstring: synced generate()
        for m in module.modules():
            if self._synced and not hasattr(m, "_is_fsdp_managed_module"):
                m._is_fsdp_managed_module = True  # type: ignore[assignment]
        names: dict[int, str] = {}
        for name, p in module.named_parameters():
            names.setdefault(id(p), name)
        for pi, p in enumerate(flat.params):
            guard(p, names.get(id(p), f"parameter {pi}"), flat.shapes[pi])
            set_gathered(p, self.flat.layout.param_segment[pi] in self._gathered)
        # persistent parameters are whole on every rank: edits outside forward reach the
        # shards and masters as at stages 0-2 (zero/params/edits.py)
        kept = [pi for s in sorted(self.persistent) for pi in layout.segments[s].params]
        self.edits = WholeEdits(
            [flat.params[pi] for pi in kept],
            [self._views[pi] for pi in kept],
            [names.get(id(flat.params[pi]), f"parameter {pi}") for pi in kept],
        )

    def _install_hooks(self, regions: Iterable[nn.Module]) -> None:
        """(Re)install the forward hooks: one pair on each module outside the leaves and
        ``regions``; a leaf or region gathers all its descendants' units at once. Inside a
        region, ``_parameters`` are plain dicts (no access tracking), so its forward has
        no Python of ours in it (``torch.compile`` traces it: :meth:`set_regions`)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        regions = list(regions)
        whole = _outermost([*self._leaves, *regions])
        inside = {id(d) for m in whole for d in m.modules() if d is not m}
        plain = {id(d) for r in regions for d in r.modules()}
        whole_ids = {id(m) for m in whole}
        self.units_of.clear()
        for name, m in reversed(list(self._root.named_modules())):
            owned = m.parameters(recurse=id(m) in whole_ids)
            units = {self._segment_of[id(p)] for p in owned if id(p) in self._segment_of}
            for s in units:
                self._unit_name[s] = name or "(the root module)"
            tracked = isinstance(m._parameters, AccessTrackingDict)
            if id(m) in plain and tracked:
                m._parameters = dict(m._parameters)
                # dynamo takes the marker for FSDP1's (graph break); generate() reads it
                # on the model only, never inside a region
                m.__dict__.pop("_is_fsdp_managed_module", None)
            elif id(m) not in plain and not tracked:
                m._parameters = AccessTrackingDict(m._parameters, self._on_access)
            if id(m) in inside:  # gathered with its leaf or region; no hooks of its own
                continue
            self.units_of[m] = tuple(sorted(units - self.persistent))
            self._hooks.append(m.register_forward_pre_hook(self._pre_forward))
            self._hooks.append(m.register_forward_hook(self._post_forward))

    def set_regions(self, regions: Iterable[nn.Module]) -> None:
        """Gather each of ``regions`` (modules whose forward ``engine.compile`` compiles)
        as a whole, with the hooks outside it; between steps only. The recorded orders
        start over (the units are asked for in another grouping now), and the next
        forward and backward check agreement again."""
        if self._stack or self.in_backward:
            raise UsageError("compile regions can change between steps only")
        self.free_all()
        self._install_hooks(regions)
        self._fwd_order = self._bwd_order = self._trace = None
        self._recording_fwd, self._recording_bwd = [], []
        self._check_left = 2

    def compile_regions(self, module: nn.Module) -> list[nn.Module]:
        """``engine.compile``: the regions to compile (``compiling.py``), each now
        gathered whole with the hooks outside it."""
        regions = find_regions(module, whole=self._leaves)
        self.set_regions(regions)
        return regions

    # -- instrumentation --------------------------------------------------------------
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

    # -- gather / free ----------------------------------------------------------------
    def _is_live(self, s: int) -> bool:
        return s in self._gathered or s in self._handles

    def _launch(self, s: int, *, prefetch: bool = False) -> None:
        if s in self._gathered or s in self._handles:
            return
        if self.comm.world_size > 1 and (self._check_every or self._check_left > 0):
            self._agree(s)
        store = self.flat.store
        chunk = store.lend(s)  # a view in memory, or a pool buffer read from NVMe
        while chunk is None:  # every pool buffer is under an all-gather in flight
            if prefetch:  # (same decision on every rank: counts, not timing)
                return
            self._wait(next(o for o in self._handles if o in self._reads))
            chunk = store.lend(s)
        self._reads[s] = chunk
        buf = self.unit_buffers[s]
        nbytes = buf.numel() * buf.element_size()
        if buf.untyped_storage().nbytes() != nbytes:  # a same-size resize_ reallocates
            buf.untyped_storage().resize_(nbytes)
        with torch.autograd._unsafe_preserve_version_counter(buf):
            # uploaded as stored (an fp32 master shard on the host), cast on the device
            chunk = chunk.to(buf.device, non_blocking=True).to(buf.dtype)
            comm = self.expert_comm if self.flat.layout.segments[s].kind else self.comm
            self._handles[s] = comm.all_gather(buf, chunk, async_op=True)
        if s not in self.persistent:
            self.live_numel += self._numel[s]
            self.peak_live_numel = max(self.peak_live_numel, self.live_numel)
            self.gathers += 1
            if prefetch:
                self._speculative[s] = None
                self.prefetched += 1

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
            f"{self._unit_name[s]!r}, another rank those of {self._unit_name[other]!r}. "
            "The model ran different modules on different ranks (data-dependent control "
            "flow: routing, early exit). Mark the module whose inside varies as a leaf, "
            "gathered whole on every rank: zeroshard.utils.set_z3_leaf_modules(model, "
            "[TheModuleClass]) before initialize, or the config's "
            'zero_optimization.leaf_module {"classes": [...]}; for an MoE, its MoE block'
        )

    def _wait(self, s: int) -> None:
        handle = self._handles.pop(s, None)
        if handle is not None:
            with torch.autograd._unsafe_preserve_version_counter(self.unit_buffers[s]):
                handle.wait()
        read = self._reads.pop(s, None)
        if read is not None:  # the all-gather has consumed it
            self.flat.store.give_back(read)
        if s not in self._gathered:
            self._gathered.add(s)
            for pi in self.flat.layout.segments[s].params:
                p = self.flat.params[pi]
                set_gathered(p, True)  # first: a released parameter refuses a new .data
                p.data = self._views[pi]

    def gather(self, s: int) -> None:
        """Gather unit ``s`` on demand (see :meth:`_gather_now`)."""
        self._gather_now((s,))

    def _gather_now(self, units: Iterable[int]) -> None:
        """Gather ``units`` now, whatever the cap; first free kept units (the furthest next
        use first), then speculative ones, while the live count would exceed it."""
        units = [s for s in dict.fromkeys(units) if s not in self.persistent]
        for s in units:
            if s in self._speculative:  # a prefetch issued it already: now it is needed
                del self._speculative[s]
                self.prefetch_hits += 1
            elif s in self._kept:  # kept since its forward: no all-gather
                del self._kept[s]
                self.reused += 1
        need = sum(self._numel[s] for s in units if not self._is_live(s))
        while self.live_numel + need > self.max_live_numel and not self._make_room(need):
            if not self._speculative:
                break
            self._free(next(reversed(self._speculative)))  # the furthest ahead
            self.evicted += 1
        for s in units:
            self._launch(s)
        for s in units:
            self._wait(s)

    def _free(self, s: int) -> None:
        if s in self._handles:
            self._wait(s)
        if s in self._gathered:
            self._gathered.discard(s)
            if s not in self.persistent:
                self.live_numel -= self._numel[s]
        self._speculative.pop(s, None)
        self._kept.pop(s, None)
        for pi in self.flat.layout.segments[s].params:
            p = self.flat.params[pi]
            p.data = self._placeholder
            set_gathered(p, False)
        self.unit_buffers[s].untyped_storage().resize_(0)

    def free_if_idle(self, s: int) -> None:
        """Free unit ``s`` unless it is persistent or still in use by a running forward."""
        if s not in self.persistent and self._users[s] == 0 and self._is_live(s):
            self._free(s)

    def free_all(self) -> None:
        for s in list(self._gathered | set(self._handles)):
            self._users[s] = 0
            self.free_if_idle(s)

    def _release_speculative(self) -> None:
        for s in list(self._speculative):
            self._free(s)

    def _make_room(self, need: int, before: int = -1) -> bool:
        """Free kept units whose next use comes after position ``before`` of the trace,
        the furthest first, until ``need`` more elements fit under the cap; whether
        they do."""
        while self.live_numel + need > self.max_live_numel:
            s = max(self._kept, key=self._kept.__getitem__, default=None)
            if s is None or self._kept[s] <= before:
                return False
            self._free(s)
            self.evicted += 1
        return True

    def _keeping(self) -> bool:
        """Whether units are kept after their forward (see the module docstring)."""
        return (
            self.max_reuse_numel > 0
            and self._trace is not None
            and not self.in_backward
            and torch.is_grad_enabled()
        )

    def _keep(self, s: int) -> bool:
        """After its forward, keep unit ``s`` gathered if its next use along the trace
        comes within ``max_reuse_numel`` elements of units gathered in between (counted
        from the furthest unit this forward has used); whether it was taken."""
        if s in self.persistent or self._users[s] or not self._is_live(s):
            return False
        assert self._trace is not None  # only called when _keeping()
        nxt = self._trace.next_use(s, self._cursor)
        if nxt is None or nxt[1] >= self.max_reuse_numel:
            return False
        self._kept[s] = nxt[0]
        self.kept += 1
        self._make_room(0)  # it was needed until now: over the cap, kept units go
        return True

    def release_kept(self) -> None:
        """Free every unit kept for reuse (after a step: the shards have changed)."""
        for s in list(self._kept):
            self._free(s)

    def refresh_persistent(self) -> None:
        """All-gather the persistent segments (at start-up and after each optimizer step)."""
        for s in self.persistent:
            self._gathered.discard(s)
            self._launch(s)
        for s in self.persistent:
            self._wait(s)

    def _advance(self, order: list[int] | None, used: Iterable[int]) -> None:
        """Move the cursor to the furthest of ``used`` in this pass's recorded order."""
        if order:
            self._cursor = max([self._cursor, *(order.index(s) for s in used if s in order)])

    def _prefetch(self, order: list[int] | None, offset: int) -> None:
        """Start gathering the units that follow the cursor in ``order`` (which starts at
        position ``offset`` of the trace), within the prefetch budget and the
        live-parameter cap; kept units used later than a prefetched one make room."""
        if not order or self.prefetch_numel <= 0:
            return
        budget = self.prefetch_numel
        for i in range(self._cursor + 1, len(order)):
            s = order[i]
            if budget < self._numel[s]:
                break
            budget -= self._numel[s]  # units already on their way count toward the window
            if self._is_live(s):
                continue
            if not self._make_room(self._numel[s], before=offset + i):
                break
            self._launch(s, prefetch=True)

    # -- hooks --------------------------------------------------------------------------
    def _on_access(self, param: torch.Tensor) -> None:
        """A parameter read through ``module.name`` while some forward runs: if it is not
        the running module's own, gather its unit and remember it as one the running
        module uses (gathered up front next time, and again for its backward)."""
        if not self._stack:
            return
        s = self._segment_of.get(id(param))
        if s is None or s in self.persistent:
            return
        top = self._stack[-1]
        if s not in self.units_of[top]:
            self.units_of[top] = (*self.units_of[top], s)
            self._users[s] += 1
        self._gather_now((s,))

    def _pre_forward(self, module: nn.Module, args) -> None:
        if module is self._root and not self.in_backward:
            self._cursor = -1  # a new forward pass
        self._stack.append(module)
        units = self.units_of[module]
        recording = (
            self._recording_fwd if self._fwd_order is None and not self.in_backward else None
        )
        for s in units:
            self._users[s] += 1
            if recording is not None and s not in recording:
                recording.append(s)
        self._gather_now(units)
        if units and not self.in_backward:
            self._advance(self._fwd_order, units)
            self._prefetch(self._fwd_order, 0)

    def _post_forward(self, module: nn.Module, args, output):
        if self._stack and self._stack[-1] is module:
            self._stack.pop()
        units = self.units_of[module]
        keeping = self._keeping()
        for s in units:
            self._users[s] -= 1
            if not self.in_backward and not (keeping and self._keep(s)):
                self.free_if_idle(s)
        if module is self._root and not self.in_backward:
            self._release_speculative()  # prefetched for this forward but never used
            self._check_left = min(self._check_left, 1)  # the first forward is checked
        if units and torch.is_grad_enabled() and not self.in_backward:
            return wrap_outputs(output, self, units)
        return output

    def gather_for_backward(self, units: tuple[int, ...]) -> None:
        recording = self._recording_bwd if self._bwd_order is None else None
        if recording is not None:
            recording.extend(s for s in units if s not in recording)
        self._gather_now(units)
        self._advance(self._bwd_order, units)
        offset = self._trace.fwd_len if self._trace is not None else 0
        self._prefetch(self._bwd_order, offset)

    def begin_backward(self) -> None:
        self.in_backward = True
        self._cursor = -1
        if self._fwd_order is None and self._recording_fwd:
            self._fwd_order = self._recording_fwd

    def end_backward(self) -> None:
        self.in_backward = False
        self._check_left = 0  # the first forward and backward are checked
        if self._bwd_order is None and self._recording_bwd:
            self._bwd_order = self._recording_bwd
        if self._trace is None and self._fwd_order and self._bwd_order:
            self._trace = _Trace(self._fwd_order, self._bwd_order, self._numel)
        self.free_all()  # kept units included

    def settle(self) -> None:
        """Nothing is gathered across calls here (stage 3 gathers within forward)."""

    def after_step(self) -> None:
        self.release_kept()  # (a forward without a backward before the step kept them)
        self.refresh_persistent()
        self.edits.mark_clean()

    def mark_clean(self) -> None:
        """The persistent parameters and the shards agree now (partitioned ones refuse
        edits while released, and ``GatheredParameters(modifier_rank=...)`` writes edits
        into the shards)."""
        self.edits.mark_clean()

    def edited(self) -> bool:
        return self.edits.pending()

    def take_edits(self) -> list[int]:
        """Write the persistent parameters changed since :meth:`mark_clean` into this
        rank's shard; the segments written (their masters take them)."""
        touched = self.edits.take()
        segs = sorted({self._segment_of[id(self.edits.params[i])] for i in touched})
        for s in segs:
            self._write_back(s)
        return segs

    def _write_back(self, s: int) -> None:
        """This rank's chunk of unit ``s``'s buffer into its shard (the elements that
        differ: ``zero/params/edits.py``)."""
        seg, rank = self.flat.layout.segments[s], self.flat.rank
        chunk = self.flat.store.chunk(s)  # a view in memory, a copy from NVMe
        lo = seg.owner(rank) * seg.chunk
        take_edits(chunk, self.unit_buffers[s][lo : lo + seg.chunk])
        self.flat.store.write_chunk(s, chunk)

    def open(self, params: list[torch.Tensor]) -> None:
        """Gather the units holding ``params`` and keep them until :meth:`close`."""
        segs = segments_of(self.flat, params)
        for s in segs:
            self._users[s] += 1
        self._gather_now(segs)

    def close(self, params: list[torch.Tensor], modifier_rank: int | None) -> list[int]:
        """Optionally take ``modifier_rank``'s values into every shard; free the units."""
        segs = segments_of(self.flat, params)
        if modifier_rank is not None:
            index = {id(p): pi for pi, p in enumerate(self.flat.params)}
            for p in params:
                pi = index.get(id(p))
                if pi is not None and moved(p, self._views[pi]):  # p.data = t inside
                    view_again(p, self._views[pi], p.__dict__.get("_zs_name", "?"))
                group, src = replica_source(p, modifier_rank, self.replicas, self.expert_replicas)
                group.broadcast(p.detach(), src=src)
            for s in segs:
                self._write_back(s)
        for s in segs:
            self._users[s] -= 1
            self.free_if_idle(s)
        return segs if modifier_rank is not None else []

    def remove(self) -> None:
        """Teardown: remove every hook and give each parameter its whole value back, one
        unit at a time (one all-gather per unit), as plain tensors the module owns."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for m in self._root.modules():
            if isinstance(m._parameters, AccessTrackingDict):
                m._parameters = dict(m._parameters)
            if self._synced and getattr(m, "_is_fsdp_managed_module", False):
                del m._is_fsdp_managed_module
        for p in self.flat.params:
            unguard(p)
        self.free_all()
        for s in range(len(self.unit_buffers)):
            self._gather_now((s,))  # persistent units are whole already
            seg = self.flat.layout.segments[s]
            whole = [self._views[pi].detach().clone() for pi in seg.params]
            if s not in self.persistent:
                self._free(s)
            for pi, value in zip(seg.params, whole, strict=True):
                self.flat.params[pi].data = value
        self.unit_buffers = []

    def buffers(self) -> list[torch.Tensor]:
        """The shard (unless swapped to NVMe) plus the always-gathered persistent segments."""
        return [*self.flat.store.buffers(), *(self.unit_buffers[s] for s in self.persistent)]
