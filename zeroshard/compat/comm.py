"""DeepSpeed's module-level ``deepspeed.comm`` names (``zeroshard.comm``): ``get_rank``,
``get_world_size``, ``init_distributed``, the collectives, ``log_summary``.

Collectives called through these go through a :class:`~zeroshard.distributed.comm.Comm`
of ``group`` (default: the world) and are counted in :data:`LEDGER`, the ledger of
module-level calls; ``log_summary()`` prints the comms logger's table
(``monitor/comms.py``). The collectives themselves are ``distributed/comm.py``'s.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from zeroshard import NotBuiltError
from zeroshard.distributed.comm import Comm
from zeroshard.distributed.ledger import Ledger

__all__ = [
    "LEDGER",
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "barrier",
    "broadcast",
    "destroy_process_group",
    "get_backend",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "init_distributed",
    "is_initialized",
    "log_summary",
    "new_group",
    "reduce_scatter_tensor",
]


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> dict | None:
    """DeepSpeed's ``deepspeed.comm.log_summary``: print (rank 0) the comms logger's
    table of the latest engine with ``comms_logger`` enabled; ``return_dict`` returns it."""
    from zeroshard.monitor.comms import log_summary as summary

    return summary(show_straggler=show_straggler, return_dict=return_dict)


LEDGER = Ledger()
ReduceOp = dist.ReduceOp
_OPS = {ReduceOp.SUM: "sum", ReduceOp.AVG: "avg", ReduceOp.MAX: "max"}


def init_distributed(dist_backend: str | None = None, **kwargs) -> None:
    """DeepSpeed's ``deepspeed.comm.init_distributed`` (``zeroshard.init_distributed``)."""
    from zeroshard.distributed.process_group import init_distributed as init

    init(dist_backend=dist_backend, **kwargs)
    from zeroshard.compat.accelerate_env import after_init_distributed

    after_init_distributed(dist_backend)


def is_initialized() -> bool:
    """Whether torch.distributed is initialized. accelerate asks this (and skips
    init_distributed when true) while building its state: see accelerate_env.py."""
    ready = dist.is_available() and dist.is_initialized()
    if ready and "accelerate.state" in sys.modules:
        from zeroshard.compat.accelerate_env import after_init_distributed

        after_init_distributed(None)
    return ready


def get_rank(group=None) -> int:
    """This process's rank in ``group`` (0 without torch.distributed)."""
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    from zeroshard.distributed.process_group import local_rank

    return local_rank()


def get_backend(group=None) -> str | None:
    return dist.get_backend(group) if is_initialized() else None


def _comm(group) -> Comm:
    return Comm(group, LEDGER, "world" if group is None else "group")


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """In place; ``op`` SUM, AVG or MAX (a ``ReduceOp`` or its name)."""
    name = _OPS.get(op, op) if not isinstance(op, str) else op.lower()
    if name not in ("sum", "avg", "max"):
        raise NotBuiltError(f"zeroshard.comm.all_reduce: op {op!r} is not built yet")
    return _comm(group).all_reduce(tensor, name, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    """From global rank ``src``, as torch.distributed."""
    local = dist.get_group_rank(group, src) if group is not None else src
    return _comm(group).broadcast(tensor, local, async_op=async_op)


def all_gather_into_tensor(output, tensor, group=None, async_op: bool = False):
    return _comm(group).all_gather(output, tensor, async_op=async_op)


def reduce_scatter_tensor(output, tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    if op is not ReduceOp.SUM and op != "sum":
        raise NotBuiltError("zeroshard.comm.reduce_scatter_tensor: only SUM is built")
    return _comm(group).reduce_scatter(output, tensor, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None) -> None:
    """Every rank's ``tensor`` into ``tensor_list`` (one flat all-gather)."""
    out = torch.empty((len(tensor_list), *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    _comm(group).all_gather(out.view(-1), tensor.contiguous().view(-1))
    for dst, src in zip(tensor_list, out, strict=True):
        dst.copy_(src)


def barrier(group=None) -> None:
    _comm(group).barrier()


def new_group(ranks: list[int] | None = None, **kwargs):
    """A process group of ``ranks`` (every rank must call it), as torch.distributed's."""
    return dist.new_group(ranks=ranks, **kwargs)


def destroy_process_group(group=None) -> None:
    """Tear down ``group`` (default: the whole torch.distributed state)."""
    dist.destroy_process_group(group)


def get_world_group():
    """The default group (DeepSpeed's ``deepspeed.comm.get_world_group``)."""
    return dist.group.WORLD
