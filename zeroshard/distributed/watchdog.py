"""Hangs become reports: a per-process watchdog for zeroshard's collectives.

Every rank keeps, in memory, what it is doing: the engine call it is in (``phase``:
forward, backward, step, save_checkpoint, ...) or last returned from, the optimizer
step, the collective it is blocked in (op, group, bytes, since when) and the last one it
finished. It publishes that state to the rendezvous store (the default process group's),
one small key per rank: when the watchdog starts (in ``initialize``), when ``step()``
returns (so a rank that stalls between steps is reported exactly, even if it can no
longer run a thread) and every couple of seconds from a daemon thread (a heartbeat: a
report that grows old names a rank that is stopped or holds the GIL). When this rank
has been blocked in one collective for longer than the timeout, the thread writes its
own state, reads every other rank's last report and prints one line per rank to
stderr, e.g.::

    zeroshard watchdog: rank 0: blocked 30 s in reduce_scatter over zero_shard
    (4.0 MiB), in backward at step 12
      rank 1: outside zeroshard since step() returned at step 12 (has not entered
      backward at step 12); its last collective: all_gather over zero_shard in step at
      step 11

then exits the process with status 3 (the launcher then stops the job). The timeout is
``comm_timeout`` in the config or ``zeroshard run --comm-timeout`` (environment
``ZEROSHARD_COMM_TIMEOUT``); default 600 s, which a healthy collective never needs on
CPU or GPU (the first NCCL call and big checkpoint writes included) and which ends a hang
30 minutes before torch's own timeout does. 0 turns the watchdog off.

Communication: none through collectives; small ``set``/``get`` calls on the store.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time

from zeroshard.distributed.env import TIMEOUT_ENV

DEFAULT_TIMEOUT = 600.0
_KEY = "zeroshard/watchdog/{}"


class Watchdog:
    """What this rank is doing, published to ``store``; reports a stuck collective."""

    def __init__(self, rank: int, world: int, store, timeout: float, period: float = 2.0):
        self.rank, self.world, self.store, self.timeout = rank, world, store, timeout
        self.period = min(period, max(timeout / 4, 0.05))
        self.phase, self.step = "initialize", 0
        self.returned = False  # whether the call ``phase`` has returned
        self._seen = {self.phase}  # every phase this rank entered
        self._blocked: tuple[str, str, int, float] | None = None  # op, axis, bytes, since
        self._last: tuple[str, str, str, int] | None = None  # op, axis, phase, step
        self._lock = threading.Lock()
        self._publishing = threading.Lock()  # one writer of this rank's key at a time
        self._stop = threading.Event()
        self._publish_now()  # from initialize on, every rank has a report
        self._thread = threading.Thread(target=self._run, name="zeroshard-watchdog", daemon=True)
        self._thread.start()

    # -- what this rank does --------------------------------------------------------------
    def enter(self, phase: str, step: int) -> None:
        self.phase, self.step, self.returned = phase, step, False
        self._seen.add(phase)

    def leave(self, step: int, publish: bool = False) -> None:
        """The call :meth:`enter` named returned, at optimizer step ``step``;
        ``publish``: write the state to the store now (once per ``step()``: a rank that
        stalls right after is then reported exactly, even if its thread cannot run)."""
        self.step, self.returned = step, True
        if publish:
            self._publish_now()

    def block(self, op: str, axis: str, nbytes: int) -> None:
        with self._lock:
            self._blocked = (op, axis, nbytes, time.monotonic())

    def unblock(self) -> None:
        with self._lock:
            if self._blocked is not None:
                self._last = (self._blocked[0], self._blocked[1], self.phase, self.step)
            self._blocked = None

    def state(self) -> dict:
        with self._lock:
            blocked, last = self._blocked, self._last
        out = {
            "phase": self.phase,
            "step": self.step,
            "returned": self.returned,
            "seen": sorted(self._seen),
            "time": time.time(),
        }
        if last is not None:
            out["last"] = dict(zip(("op", "axis", "phase", "step"), last, strict=True))
        if blocked is not None:
            op, axis, nbytes, since = blocked
            out["blocked"] = {
                "op": op,
                "axis": axis,
                "bytes": nbytes,
                "for": time.monotonic() - since,
            }
        return out

    # -- the thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                state = self._publish_now(quiet=False)
            except Exception:  # the store went away (shutdown): nothing left to watch
                return
            blocked = state.get("blocked")
            if blocked is not None and blocked["for"] > self.timeout:
                self.report(state)

    def _publish_now(self, quiet: bool = True) -> dict:
        """Write this rank's state to its key (a heartbeat even when unchanged: the
        report's age tells a live rank from a stopped one). ``quiet``: a failing store is
        not this caller's problem (the training loop's)."""
        with self._publishing:
            state = self.state()
            try:
                self.store.set(_KEY.format(self.rank), json.dumps(state, separators=(",", ":")))
            except Exception:
                if not quiet:
                    raise
        return state

    def report(self, state: dict) -> None:
        """Print every rank's last state and end this process (status 3)."""
        lines = [f"zeroshard watchdog: {describe(self.rank, state)}"]
        for r in range(self.world):
            if r == self.rank:
                continue
            key = _KEY.format(r)
            try:
                other = json.loads(self.store.get(key)) if self.store.check([key]) else None
            except Exception:
                other = None
            if other is None:
                lines.append(f"  rank {r}: no report (it never reached zeroshard.initialize)")
            else:
                lines.append(f"  {describe(r, other, state)}{self._age(other)}")
        lines.append(
            f"  (comm_timeout {self.timeout:g} s: the config's comm_timeout, or zeroshard run "
            "--comm-timeout; this rank exits with status 3)"
        )
        print("\n".join(lines), file=sys.stderr, flush=True)
        os._exit(3)

    def stop(self, wait: float = 0.0) -> None:
        """End the thread; with ``wait``, up to that many seconds for it to finish."""
        self._stop.set()
        if wait and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(wait)

    def _age(self, other: dict) -> str:
        """A note when ``other``'s report is older than its heartbeat allows."""
        age = time.time() - other.get("time", time.time())
        # a few heartbeats late; under the timeout, which a stopped rank's age exceeds
        if age <= max(2 * self.period, min(3 * self.period + 1, self.timeout / 2)):
            return ""
        return (
            f"; no report for {age:.0f} s (the process is stopped, or holds the GIL): this is "
            "its state then"
        )


def describe(rank: int, state: dict, blocked_rank: dict | None = None) -> str:
    """One rank's state in words; ``blocked_rank``: the state of the rank reporting (a
    note says where this rank stands against the call that one is blocked in)."""
    phase, step = state["phase"], state["step"]
    b = state.get("blocked")
    if b:
        return (
            f"rank {rank}: blocked {b['for']:.0f} s in {b['op']} over {b['axis']} "
            f"({b['bytes'] / 2**20:.1f} MiB), in {phase} at step {step}"
        )
    if state.get("returned"):
        text = f"rank {rank}: outside zeroshard since {phase}() returned at step {step}"
    else:
        text = f"rank {rank}: in {phase} at step {step}, not in a collective"
    if blocked_rank is not None:
        there, at = blocked_rank["phase"], blocked_rank["step"]
        if there not in state.get("seen", [phase]):
            text += f" (never entered {there})"
        elif (phase, step, state.get("returned")) != (there, at, False):
            text += f" (has not entered {there} at step {at})"
    last = state.get("last")
    if last:
        text += (
            f"; its last collective: {last['op']} over {last['axis']} in {last['phase']} at "
            f"step {last['step']}"
        )
    return text


_CURRENT: Watchdog | None = None


def current() -> Watchdog | None:
    """This process's watchdog, if one runs."""
    return _CURRENT


def start(timeout: float | None = None) -> Watchdog | None:
    """Start (once per process) the watchdog on the default group's store; ``timeout``
    None: ``ZEROSHARD_COMM_TIMEOUT`` or the default. Returns None when off (0) or when
    there is no process group or store."""
    global _CURRENT
    import torch.distributed as dist

    if timeout is None:
        timeout = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT))
    if timeout <= 0:
        stop()
        return None
    if _CURRENT is not None:
        _CURRENT.timeout = timeout
        return _CURRENT
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
    except Exception:  # no store to publish to: no watchdog
        return None
    _CURRENT = Watchdog(dist.get_rank(), dist.get_world_size(), store, timeout)
    atexit.register(_stop_at_exit)
    return _CURRENT


def stop(wait: float = 0.0) -> None:
    """Stop this process's watchdog (``wait``: seconds to let its thread finish)."""
    global _CURRENT
    if _CURRENT is not None:
        _CURRENT.stop(wait)
        _CURRENT = None


def _stop_at_exit() -> None:
    # a daemon thread still inside a store call when the interpreter finalizes is ended
    # by pthread_exit while the call restores the GIL, which aborts the process
    # ("terminate called without an active exception", SIGABRT after a clean run)
    stop(wait=5.0)
