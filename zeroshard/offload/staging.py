"""Double-buffered device->host moves of reduced gradient chunks (ZeRO-Offload). No
communication: this module only copies between the device and CPU memory.

With the optimizer offloaded, each bucket's reduced gradient chunk must reach the host
accumulation buffer (the owned gradient shard in CPU memory) while backward goes on.
:class:`HostStager` does it through ``depth`` page-locked host buffers:

1. ``submit(src, dst, accumulate)``: a side copy stream waits for the compute stream
   (so the reduced chunk is ready), copies ``src`` into a free pinned buffer without
   blocking the host, and records an event. The event is returned: the caller makes the
   compute stream wait on it before it overwrites ``src`` (a reused staging bucket).
2. A landing thread of the stager's own takes the moves in order: it waits on the
   copy's event, adds (or copies) the buffer into ``dst``, runs the move's ``then``
   (the reducer's sum of squares of the landed chunk, which the step's norm then
   skips) and frees the buffer. :meth:`drain` waits for every landing; ``submit``
   waits only when all buffers are in flight.

So the host-side accumulation of bucket *k* runs while the device reduces bucket *k+1*
and computes the rest of backward, and the thread that runs backward (autograd's, which
calls the reducer's hooks) never does the host's pass itself: it issues copies and goes
on. torch's operators release the GIL, so the landing runs beside backward. Host memory
used is ``depth`` buffers of one chunk.
The buffers are bytes: a chunk of any dtype goes through them (the reducer moves
gradient-dtype chunks, or fp32 ones it accumulated on the device); they grow, once, to
the largest chunk submitted.

Streams, events, pinned buffers and copies go through the device seam
(``zeroshard/distributed/device.py``). When the compute device is the CPU there is nothing to move
and :meth:`submit` adds or copies at once, unless ``ZEROSHARD_STAGE_ON_CPU=1`` is set:
then the queue is used with synchronous copies (the events are ``None``), so CPU-only
tests run the same bookkeeping, deferral and ordering as a GPU run; under a fake runtime
(``zeroshard/distributed/fake_device.py``) they run the side stream and its events too.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

import torch

from zeroshard.distributed.device import host_apart, runtime, stage_on_cpu
from zeroshard.distributed.env import STAGE_ON_CPU_ENV

__all__ = ["STAGE_ON_CPU_ENV", "HostStager", "stage_on_cpu"]


class HostStager:
    """Move chunks from ``device`` to host tensors through ``depth`` pinned buffers.

    Args:
        device: where the chunks come from.
        numel: the largest chunk that will be submitted.
        dtype: the chunks' usual dtype, which sizes the buffers at first (a chunk of a
            wider dtype grows them; the host destination may differ: cast on the host).
        depth: buffers in flight (2 = double buffering).
    """

    def __init__(self, device: torch.device, numel: int, dtype: torch.dtype, depth: int = 2):
        self.device = device
        self.rt = runtime(device)
        self.queued = host_apart(device)
        self._stream = None
        self._free: list[torch.Tensor] = []
        # moves issued and not landed: (buffer, view, event, dst, accumulate, then)
        self._inflight: deque = deque()
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._threads = torch.get_num_threads()
        self.submitted = 0  # chunks moved through the buffers (for tests)
        self.moved_bytes = 0  # bytes moved through the buffers (for tests, benchmarks)
        if not self.queued:
            return
        nbytes = numel * dtype.itemsize
        self._free = [self.rt.host_empty(nbytes, torch.uint8) for _ in range(depth)]
        if self.rt.streams:
            self._stream = self.rt.new_stream(device)

    def submit(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        accumulate: bool,
        then: Callable[[torch.Tensor], None] | None = None,
    ):
        """Start moving ``src`` into ``dst`` (``dst += src`` when ``accumulate``), then
        call ``then(dst)`` (on the landing thread).

        Returns an event the compute stream must wait on before ``src`` is overwritten,
        or None when ``src`` may be reused at once."""
        if not self.queued:
            (dst.add_ if accumulate else dst.copy_)(src)
            if then is not None:
                then(dst)
            return None
        with self._cv:
            while not self._free and self._error is None:
                self._cv.wait()
            self._raise()
            full = self._free.pop()
        nbytes = src.numel() * src.element_size()
        if full.numel() < nbytes:  # a wider chunk than the buffers were made for
            full = self.rt.host_empty(nbytes, torch.uint8)
        buf = full[:nbytes].view(src.dtype)
        event = None
        if self._stream is None:
            buf.copy_(src)
        else:
            rt = self.rt
            rt.wait_stream(self._stream, rt.current_stream(self.device))  # src is ready
            with rt.on(self._stream):
                rt.copy(buf, src, non_blocking=True)
            event = rt.record(self._stream)
        with self._cv:
            self._inflight.append((full, buf, event, dst, accumulate, then))
            self.submitted += 1
            self.moved_bytes += nbytes
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._land_all, name="zeroshard-host-stager", daemon=True
                )
                self._thread.start()
            self._cv.notify_all()
        return event

    def _land_all(self) -> None:
        """The landing thread: each move in order, as soon as it is issued; it ends when
        none is left (``submit`` starts another)."""
        torch.set_num_threads(self._threads)  # the same intra-op pool as the issuer's
        while True:
            with self._cv:
                if not self._inflight:
                    self._thread = None
                    return
                full, buf, event, dst, accumulate, then = self._inflight[0]
            try:
                self.rt.sync_event(event)  # the copy into the pinned buffer has landed
                (dst.add_ if accumulate else dst.copy_)(buf.view_as(dst))
                if then is not None:
                    then(dst)
            except BaseException as e:  # re-raised by the issuer: drain() or submit()
                with self._cv:
                    self._error = self._error or e
            with self._cv:
                self._inflight.popleft()
                self._free.append(full)
                self._cv.notify_all()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def drain(self) -> None:
        """Wait for every move in flight to land in its destination."""
        with self._cv:
            while self._inflight:
                self._cv.wait()
            self._raise()

    @property
    def pending(self) -> int:
        return len(self._inflight)

    def buffers(self) -> list[torch.Tensor]:
        """The pinned host buffers (host memory this stager holds)."""
        with self._cv:
            return self._free + [full for full, *_ in self._inflight]
