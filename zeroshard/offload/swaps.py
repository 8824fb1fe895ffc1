"""The NVMe swap resources of one engine: a swap directory per ``nvme_path`` (one per
rank), the stage-3 parameter shard's swap file with its buffer pool, and the Adam whose
masters and moments live in swap files. No communication."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from zeroshard.config.schema import ConfigError
from zeroshard.offload.heap import map_large_allocations
from zeroshard.offload.layout import ChunkLayout
from zeroshard.offload.nvme import BufferPool, SwapSpace
from zeroshard.offload.store import SwapShard
from zeroshard.offload.swapped_adam import FlatShard, SwappedAdam


class EngineSwaps:
    """Builds what NVMe offload needs from the config, for the rank ``rank``."""

    def __init__(self, config, rank: int) -> None:
        self.config, self.rank = config, rank
        self.spaces: dict[str, SwapSpace] = {}

    def space(self, path: str) -> SwapSpace:
        """One swap directory per rank and ``nvme_path``."""
        if path not in self.spaces:
            # RAM bounds NVMe-offloaded runs: freed units and gradients must leave it
            # (offload/heap.py), not stay as holes in the heap
            map_large_allocations()
            # aio.queue_depth = swap requests in flight = I/O threads (each blocks in one)
            threads = self.config.aio.queue_depth
            self.spaces[path] = SwapSpace(path, f"rank{self.rank}", threads=threads)
        return self.spaces[path]

    def param_store(self, path: str, layout: ChunkLayout, dtype: torch.dtype) -> SwapShard:
        """The parameter shard's swap file, read and written through a buffer pool."""
        esize = torch.empty((), dtype=dtype).element_size()
        swap = self.space(path).file("params", layout.shard_numel * esize)
        off = self.config.zero_optimization.offload_param
        # buffer_size (elements) bounds a buffer; none is larger than the largest chunk
        largest = max((seg.chunk for seg in layout.segments), default=0)
        if largest > off.buffer_size:
            raise ConfigError(
                f"zero_optimization.offload_param.buffer_size: {off.buffer_size} elements "
                f"is smaller than this rank's largest parameter chunk ({largest}); "
                "raise it or lower stage3_prefetch_bucket_size / reduce_bucket_size"
            )
        pool = BufferPool(off.buffer_count, largest * esize, "offload_param.buffer_size")
        return SwapShard(swap, pool, layout, dtype)

    def swapped_adam(
        self,
        flat: FlatShard,
        path: str,
        *,
        take_edits: Callable[[torch.Tensor, torch.Tensor], None],
        progress: Callable[[list[tuple[int, int]]], Iterable[tuple[int, int]]] = iter,
        start: int = 0,
    ) -> SwappedAdam:
        """Adam/AdamW over ``flat``'s shard from shard position ``start`` (Twin-Flow keeps
        the positions before it on the device) with its state in swap files under
        ``path`` (``take_edits``, ``progress`` and ``start``: see :class:`SwappedAdam`)."""
        zc, opt = self.config.zero_optimization, self.config.optimizer
        if opt is None or opt.type == "SGD":
            raise ConfigError(
                "zero_optimization.offload_optimizer.device: NVMe offload needs the config's "
                'optimizer to be Adam or AdamW (e.g. "optimizer": {"type": "AdamW"})'
            )
        off = zc.offload_optimizer
        return SwappedAdam(
            flat,
            self.space(path),
            decoupled=opt.type == "AdamW" or opt.adam_w_mode,
            sub_group_numel=int(zc.sub_group_size),
            pipeline_read=off.pipeline_read,
            pipeline_write=off.pipeline_write,
            initial_master=lambda a, b: flat.store.read("param", a, b),
            take_edits=take_edits,
            progress=progress,
            start=start,
        )

    def close(self) -> None:
        """Finish pending I/O and delete this engine's swap directories."""
        for space in self.spaces.values():
            space.close()
        self.spaces.clear()
