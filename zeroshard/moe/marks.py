"""Which parameters are experts of a mixture-of-experts layer, and their global names.
Pure bookkeeping: no communication.

An expert parameter differs along the expert-parallel (``ep``) axis: rank ``e`` of an
expert-parallel group of ``ep`` ranks holds experts ``[e * local, (e + 1) * local)`` of
the layer's ``num_experts`` (``local = num_experts / ep``). Two layouts exist:

* one module per expert (DeepSpeed's ``Experts``: ``deepspeed_experts.{i}.*``): each
  parameter is one expert's whole tensor, and its *name* carries the local index ``i``;
  the global name puts the global index there (:func:`global_names`);
* experts fused into 3D tensors (transformers 5's ``gate_up_proj`` ``[E, 2I, H]``): this
  rank's tensor is the slice ``[first, first + local)`` of the whole ``[E, ...]`` tensor
  along dim 0, the same name on every rank (``fused_dim`` of its :class:`ExpertShard`;
  checkpoints record it as a split over the ``ep`` axis, ``checkpoint/format.py``).

DeepSpeed's own marks are set too (``param.allreduce = False``, ``param.group_name``),
so ``deepspeed.moe.utils.is_moe_param`` and user code that reads them agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.moe.errors import ExpertParallelError

_ATTR = "zeroshard_expert"
#: the attribute of a module whose children, one per local expert, are indexed by name
EXPERT_LIST_ATTR = "zeroshard_expert_list"


@dataclass(frozen=True, kw_only=True)
class ExpertShard:
    """What an expert parameter is: of a layer of ``num_experts`` experts split over
    ``ep`` ranks, this rank being ``ep_rank``; ``fused_dim`` is the expert dim of a fused
    ``[local, ...]`` tensor (None: the parameter is one expert's own)."""

    num_experts: int
    ep: int
    ep_rank: int
    fused_dim: int | None = None

    def __post_init__(self) -> None:
        if self.num_experts % self.ep:
            raise ExpertParallelError(
                f"expert parallelism: {self.num_experts} experts do not split over "
                f"{self.ep} expert-parallel ranks"
            )
        if not 0 <= self.ep_rank < self.ep:
            raise ExpertParallelError(
                f"expert-parallel rank {self.ep_rank} out of range for {self.ep}"
            )

    @property
    def local(self) -> int:
        return self.num_experts // self.ep

    @property
    def first(self) -> int:
        """The global index of this rank's first expert."""
        return self.ep_rank * self.local


def mark_expert(p: torch.Tensor, shard: ExpertShard, group_name: str | None = None) -> None:
    """Mark ``p`` an expert parameter (and DeepSpeed's ``allreduce``/``group_name``)."""
    if shard.fused_dim is not None and p.shape[shard.fused_dim] != shard.local:
        raise ExpertParallelError(
            f"a fused expert tensor of shape {tuple(p.shape)} does not hold {shard.local} "
            f"experts along dim {shard.fused_dim}"
        )
    setattr(p, _ATTR, shard)
    p.allreduce = False  # type: ignore[attr-defined]
    p.group_name = group_name or f"ep_size_{shard.ep}"  # type: ignore[attr-defined]


def expert_shard(p: torch.Tensor) -> ExpertShard | None:
    """The :class:`ExpertShard` of an expert parameter; None for a dense one."""
    return getattr(p, _ATTR, None)


def is_expert(p: torch.Tensor) -> bool:
    """Whether ``p`` is an expert parameter split over an expert-parallel group of more
    than one rank (its ZeRO group and gradient reduction are the expert-data-parallel
    ones)."""
    shard = expert_shard(p)
    return shard is not None and shard.ep > 1


def global_names(module: nn.Module, ep_rank: int | None = None) -> dict[str, str]:
    """``{local name: global name}`` of the parameters of per-expert modules (the local
    index in the name replaced by the global one), as expert-parallel rank ``ep_rank``
    holds them (default: this rank's). Other names are not listed (they are global)."""
    out: dict[str, str] = {}
    for prefix, m in module.named_modules():
        attr = getattr(m, EXPERT_LIST_ATTR, None)
        if attr is None:
            continue
        experts = getattr(m, attr)
        shard = None
        for p in experts.parameters():
            shard = expert_shard(p)
            break
        if shard is None or shard.ep == 1:
            continue
        first = (shard.ep_rank if ep_rank is None else ep_rank) * shard.local
        base = f"{prefix}.{attr}." if prefix else f"{attr}."
        for i, expert in enumerate(experts):
            for name, _ in expert.named_parameters():
                out[f"{base}{i}.{name}"] = f"{base}{first + i}.{name}"
    return out


def expert_parallel_size(module: nn.Module) -> int:
    """The expert-parallel size the model's marked expert parameters were split for (1:
    none). Every expert parameter must agree."""
    sizes = {s.ep for p in module.parameters() if (s := expert_shard(p)) is not None}
    if len(sizes) > 1:
        raise ExpertParallelError(
            f"expert parallelism: the model's MoE layers use different ep_size values "
            f"{sorted(sizes)}; one expert-parallel size per model is built"
        )
    return sizes.pop() if sizes else 1
