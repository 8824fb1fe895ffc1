"""The device seam: the one module that calls the accelerator runtime (``torch.cuda``
and its kin) for streams, events, page-locked host memory, host<->device copies,
synchronization and the choice of the current device. No communication.

The code that overlaps copies with compute (gradient staging to the host, the offloaded
step's write-back, streamed inference weights, activation offload) and the code that
picks or waits for a device (mesh, launcher, timers), and the captured decode step
(``inference/decode_graph.py``: CUDA graphs) ask :func:`runtime` for the runtime
of a device and call it, never ``torch.cuda`` itself, as FSDP2 does with its one device
handle. What answers:

* the CPU (and ``meta``): :class:`Runtime`, host only: no streams, no events (``None``
  stands for a copy already complete), blocking copies, no page-locked memory;
* CUDA and device types whose torch module has ``Stream`` and ``Event``:
  :class:`StreamRuntime` over that module;
* other devices (``mps``): :class:`Runtime` with its memory apart from the host's:
  blocking copies on the current stream;
* in tests, whatever :func:`use` installs, e.g. ``zeroshard.distributed.fake_device.FakeRuntime``,
  which claims the CPU as an accelerator apart from host memory and logs the order of
  every copy, record, wait and synchronize, so CPU tests reach the GPU code paths.

Conventions: a runtime's methods take streams and events it made; ``None`` as an event
means "complete"; :meth:`Runtime.copy` and :meth:`Runtime.to` run on the stream current
in the calling thread (``with rt.on(stream)``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from zeroshard import UsageError
from zeroshard.distributed.env import STAGE_ON_CPU_ENV


class GraphsUnsupportedError(UsageError):
    """A graph capture asked of a device that has none (the CPU)."""


def stage_on_cpu() -> bool:
    """Whether CPU-only runs mirror the bookkeeping of a GPU run's offload (separate host
    masters, staged gradient moves, write-back) with blocking copies (tests, benchmarks)."""
    return os.environ.get(STAGE_ON_CPU_ENV, "") not in ("", "0")


class Runtime:
    """A device without streams: the CPU (``apart=False``: its memory *is* host memory)
    or a device whose copies block the host (``apart=True``)."""

    #: copies can run on side streams, ordered by events
    streams = False
    #: host buffers that feed this device are page-locked (async DMA needs them)
    pin = False

    def __init__(self, type: str, apart: bool = False) -> None:
        self.type = type
        #: the device's memory is apart from host memory (a copy between them is a transfer)
        self.apart = apart

    # -- streams and events ---------------------------------------------------------------
    def new_stream(self, device: torch.device) -> Any:
        return None

    def current_stream(self, device: torch.device) -> Any:
        return None

    @contextlib.contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        """Work issued inside runs on ``stream``."""
        yield

    def record(self, stream: Any) -> Any:
        """An event marking the work issued on ``stream`` so far (None: nothing pending)."""
        return None

    def wait_stream(self, waiter: Any, waited: Any) -> None:
        """Work issued later on ``waiter`` waits for all work issued so far on ``waited``."""

    def wait_event(self, stream: Any, event: Any) -> None:
        """Work issued later on ``stream`` waits for ``event`` (the host does not)."""

    def sync_event(self, event: Any) -> None:
        """The host waits for ``event``."""

    def done(self, event: Any) -> bool:
        """Whether ``event`` is complete (non-blocking)."""
        return True

    def keep_for(self, t: torch.Tensor, stream: Any) -> None:
        """``t``'s memory is not reused before the work issued so far on ``stream`` is done."""

    def timing_event(self) -> Any:
        """An event recorded now on the current stream, for ``elapsed_time`` between
        two of them (None: time on the host)."""
        return None

    # -- memory and copies ----------------------------------------------------------------
    def host_empty(self, size: int | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host memory that feeds this device (page-locked where :attr:`pin`)."""
        return torch.empty(size, dtype=dtype, pin_memory=self.pin)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
        """``dst.copy_(src)`` on the current stream (``non_blocking``: the host does not
        wait for it; only from page-locked memory)."""
        dst.copy_(src, non_blocking=non_blocking)

    def to(self, src: torch.Tensor, device: torch.device, non_blocking: bool = False):
        """A copy of ``src`` on ``device``, made on the current stream."""
        return src.to(device, non_blocking=non_blocking, copy=True)

    # -- graphs: work captured once, replayed many times ---------------------------------
    #: the device captures and replays graphs of its work (CUDA graphs)
    graphs = False

    def capture_graph(self, fn: Callable[[], None], warmup: int = 2) -> Any:
        """Run ``fn`` ``warmup`` times, then capture the device work of one more call
        into a graph and return it. ``fn`` reads and writes only tensors that outlive
        the graph (its static inputs and outputs); :meth:`replay_graph` reruns that work
        on whatever those tensors hold then. Capturing does not run the work on a real
        device (the warm-up calls do)."""
        raise GraphsUnsupportedError(f"{self.type} has no device graphs (CUDA graphs need a CUDA device)")  # fmt: skip

    def replay_graph(self, graph: Any) -> None:
        """Rerun the work captured in ``graph``, on the current stream."""
        raise GraphsUnsupportedError(f"{self.type} has no device graphs")

    # -- the device -----------------------------------------------------------------------
    def synchronize(self, device: torch.device | int | None = None) -> None:
        """The host waits for all work on ``device`` (default: the current one)."""

    def device_count(self) -> int:
        return 1 if self.type == "cpu" else 0

    def set_device(self, device: torch.device) -> None:
        """Make ``device`` this process's current device (and the runtime initialized)."""


class StreamRuntime(Runtime):
    """A device whose torch module (``torch.cuda``, ``torch.xpu``...) has streams."""

    streams = True

    def __init__(self, type: str) -> None:
        super().__init__(type, apart=True)
        self.pin = type == "cuda"

    @property
    def mod(self) -> Any:
        return getattr(torch, self.type)  # looked up at each call: tests may patch it

    def new_stream(self, device):
        return self.mod.Stream(device=device)

    def current_stream(self, device):
        return self.mod.current_stream(device)

    @contextlib.contextmanager
    def on(self, stream):
        with self.mod.stream(stream):
            yield

    def record(self, stream):
        return stream.record_event()

    def wait_stream(self, waiter, waited) -> None:
        waiter.wait_stream(waited)

    def wait_event(self, stream, event) -> None:
        if event is not None:
            stream.wait_event(event)

    def sync_event(self, event) -> None:
        if event is not None:
            event.synchronize()

    def done(self, event) -> bool:
        return event is None or event.query()

    def keep_for(self, t, stream) -> None:
        t.record_stream(stream)

    def timing_event(self):
        event = self.mod.Event(enable_timing=True)
        event.record()
        return event

    @property
    def graphs(self) -> bool:  # type: ignore[override]  # a class attribute on Runtime
        return hasattr(self.mod, "CUDAGraph") and hasattr(self.mod, "graph")

    def capture_graph(self, fn, warmup: int = 2):
        if not self.graphs:
            return super().capture_graph(fn, warmup)
        # warm up on a side stream (lazy initialisations, allocator), as torch's docs ask
        side = self.mod.Stream()
        side.wait_stream(self.mod.current_stream())
        with self.mod.stream(side):
            for _ in range(warmup):
                fn()
        self.mod.current_stream().wait_stream(side)
        graph = self.mod.CUDAGraph()
        with self.mod.graph(graph):
            fn()
        return graph

    def replay_graph(self, graph) -> None:
        graph.replay()

    def synchronize(self, device=None) -> None:
        self.mod.synchronize(device)

    def device_count(self) -> int:
        return self.mod.device_count()

    def set_device(self, device) -> None:
        # set_device initializes the runtime too; init() says so explicitly, because
        # DeviceMesh picks a device itself (by LOCAL_RANK) when it finds it uninitialized
        self.mod.set_device(device)
        init = getattr(self.mod, "init", None)
        if init is not None:
            init()


_RUNTIMES: dict[str, Runtime] = {}
_INSTALLED: list[Runtime] = []


def runtime(device: torch.device | str) -> Runtime:
    """The runtime of ``device`` (a device, ``"cuda:1"`` or a type such as ``"cuda"``);
    the one :func:`use` installed, if any."""
    if _INSTALLED:
        return _INSTALLED[-1]
    kind = torch.device(device).type
    rt = _RUNTIMES.get(kind)
    if rt is None:
        mod = getattr(torch, kind, None)
        if kind in ("cpu", "meta"):
            rt = Runtime(kind)
        elif hasattr(mod, "Stream") and hasattr(mod, "Event"):
            rt = StreamRuntime(kind)
        else:
            rt = Runtime(kind, apart=True)
        _RUNTIMES[kind] = rt
    return rt


@contextlib.contextmanager
def use(rt: Runtime) -> Iterator[Runtime]:
    """Answer every :func:`runtime` call with ``rt`` inside (tests: a fake runtime).
    Objects built inside keep the runtime they were given."""
    _INSTALLED.append(rt)
    try:
        yield rt
    finally:
        _INSTALLED.remove(rt)


def host_apart(device: torch.device) -> bool:
    """Whether host memory is apart from ``device``'s, so that moving a shard between
    them is a transfer to overlap (a GPU; or a CPU-only run under ``stage_on_cpu()``,
    which rehearses the GPU code path with blocking copies)."""
    return runtime(device).apart or stage_on_cpu()


def claim_device(device_type: str, index: int) -> torch.device:
    """Make ``device_type:index`` (wrapped to the visible devices) this process's current
    device and return it; the CPU is left alone. Ranks that share one GPU (gloo) wrap to
    the same device instead of asking for an ordinal that does not exist."""
    if device_type in ("cpu", "meta"):
        return torch.device(device_type)
    rt = runtime(device_type)
    count = rt.device_count()
    if count < 1:
        raise UsageError(f"no {device_type} device is visible to this process")
    device = torch.device(device_type, index % count)
    rt.set_device(device)
    return device
