"""Stages 0-2: parameters are whole on every rank, views of the flat buffer.

Communication: when optimizer state is sharded (stages 1-2), each rank's updated chunks
are all-gathered after the step over the ZeRO shard group, one all-gather per segment
(the full parameter bytes, Ψ); ``GatheredParameters(..., modifier_rank=r)`` broadcasts
each given parameter over the ``replicas`` group when it closes.

With ``zero_optimization.overlap_param_gather`` (Megatron's name for the same idea) the
all-gathers are started at the end of ``step()`` and not waited for there: a forward
pre-hook on each module waits only for the segments holding that module's parameters,
so the gathers of later layers run while earlier layers compute. Every other engine call
(backward, step, checkpoints, ``GatheredParameters``, ``destroy``) waits for all of them
first; code that reads parameters outside the engine in between must call
``engine.wait_param_gather()``. Under ``engine.compile`` the hooks sit on the compiled
regions (``compiling.py``), each waiting for all of its segments.

Parameters changed outside the engine between steps (``p.clamp_()``, ``p.data.clamp_()``,
``p.data = t``, ``load_state_dict``) are found when the next step starts and the masters
take them (``zero/params/edits.py``).
"""

from __future__ import annotations

import torch

from zeroshard.distributed.comm import Comm, Handle
from zeroshard.moe.marks import is_expert
from zeroshard.zero.layout.flat import FlatParams
from zeroshard.zero.params.edits import WholeEdits, unwatch, watch
from zeroshard.zero.params.regions import find_regions


def replica_source(
    p: torch.Tensor, modifier_rank: int, replicas: Comm, expert_replicas: Comm
) -> tuple[Comm, int]:
    """The group a ``GatheredParameters(modifier_rank=...)`` edit of ``p`` is broadcast
    over, and the source's rank in it: an expert parameter's over the ranks holding the
    same experts, from the modifier's peer there (the rank of its expert-data-parallel
    coordinate; expert-parallel ranks are adjacent in ``replicas``' order)."""
    if expert_replicas is replicas or not is_expert(p):
        return replicas, modifier_rank
    ep = replicas.world_size // expert_replicas.world_size
    return expert_replicas, modifier_rank // ep


def segments_of(flat: FlatParams, params: list[torch.Tensor]) -> list[int]:
    """The segments holding ``params`` (others ignored), in order."""
    index = {id(p): pi for pi, p in enumerate(flat.params)}
    return sorted({flat.layout.param_segment[index[id(p)]] for p in params if id(p) in index})


class WholeParams:
    """Stages 0-2: every rank holds every parameter (views of ``flat.full``).

    ``comm`` is the group the layout is sharded over (the updated chunks are all-gathered
    in it); ``replicas`` spans every rank holding these parameters (``GatheredParameters``
    broadcasts a modifier's values over it, ``modifier_rank`` being a rank in it).
    ``expert_comm`` and ``expert_replicas`` are the same for the segments of expert
    parameters (kind 1; None: as the others)."""

    def __init__(
        self,
        flat: FlatParams,
        comm: Comm,
        replicas: Comm,
        module: torch.nn.Module | None = None,
        overlap: bool = False,
        expert_comm: Comm | None = None,
        expert_replicas: Comm | None = None,
    ) -> None:
        self.flat, self.comm, self.replicas = flat, comm, replicas
        self.expert_comm = expert_comm or comm
        self.expert_replicas = expert_replicas or replicas
        self._pending: dict[int, Handle] = {}  # segment -> all-gather in flight
        self._hooks: list = []
        names: dict[int, str] = {}
        for name, p in module.named_parameters() if module is not None else ():
            names.setdefault(id(p), name)
        views = []
        for pi, p in enumerate(flat.params):
            lo, hi = flat.layout.param_range(pi)
            views.append(self._full()[lo:hi].view(flat.shapes[pi]))
            watch(p)
        self.edits = WholeEdits(
            flat.params,
            views,
            [names.get(id(p), f"parameter {i}") for i, p in enumerate(flat.params)],
        )
        self._module = module
        self._overlap = overlap and module is not None and flat.partitioned
        if self._overlap:
            assert module is not None
            self._hook([(m, False) for m in module.modules()])
        self.mark_clean()

    def _hook(self, modules: list[tuple[torch.nn.Module, bool]]) -> None:
        """A pre-forward hook on each module (with its descendants' parameters when the
        flag says so) that waits for the all-gathers of its segments."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        flat = self.flat
        index = {id(p): pi for pi, p in enumerate(flat.params)}
        for m, recurse in modules:
            segs = sorted(
                {
                    flat.layout.param_segment[index[id(p)]]
                    for p in m.parameters(recurse=recurse)
                    if id(p) in index
                }
            )
            if segs:
                self._hooks.append(m.register_forward_pre_hook(self._forward_hook(segs)))

    def compile_regions(self, module: torch.nn.Module) -> list[torch.nn.Module] | None:
        """``engine.compile``: None (compile the whole module) unless forward waits for
        the all-gathers layer by layer (``overlap_param_gather``): then the regions of
        ``compiling.py``, each waiting for all its segments before its compiled forward."""
        if not self._overlap:
            return None
        regions = find_regions(module)
        inside = {id(d) for r in regions for d in r.modules()}
        outside = [(m, False) for m in module.modules() if id(m) not in inside]
        self._hook([(r, True) for r in regions] + outside)
        return regions

    def _forward_hook(self, segments: list[int]):
        def wait_for_mine(module, args) -> None:
            if self._pending:
                for seg in segments:
                    handle = self._pending.pop(seg, None)
                    if handle is not None:
                        handle.wait()

        return wait_for_mine

    def settle(self) -> None:
        """Wait for every all-gather still in flight (overlap_param_gather)."""
        if self._pending:
            pending, self._pending = self._pending, {}
            for handle in pending.values():
                handle.wait()

    def mark_clean(self) -> None:
        """The parameters and the masters agree now."""
        self.edits.mark_clean()

    def edited(self) -> bool:
        """Whether a parameter may have been changed since :meth:`mark_clean` (e.g. a
        ``clamp_()`` after ``step()``: ``zero/params/edits.py``)."""
        self.settle()
        return self.edits.pending()

    def take_edits(self) -> list[int]:
        """The segments whose parameters may have been changed since :meth:`mark_clean`
        (the masters take them); clean again."""
        self.settle()
        touched = self.edits.take()
        return sorted({self.flat.layout.param_segment[i] for i in touched})

    def after_step(self) -> None:
        """Re-assemble whole parameters from every rank's updated chunks."""
        flat = self.flat
        if not flat.partitioned:
            self.mark_clean()
            return
        self.settle()
        chunks = flat.chunks
        assert chunks is not None  # partitioned: every rank owns its chunks
        handles = {
            seg.index: (self.expert_comm if seg.kind else self.comm).all_gather(
                flat.segment_view(seg.index), chunks[seg.index], async_op=True
            )
            for seg in flat.layout.segments
        }
        if self._hooks:  # overlap_param_gather: the next forward waits, layer by layer
            self._pending = handles
            return
        for h in handles.values():
            h.wait()
        self.mark_clean()

    def begin_backward(self) -> None:
        """Wait for the gathers still in flight (parameters the forward did not use)."""
        self.settle()

    def end_backward(self) -> None:
        """Nothing to do: whole parameters stay whole through backward."""

    def remove(self) -> None:
        """Waits for gathers in flight and removes the forward hooks; the parameters stay
        views of the full buffer."""
        self.settle()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for p in self.flat.params:
            unwatch(p)

    def open(self, params: list[torch.Tensor]) -> None:
        """Parameters are whole already (once gathers in flight have landed)."""
        self.settle()

    def close(self, params: list[torch.Tensor], modifier_rank: int | None) -> list[int]:
        """Broadcast modified parameters; returns the segments whose chunks changed."""
        if modifier_rank is None:
            return []
        for p in params:
            replicas, src = replica_source(p, modifier_rank, self.replicas, self.expert_replicas)
            replicas.broadcast(p.detach(), src=src)
        return segments_of(self.flat, params)

    def buffers(self) -> list[torch.Tensor]:
        return [self._full()]

    def _full(self) -> torch.Tensor:
        full = self.flat.full
        assert full is not None  # whole parameters (stages 0-2) keep the full buffer
        return full
