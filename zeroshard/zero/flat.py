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

from zeroshard.zero.partition import FlatLayout


class FlatParams:
    """Trainable parameters in a flat, segment-padded buffer, split into param groups.

    Args:
        params: trainable parameters in layout order.
        group_of: each parameter's optimizer param-group index.
        hyperparams: per group, its hyperparameters (lr, weight_decay, ...).
        full: keep the whole buffer (stages 0-2); else only this rank's shard.
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
        full: bool = True,
        value_of=None,
    ) -> None:
        if layout.numels != tuple(p.numel() for p in params):
            raise ValueError("layout does not match the parameters")
        self.params, self.group_of, self.hyperparams = params, group_of, hyperparams
        rank = rank if layout.world_size > 1 else 0  # unsharded: every rank owns it all
        self.layout, self.rank, self.device, self.dtype = layout, rank, device, dtype
        self.full: torch.Tensor | None = None
        self.shard: torch.Tensor | None = None
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
            # empty, not zeros: pages get touched as values arrive, so building the shard
            # while zero.Init's slices are released one by one does not double the peak
            self.shard = torch.empty(layout.shard_numel, dtype=dtype, device=device)
            for seg in segs:  # the padding at the end of each segment
                c_lo, c_hi = seg.chunk_range(rank)
                pad_lo = max(c_lo, seg.start + seg.used)
                if pad_lo < c_hi:
                    self.shard[
                        seg.shard_start + pad_lo - c_lo : seg.shard_start + seg.chunk
                    ].zero_()
            owned = {}
            for piece in layout.pieces(rank):
                owned.setdefault(piece.param, []).append(piece)
            with torch.no_grad():
                for i, p in enumerate(params):
                    value = value_of(p)
                    for piece in owned.get(i, ()):
                        dst = self.shard[piece.shard_lo : piece.shard_lo + piece.numel]
                        dst.copy_(value[piece.param_lo : piece.param_hi])
            self.chunks = [self.shard[s.shard_start : s.shard_start + s.chunk] for s in segs]
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

    def storage(self) -> torch.Tensor:
        return self.full if self.full is not None else self.shard

    def segment_view(self, segment: int) -> torch.Tensor:
        """The whole (padded) segment in the full buffer."""
        seg = self.layout.segments[segment]
        return self.full[seg.start : seg.start + seg.numel]
