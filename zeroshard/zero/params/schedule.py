"""The order stage-3 units are asked for, recorded on the first forward and the first
backward, and what it predicts: which units to prefetch next, and how far away a unit's
next use is (the reuse distance). No communication: the gatherer issues the all-gathers
it plans (``gatherer.py``, ``units.py``).

Each order is recorded from the first pass of its kind after the gatherer is built or
its compile regions change (each unit once, where it is first asked for), and fixed when
that pass ends: the forward order when backward begins, the backward order when it
ends. A *cursor* follows the running pass along its order (the furthest unit it has
asked for); prefetching looks ahead of it. Once both orders are fixed, the *trace* is the
forward order followed by the backward order (DeepSpeed's parameter trace, per unit).

The reuse distance of a unit at a module's post-forward (``stage3_max_reuse_distance``,
DeepSpeed's semantics) is the number of elements of the units gathered along the trace
between the furthest unit this forward has used and the unit's next use. With
DeepSpeed's default (1e9) a model under about 5e8 parameters (its first unit is next
used last in backward, about 2Ψ elements later) stays gathered from its forward through
its backward, so the backward all-gathers nothing but what the cap evicted: stage 3
moves 4Ψ + 4Ψ instead of 3 x 4Ψ, at the price of holding the gathered parameters
between the passes; in a larger model, the units within about half the distance of the
turn from forward to backward.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator


class Trace:
    """The units in the order recorded on the first forward, then on the first backward,
    as one sequence: where each unit is used, and how many elements are gathered up to
    each position."""

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


class Schedule:
    """The recorded orders, the running pass's cursor, and the trace (see the module
    docstring). ``numel``: each unit's elements."""

    def __init__(self, numel: list[int]) -> None:
        self._numel = numel
        self.restart()

    def restart(self) -> None:
        """Forget the orders: the next forward and backward record them again."""
        self._fwd: list[int] | None = None
        self._bwd: list[int] | None = None
        self._recording_fwd: list[int] = []
        self._recording_bwd: list[int] = []
        self.cursor = -1  # position in the recorded order reached by the running pass
        self.trace: Trace | None = None  # both orders joined, once both are recorded

    # -- recording ----------------------------------------------------------------------
    def record(self, units: Iterable[int], backward: bool) -> None:
        """Units asked for by a forward (``backward``: by a backward), while that order
        is not fixed yet."""
        recording = self._recording_bwd if backward else self._recording_fwd
        if (self._bwd if backward else self._fwd) is None:
            recording.extend(s for s in dict.fromkeys(units) if s not in recording)

    def start_pass(self) -> None:
        """A new forward: the cursor starts over."""
        self.cursor = -1

    def start_backward(self) -> None:
        """The forward order is fixed (if one was recorded); the cursor starts over."""
        self.cursor = -1
        if self._fwd is None and self._recording_fwd:
            self._fwd = self._recording_fwd

    def end_backward(self) -> None:
        """The backward order is fixed (if one was recorded); with both, the trace."""
        if self._bwd is None and self._recording_bwd:
            self._bwd = self._recording_bwd
        if self.trace is None and self._fwd and self._bwd:
            self.trace = Trace(self._fwd, self._bwd, self._numel)

    # -- following ----------------------------------------------------------------------
    def advance(self, used: Iterable[int], backward: bool) -> None:
        """Move the cursor to the furthest of ``used`` in this pass's recorded order."""
        order = self._bwd if backward else self._fwd
        if order:
            self.cursor = max([self.cursor, *(order.index(s) for s in used if s in order)])

    def ahead(self, backward: bool) -> Iterator[tuple[int, int]]:
        """The units after the cursor in this pass's recorded order, each with its
        position in the trace (in the backward order: after the forward's)."""
        order = self._bwd if backward else self._fwd
        if not order:
            return
        offset = self.trace.fwd_len if backward and self.trace is not None else 0
        for i in range(self.cursor + 1, len(order)):
            yield order[i], offset + i

    def next_use(self, s: int) -> tuple[int, int] | None:
        """Unit ``s``'s next use after the cursor along the trace, and the elements
        gathered in between (:meth:`Trace.next_use`); None without a trace."""
        return None if self.trace is None else self.trace.next_use(s, self.cursor)
