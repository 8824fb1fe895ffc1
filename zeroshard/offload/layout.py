"""The layout offload/ reads: this rank's shard as chunks of segments. No tensors, no
communication.

Structural types (``typing.Protocol``), so that placement sits below sharding: the
stores here need nothing of ``zero/``. ``zero/layout/partition.FlatLayout`` and its
``Segment`` satisfy them (the type checker holds them to it where a ``FlatLayout`` is
handed to a store).

A rank's *shard* is its chunk of every segment laid end to end: segment ``s``'s chunk
holds ``chunk`` elements from shard position ``shard_start``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class ChunkSegment(Protocol):
    """One segment, as far as this rank's shard goes."""

    @property
    def index(self) -> int: ...

    @property
    def shard_start(self) -> int:
        """Where this rank's chunk of the segment starts in its shard."""

    @property
    def chunk(self) -> int:
        """Elements of the chunk (padding included)."""


class ChunkLayout(Protocol):
    """A rank's shard: its chunk of each segment, in order."""

    @property
    def segments(self) -> Sequence[ChunkSegment]: ...

    @property
    def shard_numel(self) -> int:
        """Elements of the shard (the chunks end to end)."""
