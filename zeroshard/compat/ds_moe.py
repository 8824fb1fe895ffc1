"""DeepSpeed's ``deepspeed.utils.groups`` expert-parallel functions, importable so that
code which merely mentions them imports. No communication.

DeepSpeed-MoE itself is built (``zeroshard.moe``, served as ``deepspeed.moe``), but not
DeepSpeed's process-wide registry of expert groups: zeroshard builds the ``ep`` groups
once, at ``initialize``, from the model's ``MoE(ep_size=...)`` layers or the config's
``expert_parallel.autoep_size``, and passes them to the layers and the engine (no
globals). Each function here raises :class:`~zeroshard.NotBuiltError` naming itself when
called.
"""

from __future__ import annotations

from typing import Any

from zeroshard import NotBuiltError

_HOW = (
    "DeepSpeed's global expert-parallel group registry is not built yet in zeroshard; "
    "initialize() builds the expert-parallel groups from the MoE layers' ep_size (or "
    "expert_parallel.autoep_size) and hands them to the layers"
)


def _expert_groups_not_built(name: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotBuiltError(f"deepspeed.utils.groups.{name}: {_HOW}")

    refuse.__name__ = refuse.__qualname__ = name
    return refuse


#: ``deepspeed.utils.groups``: importing the module works, each function raises
#: NotBuiltError when called
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
