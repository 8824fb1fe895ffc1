"""Flat parameter storage for every trainable parameter of the model. No communication.

:class:`FlatParams` lays the trainable parameters out with one
:class:`~zeroshard.zero.layout.partition.FlatLayout`. Segments may mix optimizer param groups;
inside a segment a group's parameters sit next to each other, so a group's part of any
rank's chunk is one contiguous range and the inner optimizer can step each group with
its own hyperparameters; it gets one view per parameter piece
(:meth:`FlatParams.group_views`), so a parameter without a gradient is skipped as torch
skips it.

When parameters are whole (stages 0-2) it holds the whole flat buffer in the compute
dtype and every parameter's ``.data`` is a view into it, so the optimizer's write-back
and the all-gather after the step update the model in place. When parameters are
sharded (stage 3) it holds only this rank's shard, in a store of
``offload/store.py`` (device memory, CPU memory or an NVMe file); the gatherer in
``zero/params/gatherer.py`` materializes parameters around their use. Either way
:attr:`FlatParams.store` answers for this rank's chunks.
"""

from __future__ import annotations

import torch

from zeroshard import ArgumentError, InternalError
from zeroshard.offload.heap import HeapTrimmer
from zeroshard.offload.store import MemoryShard, ShardStore
from zeroshard.zero.layout.partition import FlatLayout


class FlatParams:
    """Trainable parameters in a flat, segment-padded buffer, split into param groups.

    Args:
        params: trainable parameters in layout order.
        group_of: each parameter's optimizer param-group index.
        hyperparams: per group, its hyperparameters (lr, weight_decay, ...).
        layout: where each parameter sits; ``rank`` owns chunk ``rank`` of each segment.
        device, dtype: where parameters are used, and their (compute) dtype.
        store: stage 3's shard store (``offload/store.py``), empty, for this rank's
            chunks; None keeps parameters whole on ``device`` (stages 0-2).
        value_of: gives a parameter's whole flat value (default: its data); called once
            per parameter, in layout order, on every rank (it may communicate).
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
        store: ShardStore | None = None,
        value_of=None,
    ) -> None:
        if layout.numels != tuple(p.numel() for p in params):
            raise ArgumentError("layout does not match the parameters")
        self.params, self.group_of, self.hyperparams = params, group_of, hyperparams
        self.shapes = [tuple(p.shape) for p in params]  # stage 3 swaps in placeholders
        rank = rank if layout.world_size > 1 else 0  # unsharded: every rank owns it all
        self.layout, self.rank, self.device, self.dtype = layout, rank, device, dtype
        self.full: torch.Tensor | None = None
        value_of = value_of or (lambda p: p.detach().reshape(-1))
        if store is None:
            self.full = torch.zeros(layout.total_numel, dtype=dtype, device=device)
            with torch.no_grad():
                for i, p in enumerate(params):
                    lo, hi = layout.param_range(i)
                    self.full[lo:hi].copy_(value_of(p))
                    p.data = self.full[lo:hi].view_as(p)
            views = [self.full[slice(*seg.chunk_range(rank))] for seg in layout.segments]
            store = MemoryShard(self.full, layout, views)
        else:
            self._fill(store, value_of)
        self.store: ShardStore = store
        # per group: (segment, lo, hi, parameter) of each piece of the group's parameters
        # this rank owns, relative to the chunk, in shard order
        self._pieces: list[list[tuple[int, int, int, int]]] = [[] for _ in hyperparams]
        for piece in layout.pieces(rank):
            g = group_of[piece.param]
            if g >= 0:
                start = layout.segments[piece.segment].shard_start
                lo = piece.shard_lo - start
                self._pieces[g].append((piece.segment, lo, lo + piece.numel, piece.param))

    def _fill(self, store: ShardStore, value_of) -> None:
        """Fill this rank's shard segment by segment (calling ``value_of`` for every
        parameter in layout order, on every rank)."""
        layout, rank = self.layout, self.rank
        owned: dict[int, list] = {}
        for piece in layout.pieces(rank):
            owned.setdefault(piece.param, []).append(piece)
        # the values taken (zero.Init's slices, all-gathered) are freed as they go into
        # the store: their holes are given back as they add up (offload/heap.py)
        trimmer = HeapTrimmer()
        with torch.no_grad():
            for seg in layout.segments:
                dst = store.fill(seg.index)
                c_lo, _c_hi = seg.chunk_range(rank)
                pad = max(c_lo, seg.start + seg.used) - c_lo
                dst[pad:].zero_()  # padding at the end of the segment
                for i in seg.params:
                    value = value_of(self.params[i])
                    for piece in owned.get(i, ()):
                        lo = piece.shard_lo - seg.shard_start
                        dst[lo : lo + piece.numel].copy_(value[piece.param_lo : piece.param_hi])
                    trimmer.freed(value.numel() * value.element_size())
                    del value
                store.commit(seg.index, dst)
        trimmer.flush()

    @property
    def chunks(self) -> list[torch.Tensor] | None:
        """This rank's chunk of each segment, as views, when the store is in memory."""
        return getattr(self.store, "views", None)

    @property
    def num_groups(self) -> int:
        return len(self.hyperparams)

    @property
    def partitioned(self) -> bool:
        """Whether the layout is split across ranks (each owns its chunks: ZeRO 1-3)."""
        return self.layout.world_size > 1

    def group_pieces(self, group: int) -> list[tuple[int, int, int, int]]:
        """``(segment, lo, hi, parameter)``: where each of ``group``'s parameters (the
        part this rank owns) sits in this rank's chunks."""
        return self._pieces[group]

    def group_views(self, per_segment: list[torch.Tensor], group: int) -> list[torch.Tensor]:
        """The sub-views of ``per_segment`` (one tensor per segment shaped like this rank's
        chunk: parameters, gradients or masters) that hold ``group``'s parameters, one
        per parameter piece (so each can be stepped, or skipped, on its own).

        A rank that owns nothing of a group gets one empty view, so that optimizers,
        which refuse empty param lists, still accept it."""
        views = [per_segment[s][lo:hi] for s, lo, hi, _ in self._pieces[group]]
        if not views:
            views = [per_segment[0][:0] if per_segment else torch.empty(0, device=self.device)]
        return views

    def segment_view(self, segment: int) -> torch.Tensor:
        """The whole (padded) segment in the full buffer."""
        seg = self.layout.segments[segment]
        if self.full is None:
            raise InternalError("FlatParams.segment_view: sharded parameters keep no full buffer")
        return self.full[seg.start : seg.start + seg.numel]
