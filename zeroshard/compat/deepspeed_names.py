"""Names integrations import from DeepSpeed's internal modules (``deepspeed.runtime...``,
``deepspeed.checkpoint.utils``, ``deepspeed.launcher.runner``), with zeroshard's meaning.
No communication.

The alias (``deepspeed_alias.py``) serves each DeepSpeed module from one table here;
a name not in it raises the usual ImportError / AttributeError.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from zeroshard import ArgumentError
from zeroshard.runtime.schedulers import SCHEDULERS

#: ``deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES``: the config's scheduler types
VALID_LR_SCHEDULES = sorted(SCHEDULERS)

#: ``deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME``: the per-job environment file
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")


def clone_tensors_for_torch_save(item, device: torch.device | str = "cpu"):
    """``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``: copies of the tensors
    in ``item`` (nested lists, tuples and dicts) on ``device``, owning their storage."""
    if torch.is_tensor(item):
        return item.detach().to(device, copy=True)
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item


def tp_model_init(model, tp_size: int, dtype=None, config=None, **kwargs):
    """``deepspeed.tp_model_init``: returns ``model`` unchanged; ``initialize`` applies
    AutoTP from the config's ``tensor_parallel.autotp_size`` (which must say ``tp_size``)."""
    given = ((config or {}).get("tensor_parallel") or {}).get("autotp_size")
    if config is not None and given != tp_size:
        raise ArgumentError(
            f"tp_model_init: tp_size={tp_size} but the config's tensor_parallel.autotp_size is "
            f"{given!r}; zeroshard applies tensor parallelism at initialize() from the config"
        )
    return model


# ``deepspeed.runtime.zero.partition_parameters``: transformers swaps DeepSpeed's tensor-
# constructor wrapper around zero.Init (to keep torch.arange's dtype). zeroshard's Init
# wraps no constructor, so the swap changes nothing.
def zero_wrapper_for_fp_tensor_constructor(fn, *args, **kwargs):
    return fn


_orig_torch_arange = torch.arange


def _zero_names() -> dict:
    from zeroshard.zero import (
        GatheredParameters,
        Init,
        register_external_parameter,
        unregister_external_parameter,
    )

    return {
        "GatheredParameters": GatheredParameters,
        "Init": Init,
        "register_external_parameter": register_external_parameter,
        "unregister_external_parameter": unregister_external_parameter,
    }


def _partition_parameters() -> dict:
    from zeroshard.compat.accelerator import get_accelerator

    return {
        **_zero_names(),
        "zero_wrapper_for_fp_tensor_constructor": zero_wrapper_for_fp_tensor_constructor,
        "_orig_torch_arange": _orig_torch_arange,
        "get_accelerator": get_accelerator,
    }


def _engine_names() -> dict:
    from zeroshard.runtime.engine import DeepSpeedEngine

    return {"DeepSpeedEngine": DeepSpeedEngine}


#: DeepSpeed module -> a zeroshard module (str) or a function giving its names (dict)
MODULES: dict[str, str | Callable[[], dict[str, Any]]] = {
    "deepspeed": "zeroshard",
    "deepspeed.comm": "zeroshard.comm",
    "deepspeed.zero": "zeroshard.zero",
    "deepspeed.utils": "zeroshard.utils",
    "deepspeed.accelerator": "zeroshard.accelerator",
    "deepspeed.ops": "zeroshard.ops",
    "deepspeed.ops.adam": "zeroshard.ops.adam",
    "deepspeed.pipe": "zeroshard.pipe",  # user code: PipelineModule, LayerSpec
    "deepspeed.checkpointing": "zeroshard.checkpointing",  # activation checkpointing
    "deepspeed.runtime": lambda: {},
    "deepspeed.runtime.engine": _engine_names,
    "deepspeed.runtime.zero": _zero_names,
    "deepspeed.runtime.zero.partition_parameters": _partition_parameters,
    "deepspeed.runtime.lr_schedules": lambda: {"VALID_LR_SCHEDULES": VALID_LR_SCHEDULES},
    "deepspeed.checkpoint": lambda: {},
    "deepspeed.checkpoint.utils": lambda: {
        "clone_tensors_for_torch_save": clone_tensors_for_torch_save
    },
    "deepspeed.moe": "zeroshard.moe",  # DeepSpeed-MoE: MoE, its gate, experts and utils
    "deepspeed.moe.layer": "zeroshard.moe.layer",
    "deepspeed.moe.experts": "zeroshard.moe.layer",
    "deepspeed.moe.sharded_moe": "zeroshard.moe.sharded_moe",
    "deepspeed.moe.utils": "zeroshard.moe.utils",
    "deepspeed.launcher": lambda: {},
    "deepspeed.launcher.runner": lambda: {"DEEPSPEED_ENVIRONMENT_NAME": DEEPSPEED_ENVIRONMENT_NAME},
}

#: DeepSpeed modules integrations may import that zeroshard does not build (the reason)
NOT_BUILT = {
    "deepspeed.runtime.sequence_parallel": "DeepSpeed's Ulysses for Hugging Face models "
    "(ALST); zeroshard's sequence parallelism is the config's sequence_parallel_size",
    "deepspeed.ops.adagrad": "DeepSpeed's CPU Adagrad",
    "deepspeed.ops.lion": "DeepSpeed's CPU Lion",
    "deepspeed.moe.mappings": "DeepSpeed-MoE's tensor-parallel token drop/gather "
    "(experts split by tensor parallelism)",
}
