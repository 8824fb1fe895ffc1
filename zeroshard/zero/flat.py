"""Flat parameter storage for every trainable parameter of the model. No communication.

:class:`FlatParams` lays the trainable parameters out with one
:class:`~zeroshard.zero.partition.FlatLayout`. Segments may mix optimizer param groups;
inside a segment a group's parameters sit next to each other, so a group's part of any
rank's chunk is one contiguous range (:meth:`FlatParams.group_views`) and the inner
optimizer can step each group with its own hyperparameters.

When parameters are not sharded (stages 0-2) it holds the whole flat buffer in the
compute dtype and every parameter's ``.data`` is a view into it, so the optimizer's
write-back and the all-gather after the step update the model in place. When parameters
are sharded (stage 3) it holds only this rank's shard; the gatherer in
``zero/parameters.py`` materializes parameters around their use.

``chunks[s]`` is this rank's piece of segment ``s``: a view into the full buffer, or
into the shard.
"""

from __future__ import annotations

import torch

from zeroshard.offload.nvme import aligned_empty
from zeroshard.zero.partition import FlatLayout

# Elements of the device buffer that host values pass through when their dtype differs
# from the parameters' (64 MiB of fp32).
_UPLOAD_NUMEL = 1 << 24


class FlatParams:
    """Trainable parameters in a flat, segment-padded buffer, split into param groups.

    Args:
        params: trainable parameters in layout order.
        group_of: each parameter's optimizer param-group index.
        hyperparams: per group, its hyperparameters (lr, weight_decay, ...).
        full: keep the whole buffer (stages 0-2); else only this rank's shard.
        value_of: gives a parameter's whole flat value (default: its data); called once
            per parameter, in layout order, on every rank (it may communicate).
        shard_device: where the stage-3 shard lives (the CPU with parameter offload).
        swap: a ``SwapFile`` to keep the stage-3 shard in instead of memory (NVMe);
            the layout must then be aligned to whole disk blocks.
        swap_pool: the :class:`~zeroshard.offload.nvme.BufferPool` its reads and writes
            go through (``offload_param.buffer_count`` x ``buffer_size``).
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        group_of: list[int],
        hyperparams: list[dict],
        layout: FlatLayout,
        rank: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        full: bool = True,
        value_of=None,
        shard_device: torch.device | None = None,
        swap=None,
        swap_pool=None,
    ) -> None:
        if layout.numels != tuple(p.numel() for p in params):
            raise ValueError("layout does not match the parameters")
        self.params, self.group_of, self.hyperparams = params, group_of, hyperparams
        self.shapes = [tuple(p.shape) for p in params]  # stage 3 swaps in placeholders
        rank = rank if layout.world_size > 1 else 0  # unsharded: every rank owns it all
        self.layout, self.rank, self.device, self.dtype = layout, rank, device, dtype
        self.full: torch.Tensor | None = None
        self.shard: torch.Tensor | None = None
        self.swap = None  # a SwapFile holding the shard (parameter offload to NVMe)
        self.swap_pool = swap_pool
        self.chunks: list[torch.Tensor] | None = None
        self._upload: torch.Tensor | None = None  # see _upload_and_cast
        segs = layout.segments
        value_of = value_of or (lambda p: p.detach().reshape(-1))
        if full:
            self.full = torch.zeros(layout.total_numel, dtype=dtype, device=device)
            with torch.no_grad():
                for i, p in enumerate(params):
                    lo, hi = layout.param_range(i)
                    self.full[lo:hi].copy_(value_of(p))
                    p.data = self.full[lo:hi].view_as(p)
            self.chunks = [self.full[slice(*seg.chunk_range(rank))] for seg in segs]
        else:
            self.swap = swap
            self._build_shard(params, value_of, shard_device or device)
        # per group, per segment: this rank's owned range of the group, relative to the chunk
        self._spans: list[list[tuple[int, int, int]]] = []
        for g in range(len(hyperparams)):
            spans = []
            for seg in segs:
                members = [p for p in seg.params if group_of[p] == g]
                lo, hi = layout.owned_span(seg.index, members, rank)
                if hi > lo:
                    spans.append((seg.index, lo - seg.shard_start, hi - seg.shard_start))
            self._spans.append(spans)

    def _build_shard(self, params, value_of, where: torch.device) -> None:
        """Fill this rank's shard segment by segment (calling ``value_of`` for every
        parameter in layout order, on every rank)."""
        layout, rank, dtype = self.layout, self.rank, self.dtype
        if self.swap is None:
            # empty, not zeros: pages get touched as values arrive, so building the shard
            # while zero.Init's slices are released one by one does not double the peak
            self.shard = torch.empty(layout.shard_numel, dtype=dtype, device=where)
        owned: dict[int, list] = {}
        for piece in layout.pieces(rank):
            owned.setdefault(piece.param, []).append(piece)
        with torch.no_grad():
            for seg in layout.segments:
                if self.swap is None:
                    dst = self.shard[seg.shard_start : seg.shard_start + seg.chunk]
                else:
                    dst = aligned_empty(seg.chunk * self.esize).view(dtype)
                c_lo, _c_hi = seg.chunk_range(rank)
                pad = max(c_lo, seg.start + seg.used) - c_lo
                dst[pad:].zero_()  # padding at the end of the segment
                for i in seg.params:
                    value = value_of(params[i])
                    for piece in owned.get(i, ()):
                        lo = piece.shard_lo - seg.shard_start
                        dst[lo : lo + piece.numel].copy_(value[piece.param_lo : piece.param_hi])
                if self.swap is not None:
                    self.swap.write(dst, seg.shard_start * self.esize)
        if self.swap is None:
            self.chunks = [
                self.shard[s.shard_start : s.shard_start + s.chunk] for s in layout.segments
            ]

    @property
    def esize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def read_chunk(self, s: int) -> torch.Tensor:
        """This rank's chunk of segment ``s`` (a view, or a buffer read from the swap file)."""
        if self.swap is None:
            return self.chunks[s]
        seg = self.layout.segments[s]
        buf = aligned_empty(seg.chunk * self.esize).view(self.dtype)
        self.swap.read(buf, seg.shard_start * self.esize)
        return buf

    def read_chunk_pooled(self, s: int) -> torch.Tensor | None:
        """Like :meth:`read_chunk` for a swapped shard, into a buffer of the pool (give
        it back with :meth:`release_chunk`); None when every pool buffer is lent out."""
        seg = self.layout.segments[s]
        raw = self.swap_pool.acquire(seg.chunk * self.esize)
        if raw is None:
            return None
        buf = raw.view(self.dtype)[: seg.chunk]
        self.swap.read(raw, seg.shard_start * self.esize)
        return buf

    def release_chunk(self, buf: torch.Tensor) -> None:
        self.swap_pool.release(buf)

    def write_chunk(self, s: int, values: torch.Tensor, lo: int = 0) -> None:
        """Store ``values`` into this rank's chunk of segment ``s`` from element ``lo``."""
        if self.swap is None:
            dst = self.chunks[s][lo : lo + values.numel()]
            if dst.device != values.device and dst.dtype != values.dtype:
                self._upload_and_cast(dst, values)
            else:
                dst.copy_(values, non_blocking=True)
            return
        nbytes = values.numel() * self.esize
        raw = self.swap_pool.acquire(nbytes) if self.swap_pool is not None else None
        buf = (raw if raw is not None else aligned_empty(nbytes)).view(self.dtype)
        buf[: values.numel()].copy_(values)
        self.swap.write(
            buf[: values.numel()], (self.layout.segments[s].shard_start + lo) * self.esize
        )
        if raw is not None:
            self.swap_pool.release(raw)

    def _upload_and_cast(self, dst: torch.Tensor, values: torch.Tensor) -> None:
        """Host ``values`` into a device chunk of another dtype (fp32 masters into bf16
        parameters). ``copy_`` would cast on the host into a pageable temporary, whose
        upload then blocks the host: instead the values go as they are (from pinned
        memory: without blocking) into a device buffer of at most ``_UPLOAD_NUMEL``
        elements, and the device casts. One buffer is enough: the copies and casts are
        ordered on the current stream. The buffer is not in ``memory_stats()``."""
        if values.numel() == 0:
            return
        n = min(values.numel(), _UPLOAD_NUMEL)
        buf = self._upload
        if buf is None or buf.numel() < n or buf.dtype != values.dtype:
            buf = self._upload = torch.empty(n, dtype=values.dtype, device=dst.device)
        for a in range(0, values.numel(), buf.numel()):
            b = min(a + buf.numel(), values.numel())
            part = buf[: b - a]
            part.copy_(values[a:b], non_blocking=True)
            dst[a:b].copy_(part)

    def read_range(self, a: int, b: int) -> torch.Tensor:
        """A copy of shard positions ``[a, b)``."""
        parts = []
        for seg in self.layout.segments:
            lo, hi = max(a, seg.shard_start), min(b, seg.shard_start + seg.chunk)
            if lo < hi:
                chunk = self.read_chunk(seg.index)
                parts.append(chunk[lo - seg.shard_start : hi - seg.shard_start])
        return torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype)

    def write_range(self, a: int, b: int, values: torch.Tensor) -> None:
        """Store ``values`` (``b - a`` elements) at shard positions ``[a, b)``."""
        for seg in self.layout.segments:
            lo, hi = max(a, seg.shard_start), min(b, seg.shard_start + seg.chunk)
            if lo < hi:
                self.write_chunk(seg.index, values[lo - a : hi - a], lo - seg.shard_start)

    def memory(self) -> list[torch.Tensor]:
        """Persistent parameter storage held in memory (with NVMe: the buffer pool)."""
        pool = self.swap_pool.buffers() if self.swap_pool is not None else []
        return [t for t in (self.full, self.shard) if t is not None] + pool

    def nvme_bytes(self) -> int:
        return self.swap.nbytes if self.swap is not None else 0

    @property
    def num_groups(self) -> int:
        return len(self.hyperparams)

    @property
    def sharded(self) -> bool:
        """Whether optimizer state (and so ownership of chunks) is split across ranks."""
        return self.layout.world_size > 1

    def group_views(self, per_segment: list[torch.Tensor], group: int) -> list[torch.Tensor]:
        """The sub-views of ``per_segment`` (one tensor per segment shaped like this rank's
        chunk: parameters, gradients or masters) that hold ``group``'s elements.

        A rank that owns nothing of a group gets one empty view, so that optimizers,
        which refuse empty param lists, still accept it."""
        views = [per_segment[s][lo:hi] for s, lo, hi in self._spans[group]]
        if not views:
            views = [per_segment[0][:0] if per_segment else torch.empty(0, device=self.device)]
        return views

    def storage(self) -> torch.Tensor | None:
        return self.full if self.full is not None else self.shard

    def segment_view(self, segment: int) -> torch.Tensor:
        """The whole (padded) segment in the full buffer."""
        seg = self.layout.segments[segment]
        return self.full[seg.start : seg.start + seg.numel]
