"""Activation offload: keep tensors saved for backward in (pinned) CPU memory instead of
the device, through saved-tensor hooks (:class:`offload_saved_tensors`). Used by
:mod:`zeroshard.activation.checkpointing` (``offload=True``, ``apply_activation_offload``,
``cpu_checkpointing``). No communication.

* CPU-only runs (tensors on the CPU): nothing is copied, saved tensors stay as they are.
* On CUDA (any device whose torch module has ``Stream`` and ``Event``) the copies run on
  one side stream per device (created on first use), not on the compute (current)
  stream, so they overlap with compute. Forward: the side stream waits for the compute
  stream (the tensor is ready), copies into pinned host memory and records an event;
  the compute stream never waits for it. The source tensor stays referenced until that
  event is seen complete — polled at each pack and unpack, waited for when more than
  1 GiB of sources is held, and at the end of each backward — and is
  ``record_stream``-ed on the side stream (a storage freed under it, as ZeRO-3 does with
  parameters, is not reused before the copy is done), so the caching allocator cannot
  hand its memory out while the copy reads it. Backward: the copy back runs on
  the side stream and records an event; the compute stream waits on that event
  (``wait_event``: no host synchronization) before using the result, which is
  ``record_stream``-ed on the compute stream.
* Prefetch: when backward first unpacks a tensor of a block, the copies back of every
  tensor of the block packed before it start, so they overlap this block's backward;
  within the first block unpacked, the few tensors packed just before each one; the
  selective recompute asks for the next kept matmul outputs ahead. A tensor whose copy to
  host is not seen complete yet when backward needs it is used as is (no copy back).
* Other devices (``mps``): blocking copies on the current stream.
* A saved tensor modified in place while its copy to host may still be reading it is
  refused at unpack (autograd refuses a modified saved tensor without offload too).
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any

import torch

from zeroshard import UsageError
from zeroshard.distributed.device import Runtime, runtime


class _StreamMover:
    """The copies an offload does, on one side stream per device (created on first use),
    so that they overlap with compute on the current stream; streams, events and pinned
    memory come from the device seam (``zeroshard/distributed/device.py``). A device without streams
    (e.g. ``mps``) gets blocking copies on the current stream.

    Events are the device runtime's; ``None`` stands for a copy already complete. The
    mover keeps, per device, the runtime it first saw (a test's fake one included)."""

    def __init__(self) -> None:
        self._side: dict[torch.device, tuple[Runtime, Any]] = {}

    def moves(self, t: torch.Tensor) -> bool:
        # CPU training: nothing to move
        return t.device.type != "meta" and runtime(t.device).apart

    def _side_of(self, device: torch.device) -> tuple[Runtime, Any]:
        got = self._side.get(device)
        if got is None:
            rt = runtime(device)
            got = self._side[device] = (rt, rt.new_stream(device) if rt.streams else None)
        return got

    def to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        rt, side = self._side_of(t.device)
        host = rt.host_empty(t.size(), t.dtype)  # pinned on CUDA: a true async DMA
        if side is None:
            rt.copy(host, t)
            return host, None
        rt.wait_stream(side, rt.current_stream(t.device))  # t is written on the compute stream
        with rt.on(side):
            rt.copy(host, t, non_blocking=host.is_pinned())
        # besides the reference the queue keeps: a storage freed under us (ZeRO-3 resizes
        # parameter storage to 0 after a block) must not be reused before the copy is done
        rt.keep_for(t, side)
        return host, rt.record(side)

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        rt, side = self._side_of(device)
        if side is None:
            return rt.to(host, device), None
        with rt.on(side):  # allocated from the side stream's pool, filled there
            dev = rt.to(host, device, non_blocking=host.is_pinned())
        return dev, rt.record(side)

    def use(self, dev: torch.Tensor, event: Any) -> None:
        """Hand a :meth:`to_device` result to the compute stream."""
        if event is None:
            return
        rt, _ = self._side_of(dev.device)
        compute = rt.current_stream(dev.device)
        rt.wait_event(compute, event)
        # freed later on the compute stream: the allocator must not give the block back to
        # the side stream before the compute stream is done with it
        rt.keep_for(dev, compute)

    def done(self, event: Any, device: torch.device) -> bool:
        """Whether ``event`` (of a copy for ``device``) is complete; does not block."""
        return event is None or self._side_of(device)[0].done(event)

    def wait(self, event: Any, device: torch.device) -> None:
        if event is not None:
            self._side_of(device)[0].sync_event(event)


class _Group:
    """The entries packed in one offload region (one block's forward), in pack order."""

    __slots__ = ("__weakref__", "entries", "prev", "started")

    def __init__(self, prev: _Group | None) -> None:
        self.entries: list[weakref.ref[_Offloaded]] = []  # weak: the graph owns them
        self.prev = weakref.ref(prev) if prev is not None else None
        self.started = False  # backward has unpacked one of them


class _Offloaded:
    """What packing a device tensor returns: its host copy, plus the source tensor until
    the copy is seen complete, and the tensor to unpack once it is on its way back."""

    __slots__ = (
        *("__weakref__", "d2h", "dev", "device", "from_src", "group", "h2d", "host"),
        *("nbytes", "prev", "src", "stale", "unpacked", "version"),
    )

    def __init__(
        self, t: torch.Tensor, host: torch.Tensor, d2h: Any, prev: Any, group: _Group
    ) -> None:
        self.device, self.host, self.d2h, self.prev = t.device, host, d2h, prev
        self.group = group
        self.src: torch.Tensor | None = t  # kept alive: the side stream still reads it
        self.version = t._version
        self.nbytes = t.numel() * t.element_size()
        self.dev: torch.Tensor | None = None  # what the next unpack returns
        self.h2d: Any = None  # the event of dev's copy back (None: nothing to wait for)
        self.from_src = False  # dev is the source itself, not a copy
        self.stale = False
        self.unpacked = False


class _OffloadQueue:
    """Bookkeeping of offloaded saved activations; the copies themselves are the mover's.

    * pack: start the device-to-host copy, keep the source until the copy is seen
      complete (polled at every pack and unpack; a pack blocks on the oldest copies while
      more than ``max_inflight_bytes`` of sources are held), link it to the entry packed
      just before and to its group, the region (block) being packed: links to earlier
      entries and groups are weak, so a freed graph's entries die with it.
    * unpack: start the host-to-device copy unless a prefetch did and hand the result
      to the compute stream. Prefetch, since backward runs roughly in reverse pack
      order: the first unpack of a group starts the copies of the whole group packed
      before it (the previous block: its copies overlap this block's backward), and the
      first unpack of each entry those of the ``prefetch`` entries packed just before it
      (within the group unpacked first). An entry whose source is still held (copy to
      host not seen complete) gets the source back: no copy back.
    * at the end of each backward that unpacked, the copies still running are waited for
      and their sources released, so nothing outlives the backward.
    * a source modified in place before its copy was seen complete may have been copied
      half-modified: its unpack raises (without offload autograd would raise too)."""

    def __init__(self, mover: Any, prefetch: int = 4, max_inflight_bytes: int = 1 << 30) -> None:
        self.mover, self.prefetch_depth = mover, prefetch
        self.max_inflight_bytes = max_inflight_bytes
        self.pending: collections.deque[_Offloaded] = collections.deque()
        self.inflight_bytes = 0
        self._last: Any = None  # weakref to the entry packed last
        self._group: _Group | None = None  # the group being packed
        self._new_group = True
        self._drain_task = -1  # the backward (graph task) a drain is queued for
        self._lock = threading.RLock()  # pack: forward thread; unpack: autograd's threads

    def pack(self, t: torch.Tensor) -> Any:
        if not self.mover.moves(t):
            return t
        with self._lock:
            self._reap()
            if self._new_group or self._group is None:
                self._group, self._new_group = _Group(self._group), False
            host, event = self.mover.to_host(t)
            entry = _Offloaded(t, host, event, self._last, self._group)
            self._last = weakref.ref(entry)
            self._group.entries.append(self._last)
            self.pending.append(entry)
            self.inflight_bytes += entry.nbytes
            while self.inflight_bytes > self.max_inflight_bytes and self.pending:
                self.mover.wait(self.pending[0].d2h, self.pending[0].device)
                self._release(self.pending.popleft())
            return entry

    def unpack(self, packed: Any) -> torch.Tensor:
        if torch.is_tensor(packed):
            return packed
        e: _Offloaded = packed
        with self._lock:
            self._reap()
            self._queue_drain()
            self._start(e)
            out, event = e.dev, e.h2d
            assert out is not None  # _start brought it back
            if e.stale or (e.from_src and out._version != e.version):
                raise UsageError(
                    "activation offload: a saved tensor was modified in place while it was "
                    "being copied to host memory (autograd would refuse it without offload)"
                )
            e.dev, e.h2d, e.from_src = None, None, False  # a second backward fetches again
            if not e.unpacked:
                e.unpacked = True
                self._prefetch_before(e)
            if not e.group.started:
                e.group.started = True
                previous = e.group.prev() if e.group.prev is not None else None
                for ref in previous.entries if previous is not None else ():
                    if (entry := ref()) is not None and not entry.unpacked:
                        self._start(entry)
        if event is not None:
            self.mover.use(out, event)
        return out

    def prefetch(self, packed: Any) -> None:
        """Start bringing ``packed`` back now (it will be unpacked soon)."""
        if isinstance(packed, _Offloaded):
            with self._lock:
                self._start(packed)

    def begin_group(self) -> None:
        """What is packed from now on belongs to a new group (block)."""
        with self._lock:
            self._new_group = True

    def reap(self) -> None:
        """Release the sources whose copies to host are complete (non-blocking)."""
        with self._lock:
            self._reap()

    def drain(self) -> None:
        """Wait for every copy to host still running, release every source."""
        with self._lock:
            while self.pending:
                self.mover.wait(self.pending[0].d2h, self.pending[0].device)
                self._release(self.pending.popleft())

    # -- under the lock ----------------------------------------------------------------
    def _release(self, e: _Offloaded) -> None:
        if e.src is not None and e.src._version != e.version:
            e.stale = True  # modified while (or after) the copy read it: refuse at unpack
        e.src = None
        self.inflight_bytes -= e.nbytes

    def _reap(self) -> None:
        # the copies of a side stream finish in order: stop at the first still running
        while self.pending and self.mover.done(self.pending[0].d2h, self.pending[0].device):
            self._release(self.pending.popleft())

    def _start(self, e: _Offloaded) -> None:
        """Get ``e``'s tensor on its way back to the device (once)."""
        if e.dev is not None or e.stale:
            return
        if e.src is not None:  # still on the device: keep it instead of copying back
            e.dev, e.h2d, e.from_src = e.src, None, True
        else:
            e.dev, e.h2d = self.mover.to_device(e.host, e.device)

    def _prefetch_before(self, e: _Offloaded) -> None:
        ref = e.prev
        for _ in range(self.prefetch_depth):
            prev = ref() if ref is not None else None
            if prev is None:
                return
            if not prev.unpacked:
                self._start(prev)
            ref = prev.prev

    def _queue_drain(self) -> None:
        task = torch._C._current_graph_task_id()  # -1: not in a backward
        if task == -1 or task == self._drain_task or not self.pending:
            return
        torch.autograd.Variable._execution_engine.queue_callback(self.drain)
        self._drain_task = task


_QUEUE = _OffloadQueue(_StreamMover())


def to_host(t: torch.Tensor) -> Any:
    """Pack: a device tensor becomes an :class:`_Offloaded` whose copy to (pinned) host
    memory is under way; a CPU tensor stays as it is (CPU training: nothing to move)."""
    return _QUEUE.pack(t)


def to_device(packed: Any) -> torch.Tensor:
    """Unpack what :func:`to_host` packed."""
    return _QUEUE.unpack(packed)


def prefetch(packed: Any) -> None:
    _QUEUE.prefetch(packed)


class offload_saved_tensors(torch.autograd.graph.saved_tensors_hooks):
    """Keep tensors saved for backward in (pinned) CPU memory instead of the device; the
    copies run on a side stream (see the module docstring)."""

    def __init__(self, queue: _OffloadQueue | None = None) -> None:
        if queue is None:  # looked up at each call, so the module's functions can be wrapped
            super().__init__(lambda t: to_host(t), lambda packed: to_device(packed))
        else:
            super().__init__(queue.pack, queue.unpack)
        self._queue = queue

    def __enter__(self) -> None:
        (self._queue or _QUEUE).begin_group()  # a block boundary
        super().__enter__()

    def __exit__(self, *args: object) -> None:
        super().__exit__(*args)
        (self._queue or _QUEUE).reap()  # a block boundary: let finished copies go
