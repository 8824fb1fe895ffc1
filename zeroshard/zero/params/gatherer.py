"""Stage 3: parameters live as shards and are gathered per unit around their use
(:class:`ParamGatherer`; stages 0-2 keep them whole: ``whole.py``). This module decides
*when* a unit is gathered and released, from module hooks (``wiring.py`` places them);
``units.py`` does it (and holds the live-parameter cap), ``schedule.py`` records the
order it plans with, and ``states.py`` names the states and their legal moves (the
phase of the passes, and each unit's).

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
* fp8 all-gather (``fp8.enable_fsdp_float8_all_gather``): units with a codec
  (``codec.py``, one fp8 Linear weight each) travel as 1 byte per element, plus one
  all-reduce (max) of a float32 amax per gather, in forward and backward alike.
* ``GatheredParameters``: all-gathers the units holding its parameters; with
  ``modifier_rank``, one broadcast per parameter over ``replicas`` when it closes.

Reuse (``stage3_max_reuse_distance``, DeepSpeed's semantics): at a module's
post-forward, with grad enabled, a unit of its that no running forward still uses is
*kept* gathered instead of freed if its next use along the recorded trace comes within
that many gathered elements (``schedule.py`` says how it is measured, and what the
default means: a model under about 5e8 parameters stays gathered from its forward
through its backward, so stage 3 moves 4Ψ + 4Ψ instead of 3 x 4Ψ). 0 frees every unit
after its forward. Units still kept are freed when backward ends, and after an
optimizer step (a forward without a backward, then a step: the shards changed). A
forward under ``no_grad`` (evaluation) keeps nothing, and what it finds kept it frees
after use. How kept and prefetched units yield to ``stage3_max_live_parameters``:
``units.py``. :meth:`ParamGatherer.stats` gives the live count, its peak since
:meth:`ParamGatherer.reset_stats`, and counters of the gathers issued, prefetched,
prefetches used, units evicted, units kept for reuse and requests they served.

A released parameter answers its metadata for the whole parameter and refuses every
other torch op, its ``.data`` included (``hooks.RELEASED_READS``), naming itself and
``GatheredParameters``, instead of computing on the placeholder. Persistent parameters
are whole on every rank: edits made to them outside forward are written into this
rank's shard when the next step starts (``zero/params/edits.py``), as at stages 0-2.

Agreement: ranks must gather the same units in the same order; the first forward and
backward check it (``units.py``: an error naming both modules and the remedy, a leaf
module, instead of gloo aborting or NCCL hanging).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from zeroshard import NotBuiltError, UsageError
from zeroshard.distributed.comm import Comm
from zeroshard.zero.layout.flat import FlatParams
from zeroshard.zero.params import states
from zeroshard.zero.params.codec import UnitCodec
from zeroshard.zero.params.edits import WholeEdits, moved, view_again
from zeroshard.zero.params.hooks import guard, set_gathered, unguard
from zeroshard.zero.params.regions import find_regions
from zeroshard.zero.params.schedule import Schedule
from zeroshard.zero.params.states import Event, Phase, UnitState
from zeroshard.zero.params.units import Units
from zeroshard.zero.params.whole import replica_source, segments_of
from zeroshard.zero.params.wiring import ModuleWiring, wrap_outputs

E = Event


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
        codecs: Mapping[int, UnitCodec] | None = None,
    ) -> None:
        self.flat, self.comm, self.replicas = flat, comm, replicas
        # units of expert parameters (kind 1) are gathered over the expert shard group,
        # and GatheredParameters broadcasts their edits over the expert replicas
        self.expert_replicas = expert_replicas or replicas
        self.units = Units(
            flat,
            comm,
            persistent,
            max_live_numel=max_live_numel,
            check_every_pass=check_every_pass,
            expert_comm=expert_comm,
            codecs=codecs,
        )
        self.persistent = self.units.persistent
        self.prefetch_numel, self.max_reuse_numel = prefetch_numel, max_reuse_numel
        self.phase = Phase.IDLE
        self._schedule = Schedule(self.units.numel)
        self._root = module
        for s in range(len(flat.layout.segments)):
            if s not in self.persistent:
                self.units.free(s)
        self.units.refresh_persistent()
        layout = flat.layout
        self._segment_of = {id(p): layout.param_segment[pi] for pi, p in enumerate(flat.params)}
        self._stack: list[nn.Module] = []  # modules whose forward is running
        self._wiring = ModuleWiring(
            module,
            leaves,
            self._segment_of,
            self.persistent,
            self.units.names,
            pre_forward=self._pre_forward,
            post_forward=self._post_forward,
            on_access=self._on_access,
            synced=comm.world_size > 1,
        )
        # module -> units of the parameters it owns directly (shared parameters included),
        # plus units of parameters it was seen using from other modules (see _on_access)
        self.units_of = self._wiring.units_of
        names: dict[int, str] = {}
        for name, p in module.named_parameters():
            names.setdefault(id(p), name)
        for pi, p in enumerate(flat.params):
            guard(p, names.get(id(p), f"parameter {pi}"), flat.shapes[pi])
            s = layout.param_segment[pi]
            set_gathered(p, self.units.state[s] is UnitState.PERSISTENT)
        # persistent parameters are whole on every rank: edits outside forward reach the
        # shards and masters as at stages 0-2 (zero/params/edits.py)
        kept = [pi for s in sorted(self.persistent) for pi in layout.segments[s].params]
        self.edits = WholeEdits(
            [flat.params[pi] for pi in kept],
            [self.units.views[pi] for pi in kept],
            [names.get(id(flat.params[pi]), f"parameter {pi}") for pi in kept],
        )

    def _to(self, event: Event) -> Phase:
        """The passes' phase takes ``event`` (``states.PHASE``); the new phase."""
        self.phase = states.step("phase", (self.phase, event))
        return self.phase

    def set_regions(self, regions: Iterable[nn.Module]) -> None:
        """Gather each of ``regions`` (modules whose forward ``engine.compile`` compiles)
        as a whole, with the hooks outside it; between steps only. The recorded orders
        start over (the units are asked for in another grouping now), and the next
        forward and backward check agreement again."""
        if self._stack or self.phase is Phase.BACKWARD:
            raise UsageError("compile regions can change between steps only")
        self.units.free_all()
        self._wiring.install(regions)
        self._schedule.restart()
        self.units.checking = True

    def compile_regions(self, module: nn.Module) -> list[nn.Module]:
        """``engine.compile``: the regions to compile (``compiling.py``), each now
        gathered whole with the hooks outside it."""
        if self.units.codecs:
            raise NotBuiltError(
                "engine.compile() with fp8.enable_fsdp_float8_all_gather is not built yet "
                "(the compiled regions would trace weights gathered in fp8, whose values the "
                "parameters refuse); compile without it (weights gathered in bf16)"
            )
        regions = find_regions(module, whole=self._wiring.leaves)
        self.set_regions(regions)
        return regions

    # -- instrumentation (units.py keeps the counters) ----------------------------------
    def reset_stats(self) -> None:
        """Restart the counters; the peak restarts from what is live now."""
        self.units.reset_stats()

    def stats(self) -> dict[str, int]:
        """The live count, its peak and the counters (``Units.reset_stats`` says each)."""
        return self.units.stats()

    def kept_units(self) -> list[int]:
        """The units kept gathered for reuse right now."""
        return self.units.in_state(UnitState.KEPT)

    # -- the policy: prefetch and keep --------------------------------------------------
    def _keeping(self) -> bool:
        """Whether units are kept after their forward (see the module docstring)."""
        return (
            self.max_reuse_numel > 0
            and self._schedule.trace is not None
            and self.phase is not Phase.BACKWARD
            and torch.is_grad_enabled()
        )

    def _keep(self, s: int) -> bool:
        """After its forward, keep unit ``s`` gathered if its next use along the trace
        comes within ``max_reuse_numel`` elements of units gathered in between (counted
        from the furthest unit this forward has used); whether it was taken."""
        units = self.units
        if s in self.persistent or units.users[s] or not units.is_live(s):
            return False
        nxt = self._schedule.next_use(s)
        if nxt is None or nxt[1] >= self.max_reuse_numel:
            return False
        units.keep(s, nxt[0])
        return True

    def _prefetch(self, backward: bool) -> None:
        """Start gathering the units that follow the cursor in this pass's order, within
        the prefetch budget and the live-parameter cap; kept units used later than a
        prefetched one make room."""
        if self.prefetch_numel <= 0:
            return
        units, budget = self.units, self.prefetch_numel
        for s, pos in self._schedule.ahead(backward):
            if budget < units.numel[s]:
                break
            budget -= units.numel[s]  # units already on their way count toward the window
            if units.is_live(s):
                continue
            if not units.make_room(units.numel[s], before=pos):
                break
            units.launch(s, E.PREFETCH)

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
            self.units.users[s] += 1
        self.units.gather((s,))

    def _pre_forward(self, module: nn.Module, args) -> None:
        # the root's forward starts a pass (inside backward: a recomputation)
        if module is self._root and self._to(E.FORWARD_START) is Phase.FORWARD:
            self._schedule.start_pass()
        self._stack.append(module)
        units = self.units_of[module]
        backward = self.phase is Phase.BACKWARD
        for s in units:
            self.units.users[s] += 1
        if not backward:
            self._schedule.record(units, backward=False)
        self.units.gather(units)
        if units and not backward:
            self._schedule.advance(units, backward=False)
            self._prefetch(backward=False)

    def _post_forward(self, module: nn.Module, args, output):
        if self._stack and self._stack[-1] is module:
            self._stack.pop()
        units = self.units_of[module]
        backward = self.phase is Phase.BACKWARD
        keeping = self._keeping()
        for s in units:
            self.units.users[s] -= 1
            if not backward and not (keeping and self._keep(s)):
                self.units.free_if_idle(s)
        if module is self._root and self._to(E.FORWARD_END) is Phase.IDLE:
            self.units.release_speculative()  # prefetched for this forward but never used
        if units and torch.is_grad_enabled() and not backward:
            return wrap_outputs(output, self.gather_for_backward, units)
        return output

    def gather_for_backward(self, units: tuple[int, ...]) -> None:
        """Before a module's backward (``wiring.PreBackward``): gather its units."""
        self._schedule.record(units, backward=True)
        self.units.gather(units)
        self._schedule.advance(units, backward=True)
        self._prefetch(backward=True)

    def free_if_idle(self, s: int) -> None:
        """Free unit ``s`` unless it is persistent or in use (the gradient reducer calls
        this once the unit's gradients are in)."""
        self.units.free_if_idle(s)

    # -- what the engine calls (zero/params/manager.py) ---------------------------------
    def begin_backward(self) -> None:
        self._to(E.BACKWARD_START)
        self._schedule.start_backward()

    def end_backward(self) -> None:
        self._to(E.BACKWARD_END)
        self.units.checking = False  # the first forward and backward are checked
        self._schedule.end_backward()
        self.units.free_all()  # kept units included

    def settle(self) -> None:
        """Nothing is gathered across calls here (stage 3 gathers within forward)."""

    def after_step(self) -> None:
        self.units.release_kept()  # (a forward without a backward before the step kept them)
        self.units.refresh_persistent()
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
            self.units.write_back(s)
        return segs

    def open(self, params: list[torch.Tensor]) -> None:
        """Gather the units holding ``params`` and keep them until :meth:`close`."""
        segs = segments_of(self.flat, params)
        for s in segs:
            self.units.users[s] += 1
        try:
            self.units.gather(segs, values=True)
        except UsageError:  # refused before any gather (units.py): the uses are dropped
            for s in segs:
                self.units.users[s] -= 1
            raise

    def close(self, params: list[torch.Tensor], modifier_rank: int | None) -> list[int]:
        """Optionally take ``modifier_rank``'s values into every shard; free the units."""
        segs = segments_of(self.flat, params)
        if modifier_rank is not None:
            index = {id(p): pi for pi, p in enumerate(self.flat.params)}
            views = self.units.views
            for p in params:
                pi = index.get(id(p))
                if pi is not None and moved(p, views[pi]):  # p.data = t inside
                    view_again(p, views[pi], p.__dict__.get("_zs_name", "?"))
                group, src = replica_source(p, modifier_rank, self.replicas, self.expert_replicas)
                group.broadcast(p.detach(), src=src)
            for s in segs:
                self.units.write_back(s)
        for s in segs:
            self.units.users[s] -= 1
            self.units.free_if_idle(s)
        return segs if modifier_rank is not None else []

    def remove(self) -> None:
        """Teardown: remove every hook and give each parameter its whole value back, one
        unit at a time (one all-gather per unit), as plain tensors the module owns."""
        self._wiring.remove()
        for p in self.flat.params:
            unguard(p)
        self.units.detach()

    def buffers(self) -> list[torch.Tensor]:
        """The shard (unless swapped to NVMe) plus the always-gathered persistent segments."""
        return [*self.flat.store.buffers(), *(self.units.buffers[s] for s in self.persistent)]
