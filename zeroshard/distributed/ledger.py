"""The ledger: what this rank's collectives moved, per mesh axis and op.

Per (axis, op): calls, bytes (the ZeRO paper's convention, see ``comm.py``) and the
seconds the caller was blocked; observers (the comms logger) are told of each completed
collective. Pure bookkeeping: it issues no communication; ``comm.Comm`` fills it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class OpStats:
    """Totals for one collective op on one rank."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


Stats = dict[str, dict[str, float | int]]


@dataclass(frozen=True)
class OpEvent:
    """One completed collective, as ledger observers see it."""

    axis: str
    op: str
    nbytes: int  # the ledger's count (see the byte convention above)
    seconds: float  # blocked: issue plus wait
    group_size: int
    caller: str  # the function that called the Comm


class Ledger:
    """Per-(axis, op) call, byte and blocked-time totals for this rank, and the
    ``observers`` told of each completed collective."""

    def __init__(self) -> None:
        self._ops: dict[tuple[str, str], OpStats] = defaultdict(OpStats)
        self.observers: list[Callable[[OpEvent], None]] = []

    def record(self, op: str, nbytes: int, seconds: float, axis: str = "world") -> None:
        s = self._ops[axis, op]
        s.calls += 1
        s.bytes += int(nbytes)
        s.seconds += seconds

    def add_seconds(self, op: str, seconds: float, axis: str = "world") -> None:
        self._ops[axis, op].seconds += seconds

    @staticmethod
    def _totals(items) -> Stats:
        out: Stats = {}
        for op, s in items:
            t = out.setdefault(op, {"calls": 0, "bytes": 0, "seconds": 0.0})
            t["calls"] += s.calls
            t["bytes"] += s.bytes
            t["seconds"] += s.seconds
        return dict(sorted(out.items()))

    def snapshot(self) -> Stats:
        """``{op: {"calls", "bytes", "seconds"}}``, summed over axes."""
        return self._totals((op, s) for (_, op), s in self._ops.items())

    def by_axis(self) -> dict[str, Stats]:
        """``{axis: {op: {"calls", "bytes", "seconds"}}}``."""
        axes = sorted({axis for axis, _ in self._ops})
        return {
            a: self._totals((op, s) for (ax, op), s in self._ops.items() if ax == a) for a in axes
        }

    def total_bytes(self) -> int:
        return sum(s.bytes for s in self._ops.values())

    def reset(self) -> None:
        self._ops.clear()
