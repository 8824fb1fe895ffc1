"""Expert parallelism for Hugging Face MoE models (transformers 5): the sparse blocks of
Mixtral, Qwen2-MoE and Qwen3-MoE keep their router (``gate``, whose logits the model's
``router_aux_loss`` reads), their shared expert (Qwen2-MoE) and their forward; only
their ``experts`` module (fused ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``)
is replaced, in place, by :class:`ExpertParallelExperts` holding this rank's slice
``[first, first + E / ep)`` of each tensor under the same names. Weights map one to
one: the whole tensors are the ranks' slices concatenated along the expert dim
(checkpoints record the split; ``save_16bit_model``, ``zeroshard convert`` and the
engine's consolidated state dict write them whole, so ``save_pretrained`` output loads
into the stock model).

Communication: the token exchange of ``dispatch.py`` in each block's forward (and its
reverse in backward), over the ``ep`` axis.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zeroshard.distributed.comm import Comm
from zeroshard.moe.dispatch import run_experts
from zeroshard.moe.errors import ExpertParallelError
from zeroshard.moe.grouped import default_way, grouped_linear
from zeroshard.moe.marks import ExpertShard, mark_expert

#: preset name (``expert_parallel.preset_model``) -> the fused experts class it converts
PRESETS = {
    "mixtral": "MixtralExperts",
    "qwen2_moe": "Qwen2MoeExperts",
    "qwen3_moe": "Qwen3MoeExperts",
}


def _known(module: nn.Module, preset: str | None) -> bool:
    names = PRESETS.values() if preset is None else [PRESETS[preset]]
    return type(module).__name__ in names


class ExpertParallelExperts(nn.Module):
    """This rank's experts of a transformers sparse block, run as grouped matmuls on the
    rows the token exchange brings. ``way``: ``"grouped_mm"``, ``"bmm"`` or ``"loop"``
    (``grouped.py``)."""

    def __init__(self, stock: nn.Module, comm: Comm | None, way: str | None = None) -> None:
        super().__init__()
        num = int(stock.num_experts)  # type: ignore[arg-type]
        ep = comm.world_size if comm is not None else 1
        rank = comm.rank if comm is not None else 0
        if num % ep:
            raise ExpertParallelError(
                f"expert_parallel.autoep_size: {num} experts of {type(stock).__name__} do not "
                f"split over {ep} expert-parallel ranks"
            )
        local = num // ep
        self.num_experts, self.num_local_experts = num, local
        self.hidden_dim = stock.hidden_dim
        self.intermediate_dim = stock.intermediate_dim
        self.act_fn: Callable[[torch.Tensor], torch.Tensor] = stock.act_fn  # type: ignore[assignment]
        self.comm, self.way = comm, way or default_way()
        #: rows (routed token copies) this rank sent and received in the last forward
        self.rows_sent = self.rows_received = 0
        self.stock_class = type(stock)
        shard = ExpertShard(num_experts=num, ep=ep, ep_rank=rank, fused_dim=0)
        for name in ("gate_up_proj", "down_proj"):
            whole = getattr(stock, name)
            if whole.shape[0] != num:
                raise ExpertParallelError(
                    f"{type(stock).__name__}.{name}: expected {num} experts along dim 0, "
                    f"got shape {tuple(whole.shape)}"
                )
            mine = nn.Parameter(
                whole.detach()[rank * local : (rank + 1) * local].clone(),
                requires_grad=whole.requires_grad,
            )
            mark_expert(mine, shard)
            setattr(self, name, mine)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        comm = self.comm if self.comm is not None and self.comm.world_size > 1 else None
        out, plan = run_experts(hidden_states, top_k_index, self.num_experts, comm, self._rows)
        self.rows_sent, self.rows_received = sum(plan.sent), sum(plan.received)
        # as transformers: each route's output times its weight, in the hidden dtype, summed
        routed = (out * top_k_weights.unsqueeze(-1)).to(hidden_states.dtype)
        return routed.sum(1)

    def _rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        gate_up: torch.Tensor = self.gate_up_proj  # type: ignore[assignment]
        down: torch.Tensor = self.down_proj  # type: ignore[assignment]
        gate, up = grouped_linear(x, gate_up, counts, self.way).chunk(2, dim=-1)
        return grouped_linear(self.act_fn(gate) * up, down, counts, self.way)


def convert_sparse_blocks(
    model: nn.Module, comm: Comm | None, preset: str | None = None, way: str | None = None
) -> list[str]:
    """Replace every known fused-experts module of ``model`` (of ``preset``'s family, or
    any known one) by its expert-parallel slice over ``comm``; returns their names. A
    model with none is an error naming the families looked for."""
    if preset is not None and preset not in PRESETS:
        raise ExpertParallelError(
            f"expert_parallel.preset_model: {preset!r} is not one of {sorted(PRESETS)}"
        )
    found = [(name, m) for name, m in model.named_modules() if _known(m, preset)]
    if not found:
        families = [PRESETS[preset]] if preset else sorted(PRESETS.values())
        raise ExpertParallelError(
            f"expert_parallel.enabled: no MoE experts module of {families} in "
            f"{type(model).__name__}; expert parallelism converts those (or build the "
            "model with deepspeed.moe.layer.MoE)"
        )
    for name, stock in found:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, ExpertParallelExperts(stock, comm, way))
    return [name for name, _ in found]
