"""The gradient reducer's buckets and their buffers. No communication here: the
reducer (``zero/grads/reducer.py``) reduces what these hold.

Each segment of the :class:`~zeroshard.zero.layout.flat.FlatParams` layout that has a
trainable parameter is a :class:`Bucket`; :func:`make_buckets` orders them like backward
produces them (last layers first), the one global order every rank launches them in.
Sharded gradients (stages 2-3) copy each gradient into a pooled staging buffer of one
segment's size (:class:`Pool`); a point-to-point reduce-scatter receives into a pooled
buffer of (N - 1) / N of a bucket. At most :data:`IN_FLIGHT` buffers of a pool exist, so
the staging memory is about two buckets. :func:`shard_chunks` cuts a shard into one chunk
per segment; :func:`chunk_sum_of_squares` is the fp32 sum of squares of one chunk (the
global norm's term).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zeroshard.zero.grads.states import BucketState
from zeroshard.zero.layout.flat import FlatParams


def chunk_sum_of_squares(c: torch.Tensor) -> torch.Tensor:
    """fp32 sum of squares of one gradient chunk. An fp32 chunk in CPU memory (the
    offloaded shard) goes through BLAS ``dot``, which uses every core: torch's CPU norm
    reduction ran on one (measured, torch 2.11 on a 16-core host: 38 ms per 100M
    elements at any thread count, ``dot`` 7 ms; it was 0.42 s of a 1B model's 0.75 s
    offloaded step)."""
    if c.device.type == "cpu" and c.dtype == torch.float32:
        return torch.dot(c, c)
    return torch.linalg.vector_norm(c, dtype=torch.float32).square()


# reductions in flight at once, at most: each holds a staging bucket (stages 2-3) and a
# receive buffer (point-to-point reduce-scatter); more wait for the oldest
IN_FLIGHT = 2


class Pool:
    """Buffers of one size, at most :data:`IN_FLIGHT` of them: with none free and all
    made, ``take`` returns None (the owner completes its oldest pending reduction, which
    gives its buffer back, and asks again)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.numel, self.dtype, self.device = numel, dtype, device
        self.free: list[torch.Tensor] = []
        self.made = 0

    def take(self) -> torch.Tensor | None:
        if self.free:
            return self.free.pop()
        if self.made >= IN_FLIGHT:
            return None
        return self.make()

    def make(self) -> torch.Tensor:
        self.made += 1
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)


@dataclass(eq=False)
class Bucket:
    segment: int
    order_key: int
    slots: dict[int, tuple[int, int]]  # param index -> (lo, hi) within the segment
    trainable: int  # how many of its parameters receive gradients
    ready: set[int] = field(default_factory=set)
    state: BucketState = BucketState.EMPTY
    staging: torch.Tensor | None = None
    scratch: torch.Tensor | None = None  # the reduce-scatter's receive buffer, if any
    direct: bool = False  # reduced straight into the owned gradient shard
    filled: set[int] = field(default_factory=set)


def reduced_segments(flat: FlatParams) -> list:
    """The segments with a trainable parameter: the only ones reduced and stored (stage 3
    keeps frozen parameters in segments of their own)."""
    return [seg for seg in flat.layout.segments if any(flat.group_of[p] >= 0 for p in seg.params)]


def make_buckets(
    flat: FlatParams, registration_index: dict[int, int] | None
) -> tuple[list[Bucket], list[Bucket]]:
    """One bucket per reduced segment, in launch order, and each parameter's bucket."""
    layout = flat.layout
    reg = registration_index or {}
    buckets: list[Bucket] = []
    bucket_of: list[Bucket] = [None] * len(flat.params)  # type: ignore[list-item]
    for seg in reduced_segments(flat):
        slots = {p: (lo, hi) for p, lo, hi in layout.segment_param_pieces(seg.index)}
        key = min((reg.get(id(flat.params[p]), 1 << 30) for p in seg.params), default=0)
        trainable = sum(flat.group_of[p] >= 0 for p in seg.params)
        bucket = Bucket(seg.index, key, slots, trainable)
        buckets.append(bucket)
        for pi in seg.params:
            bucket_of[pi] = bucket
    # Last layers first: a bucket is complete when its earliest parameter's grad lands.
    buckets.sort(key=lambda b: (-b.order_key, b.segment))
    return buckets, bucket_of


def shard_chunks(
    flat: FlatParams, shard: torch.Tensor, segments: list | None = None
) -> list[torch.Tensor]:
    """Views of ``shard``, one per segment: the chunks of ``segments`` (default: every
    segment with a trainable parameter) end to end, empty for the others."""
    layout = flat.layout
    chunks = [shard[:0]] * len(layout.segments)  # frozen: none
    start = 0
    for seg in layout.segments if segments is None else segments:
        if any(flat.group_of[p] >= 0 for p in seg.params):
            chunks[seg.index] = shard[start : start + seg.chunk]
            start += seg.chunk
    return chunks
