"""Whole experts for consolidated weights (``save_16bit_model``, the engine's
consolidated state dict, which ``save_pretrained`` writes): each rank holds its
expert-parallel share, so a local entry stands for several global ones (a per-expert
module's parameter for the same local expert on every expert-parallel rank) or for a
bigger one (a fused expert tensor's slices, concatenated along the expert dim).

Communication: :func:`gather_global` all-gathers one tensor over the ``ep`` group
(``ep`` x its bytes); every rank calls it for the same entries, in the same order.
"""

from __future__ import annotations

import torch
from torch import nn

from zeroshard.distributed.comm import Comm
from zeroshard.moe.marks import expert_shard, global_names


def _shard(t: torch.Tensor):
    shard = expert_shard(t)
    return shard if shard is not None and shard.ep > 1 else None


def global_shapes(
    module: nn.Module, name: str, t: torch.Tensor, shape: list[int]
) -> list[tuple[str, list[int]]]:
    """The global entries (name, shape) local entry ``name`` (tensor ``t`` of whole local
    ``shape``: stage 3 may hold a placeholder) stands for."""
    shard = _shard(t)
    if shard is None:
        return [(name, list(shape))]
    if shard.fused_dim is not None:
        full = list(shape)
        full[shard.fused_dim] = shard.num_experts
        return [(name, full)]
    return [(global_names(module, c).get(name, name), list(shape)) for c in range(shard.ep)]


def gather_global(
    module: nn.Module, comm: Comm, name: str, t: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """The global tensors local entry ``name`` stands for (see :func:`global_shapes`):
    every expert-parallel rank's tensor gathered over ``comm`` (the ``ep`` group)."""
    shard = _shard(t)
    if shard is None:
        return [(name, t.detach())]
    local = t.detach().contiguous()
    parts = local.new_empty((comm.world_size, *local.shape))
    comm.all_gather(parts.view(-1), local.view(-1))
    if shard.fused_dim is not None:
        return [(name, torch.cat(list(parts), dim=shard.fused_dim))]
    return [(global_names(module, c).get(name, name), parts[c]) for c in range(shard.ep)]
