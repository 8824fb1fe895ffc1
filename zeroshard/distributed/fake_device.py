"""A fake accelerator runtime for CPU tests (:class:`FakeRuntime`), installed with
``zeroshard.distributed.device.use(FakeRuntime())``. No communication.

It claims the CPU as a device apart from host memory, with streams and events, so a
CPU-only run takes the code paths of a GPU run (side copy streams, events, waits,
write-back uploads), and it logs every copy, record, wait and synchronize asked of it,
in order, for tests to assert the order a GPU would follow.

Semantics, those of a GPU made deterministic:

* the compute stream (``"compute"``) runs its work at once: it is the host thread, where
  every torch op that does not go through the seam runs too;
* a side stream (``"side0"``, ``"side1"``...) *queues* its copies; they run only when
  something waits for them: an event recorded after them is waited on (``wait_event``,
  ``sync_event``) or polled (``done``: "the device finished by now"), a stream waits
  for the side stream, or ``synchronize``. So a host that reads a copy's destination
  before waiting for its event reads stale values, and a compute stream that rewrites
  a copy's source before waiting for its event makes the copy read the new values:
  the races a GPU run may hit show up as wrong numbers, every time.

Log entries (tuples): ``("copy", stream, dst, src)`` when a copy is issued,
``("record", event, stream)``, ``("wait_stream", waiter, waited)``,
``("wait_event", stream, event)``, ``("sync", event)`` (the host waits),
``("record_stream", stream, tensor)``, ``("synchronize",)``, ``("set_device", index)``,
``("capture", graph)`` and ``("replay", graph)`` (device graphs: :class:`FakeGraph`; the
warm-up calls before a capture run the work, the capture runs nothing, each replay runs
it again), plus whatever a test adds with :meth:`FakeRuntime.note`. Tensors are logged by the
names given with :meth:`FakeRuntime.name` (``hostN`` for the N-th buffer of
``host_empty``, ``devN`` for the N-th result of ``to``, ``"?"`` for others).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

from zeroshard.distributed.device import Runtime


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: list[tuple[int, Callable[[], object]]] = []
        self.issued = 0  # work items issued on this stream so far

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    def __init__(self, name: str, stream: FakeStream) -> None:
        self.name, self.stream, self.upto = name, stream, stream.issued

    def __repr__(self) -> str:
        return f"FakeEvent({self.name} on {self.stream.name})"


class FakeGraph:
    """A captured "graph": the function whose work it stands for, rerun at each replay
    (on whatever its static tensors hold then, as a CUDA graph reads its memory)."""

    def __init__(self, name: str, fn: Callable[[], object]) -> None:
        self.name, self.fn, self.replays = name, fn, 0

    def __repr__(self) -> str:
        return f"FakeGraph({self.name}, {self.replays} replays)"


class _Timing:
    """A timing event that measures nothing (timers read 0 ms)."""

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: _Timing) -> float:
        return 0.0


class FakeRuntime(Runtime):
    """See the module docstring. ``devices``: how many devices :meth:`set_device`
    accepts (a larger ordinal raises as CUDA does)."""

    streams = True
    pin = False  # a CPU build of torch cannot page-lock memory
    graphs = True

    def __init__(self, devices: int = 1) -> None:
        super().__init__("fake", apart=True)
        self.devices = devices
        self.log: list[tuple] = []
        self.compute = FakeStream("compute")
        self._sides: list[FakeStream] = []
        self._events = 0
        self._names: list[tuple[int, int, str]] = []
        self._counts: dict[str, int] = {}
        self._lock = threading.RLock()
        self._local = threading.local()
        self.graphs_made: list[FakeGraph] = []

    # -- for tests ------------------------------------------------------------------------
    def note(self, *entry) -> None:
        """Add a test's own marker to the log."""
        with self._lock:
            self.log.append(entry)

    def name(self, t: torch.Tensor, label: str) -> None:
        """Log ``t`` (and any view inside its memory) as ``label``."""
        if t.numel() == 0:
            return
        lo = t.data_ptr()
        self._names.append((lo, lo + t.numel() * t.element_size(), label))

    def label(self, t: torch.Tensor) -> str:
        if t.numel() == 0:  # its address may be where the next tensor starts
            return "empty"
        p = t.data_ptr()
        return next((n for lo, hi, n in reversed(self._names) if lo <= p < hi), "?")

    def _made(self, kind: str) -> int:
        with self._lock:
            n = self._counts[kind] = self._counts.get(kind, -1) + 1
            return n

    def pending(self) -> int:
        """Side-stream work issued and not run yet."""
        return sum(len(s.queue) for s in self._sides)

    # -- streams and events -----------------------------------------------------------------
    def _stack(self) -> list[FakeStream]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def new_stream(self, device) -> FakeStream:
        with self._lock:
            s = FakeStream(f"side{len(self._sides)}")
            self._sides.append(s)
            return s

    def current_stream(self, device) -> FakeStream:
        stack = self._stack()
        return stack[-1] if stack else self.compute

    @contextlib.contextmanager
    def on(self, stream: FakeStream) -> Iterator[None]:
        self._stack().append(stream)
        try:
            yield
        finally:
            self._stack().pop()

    def _run(self, stream: FakeStream, upto: int) -> None:
        while stream.queue and stream.queue[0][0] < upto:
            _, fn = stream.queue.pop(0)
            fn()

    def record(self, stream: FakeStream) -> FakeEvent:
        with self._lock:
            event = FakeEvent(f"e{self._events}", stream)
            self._events += 1
            self.log.append(("record", event.name, stream.name))
            return event

    def wait_stream(self, waiter: FakeStream, waited: FakeStream) -> None:
        with self._lock:
            self.log.append(("wait_stream", waiter.name, waited.name))
            self._run(waited, waited.issued)

    def wait_event(self, stream: FakeStream, event: FakeEvent | None) -> None:
        if event is None:
            return
        with self._lock:
            self.log.append(("wait_event", stream.name, event.name))
            self._run(event.stream, event.upto)

    def sync_event(self, event: FakeEvent | None) -> None:
        if event is None:
            return
        with self._lock:
            self.log.append(("sync", event.name))
            self._run(event.stream, event.upto)

    def done(self, event: FakeEvent | None) -> bool:
        if event is not None:
            with self._lock:
                self._run(event.stream, event.upto)
        return True

    def keep_for(self, t: torch.Tensor, stream: FakeStream) -> None:
        with self._lock:
            self.log.append(("record_stream", stream.name, self.label(t)))

    def timing_event(self) -> _Timing:
        return _Timing()

    # -- memory and copies ----------------------------------------------------------------
    def host_empty(self, size, dtype) -> torch.Tensor:
        t = torch.empty(size, dtype=dtype)
        self.name(t, f"host{self._made('host')}")
        return t

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
        stream = self.current_stream(None)
        with self._lock:
            self.log.append(("copy", stream.name, self.label(dst), self.label(src)))
            if stream is self.compute:
                dst.copy_(src)
                return
            stream.queue.append((stream.issued, lambda: dst.copy_(src)))
            stream.issued += 1

    def to(self, src: torch.Tensor, device, non_blocking: bool = False) -> torch.Tensor:
        out = torch.empty_like(src, device="cpu")
        self.name(out, f"dev{self._made('dev')}")
        self.copy(out, src, non_blocking)
        return out

    # -- graphs ---------------------------------------------------------------------------
    def capture_graph(self, fn: Callable[[], object], warmup: int = 2) -> FakeGraph:
        for _ in range(warmup):
            fn()
        with self._lock:
            graph = FakeGraph(f"g{len(self.graphs_made)}", fn)
            self.graphs_made.append(graph)
            self.log.append(("capture", graph.name))
        return graph  # as on a GPU, capturing runs nothing: replays do

    def replay_graph(self, graph: FakeGraph) -> None:
        with self._lock:
            self.log.append(("replay", graph.name))
        graph.replays += 1
        graph.fn()

    # -- the device -----------------------------------------------------------------------
    def synchronize(self, device=None) -> None:
        with self._lock:
            self.log.append(("synchronize",))
            for s in self._sides:
                self._run(s, s.issued)

    def device_count(self) -> int:
        return self.devices

    def set_device(self, device) -> None:
        index = torch.device(device).index or 0
        if index >= self.devices:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        self.note("set_device", index)
