"""DeepSpeed's ``deepspeed.moe.utils``: telling expert parameters from shared ones and
splitting optimizer param groups by them. No communication.

zeroshard does not need the split (its engine shards each kind over its own group
whatever the param groups are), but code written for DeepSpeed calls these and passes
the result to ``initialize``: the groups they make (``"moe": True``, ``"name"``) are
taken as ordinary param groups with their hyperparameters.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from zeroshard.moe.errors import ExpertParallelError
from zeroshard.moe.layer import MoE


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """Whether ``m`` holds a ``MoE`` layer, and the first one's ``num_experts``."""
    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert parameter (DeepSpeed's mark: ``allreduce`` False)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(
    params: list[nn.Parameter],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    shared = [p for p in params if not is_moe_param(p)]
    expert = [p for p in params if is_moe_param(p)]
    return shared, expert


def split_params_grads_into_shared_and_expert_params(
    group: list[nn.Parameter],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The gradients of ``group``'s parameters that have one, shared and expert apart
    (each cast to its parameter's dtype)."""
    shared: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
    max_group_size: int | float | None = 178956971,
) -> list[dict[str, Any]]:
    """DeepSpeed's split: each group's expert parameters move to new groups (one per
    expert group name, copying the group's settings, ``"moe": True``, ``"name"`` the
    expert group name), cut into groups of at most ``max_group_size`` elements. Every
    group needs a ``"name"``, as in DeepSpeed. The list is changed in place and
    returned."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ExpertParallelError(f"Unknown param group type of {type(param_groups)}")
    for i, g in enumerate(param_groups):
        if "name" not in g:
            raise KeyError(
                f"split_params_into_different_moe_groups_for_optimizer: param group {i} has "
                "no 'name' (DeepSpeed names each group, e.g. {'params': ..., 'name': 'dense'})"
            )
    names = {p.group_name for g in param_groups for p in g["params"] if is_moe_param(p)}
    moe: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for g in param_groups:
        for key in sorted(names):
            moe[g["name"]][key] = {**g, "name": key, "moe": True, "params": []}
    for g in param_groups:
        keep = []
        for p in g["params"]:
            if is_moe_param(p):
                moe[g["name"]][p.group_name]["params"].append(p)
            else:
                keep.append(p)
        g["params"] = keep
    for by_name in moe.values():
        for g in by_name.values():
            if max_group_size is None:
                param_groups.append(g)
                continue
            chunk: list[nn.Parameter] = []
            size = 0
            chunks: list[list[nn.Parameter]] = []
            for p in g["params"]:
                if size + p.numel() <= max_group_size:
                    chunk.append(p)
                    size += p.numel()
                else:
                    chunks.append(chunk)
                    chunk, size = [p], p.numel()
            if chunk:
                chunks.append(chunk)
            param_groups.extend({**g, "params": c} for c in chunks)
    return param_groups


def is_moe_param_group(param_group: dict) -> bool:
    return bool(param_group.get("moe", False))


def configure_moe_param_groups(model_parameters: list) -> list:
    """DeepSpeed's: parameters (or groups without MoE groups yet) split into MoE-aware
    param groups; groups that have them already are returned as they are."""
    if not isinstance(model_parameters, list):
        raise TypeError("configure_moe_param_groups: model_parameters must be a list")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError(
                "param argument that would be given to the optimizer should be an iterable "
                f"of Tensors or dicts, but got {type(p)}"
            )
    first = model_parameters[0]
    if isinstance(first, nn.Parameter):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": model_parameters, "name": "dense-params"}
        )
    if any("moe" in g for g in model_parameters):
        return model_parameters
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)
