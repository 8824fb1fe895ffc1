"""DeepSpeed's ``deepspeed.runtime.utils`` names that user code and tests import:
partitioning helpers, :class:`PartitionedTensor`, ``see_memory_usage``,
``move_to_device`` and ``call_to_str``.

Communication: :meth:`PartitionedTensor.full` gathers the parts over its group (one
all-gather when the parts are equal, else one broadcast per part); nothing else here
communicates.
"""

from __future__ import annotations

import gc
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from zeroshard import ArgumentError
from zeroshard.compat import comm

log = logging.getLogger("zeroshard")


def call_to_str(base: str, *args: Any, **kwargs: Any) -> str:
    """The text of a call: ``call_to_str("f", 3, "a", k=1) == "f(3, 'a', k=1)"`` (each
    argument's ``repr``; keywords in the order given)."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(parts)})"


def prefix_sum_inc(weights: Sequence[float]) -> list[float]:
    """Inclusive running sums: ``[3, 4, 5] -> [3, 7, 12]``."""
    out: list[float] = []
    total: Any = 0
    for w in weights:
        total = total + w
        out.append(total)
    return out


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries ``[0, b1, ..., num_items]`` of ``num_parts`` parts whose sizes differ by
    at most one (the first ``num_items % num_parts`` parts are the larger). With fewer
    items than parts, the first parts hold one item each and the rest are empty."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    base, extra = divmod(num_items, num_parts)
    bounds = [0]
    for p in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if p < extra else 0))
    return bounds


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` contiguous parts of ``weights`` that make the spread
    between the heaviest and the lightest part as small as possible (DeepSpeed's rule,
    ties going to the later cut); with no more weights than parts, as
    :func:`partition_uniform`."""
    n = len(weights)
    if n <= num_parts:
        return partition_uniform(n, num_parts)
    prefix = [0.0, *(float(x) for x in prefix_sum_inc(weights))]
    inf = math.inf
    # state[i][j]: (spread, heaviest, lightest, cut) of the best split of the first i
    # weights into j parts, the last part starting at ``cut``
    state = [[(inf, inf, inf, 0)] * (num_parts + 1) for _ in range(n + 1)]
    state[0][0] = (0.0, 0.0, inf, 0)
    for i in range(1, n + 1):
        for j in range(1, min(i, num_parts) + 1):
            best = state[i][j]
            for k in range(i):
                _, heavy, light, _ = state[k][j - 1]
                part = prefix[i] - prefix[k]
                hi, lo = max(heavy, part), min(light, part)
                spread = hi - lo
                if spread <= best[0]:
                    best = (spread, hi, lo, k)
            state[i][j] = best
    bounds, i = [n], n
    for j in range(num_parts, 0, -1):
        i = state[i][j][3]
        bounds.append(i)
    return bounds[::-1]


class PartitionedTensor:
    """A tensor split evenly (as :func:`partition_uniform` over its elements) across the
    ranks of ``group``; each rank keeps its part (``data()``) and ``full()`` rebuilds the
    whole tensor on every rank."""

    def __init__(self, tensor: torch.Tensor, group, partition_meta=None) -> None:
        self.group = group
        self.num_parts = comm.get_world_size(group)
        self.rank = comm.get_rank(group)
        self.orig_size = list(tensor.size())
        self.orig_device = tensor.device
        self.partition = partition_uniform(tensor.numel(), self.num_parts)
        lo, hi = self.partition[self.rank], self.partition[self.rank + 1]
        self.local_data = tensor.detach().contiguous().view(-1)[lo:hi].clone()
        self.even_split = tensor.numel() % self.num_parts == 0

    @classmethod
    def from_meta(cls, meta: torch.Tensor, local_part: torch.Tensor, group, device=None):
        """Rebuild from :meth:`to_meta` and this rank's part."""
        if meta.dtype != torch.long:
            raise TypeError(f"PartitionedTensor.from_meta: meta must be int64, got {meta.dtype}")
        values = meta.tolist()
        ndim = values[0]
        obj = cls.__new__(cls)
        obj.group = group
        obj.orig_size = values[1 : 1 + ndim]
        obj.num_parts, obj.rank = values[1 + ndim], values[2 + ndim]
        obj.partition = values[3 + ndim :]
        if obj.num_parts != comm.get_world_size(group) or obj.rank != comm.get_rank(group):
            raise ArgumentError(
                f"PartitionedTensor.from_meta: the meta describes part {obj.rank} of "
                f"{obj.num_parts}, this rank is {comm.get_rank(group)} of "
                f"{comm.get_world_size(group)} in the group"
            )
        obj.orig_device = local_part.device if device is None else torch.device(device)
        obj.local_data = local_part.detach()
        obj.even_split = math.prod(obj.orig_size) % obj.num_parts == 0
        return obj

    def full(self, device=None) -> torch.Tensor:
        """The whole tensor on every rank (collective over the group)."""
        device = self.orig_device if device is None else device
        flat = torch.zeros(
            math.prod(self.orig_size), dtype=self.local_data.dtype, device=self.local_data.device
        )
        if self.even_split:
            comm.all_gather_into_tensor(flat, self.local_data.contiguous(), group=self.group)
        else:
            ranks = _group_ranks(self.group, self.num_parts)
            for part in range(self.num_parts):
                lo, hi = self.partition[part], self.partition[part + 1]
                piece = flat[lo:hi]
                if part == self.rank:
                    piece.copy_(self.local_data)
                comm.broadcast(piece, ranks[part], group=self.group)
        return flat.view(self.orig_size).to(device).clone()

    def to_meta(self) -> torch.Tensor:
        """``[ndim, *size, num_parts, rank, *boundaries]`` as an int64 tensor."""
        values = [len(self.orig_size), *self.orig_size, self.num_parts, self.rank, *self.partition]
        return torch.tensor(values, dtype=torch.long, device=self.orig_device)

    def data(self) -> torch.Tensor:
        return self.local_data

    def local_size(self) -> torch.Size:
        return self.local_data.size()

    def full_size(self) -> list[int]:
        return self.orig_size


def _group_ranks(group, size: int) -> list[int]:
    """Global ranks of ``group``'s members, in group order (broadcast takes global ranks)."""
    if group is None:
        return list(range(size))
    import torch.distributed as dist

    return [dist.get_global_rank(group, r) for r in range(size)]


def see_memory_usage(message: str, force: bool = False) -> None:
    """With ``force``, log ``message`` and this process's accelerator memory (rank 0)."""
    if not force or comm.get_rank() != 0:
        return
    from zeroshard.compat.accelerator import get_accelerator

    gc.collect()
    acc = get_accelerator()
    gib = 2**30
    log.info(
        "%s | allocated %.2f GiB, peak %.2f GiB",
        message,
        acc.memory_allocated() / gib,
        acc.max_memory_allocated() / gib,
    )


def move_to_device(item: Any, device, criterion_func: Callable[[Any], bool]) -> Any:
    """Move every item of a (nested) list / tuple / dict that ``criterion_func`` accepts
    to ``device``, in place (its ``.data`` is replaced); returns the same structure."""
    if criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item
