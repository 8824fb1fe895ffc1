"""The key names of a DeepSpeed config that :mod:`zeroshard.config` knows, section by
section, with DeepSpeed's defaults where the parser needs them. Private; data only.

Key names and defaults are facts taken from DeepSpeed's documentation and config classes.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from zeroshard._config_fields import ConfigError, Fields, describe

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

# -- optimizer ------------------------------------------------------------------------
# "max_grad_norm" is known only to explain that DeepSpeed configs use gradient_clipping.
ADAM_PARAMS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "adam_w_mode",
    "bias_correction",
    "fused",
    "torch_adam",
    "max_grad_norm",
)
SGD_PARAMS = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "max_grad_norm")

# Optimizer types DeepSpeed builds itself that zeroshard does not (lower case).
DEEPSPEED_ONLY_OPTIMIZERS = frozenset(
    {
        "adagrad",
        "lamb",
        "lion",
        "muon",
        "onebitadam",
        "zerooneadam",
        "onebitlamb",
        "muadam",
        "muadamw",
        "musgd",
    }
)

# -- scheduler: parameter name -> kind of value --------------------------------------
# lr: number >= 0 or a list of them (one per parameter group); steps: whole >= 0;
# positive: whole >= 1; iteration: whole >= -1; ratio: number in [0, 1]; rate: number >= 0.
_WARMUP = {
    "warmup_min_lr": "lr",
    "warmup_max_lr": "lr",
    "warmup_num_steps": "steps",
    "warmup_type": "warmup_type",
    "last_batch_iteration": "iteration",
}
SCHEDULER_PARAMS: dict[str, dict[str, str]] = {
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": {**_WARMUP, "total_num_steps": "positive"},
    "WarmupCosineLR": {
        "total_num_steps": "positive",
        "warmup_min_ratio": "ratio",
        "warmup_num_steps": "steps",
        "cos_min_ratio": "ratio",
        "warmup_type": "warmup_type",
        "last_batch_iteration": "iteration",
    },
    "OneCycle": {
        "cycle_min_lr": "lr",
        "cycle_max_lr": "lr",
        "decay_lr_rate": "rate",
        "cycle_first_step_size": "positive",
        "cycle_second_step_size": "positive",
        "cycle_first_stair_count": "steps",
        "cycle_second_stair_count": "steps",
        "decay_step_size": "steps",
        "cycle_momentum": "bool",
        "cycle_min_mom": "ratio",
        "cycle_max_mom": "ratio",
        "decay_mom_rate": "rate",
        "last_batch_iteration": "iteration",
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": "lr",
        "lr_range_test_step_size": "positive",
        "lr_range_test_step_rate": "rate",
        "lr_range_test_staircase": "bool",
        "last_batch_iteration": "iteration",
    },
}
SCHEDULER_REQUIRED = {
    "WarmupDecayLR": ("total_num_steps",),
    "WarmupCosineLR": ("total_num_steps",),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr"),
}

# -- precision -------------------------------------------------------------------------
FP16 = (
    "enabled",
    "auto_cast",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
    "fp16_master_weights_and_grads",
    "fused_mode",
)
BF16 = (
    "enabled",
    "immediate_grad_update",
    "check_grad_overflow",
    "bf16_master_weights_and_grads",
    "bf16_optimizer_states",
)
# DeepSpeed's accepted spellings of the data_types dtypes.
DTYPE_SPELLINGS = {
    "fp32": ("fp32", "float32", "float", "torch.float32"),
    "fp16": ("fp16", "float16", "half", "torch.float16"),
    "bf16": ("bf16", "bfloat16", "torch.bfloat16"),
}

# -- zero_optimization -------------------------------------------------------------------
OFFLOAD_PARAM = ("device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu")
OFFLOAD_OPTIMIZER = (
    "device",
    "nvme_path",
    "pin_memory",
    "buffer_count",
    "pipeline_read",
    "pipeline_write",
    "fast_init",
    "ratio",
    "super_offload",
    "convert_grad_on_cpu",
    "cpuadam_cores_perc",
)

# Canonical name -> ("bool" | "int", DeepSpeed default). Defaults of None mean "optional".
ZERO_SCALARS: dict[str, tuple[str, Any]] = {
    "contiguous_gradients": ("bool", True),
    "reduce_scatter": ("bool", True),
    "reduce_bucket_size": ("int", 500_000_000),
    "use_multi_rank_bucket_allreduce": ("bool", True),
    "allgather_partitions": ("bool", True),
    "allgather_bucket_size": ("int", 500_000_000),
    "overlap_comm": ("bool", None),
    "load_from_fp32_weights": ("bool", True),
    "elastic_checkpoint": ("bool", False),
    "sub_group_size": ("int", 1_000_000_000),
    "cpu_offload": ("bool", None),
    "cpu_offload_param": ("bool", None),
    "cpu_offload_use_pin_memory": ("bool", None),
    "stage3_prefetch_bucket_size": ("int", 50_000_000),
    "stage3_param_persistence_threshold": ("int", 100_000),
    "stage3_model_persistence_threshold": ("int", sys.maxsize),
    "stage3_max_live_parameters": ("int", 1_000_000_000),
    "stage3_max_reuse_distance": ("int", 1_000_000_000),
    "stage3_gather_16bit_weights_on_model_save": ("bool", False),
    "stage3_module_granularity_threshold": ("int", 0),
    "stage3_use_all_reduce_for_fetch_params": ("bool", False),
    "stage3_allgather_sequential": ("bool", False),
    "stage3_partition_stream_chunk_size": ("int", 0),
    "ignore_unused_parameters": ("bool", True),
    "legacy_stage1": ("bool", False),
    "round_robin_gradients": ("bool", False),
    "compute_grad_norm": ("bool", True),
    "parameter_alignment": ("bool", False),
    "zero_hpz_partition_size": ("int", 1),
    "zero_quantized_weights": ("bool", False),
    "zero_quantized_nontrainable_weights": ("bool", False),
    "zero_quantized_gradients": ("bool", False),
    "mics_shard_size": ("int", -1),
    "mics_hierarchical_params_gather": ("bool", False),
    "memory_efficient_linear": ("bool", True),
    "pipeline_loading_checkpoint": ("bool", False),
    "override_module_apply": ("bool", True),
    "log_trace_cache_warnings": ("bool", False),
    "enable_sanity_checks": ("bool", False),
    "save_muon_momentum_buffer_in_memory": ("bool", False),
}
# Canonical name -> other accepted names (giving two of them is an error).
ZERO_ALIASES: dict[str, tuple[str, ...]] = {
    "stage3_prefetch_bucket_size": ("prefetch_bucket_size",),
    "stage3_param_persistence_threshold": ("param_persistence_threshold",),
    "stage3_model_persistence_threshold": ("model_persistence_threshold",),
    "stage3_max_live_parameters": ("max_live_parameters",),
    "stage3_max_reuse_distance": ("max_reuse_distance",),
    "stage3_gather_16bit_weights_on_model_save": (
        "gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",
    ),
    "stage3_module_granularity_threshold": ("module_granularity_threshold",),
    "stage3_use_all_reduce_for_fetch_params": ("use_all_reduce_for_fetch_params",),
    "stage3_allgather_sequential": ("allgather_sequential",),
    "stage3_partition_stream_chunk_size": ("partition_stream_chunk_size",),
}
ZERO = (
    "stage",
    *ZERO_SCALARS,
    *(alias for aliases in ZERO_ALIASES.values() for alias in aliases),
    "offload_param",
    "offload_optimizer",
    "zeropp_loco_param",
    "zenflow",
    "leaf_module",
)

# -- other sections ---------------------------------------------------------------------
ACTIVATION_CHECKPOINTING = (
    "partition_activations",
    "cpu_checkpointing",
    "contiguous_memory_optimization",
    "number_checkpoints",
    "synchronize_checkpoint_boundary",
    "profile",
)
AIO = (
    "block_size",
    "queue_depth",
    "intra_op_parallelism",
    "thread_count",
    "single_submit",
    "overlap_events",
    "use_gds",
)
CHECKPOINT = (
    "dir",
    "tag_validation",
    "load_universal",
    "use_node_local_storage",
    "parallel_write",
    "serialization",
    "writer",
)

# Monitoring/logging sections: accepted, recorded in Config.ignored_enabled when on.
MONITORS: dict[str, tuple[str, ...]] = {
    "tensorboard": ("enabled", "output_path", "job_name"),
    "wandb": ("enabled", "group", "team", "project"),
    "csv_monitor": ("enabled", "output_path", "job_name"),
    "comet": (
        "enabled",
        "samples_log_interval",
        "project",
        "workspace",
        "api_key",
        "experiment_name",
        "experiment_key",
        "online",
        "mode",
    ),
    "trackio": ("enabled", "project"),
    "comms_logger": ("enabled", "verbose", "prof_all", "debug", "prof_ops"),
    "flops_profiler": (
        "enabled",
        "recompute_fwd_factor",
        "profile_step",
        "module_depth",
        "top_modules",
        "detailed",
        "output_file",
    ),
}

# Feature sections kept only as raw JSON: their contents are DeepSpeed's business; we
# check that they are objects (and "enabled" a boolean) and refuse them via NOT_BUILT.
FEATURE_SECTIONS = (
    "pipeline",
    "amp",
    "torch_autocast",
    "sparse_attention",
    "compression_training",
    "data_efficiency",
    "curriculum_learning",
    "elasticity",
    "autotuning",
    "hybrid_engine",
    "progressive_layer_drop",
    "eigenvalue",
    "quantize_training",
    "tensor_parallel",
    "expert_parallel",
    "compile",
    "weight_quantization",
    "nebula",
    "datastates",
)

# Top-level booleans accepted as harmless or refused via NOT_BUILT when set.
ACCEPTED_FLAGS = (
    "sparse_gradients",
    "managed_gradient_accumulation",
    "graph_harvesting",
    "disable_python_gc",
    "use_data_before_expert_parallelism",
)

TOP_LEVEL = (
    *BATCH_KEYS,
    "optimizer",
    "scheduler",
    "fp16",
    "bf16",
    "bfloat16",
    "zero_optimization",
    "activation_checkpointing",
    "aio",
    "checkpoint",
    "data_types",
    "gradient_clipping",
    "prescale_gradients",
    "gradient_predivide_factor",
    "communication_data_type",
    "seq_parallel_comm_data_type",
    "gradient_allreduce_op",
    "steps_per_print",
    "seed",
    "wall_clock_breakdown",
    "memory_breakdown",
    "dump_state",
    "dataloader_drop_last",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "disable_allgather",
    "allgather_size",
    "vocabulary_size",
    "sequence_parallel_size",
    "log_level",
    "timers",
    "monitor_config",
    *ACCEPTED_FLAGS,
    *MONITORS,
    *FEATURE_SECTIONS,
)


def _belongs(section: str, names: tuple[str, ...]) -> dict[str, str]:
    return {n: f"it belongs under '{section}'" for n in names if n not in TOP_LEVEL}


# A section's key written at the top level gets a pointer to its section.
TOP_LEVEL_HINTS: dict[str, str] = {
    **_belongs("optimizer.params", ADAM_PARAMS + SGD_PARAMS),
    **_belongs("fp16", FP16),
    **_belongs("activation_checkpointing", ACTIVATION_CHECKPOINTING),
    **_belongs("zero_optimization", ZERO),
}


def tensor_parallel_size(section: Mapping[str, Any] | None) -> int:
    """The tensor-parallel degree a ``tensor_parallel`` section asks for (1 = none):
    ``autotp_size``, or the older ``tp.tp_size``."""
    if section is None:
        return 1
    if not isinstance(section, Mapping):
        raise ConfigError("tensor_parallel", f"expected an object {{...}}, got {describe(section)}")
    f = Fields(section, "tensor_parallel", section.keys())
    size = f.integer("autotp_size", 0, minimum=0)
    tp = f.section("tp")
    if tp is not None:
        size = max(size, Fields(tp, f.at("tp"), tp.keys()).integer("tp_size", 1, minimum=0))
    return max(size, 1)
