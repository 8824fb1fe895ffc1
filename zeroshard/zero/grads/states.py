"""The gradient reducer's states and its transition tables, in one place.

No communication here: these are the names and the legal moves of
:class:`~zeroshard.zero.grads.reducer.GradReducer`, which performs each move's action
(its collectives are described in ``zero/grads/launch.py``). Four machines, each a table
``{(state, event): next}`` (the window's table also names the action); a pair missing
from a table is an illegal call order and raises :class:`~zeroshard.InternalError`
naming the machine, the state and the event.

* :class:`Phase` (the reducer's FSDP2 ``TrainingState``): whether a backward runs,
  whether it reduces, and (optimizer offload, sharded gradients) whether its reductions
  stay in the device's fp32 sum. Changed by ``begin`` / ``finish`` / ``abandon`` only.
* :class:`Window` (what the gradient buffers mean in this accumulation window). It
  changes only on calls every rank makes together (begin, finish, flush, finalize,
  zero_grad), never on a gradient's arrival: a rank whose backward reached no parameter
  moves with the others, and the collectives stay matched (the lesson of d1d62bd).
* :class:`BucketState`, per bucket and per backward: filling, launched, replicated over
  the hybrid group, done.
* :class:`Slot`, per parameter in this window (full gradients only): empty (stale
  values), holding raw sums, or holding the gradient already divided on its way in (then
  the launch must not divide it again). Which parameters got a gradient on this rank is
  data, not a state (the step's unused-parameter check reads it).

Invariants of the window (full gradients, stages 0-1):

* LOCAL: the sum over ranks of the buffer, divided by the group's size, is the window's
  gradient so far; nothing reduced is owed again.
* REDUCED: stage 0, the buffer holds the window's average on every rank; stage 1, this
  rank's chunk of it does (the rest is stale).

With expert parallelism, expert segments are reduced over the expert-data-parallel
ranks only (1/ep of the data-parallel ones) and their sum divided by every contributor
all the same (DeepSpeed's rule), so the invariants read "the sum over the segment's
group, divided by the contributors". One table serves both kinds; one action differs by
kind: stage 0's REDUCED holds the average on every rank, which a later backward's
reduction sums over the group again, so a new backward first rescales (RESCALE) an
expert segment by ep (its group holds 1/ep of the contributors; dense segments: times
1, nothing done). Stage 1's RESTATE needs nothing per kind: the restated chunk (times
the dense group's size, the contributors per replica) sits on one rank of each group.

With sharded gradients (stages 2-3), ACCUMULATED: the owned shard holds the sum of the
window's reduced micro-steps. ON_DEVICE (optimizer offload only): the device's fp32
buffer holds that sum and the host shard holds nothing of this window; the micro-steps
before the boundary stay there, and the window's sum crosses to the host once, at the
boundary's backward (FINISH_REDUCING) or when the gradients are read before it (FLUSH,
FINALIZE: action LAND). LAND moves data between this rank's device and host only, no
collective, so ranks may take it at different calls without unmatching anything.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

from zeroshard import InternalError


class Mode(Enum):
    REPLICATED = "full gradients, all-reduced (stage 0)"
    PARTITIONED = "full gradients, reduce-scattered (stage 1)"
    SHARDED = "sharded gradients (stages 2-3)"


class Phase(Enum):
    IDLE = "no backward runs"
    BACKWARD_LOCAL = "a backward accumulating without communication"
    BACKWARD_REDUCING = "a backward reducing its buckets as they fill"
    BACKWARD_HOLDING = "a backward reducing its buckets into the device's fp32 sum (offload)"


class Window(Enum):
    EMPTY = "no gradient in this window"
    LOCAL = "unreduced local sums"
    REDUCED = "reduced in this window"
    ACCUMULATED = "the owned shard holds reduced micro-steps"
    ON_DEVICE = "the device's fp32 sum holds the reduced micro-steps (offload), the host none"


class BucketState(Enum):
    EMPTY = "nothing arrived in this backward"
    FILLING = "some gradients arrived"
    LAUNCHED = "its reduction is in flight"
    REPLICATING = "its chunk is being summed over the replicas (hybrid)"
    DONE = "reduced"


class Slot(Enum):
    EMPTY = "no gradient in this window"
    RAW = "raw local sum"
    DIVIDED = "divided on its way in (its window's only gradient, at a reducing backward)"


class Event(Enum):
    BEGIN = "begin: a backward starts (any boundary)"
    BEGIN_LOCAL = "begin: a backward that does not reduce"
    BEGIN_REDUCING = "begin: a backward that reduces"
    BEGIN_HOLDING = "begin: a backward before the boundary whose reductions stay on the device"
    FINISH = "finish: the backward ended"
    FINISH_LOCAL = "finish: a backward that did not reduce ended"
    FINISH_REDUCING = "finish: a reducing backward ended"
    FINISH_HOLDING = "finish: a backward that reduced into the device's sum ended"
    ABANDON = "abandon: the backward raised"
    FLUSH = "flush: reduce the window now"
    FINALIZE = "finalize: the optimizer step reads the gradients"
    ZERO_GRAD = "zero_grad: a new window"
    TIED = "local_grad: a tied parameter's local gradient is summed over stages"
    ARRIVE = "a gradient arrived"
    LAUNCH = "launch its reduction"
    COMPLETE = "its reduction completed"
    REPLICATE = "its reduction completed, the replicas' sum follows"
    RESET = "the backward's reductions are all done"
    ARRIVE_DIVIDED = "the window's only gradient arrived at a reducing backward"
    ARRIVE_AGAIN = "another gradient arrived"


E, W, P, B, S = Event, Window, Phase, BucketState, Slot

PHASE: dict[tuple[Phase, Event], Phase] = {
    (P.IDLE, E.BEGIN_LOCAL): P.BACKWARD_LOCAL,
    (P.IDLE, E.BEGIN_REDUCING): P.BACKWARD_REDUCING,
    (P.IDLE, E.BEGIN_HOLDING): P.BACKWARD_HOLDING,
    (P.BACKWARD_LOCAL, E.FINISH): P.IDLE,
    (P.BACKWARD_REDUCING, E.FINISH): P.IDLE,
    (P.BACKWARD_HOLDING, E.FINISH): P.IDLE,
    (P.BACKWARD_LOCAL, E.ABANDON): P.IDLE,
    (P.BACKWARD_REDUCING, E.ABANDON): P.IDLE,
    (P.BACKWARD_HOLDING, E.ABANDON): P.IDLE,
    # between backwards only (a nested backward, or a step inside one, is refused)
    (P.IDLE, E.FLUSH): P.IDLE,
    (P.IDLE, E.FINALIZE): P.IDLE,
    (P.IDLE, E.ZERO_GRAD): P.IDLE,
    (P.IDLE, E.TIED): P.IDLE,
}

# actions the reducer runs on a window move
NONE = "none"
RESTATE = "restate"  # stage 1: own chunk times the group's size, zeros elsewhere
# stage 0: segments reduced over fewer ranks than the window's contributors (experts,
# with expert parallelism) times contributors / those ranks; nothing for the others
RESCALE = "rescale"
REDUCE = "reduce"  # launch every bucket left, in the global order, and wait for all
ZERO = "zero"  # the buffers hold the last window's values: zero them
CLEAR = "clear"  # forget the window's arrivals; param.grad = None
LAND = "land"  # offload: move the device's fp32 sum into the host shard (no collective)

_FULL: dict[tuple[Window, Event], tuple[Window, str]] = {
    (W.EMPTY, E.BEGIN): (W.EMPTY, NONE),
    (W.LOCAL, E.BEGIN): (W.LOCAL, NONE),
    (W.EMPTY, E.FINISH_LOCAL): (W.LOCAL, NONE),  # even with no arrival on this rank
    (W.LOCAL, E.FINISH_LOCAL): (W.LOCAL, NONE),
    (W.EMPTY, E.FINISH_REDUCING): (W.REDUCED, REDUCE),
    (W.LOCAL, E.FINISH_REDUCING): (W.REDUCED, REDUCE),
    (W.EMPTY, E.FLUSH): (W.REDUCED, REDUCE),
    (W.LOCAL, E.FLUSH): (W.REDUCED, REDUCE),
    (W.REDUCED, E.FLUSH): (W.REDUCED, NONE),
    (W.EMPTY, E.FINALIZE): (W.EMPTY, ZERO),
    # a step on unreduced local sums (boundary set again after a backward without it):
    # reduced first, on every rank, else ranks step on different gradients (stage 0)
    # or on a zeroed buffer (stage 1)
    (W.LOCAL, E.FINALIZE): (W.REDUCED, REDUCE),
    (W.REDUCED, E.FINALIZE): (W.REDUCED, NONE),  # an idle rank keeps the others' average
    (W.EMPTY, E.ZERO_GRAD): (W.EMPTY, CLEAR),
    (W.LOCAL, E.ZERO_GRAD): (W.EMPTY, CLEAR),
    (W.REDUCED, E.ZERO_GRAD): (W.EMPTY, CLEAR),
    (W.EMPTY, E.TIED): (W.LOCAL, NONE),
    (W.LOCAL, E.TIED): (W.LOCAL, NONE),
}

WINDOW: dict[tuple[Mode, Window, Event], tuple[Window, str]] = {
    **{(Mode.REPLICATED, w, e): v for (w, e), v in _FULL.items()},
    **{(Mode.PARTITIONED, w, e): v for (w, e), v in _FULL.items()},
    # another backward after the reduction: stage 0's average on every rank already
    # satisfies LOCAL's invariant where every rank sums it (an expert segment, summed
    # over 1/ep of them, is rescaled); stage 1's buffer is restated (d9dbb47, 14aefba)
    (Mode.REPLICATED, W.REDUCED, E.BEGIN): (W.LOCAL, RESCALE),
    (Mode.PARTITIONED, W.REDUCED, E.BEGIN): (W.LOCAL, RESTATE),
    # sharded gradients are reduced every backward; the shard accumulates
    (Mode.SHARDED, W.EMPTY, E.BEGIN): (W.EMPTY, NONE),
    (Mode.SHARDED, W.ACCUMULATED, E.BEGIN): (W.ACCUMULATED, NONE),
    (Mode.SHARDED, W.EMPTY, E.FINISH_REDUCING): (W.ACCUMULATED, REDUCE),
    (Mode.SHARDED, W.ACCUMULATED, E.FINISH_REDUCING): (W.ACCUMULATED, REDUCE),
    (Mode.SHARDED, W.EMPTY, E.FLUSH): (W.EMPTY, NONE),
    (Mode.SHARDED, W.ACCUMULATED, E.FLUSH): (W.ACCUMULATED, NONE),
    (Mode.SHARDED, W.EMPTY, E.FINALIZE): (W.EMPTY, ZERO),
    (Mode.SHARDED, W.ACCUMULATED, E.FINALIZE): (W.ACCUMULATED, NONE),
    (Mode.SHARDED, W.EMPTY, E.ZERO_GRAD): (W.EMPTY, CLEAR),
    (Mode.SHARDED, W.ACCUMULATED, E.ZERO_GRAD): (W.EMPTY, CLEAR),
    # optimizer offload: the micro-steps before the boundary add up on the device (only
    # while the host holds nothing of the window: its additions then stay in order)
    (Mode.SHARDED, W.EMPTY, E.FINISH_HOLDING): (W.ON_DEVICE, REDUCE),
    (Mode.SHARDED, W.ON_DEVICE, E.FINISH_HOLDING): (W.ON_DEVICE, REDUCE),
    (Mode.SHARDED, W.ON_DEVICE, E.BEGIN): (W.ON_DEVICE, NONE),
    # the boundary's backward adds its micro-step and moves the sum, bucket by bucket
    (Mode.SHARDED, W.ON_DEVICE, E.FINISH_REDUCING): (W.ACCUMULATED, REDUCE),
    # read before a boundary's backward (the pipeline engine; a step with the boundary
    # set again after backwards without it): the sum lands on the host first
    (Mode.SHARDED, W.ON_DEVICE, E.FLUSH): (W.ACCUMULATED, LAND),
    (Mode.SHARDED, W.ON_DEVICE, E.FINALIZE): (W.ACCUMULATED, LAND),
    (Mode.SHARDED, W.ON_DEVICE, E.ZERO_GRAD): (W.EMPTY, CLEAR),
}

BUCKET: dict[tuple[BucketState, Event], BucketState] = {
    (B.EMPTY, E.ARRIVE): B.FILLING,
    (B.FILLING, E.ARRIVE): B.FILLING,
    (B.EMPTY, E.LAUNCH): B.LAUNCHED,  # forced at the end, in order: zeros
    (B.FILLING, E.LAUNCH): B.LAUNCHED,
    (B.LAUNCHED, E.REPLICATE): B.REPLICATING,
    (B.LAUNCHED, E.COMPLETE): B.DONE,
    (B.REPLICATING, E.COMPLETE): B.DONE,
    (B.DONE, E.RESET): B.EMPTY,
}

SLOT: dict[tuple[Slot, Event], Slot] = {
    (S.EMPTY, E.ARRIVE): S.RAW,
    (S.EMPTY, E.ARRIVE_DIVIDED): S.DIVIDED,
    (S.RAW, E.ARRIVE_AGAIN): S.RAW,
    (S.DIVIDED, E.ARRIVE_AGAIN): S.DIVIDED,  # a second gradient in the same backward
    # zeroed (stale values), then reduced: it holds the others' gradients from now on,
    # which a later backward of this window adds to
    (S.EMPTY, E.LAUNCH): S.RAW,
    (S.RAW, E.LAUNCH): S.RAW,  # divided now
    (S.DIVIDED, E.LAUNCH): S.RAW,  # already divided; later backwards add raw sums
    (S.EMPTY, E.TIED): S.RAW,  # zeroed, then summed over the tied stages
    (S.RAW, E.TIED): S.RAW,
}

MACHINES: dict[str, dict[tuple, Any]] = {
    "phase": PHASE,
    "window": WINDOW,
    "bucket": BUCKET,
    "slot": SLOT,
}


def step(machine: str, key: tuple, on_step: Callable[[str, tuple], None] | None = None) -> Any:
    """The next state (and action) for ``key`` in ``MACHINES[machine]``; an illegal
    move raises :class:`~zeroshard.InternalError`. ``on_step(machine, key)`` records
    every move taken (the transition-table test)."""
    try:
        out = MACHINES[machine][key]
    except KeyError:
        *state, event = key
        where = ", ".join(s.name for s in state)
        raise InternalError(
            f"gradient reducer: no {machine} transition from ({where}) on {event.name} "
            f"({event.value}); an illegal call order: zero/grads/states.py lists the legal ones"
        ) from None
    if on_step is not None:
        on_step(machine, key)
    return out
