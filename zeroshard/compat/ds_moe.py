"""DeepSpeed's ``deepspeed.moe.layer`` / ``deepspeed.moe.utils`` names, importable so that
code which merely mentions mixture-of-experts (DeepSpeed's test helpers, optimizers that
split expert parameters into groups) runs. The MoE layer itself is not built yet
(issue 34): constructing :class:`MoE` raises, naming it. No communication.

The helpers answer as DeepSpeed's do for models without expert parameters; a parameter
marked as an expert's (``param.allreduce = False``, as DeepSpeed's MoE marks them) is
refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zeroshard import ArgumentError, NotBuiltError

_NOT_BUILT = "mixture-of-experts layers (deepspeed.moe) are not built yet in zeroshard (issue 34)"


class MoE(nn.Module):
    """DeepSpeed's ``deepspeed.moe.layer.MoE``: not built yet (issue 34)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotBuiltError(f"deepspeed.moe.layer.MoE: {_NOT_BUILT}")


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is marked as an expert's (``param.allreduce`` is False)."""
    return getattr(param, "allreduce", True) is False


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """``(True, num_experts)`` of the first MoE layer in ``m``, else ``(False, 0)``."""
    for module in m.modules():
        if isinstance(module, MoE):
            return True, int(getattr(module, "num_experts", 0))
    return False, 0


def _refuse_experts(params, what: str) -> None:
    for p in params:
        if is_moe_param(p):
            raise NotBuiltError(f"{what}: an expert parameter was given; {_NOT_BUILT}")


def split_params_into_shared_and_expert_params(
    params: list[nn.Parameter],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(shared, expert)``; expert parameters are refused (issue 34)."""
    params = list(params)
    _refuse_experts(params, "split_params_into_shared_and_expert_params")
    return params, []


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict | tuple | list, max_group_size: int | float | None = 178956971
) -> list[dict]:
    """DeepSpeed's optimizer-group split: expert parameters would move into groups of
    their own. Without expert parameters the groups come back as given (as a list);
    with one it raises (issue 34)."""
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (list, tuple)):
        groups = list(param_groups)
    else:
        raise ArgumentError(f"Unknown param group type of {type(param_groups)}")
    for g in groups:
        _refuse_experts(g["params"], "split_params_into_different_moe_groups_for_optimizer")
    return groups


def is_moe_param_group(param_group: dict) -> bool:
    return bool(param_group.get("moe", False))


def configure_moe_param_groups(model_parameters: list) -> list:
    """DeepSpeed's ``configure_moe_param_groups``: model parameters (or groups) with no
    expert parameters come back as param groups unchanged; experts are refused."""
    params = list(model_parameters)
    if params and isinstance(params[0], dict):
        return split_params_into_different_moe_groups_for_optimizer(params)
    _refuse_experts(params, "configure_moe_param_groups")
    return [{"params": params, "name": "dense-params"}]


def _expert_groups_not_built(name: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotBuiltError(
            f"deepspeed.utils.groups.{name}: expert-parallel groups of {_NOT_BUILT}"
        )

    refuse.__name__ = refuse.__qualname__ = name
    return refuse


#: ``deepspeed.utils.groups``: its expert-parallel process groups exist for MoE layers
#: only; importing the module works, each function raises NotBuiltError when called
GROUPS = {
    name: _expert_groups_not_built(name)
    for name in (
        "_create_expert_and_data_parallel",
        "_create_expert_data_and_model_parallel",
        "_get_expert_parallel_group",
        "_get_expert_parallel_group_dict",
        "_get_expert_data_parallel_group",
        "_get_expert_data_parallel_group_dict",
        "_get_expert_parallel_world_size",
        "_get_expert_parallel_rank",
        "_get_expert_data_parallel_world_size",
        "_get_expert_data_parallel_rank",
    )
}
