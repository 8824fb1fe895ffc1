"""The stage-3 gatherer's states and its transition tables, in one place.

No communication here: these are the names and the legal moves of
:class:`~zeroshard.zero.params.gatherer.ParamGatherer` (the passes) and
:class:`~zeroshard.zero.params.units.Units` (each unit), which perform each move's
action (their collectives are described there). Two machines, each a table
``{(state, event): next}``; a pair missing from a table is an illegal call order and
raises :class:`~zeroshard.InternalError` naming the machine, the state and the event.

* :class:`Phase` (FSDP2's ``TrainingState``), for the whole model: changed by the root
  module's forward hooks and by the engine's ``begin_backward`` / ``end_backward`` only.
  A forward of the root inside backward (activation checkpointing of the whole model)
  leaves it in BACKWARD; a forward of another module alone changes nothing.
* :class:`UnitState` (FSDP2's ``ShardedState``, with the all-gather in flight and the
  reason a unit is live spelled out), per unit. Every live unit is *needed* (FETCHING,
  GATHERED), *speculative* (PREFETCHING, PREFETCHED) or *kept* (KEPT); a persistent
  unit is REFRESHING or PERSISTENT its whole life. Only speculative and kept units are
  evicted to stay under ``stage3_max_live_parameters``: a needed unit has no EVICT row.
  An all-gather in flight lands before its unit is freed (no row frees FETCHING or
  PREFETCHING), and an on-demand one lands before the request returns.

How many forwards (and ``GatheredParameters`` blocks) use a unit right now, its users,
is data, not a state: a unit with users is needed (GATHERED once its request returns;
tests/test_param_states.py checks it between calls), and only a unit without users is
released or kept, but when every use is dropped at once (end of backward, teardown).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from zeroshard import InternalError


class Phase(Enum):
    IDLE = "no pass of the model runs"
    FORWARD = "the root module's forward runs (outside backward)"
    BACKWARD = "the engine's backward runs"


class UnitState(Enum):
    NEW = "built: its buffer holds nothing yet"
    RELEASED = "only this rank's shard held; the parameters refuse ops (hooks.py)"
    FETCHING = "needed, its all-gather in flight"
    GATHERED = "needed: whole, used by a forward, a backward or GatheredParameters"
    PREFETCHING = "prefetched, its all-gather in flight, not asked for yet"
    PREFETCHED = "prefetched and whole, not asked for yet"
    KEPT = "whole after its forward, kept for a reuse within the reuse distance"
    REFRESHING = "persistent, its all-gather in flight (at start-up, after a step)"
    PERSISTENT = "persistent: whole on every rank, never released"
    DETACHED = "teardown: the parameters hold their whole values as plain tensors"


class Event(Enum):
    # phase
    FORWARD_START = "the root module's pre-forward hook"
    FORWARD_END = "the root module's post-forward hook"
    BACKWARD_START = "begin_backward: the engine's backward starts"
    BACKWARD_END = "end_backward: the engine's backward ended (or raised)"
    # unit
    FETCH = "asked for while released: its all-gather starts"
    PREFETCH = "prefetched along the recorded order: its all-gather starts"
    REFRESH = "a persistent unit's all-gather starts"
    LAND = "its all-gather is waited for"
    CLAIM = "asked for while prefetched (a prefetch hit)"
    REUSE = "asked for while kept (an all-gather saved)"
    KEEP = "its forward ended: kept for reuse instead of released"
    RELEASE = "released: no use left (or every use dropped)"
    EVICT = "released to make room under the live-parameter cap"
    DETACH = "teardown"


E, P, U = Event, Phase, UnitState

PHASE: dict[tuple[Phase, Event], Phase] = {
    (P.IDLE, E.FORWARD_START): P.FORWARD,
    (P.FORWARD, E.FORWARD_END): P.IDLE,
    # a forward of the root that raised before its end, or the root called inside its
    # own forward: a new pass either way (the hooks cannot tell them apart)
    (P.FORWARD, E.FORWARD_START): P.FORWARD,
    (P.IDLE, E.FORWARD_END): P.IDLE,  # the outer call's end, after such a nested one
    (P.IDLE, E.BACKWARD_START): P.BACKWARD,
    (P.FORWARD, E.BACKWARD_START): P.BACKWARD,  # a forward raised; an earlier loss's backward
    (P.BACKWARD, E.BACKWARD_END): P.IDLE,
    # the root's forward recomputed inside backward (activation checkpointing)
    (P.BACKWARD, E.FORWARD_START): P.BACKWARD,
    (P.BACKWARD, E.FORWARD_END): P.BACKWARD,
}

UNIT: dict[tuple[UnitState, Event], UnitState] = {
    (U.NEW, E.RELEASE): U.RELEASED,
    (U.NEW, E.REFRESH): U.REFRESHING,
    (U.PERSISTENT, E.REFRESH): U.REFRESHING,  # after an optimizer step
    (U.REFRESHING, E.LAND): U.PERSISTENT,
    # needed: asked for by a forward, a backward, an access or GatheredParameters
    (U.RELEASED, E.FETCH): U.FETCHING,
    (U.FETCHING, E.LAND): U.GATHERED,
    # speculative: gathered ahead of its use; lands when asked for, when a pool buffer
    # it holds is wanted (NVMe), or just before it is freed unused
    (U.RELEASED, E.PREFETCH): U.PREFETCHING,
    (U.PREFETCHING, E.CLAIM): U.FETCHING,
    (U.PREFETCHING, E.LAND): U.PREFETCHED,
    (U.PREFETCHED, E.CLAIM): U.GATHERED,
    # kept after its forward, until asked for again or freed
    (U.GATHERED, E.KEEP): U.KEPT,
    (U.KEPT, E.REUSE): U.GATHERED,
    (U.GATHERED, E.RELEASE): U.RELEASED,
    (U.KEPT, E.RELEASE): U.RELEASED,  # after a step, at the end of backward, after an eval
    (U.PREFETCHED, E.RELEASE): U.RELEASED,  # unused when its pass ended
    (U.KEPT, E.EVICT): U.RELEASED,
    (U.PREFETCHED, E.EVICT): U.RELEASED,
    (U.RELEASED, E.DETACH): U.DETACHED,
    (U.PERSISTENT, E.DETACH): U.DETACHED,
}

#: the states whose buffer is allocated and counted as live (non-persistent units)
LIVE = frozenset({U.FETCHING, U.GATHERED, U.PREFETCHING, U.PREFETCHED, U.KEPT})
#: an all-gather in flight
IN_FLIGHT = frozenset({U.FETCHING, U.PREFETCHING, U.REFRESHING})
#: prefetched and not asked for yet
SPECULATIVE = frozenset({U.PREFETCHING, U.PREFETCHED})

MACHINES: dict[str, dict[tuple, Any]] = {"phase": PHASE, "unit": UNIT}


def step(machine: str, key: tuple) -> Any:
    """The next state for ``key`` in ``MACHINES[machine]``; an illegal move raises
    :class:`~zeroshard.InternalError`. Every move of both machines goes through here
    (the transition-table test, tests/test_param_states.py, records them here)."""
    try:
        out = MACHINES[machine][key]
    except KeyError:
        state, event = key
        raise InternalError(
            f"stage-3 gatherer: no {machine} transition from ({state.name}) on {event.name} "
            f"({event.value}); an illegal call order: zero/params/states.py lists the legal ones"
        ) from None
    return out
