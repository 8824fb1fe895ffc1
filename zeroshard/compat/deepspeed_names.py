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


def _runtime_config_names() -> dict:
    """``deepspeed.runtime.config``'s optimizer type names (the config's ``optimizer.type``,
    lower-cased as DeepSpeed compares them); its ``DeepSpeedConfig`` is zeroshard's
    ``load_config`` and is not served under that name."""
    from zeroshard.config import OPTIMIZER_TYPES

    names = {
        "ADAGRAD_OPTIMIZER": "adagrad",
        "ADAM_OPTIMIZER": "adam",
        "ADAMW_OPTIMIZER": "adamw",
        "LAMB_OPTIMIZER": "lamb",
        "ONEBIT_ADAM_OPTIMIZER": "onebitadam",
        "ZERO_ONE_ADAM_OPTIMIZER": "zerooneadam",
        "ONEBIT_LAMB_OPTIMIZER": "onebitlamb",
        "MUADAM_OPTIMIZER": "muadam",
        "MUADAMW_OPTIMIZER": "muadamw",
        "MUSGD_OPTIMIZER": "musgd",
        "LION_OPTIMIZER": "lion",
    }
    return {**names, "DEEPSPEED_OPTIMIZERS": sorted(t.lower() for t in OPTIMIZER_TYPES)}


def _repeating_loader() -> type:
    from zeroshard.compat.utils import RepeatingLoader

    return RepeatingLoader


def _groups_names() -> dict:
    from zeroshard.compat import ds_moe

    return ds_moe.GROUPS


def _engine_names() -> dict:
    from zeroshard.runtime.engine import DeepSpeedEngine

    return {"DeepSpeedEngine": DeepSpeedEngine}


def _zero_optimizer_names() -> dict:
    """DeepSpeed's ZeRO optimizer classes (``stage_1_and_2.DeepSpeedZeroOptimizer``,
    ``stage3.DeepSpeedZeroOptimizer_Stage3``): zeroshard has one sharded optimizer for
    every stage, which ``isinstance`` checks against either name accept."""
    from zeroshard.zero.optim.optimizer import ShardedOptimizer

    return {
        "DeepSpeedZeroOptimizer": ShardedOptimizer,
        "DeepSpeedZeroOptimizer_Stage3": ShardedOptimizer,
    }


def _zero_runtime_names() -> dict:
    from zeroshard.compat import ds_zero_names as z

    return {
        **_zero_names(),
        "ZeroParamStatus": z.ZeroParamStatus,
        "DeepSpeedZeroConfig": z.DeepSpeedZeroConfig,
        "unwrap_model_for_generation": z.unwrap_model_for_generation,
    }


def _zero_utils_names() -> dict:
    from zeroshard.compat import ds_zero_names as z

    return {"ZeRORuntimeException": z.ZeRORuntimeException}


def _fp16_names() -> dict:
    from zeroshard.compat import ds_zero_names as z

    return {"FP16_Optimizer": z.FP16_Optimizer, "FP16_UnfusedOptimizer": z.FP16_UnfusedOptimizer}


def _activation_checkpointing() -> dict:
    from zeroshard.activation import checkpointing

    names = {
        n: getattr(checkpointing, n) for n in ("checkpoint", "configure", "is_configured", "reset")
    }
    # zeroshard's checkpoint() is torch's non-reentrant checkpoint already
    return {**names, "non_reentrant_checkpoint": checkpointing.checkpoint}


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """``deepspeed.checkpoint.utils.get_model_ckpt_name_for_rank``: where DeepSpeed writes
    a model-parallel rank's model states (zeroshard's checkpoints have no such file)."""
    return os.path.join(base_folder, f"mp_rank_{mp_rank_str}_model_states.pt")


def _partition_parameters() -> dict:
    from zeroshard.compat import ds_zero_names as z
    from zeroshard.compat.accelerator import get_accelerator

    return {
        **_zero_names(),
        "zero_wrapper_for_fp_tensor_constructor": zero_wrapper_for_fp_tensor_constructor,
        "_orig_torch_arange": _orig_torch_arange,
        "get_accelerator": get_accelerator,
        "ZeroParamStatus": z.ZeroParamStatus,
        "partitioned_param_data_shape": z.partitioned_param_data_shape,
    }


def _zero_config_names() -> dict:
    from zeroshard.compat import ds_zero_names as z

    return {
        "DeepSpeedZeroConfig": z.DeepSpeedZeroConfig,
        "DeepSpeedZeroOffloadParamConfig": z.DeepSpeedZeroOffloadParamConfig,
        "DeepSpeedZeroOffloadOptimizerConfig": z.DeepSpeedZeroOffloadOptimizerConfig,
        "OffloadDeviceEnum": z.OffloadDeviceEnum,
        "OffloadStateTypeEnum": z.OffloadStateTypeEnum,
    }


def _runtime_utils() -> dict:
    from zeroshard.compat import ds_runtime_utils as u

    return {
        name: getattr(u, name)
        for name in (
            "prefix_sum_inc",
            "partition_uniform",
            "partition_balanced",
            "PartitionedTensor",
            "see_memory_usage",
            "move_to_device",
            "call_to_str",
        )
    }


def _ops_names(what: str) -> Callable[[], dict]:
    def names() -> dict:
        from zeroshard.compat import ds_ops

        if what == "aio":
            return {"AsyncIOBuilder": ds_ops.BUILDERS["AsyncIOBuilder"]}
        return ds_ops.op_builder_names()

    return names


def _version_names() -> dict:
    from zeroshard.compat import ds_version as v

    git_hash, git_branch = v.git_info()
    return {
        "version": v.DEEPSPEED_VERSION,
        "git_hash": git_hash,
        "git_branch": git_branch,
        "torch_info": v.torch_info(),
        "installed_ops": _compatible_ops(),
        "compatible_ops": _compatible_ops(),
    }


def _compatible_ops() -> dict:
    from zeroshard.compat.ds_ops import COMPATIBLE_OPS

    return dict(COMPATIBLE_OPS)


def _torch_utils() -> dict:
    from zeroshard.compat.ds_version import required_torch_version

    return {"required_torch_version": required_torch_version}


def _zero_to_fp32() -> dict:
    from zeroshard.compat import zero_to_fp32 as z

    return {name: getattr(z, name) for name in z.__all__}


def _checkpoint_names() -> dict:
    return {
        "clone_tensors_for_torch_save": clone_tensors_for_torch_save,
        "get_model_ckpt_name_for_rank": get_model_ckpt_name_for_rank,
    }


#: DeepSpeed module -> a zeroshard module (str) or a function giving its names (dict)
MODULES: dict[str, str | Callable[[], dict[str, Any]]] = {
    "deepspeed": "zeroshard",
    "deepspeed.comm": "zeroshard.comm",
    "deepspeed.zero": "zeroshard.zero",
    "deepspeed.utils": "zeroshard.compat.utils",
    "deepspeed.utils.zero_to_fp32": _zero_to_fp32,
    "deepspeed.utils.torch": _torch_utils,
    "deepspeed.git_version_info": _version_names,
    "deepspeed.accelerator": "zeroshard.compat.accelerator",
    "deepspeed.ops": "zeroshard.ops",
    "deepspeed.ops.adam": "zeroshard.ops.adam",
    "deepspeed.ops.op_builder": _ops_names("builders"),
    "deepspeed.ops.aio": _ops_names("aio"),
    "deepspeed.moe": "zeroshard.moe",  # DeepSpeed-MoE: MoE, its gate, experts and utils
    "deepspeed.moe.layer": "zeroshard.moe.layer",
    "deepspeed.moe.experts": "zeroshard.moe.layer",
    "deepspeed.moe.sharded_moe": "zeroshard.moe.sharded_moe",
    "deepspeed.moe.utils": "zeroshard.moe.utils",
    "deepspeed.pipe": "zeroshard.pipe",  # user code: PipelineModule, LayerSpec
    "deepspeed.checkpointing": "zeroshard.checkpointing",  # activation checkpointing
    "deepspeed.runtime": lambda: {},
    "deepspeed.runtime.engine": _engine_names,
    "deepspeed.runtime.pipe": "zeroshard.pipe",
    "deepspeed.runtime.utils": _runtime_utils,
    "deepspeed.runtime.zero": _zero_runtime_names,
    "deepspeed.runtime.zero.partition_parameters": _partition_parameters,
    "deepspeed.runtime.zero.config": _zero_config_names,
    "deepspeed.runtime.zero.offload_config": _zero_config_names,
    "deepspeed.runtime.zero.stage_1_and_2": _zero_optimizer_names,
    "deepspeed.runtime.zero.stage3": _zero_optimizer_names,
    "deepspeed.runtime.zero.utils": _zero_utils_names,
    "deepspeed.runtime.fp16": lambda: {},
    "deepspeed.runtime.fp16.fused_optimizer": _fp16_names,
    "deepspeed.runtime.fp16.unfused_optimizer": _fp16_names,
    "deepspeed.runtime.activation_checkpointing": lambda: {},
    "deepspeed.runtime.activation_checkpointing.checkpointing": _activation_checkpointing,
    "deepspeed.runtime.lr_schedules": "zeroshard.compat.ds_lr_schedules",
    "deepspeed.runtime.config": _runtime_config_names,
    "deepspeed.runtime.dataloader": lambda: {"RepeatingLoader": _repeating_loader()},
    "deepspeed.utils.groups": _groups_names,
    "deepspeed.checkpoint": lambda: {"UNIVERSAL_CHECKPOINT_INFO": "universal_checkpoint_info"},
    "deepspeed.checkpoint.utils": _checkpoint_names,
    "deepspeed.launcher": lambda: {},
    "deepspeed.launcher.runner": lambda: {"DEEPSPEED_ENVIRONMENT_NAME": DEEPSPEED_ENVIRONMENT_NAME},
}

#: dunder names DeepSpeed modules carry: (module, name) -> a function giving the value
DUNDERS: dict[tuple[str, str], Callable[[], Any]] = {
    ("deepspeed", "__version__"): lambda: _version_names()["version"],
    ("deepspeed", "__git_hash__"): lambda: _version_names()["git_hash"],
    ("deepspeed", "__git_branch__"): lambda: _version_names()["git_branch"],
    ("deepspeed.ops", "__compatible_ops__"): _compatible_ops,
}

#: DeepSpeed modules integrations may import that zeroshard does not build (the reason)
NOT_BUILT = {
    "deepspeed.runtime.sequence_parallel": "DeepSpeed's Ulysses for Hugging Face models "
    "(ALST); zeroshard's sequence parallelism is the config's sequence_parallel_size",
    "deepspeed.ops.adagrad": "DeepSpeed's CPU Adagrad",
    "deepspeed.ops.lion": "DeepSpeed's CPU Lion",
    "deepspeed.runtime.zero.tiling": "DeepSpeed's TiledLinear (splitting a Linear into "
    "tiles gathered one at a time)",
    "deepspeed.runtime.zero.offload_states": "offloading engine states on demand "
    "(engine.offload_states)",
    "deepspeed.runtime.checkpoint_engine": "DeepSpeed's pluggable checkpoint engines "
    "(zeroshard writes its own pickle-free safetensors checkpoints)",
    "deepspeed.runtime.pipe.topology": "DeepSpeed's process-topology classes (zeroshard "
    "builds its mesh from the config)",
    "deepspeed.checkpoint.ds_to_universal": "DeepSpeed's universal-checkpoint conversion "
    "(zeroshard's checkpoints load at any world size and stage as they are)",
    "deepspeed.checkpoint.model_3d_desc": "DeepSpeed's 3D-parallel checkpoint reshaping "
    "(zeroshard's checkpoints load at any world size and stage as they are)",
    "deepspeed.moe.mappings": "DeepSpeed-MoE's tensor-parallel token drop/gather "
    "(experts split by tensor parallelism)",
}
