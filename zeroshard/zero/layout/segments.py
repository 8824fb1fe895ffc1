"""Which parameter goes in which segment of the flat layout. Pure index work, no tensors
are allocated and nothing is communicated.

* :func:`bucket_segments` (stages 0-2): trainable parameters in backward order (last
  layers first), packed greedily into gradient buckets.
* :func:`unit_segments` (stage 3): one segment per module holding the parameters it owns
  directly (trainable and frozen alike, since both are sharded); parameters smaller than
  the persistence threshold are packed into persistent segments that stay gathered.

Inside every segment each optimizer param group's parameters sit next to each other, so
a group's share of any chunk is contiguous (see ``FlatParams.group_views``).

A segment holds parameters of one *kind* (``kind_of``; 1: expert parameters of a
mixture-of-experts layer, sharded and reduced over the expert-data-parallel group; 0:
the rest), so each segment's collectives run in one group.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from zeroshard.zero.layout.partition import greedy_segments

FROZEN = -1  # group index of parameters no optimizer group updates


@dataclass(frozen=True)
class SegmentPlan:
    params: list[nn.Parameter]  # in layout order
    group_of: list[int]  # param-group index per parameter (FROZEN for frozen ones)
    segments: list[list[int]]  # indices into ``params``, contiguous and in order
    persistent: list[int]  # segment indices that stay gathered (stage 3)
    kinds: list[int]  # each segment's kind (the group its collectives run in)


#: gradient bucket when the config gives none: DDP's bucket_cap_mb, 25 MiB
DEFAULT_BUCKET_BYTES = 25 * 2**20

KindOf = Callable[[nn.Parameter], int]


def _dense(p: nn.Parameter) -> int:
    return 0


def _by_kind(params: list[nn.Parameter], kind_of: KindOf) -> list[list[nn.Parameter]]:
    """``params`` split by kind (kind 0 first), each keeping its order; empty ones left out."""
    kinds = sorted({kind_of(p) for p in params})
    return [[p for p in params if kind_of(p) == k] for k in kinds]


def _group_index(param_groups: list[dict]) -> dict[int, int]:
    return {
        id(p): gi if p.requires_grad else FROZEN
        for gi, spec in enumerate(param_groups)
        for p in spec["params"]
    }


def _assemble(
    members: list[list[nn.Parameter]],
    group: dict[int, int],
    persistent_from: int,
    kind_of: KindOf = _dense,
) -> SegmentPlan:
    params: list[nn.Parameter] = []
    segments: list[list[int]] = []
    for seg in members:
        seg = sorted(seg, key=lambda p: group.get(id(p), FROZEN))  # stable: keeps order in a group
        segments.append(list(range(len(params), len(params) + len(seg))))
        params += seg
    return SegmentPlan(
        params=params,
        group_of=[group.get(id(p), FROZEN) for p in params],
        segments=segments,
        persistent=list(range(persistent_from, len(segments))),
        kinds=[kind_of(seg[0]) if seg else 0 for seg in members],
    )


def bucket_segments(
    module: nn.Module,
    param_groups: list[dict],
    bucket_numel: int,
    alone: frozenset = frozenset(),
    kind_of: KindOf = _dense,
) -> SegmentPlan:
    """Stages 0-2: trainable parameters only, in gradient buckets (each of one kind).
    Parameters whose id is in ``alone`` get a segment each (so their chunks hold the
    same elements on every pipeline stage that has a copy: tied layers)."""
    group = _group_index(param_groups)
    order = {id(p): i for i, p in enumerate(module.parameters())}
    trainable = [p for spec in param_groups for p in spec["params"] if p.requires_grad]
    trainable.sort(key=lambda p: -order.get(id(p), -1))
    single = [[p] for p in trainable if id(p) in alone]
    trainable = [p for p in trainable if id(p) not in alone]
    members = [
        [kind[i] for i in s]
        for kind in _by_kind(trainable, kind_of)
        for s in greedy_segments([p.numel() for p in kind], bucket_numel)
    ]
    return _assemble(
        single + members, group, persistent_from=len(single) + len(members), kind_of=kind_of
    )


def unit_segments(
    module: nn.Module,
    param_groups: list[dict],
    persistence_threshold: int,
    bucket_numel: int,
    model_persistence_threshold: int | None = None,
    alone: frozenset = frozenset(),
    kind_of: KindOf = _dense,
) -> SegmentPlan:
    """Stage 3: a segment per module of its own parameters, its trainable and its frozen
    ones apart (frozen segments are never reduced and hold no gradient storage); small
    ones persistent; those in ``alone`` each in a segment of their own.

    As in DeepSpeed, a parameter with ``numel <= persistence_threshold`` stays whole on
    every rank, as long as the persistent total stays within
    ``model_persistence_threshold`` (later ones are partitioned instead)."""
    group = _group_index(param_groups)
    budget = sys.maxsize if model_persistence_threshold is None else model_persistence_threshold
    seen: set[int] = set()
    units: list[list[nn.Parameter]] = []
    small: list[nn.Parameter] = []
    for m in module.modules():
        own = []
        for p in m.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if id(p) in alone:  # a segment of its own, never persistent
                units.append([p])
                continue
            if p.numel() <= persistence_threshold and p.numel() <= budget:
                small.append(p)
                budget -= p.numel()
            else:
                own.append(p)
        for same in _by_kind(own, kind_of):
            units += _split_frozen(same, group)
    packed = []
    for same in _by_kind(small, kind_of):
        for kind in _split_frozen(same, group):
            packed += [
                [kind[i] for i in s]
                for s in greedy_segments([p.numel() for p in kind], bucket_numel)
            ]
    return _assemble(units + packed, group, persistent_from=len(units), kind_of=kind_of)


def _split_frozen(params: list[nn.Parameter], group: dict[int, int]) -> list[list[nn.Parameter]]:
    """``params`` as up to two lists: the trainable ones, then the frozen ones."""
    trainable = [p for p in params if group.get(id(p), FROZEN) >= 0]
    frozen = [p for p in params if group.get(id(p), FROZEN) < 0]
    return [kind for kind in (trainable, frozen) if kind]
