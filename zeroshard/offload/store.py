"""Where a rank's parameter shard lives: memory (the device, or CPU memory, pinned on
CUDA) or an NVMe swap file. No communication.

Both stores answer one protocol, :class:`ShardStore` (a ``typing.Protocol`` the type
checker holds :class:`MemoryShard` and :class:`SwapShard` to), so the flat parameters,
the sharded optimizer and checkpoints never ask where a shard is. Its first part,
:class:`Store`, is what the optimizer-state stores answer too (``offload/states.py``):

* ``kinds``: the kinds of state held (here ``("param",)``);
* ``read(kind, a, b)`` / ``write(kind, a, values)``: a copy of shard positions
  ``[a, b)`` / overwrite from ``a`` (checkpoints, ``zero.Init`` hand-over);
* ``buffers()``: the tensors held in memory (``memory_stats()``); ``disk_bytes()``;

and, for the stage-3 gatherer and the optimizer's write-back, per segment ``s`` of the
layout (this rank's chunk of it):

* ``lend(s)``: the chunk to all-gather from, or None when a swapped store's buffer pool
  is exhausted; ``give_back(buf)`` once the all-gather has read it;
* ``write_chunk(s, values, lo)``: store ``values`` from element ``lo`` of the chunk,
  casting (and uploading) as needed;
* ``fill(s)`` / ``commit(s, buf)``: a writable buffer for the chunk and the call that
  stores it, to build a shard segment by segment;
* ``writer()``: a :class:`ChunkWriter` taking consecutive shard positions (the NVMe
  optimizer's write-back, sub-group after sub-group); a swapped store writes each chunk
  once, whole, when it is complete, instead of reading, patching and writing the whole
  chunk for every piece (a chunk spanning k sub-groups moved k times each way).

A store's dtype need not be the compute dtype: with CPU optimizer offload on a GPU the
stage-3 shard *is* the fp32 master (one host copy, as FSDP2's CPU offload keeps), and
gathers cast to the compute dtype on the device after the upload.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from zeroshard.distributed.device import runtime
from zeroshard.offload.layout import ChunkLayout
from zeroshard.offload.nvme import BufferPool, SwapFile, aligned_empty

# Elements of the device buffer that host values pass through when their dtype differs
# from the destination's (64 MiB of fp32).
_UPLOAD_NUMEL = 1 << 24


class Store(Protocol):
    """What checkpoints and the memory report read of any store: the shard stores here
    and the optimizer-state stores (``offload/states.py``)."""

    @property
    def kinds(self) -> Sequence[str]:
        """The kinds of state held (``param``; ``master``, ``exp_avg``, ...)."""

    def read(self, kind: str, a: int, b: int) -> torch.Tensor:
        """A tensor of ``kind`` at shard positions ``[a, b)`` (a view or a copy)."""

    def write(self, kind: str, a: int, values: torch.Tensor) -> None:
        """Overwrite ``kind`` at shard positions ``[a, a + values.numel())``."""

    def buffers(self) -> list[torch.Tensor]:
        """The tensors held in memory (``memory_stats()``)."""

    def disk_bytes(self) -> int:
        """Bytes held in files."""


class ShardStore(Store, Protocol):
    """A rank's parameter shard, wherever it lives; see the module docstring."""

    @property
    def layout(self) -> ChunkLayout: ...

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the shard is kept in (not always the compute dtype)."""

    @property
    def device(self) -> torch.device:
        """Where the shard's chunks are read from (an NVMe store's: the CPU)."""

    def lend(self, s: int) -> torch.Tensor | None:
        """Chunk ``s`` to all-gather from; None when a pool of buffers is exhausted."""

    def give_back(self, buf: torch.Tensor) -> None:
        """The all-gather has read ``buf`` (a chunk :meth:`lend` gave)."""

    def chunk(self, s: int) -> torch.Tensor:
        """Chunk ``s`` (the stored tensor in memory, a fresh copy from a file)."""

    def fill(self, s: int) -> torch.Tensor:
        """A writable buffer for chunk ``s``; :meth:`commit` stores it."""

    def commit(self, s: int, buf: torch.Tensor) -> None:
        """Store ``buf`` (from :meth:`fill`) as chunk ``s``."""

    def write_chunk(self, s: int, values: torch.Tensor, lo: int = 0) -> None:
        """Store ``values`` from element ``lo`` of chunk ``s``, casting as needed."""

    def writer(self) -> ChunkWriter:
        """A writer of consecutive shard positions (see :class:`ChunkWriter`)."""


class ChunkWriter(Protocol):
    """Writes runs of shard positions that come in increasing order (each ``put``
    starting where the last one ended, as an optimizer walks its shard); ``close``
    stores what is still held. Positions not put keep their stored values."""

    def put(self, a: int, values: torch.Tensor) -> None:
        """Store ``values`` at shard positions ``[a, a + values.numel())``."""

    def close(self) -> None:
        """Store the chunk still being assembled, if any."""


class _DirectWriter:
    """A memory store's writer: each run is written as it comes (no I/O to save)."""

    def __init__(self, store: ShardStore) -> None:
        self.store = store

    def put(self, a: int, values: torch.Tensor) -> None:
        _write_ranges(self.store, a, values)

    def close(self) -> None:
        pass


def _ranges(layout: ChunkLayout, a: int, b: int) -> Iterator[tuple[int, int, int]]:
    """``(segment, lo, hi)`` pieces of shard positions ``[a, b)``, relative to each chunk."""
    for seg in layout.segments:
        lo, hi = max(a, seg.shard_start), min(b, seg.shard_start + seg.chunk)
        if lo < hi:
            yield seg.index, lo - seg.shard_start, hi - seg.shard_start


def _write_ranges(store: ShardStore, a: int, values: torch.Tensor) -> None:
    for s, lo, hi in _ranges(store.layout, a, a + values.numel()):
        start = store.layout.segments[s].shard_start
        store.write_chunk(s, values[lo + start - a : hi + start - a], lo)


class MemoryShard:
    """A shard in one memory buffer; every chunk is a view of it.

    ``buffer`` is the shard itself (stage 3) or, when parameters are whole (stages 0-2),
    their full flat buffer, with ``views`` this rank's chunk of each segment in it."""

    kinds = ("param",)

    def __init__(
        self,
        buffer: torch.Tensor,
        layout: ChunkLayout,
        views: list[torch.Tensor] | None = None,
        *,
        upload_numel: int = _UPLOAD_NUMEL,
    ) -> None:
        self.buffer, self.layout = buffer, layout
        if views is None:
            views = [buffer[s.shard_start : s.shard_start + s.chunk] for s in layout.segments]
        self.views = views
        self.dtype, self.device = buffer.dtype, buffer.device
        #: elements of the device buffer that host values of another dtype pass through
        self.upload_numel = upload_numel
        self._upload: torch.Tensor | None = None  # see _upload_and_cast

    @classmethod
    def empty(
        cls, layout: ChunkLayout, dtype: torch.dtype, device, pin: bool, **kwargs
    ) -> MemoryShard:
        # empty, not zeros: pages get touched as values arrive, so building the shard
        # while zero.Init's slices are released one by one does not double the peak
        buf = torch.empty(layout.shard_numel, dtype=dtype, device=device, pin_memory=pin)
        return cls(buf, layout, **kwargs)

    # -- per segment --------------------------------------------------------------------
    def lend(self, s: int) -> torch.Tensor:
        return self.views[s]

    def chunk(self, s: int) -> torch.Tensor:
        return self.views[s]

    def give_back(self, buf: torch.Tensor) -> None:
        pass

    def fill(self, s: int) -> torch.Tensor:
        return self.views[s]

    def commit(self, s: int, buf: torch.Tensor) -> None:
        pass

    def write_chunk(self, s: int, values: torch.Tensor, lo: int = 0) -> None:
        """Non-blocking from page-locked host memory, on the current stream: what the
        device computes next is ordered after it; the host must not rewrite ``values``
        before an event recorded after it (the optimizer's write-back records one)."""
        dst = self.views[s][lo : lo + values.numel()]
        rt = runtime(values.device if dst.device.type == "cpu" else dst.device)
        if dst.device != values.device and dst.dtype != values.dtype:
            self._upload_and_cast(rt, dst, values)
        else:
            rt.copy(dst, values, non_blocking=True)

    def _upload_and_cast(self, rt, dst: torch.Tensor, values: torch.Tensor) -> None:
        """Host ``values`` into a device chunk of another dtype (fp32 masters into bf16
        parameters). ``copy_`` would cast on the host into a pageable temporary, whose
        upload then blocks the host: instead the values go as they are (from pinned
        memory: without blocking) into a device buffer of at most ``upload_numel``
        elements, and the device casts. One buffer is enough: the copies and casts are
        ordered on the current stream. The buffer is not in ``buffers()``."""
        if values.numel() == 0:
            return
        n = min(values.numel(), self.upload_numel)
        buf = self._upload
        if buf is None or buf.numel() < n or buf.dtype != values.dtype:
            buf = self._upload = torch.empty(n, dtype=values.dtype, device=dst.device)
        for a in range(0, values.numel(), buf.numel()):
            b = min(a + buf.numel(), values.numel())
            part = buf[: b - a]
            rt.copy(part, values[a:b], non_blocking=True)
            rt.copy(dst[a:b], part)  # the cast, on the device

    # -- the protocol -------------------------------------------------------------------
    def read(self, kind: str, a: int, b: int) -> torch.Tensor:
        parts = [self.views[s][lo:hi] for s, lo, hi in _ranges(self.layout, a, b)]
        return torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype)

    def write(self, kind: str, a: int, values: torch.Tensor) -> None:
        _write_ranges(self, a, values)

    def writer(self) -> ChunkWriter:
        return _DirectWriter(self)

    def buffers(self) -> list[torch.Tensor]:
        return [self.buffer]

    def disk_bytes(self) -> int:
        return 0


class SwapShard:
    """A shard in an NVMe swap file; chunks move through a pool of aligned buffers (the
    RAM it holds). Chunk offsets are whole disk blocks (``FlatLayout(align=...)``)."""

    kinds = ("param",)
    device = torch.device("cpu")

    def __init__(
        self, file: SwapFile, pool: BufferPool, layout: ChunkLayout, dtype: torch.dtype
    ) -> None:
        self.file, self.pool, self.layout, self.dtype = file, pool, layout, dtype
        self.esize = torch.empty((), dtype=dtype).element_size()

    def _offset(self, s: int, lo: int = 0) -> int:
        return (self.layout.segments[s].shard_start + lo) * self.esize

    def _read_into(self, s: int, raw: torch.Tensor) -> torch.Tensor:
        self.file.read(raw, self._offset(s))
        return raw.view(self.dtype)[: self.layout.segments[s].chunk]

    # -- per segment --------------------------------------------------------------------
    def lend(self, s: int) -> torch.Tensor | None:
        raw = self.pool.acquire(self.layout.segments[s].chunk * self.esize)
        return None if raw is None else self._read_into(s, raw)

    def give_back(self, buf: torch.Tensor) -> None:
        self.pool.give_back(buf)

    def chunk(self, s: int) -> torch.Tensor:
        """A fresh copy of chunk ``s`` (outside the pool)."""
        return self._read_into(s, aligned_empty(self.layout.segments[s].chunk * self.esize))

    def fill(self, s: int) -> torch.Tensor:
        return aligned_empty(self.layout.segments[s].chunk * self.esize).view(self.dtype)

    def commit(self, s: int, buf: torch.Tensor) -> None:
        self.file.write(buf, self._offset(s))

    def write_chunk(self, s: int, values: torch.Tensor, lo: int = 0) -> None:
        """Whole chunks are written as they are; a part of one is read, patched and
        written back whole (swap I/O moves whole disk blocks)."""
        chunk = self.layout.segments[s].chunk
        raw = self.pool.acquire(chunk * self.esize)
        buf = raw if raw is not None else aligned_empty(chunk * self.esize)
        if lo or values.numel() != chunk:
            self.file.read(buf, self._offset(s))
        buf.view(self.dtype)[lo : lo + values.numel()].copy_(values)
        self.file.write(buf, self._offset(s))
        if raw is not None:
            self.pool.give_back(raw)

    # -- the protocol -------------------------------------------------------------------
    def read(self, kind: str, a: int, b: int) -> torch.Tensor:
        parts = [self.chunk(s)[lo:hi] for s, lo, hi in _ranges(self.layout, a, b)]
        return torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype)

    def write(self, kind: str, a: int, values: torch.Tensor) -> None:
        _write_ranges(self, a, values)

    def writer(self) -> ChunkWriter:
        return _SwapWriter(self)

    def buffers(self) -> list[torch.Tensor]:
        return self.pool.buffers()

    def disk_bytes(self) -> int:
        return self.file.nbytes


class _SwapWriter:
    """A swapped store's writer: a chunk is assembled in one buffer (from the pool when
    one is free) and written once, whole. A chunk entered past its start has its head
    read from the file first; one left before its end, its tail."""

    def __init__(self, shard: SwapShard) -> None:
        self.shard = shard
        self.s: int | None = None
        self.raw = torch.empty(0, dtype=torch.uint8)  # the chunk's bytes being assembled
        self.pooled = False
        self.end = 0  # chunk elements assembled so far: [0, end)

    def put(self, a: int, values: torch.Tensor) -> None:
        layout = self.shard.layout
        for s, lo, hi in _ranges(layout, a, a + values.numel()):
            if s != self.s or lo != self.end:
                self.close()
                self._open(s, lo)
            start = layout.segments[s].shard_start
            self._chunk()[lo:hi].copy_(values[start + lo - a : start + hi - a])
            self.end = hi
            if hi == layout.segments[s].chunk:
                self.close()

    def _chunk(self) -> torch.Tensor:
        assert self.s is not None
        return self.raw.view(self.shard.dtype)[: self.shard.layout.segments[self.s].chunk]

    def _open(self, s: int, lo: int) -> None:
        shard = self.shard
        nbytes = shard.layout.segments[s].chunk * shard.esize
        raw = shard.pool.acquire(nbytes)
        self.pooled = raw is not None
        self.raw = raw if raw is not None else aligned_empty(nbytes)
        if lo:  # the head is not ours to write: it comes from the file
            shard.file.read(self.raw, shard._offset(s))
        self.s, self.end = s, lo

    def close(self) -> None:
        if self.s is None:
            return
        shard, s = self.shard, self.s
        chunk = shard.layout.segments[s].chunk
        try:
            if self.end < chunk:  # the tail keeps its stored values
                self._chunk()[self.end :].copy_(shard.chunk(s)[self.end :])
            shard.file.write(self.raw, shard._offset(s))
        finally:
            if self.pooled:
                shard.pool.give_back(self.raw)
            self.s, self.raw, self.pooled = None, torch.empty(0, dtype=torch.uint8), False
