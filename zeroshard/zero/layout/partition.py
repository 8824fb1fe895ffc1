"""Flat-buffer layout and shard ranges: pure index math, no tensors, no communication.

A param group's trainable parameters are laid end to end in one flat buffer, cut into
*segments*. A segment is the unit of communication: a gradient bucket at stages 0-2,
a parameter unit (gathered together) at stage 3. Each segment is padded so that it
splits into ``world_size`` equal *chunks*; rank ``r`` owns chunk ``r`` of every segment.
A rank's *shard* is its chunks laid end to end, so per-rank bytes are the padded total
divided by ``world_size``, and every collective on a segment has equal-sized pieces.

Parameters may straddle chunk (and so rank) boundaries; :meth:`FlatLayout.pieces`
gives, for a rank, which part of which parameter it owns and where that part sits in
its shard.

A segment may be split over fewer ranks than the layout (its *kind* says which group its
collectives run in): expert parameters of a mixture-of-experts layer differ along the
expert-parallel axis, so their segments are split into ``world_size / stride`` chunks
over the expert-data-parallel ranks, and rank ``r`` owns chunk ``r // stride`` of them
(the expert-parallel ranks, adjacent in the ZeRO group's order, hold different experts
in the same place).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zeroshard import ArgumentError


@dataclass(frozen=True)
class Segment:
    """A contiguous run of parameters, padded to ``world_size`` equal chunks."""

    index: int
    start: int  # offset of the segment in the full flat buffer
    numel: int  # padded size, a multiple of world_size
    used: int  # unpadded size (sum of its parameters' numel)
    params: tuple[int, ...]  # indices of its parameters, in layout order
    shard_start: int  # offset of a rank's chunk of this segment within that rank's shard
    world_size: int  # chunks (ranks of the group its collectives run in)
    stride: int = 1  # layout ranks per chunk owner: rank r owns chunk r // stride
    kind: int = 0  # the group its collectives run in (0: the layout's; 1: experts')

    @property
    def chunk(self) -> int:
        return self.numel // self.world_size

    def owner(self, rank: int) -> int:
        """The chunk a layout rank owns (its rank in this segment's group)."""
        return rank // self.stride

    def chunk_range(self, rank: int) -> tuple[int, int]:
        """Range of (layout) ``rank``'s chunk in the full flat buffer."""
        lo = self.start + self.owner(rank) * self.chunk
        return lo, lo + self.chunk


@dataclass(frozen=True)
class Piece:
    """The part of parameter ``param`` owned by one rank.

    Elements ``[param_lo, param_hi)`` of the flattened parameter sit at
    ``[shard_lo, shard_lo + (param_hi - param_lo))`` of that rank's shard.
    """

    param: int
    param_lo: int
    param_hi: int
    shard_lo: int
    segment: int

    @property
    def numel(self) -> int:
        return self.param_hi - self.param_lo


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def greedy_segments(numels: Sequence[int], cap: int | None) -> list[list[int]]:
    """Consecutive parameters packed into segments of at most ``cap`` elements; a
    parameter larger than ``cap`` gets a segment of its own. ``cap`` None: one segment."""
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, n in enumerate(numels):
        if current and cap and size + n > cap:
            groups.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        groups.append(current)
    return groups


class FlatLayout:
    """Where each parameter lives in the flat buffer and which rank owns what.

    Args:
        numels: element count of each parameter, in layout order.
        world_size: number of ranks the shards are split across (1 = unsharded).
        bucket_numel: greedy segment size cap; a parameter larger than the cap gets a
            segment of its own. Ignored when ``groups`` is given.
        groups: explicit segments as lists of parameter indices (contiguous, in order,
            covering every parameter), e.g. one per stage-3 module unit.
        align: each chunk is a multiple of ``align`` elements (vector-friendly offsets).
        kinds: per segment, the group its collectives run in (default all 0).
        strides: per kind, how many adjacent layout ranks share a chunk owner (default
            1): a segment of that kind is split ``world_size // stride`` ways.
    """

    def __init__(
        self,
        numels: Sequence[int],
        world_size: int,
        *,
        bucket_numel: int | None = None,
        groups: Sequence[Sequence[int]] | None = None,
        align: int = 1,
        kinds: Sequence[int] | None = None,
        strides: dict[int, int] | None = None,
    ) -> None:
        if world_size < 1:
            raise ArgumentError(f"world_size must be >= 1, got {world_size}")
        if align < 1:
            raise ArgumentError(f"align must be >= 1, got {align}")
        if any(n < 0 for n in numels):
            raise ArgumentError("parameter sizes must be >= 0")
        self.numels = tuple(int(n) for n in numels)
        self.world_size = world_size
        self.align = align
        if groups is None:
            groups = greedy_segments(self.numels, bucket_numel)
        self._check_groups(groups)
        kinds = list(kinds) if kinds is not None else [0] * len(groups)
        if len(kinds) != len(groups):
            raise ArgumentError(f"{len(kinds)} segment kinds for {len(groups)} segments")
        strides = dict(strides or {})
        for kind, stride in strides.items():
            if stride < 1 or world_size % stride:
                raise ArgumentError(
                    f"stride {stride} of segment kind {kind} does not divide the world size "
                    f"{world_size}"
                )
        self.param_offset: list[int] = [0] * len(self.numels)
        self.param_segment: list[int] = [0] * len(self.numels)
        segments, start, shard_start = [], 0, 0
        for i, members in enumerate(groups):
            used = 0
            for p in members:
                self.param_offset[p] = start + used
                self.param_segment[p] = i
                used += self.numels[p]
            stride = strides.get(kinds[i], 1)
            ways = world_size // stride
            numel = _round_up(used, ways * align)
            seg = Segment(
                i, start, numel, used, tuple(members), shard_start, ways, stride, kinds[i]
            )
            segments.append(seg)
            start += numel
            shard_start += numel // ways
        self.segments: tuple[Segment, ...] = tuple(segments)
        self.total_numel = start
        self.shard_numel = shard_start

    def _check_groups(self, groups: Sequence[Sequence[int]]) -> None:
        flat = [p for g in groups for p in g]
        if flat != list(range(len(self.numels))):
            raise ArgumentError("segments must list every parameter once, in layout order")

    @property
    def used_numel(self) -> int:
        return sum(self.numels)

    def param_range(self, param: int) -> tuple[int, int]:
        """Range of parameter ``param`` in the full flat buffer."""
        lo = self.param_offset[param]
        return lo, lo + self.numels[param]

    def pieces(self, rank: int) -> list[Piece]:
        """Every (part of a) parameter that ``rank`` owns, in shard order."""
        out: list[Piece] = []
        for seg in self.segments:
            c_lo, c_hi = seg.chunk_range(rank)
            for p in seg.params:
                p_lo, p_hi = self.param_range(p)
                lo, hi = max(p_lo, c_lo), min(p_hi, c_hi)
                if lo < hi:
                    out.append(
                        Piece(p, lo - p_lo, hi - p_lo, seg.shard_start + lo - c_lo, seg.index)
                    )
        return out

    def segment_param_pieces(self, segment: int) -> list[tuple[int, int, int]]:
        """``(param, lo, hi)`` of each parameter in ``segment``, relative to the segment start."""
        seg = self.segments[segment]
        return [
            (p, self.param_offset[p] - seg.start, self.param_offset[p] - seg.start + self.numels[p])
            for p in seg.params
        ]

    def owned_span(self, segment: int, members: Sequence[int], rank: int) -> tuple[int, int]:
        """Range, in ``rank``'s shard, of the elements of ``members`` (parameters that
        sit next to each other in ``segment``) that ``rank`` owns; empty if none."""
        seg = self.segments[segment]
        if not members:
            return seg.shard_start, seg.shard_start
        lo = min(self.param_offset[p] for p in members)
        hi = max(self.param_offset[p] + self.numels[p] for p in members)
        if hi - lo != sum(self.numels[p] for p in members):
            raise ArgumentError(
                f"parameters {list(members)} are not contiguous in segment {segment}"
            )
        c_lo, c_hi = seg.chunk_range(rank)
        lo, hi = max(lo, c_lo), min(hi, c_hi)
        if lo >= hi:
            return seg.shard_start, seg.shard_start
        return seg.shard_start + lo - c_lo, seg.shard_start + hi - c_lo
