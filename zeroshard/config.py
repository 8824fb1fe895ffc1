"""DeepSpeed-compatible JSON config, parsed into frozen, validated dataclasses.

``load_config(source, dp_world_size=N)`` takes a dict or a path to a JSON file (``//``,
``#`` and ``/* */`` comments and trailing commas allowed, as DeepSpeed's hjson reader
does), checks every key of every section, resolves the batch-size rule for ``N``
data-parallel ranks and returns a :class:`Config`. The first problem raises
:class:`ConfigError`, whose message starts with the dotted key path:
``zero_optimization.stage: expected one of 0, 1, 2, 3, got 4``. Unknown keys get a
"did you mean" suggestion. Checks run in this order: the file, key names and value types
section by section, ranges and cross-field rules, the batch rule, then :data:`NOT_BUILT`.

Semantics carried over from DeepSpeed (facts, not code): key names and defaults;
``train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x
dp_world_size`` with any one of the three derivable from the others (absent, null,
``"auto"`` and 0 all mean "derive it"); optimizer type ``Adam`` meaning decoupled weight
decay unless ``adam_w_mode`` is false; ``"auto"`` elsewhere (written by Hugging Face's
Trainer, which fills it in) meaning "use the default"; stage-3 settings accepted with or
without their ``stage3_`` prefix; duplicate keys in a file rejected.

Like DeepSpeed, offload settings the chosen stage does not use (parameter offload below
stage 3, optimizer offload at stage 0) are ignored; they are dropped from the parsed
sections and named in ``Config.ignored_enabled`` so the engine can warn.

Where we are stricter than DeepSpeed: unknown keys are errors everywhere (DeepSpeed
ignores unknown top-level keys); booleans must be JSON booleans (pydantic would take
``1`` or ``"true"``); NVMe or partial (ratio < 1) optimizer offload below stage 3 is an
error; ``optimizer.params.max_grad_norm`` is an error, as in DeepSpeed's engine. Sections for features DeepSpeed has and we do not (pipeline, MoQ,
...) are kept only in ``Config.raw``.

This module issues no collectives and touches no devices.
"""

from __future__ import annotations

import copy
import operator
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from zeroshard import _config_keys as keys
from zeroshard._config_fields import ConfigError, check, describe
from zeroshard._config_json import read_config_file

__all__ = [
    "NOT_BUILT",
    "AIOConfig",
    "ActivationCheckpointingConfig",
    "BF16Config",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "FP16Config",
    "OffloadConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "load_config",
    "resolve_batch_sizes",
]


# ---------------------------------------------------------------------------------------
# Not built yet. These settings parse, but the library does not implement them yet, so a
# config asking for them fails at load: "<key path>: <feature> is not built yet in
# zeroshard". Delete a row when its feature lands. Rows are checked in order, on the
# fully parsed Config; the first match is reported.
# ---------------------------------------------------------------------------------------
def _raw(config: Config, *path: str) -> Any:
    """A value of the original dict (for sections we keep only as raw JSON)."""
    value: Any = config.raw
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def _on(config: Config, section: str) -> bool:
    """The raw section exists and says ``"enabled": true``."""
    return _raw(config, section, "enabled") is True


# fmt: off
NOT_BUILT: tuple[tuple[str, Callable[[Config], bool], str], ...] = (
    ("zero_optimization.offload_optimizer.super_offload", lambda c: c.zero_optimization.offload_optimizer.super_offload, "SuperOffload"),
    ("zero_optimization.zero_hpz_partition_size", lambda c: c.zero_optimization.zero_hpz_partition_size > 1, "ZeRO++ hierarchical partitioning (hpZ)"),
    ("zero_optimization.zero_quantized_weights", lambda c: c.zero_optimization.zero_quantized_weights, "ZeRO++ quantized weight communication (qwZ)"),
    ("zero_optimization.zero_quantized_nontrainable_weights", lambda c: c.zero_optimization.zero_quantized_nontrainable_weights, "ZeRO++ quantized frozen weights"),
    ("zero_optimization.zero_quantized_gradients", lambda c: c.zero_optimization.zero_quantized_gradients, "ZeRO++ quantized gradient communication (qgZ)"),
    ("zero_optimization.mics_shard_size", lambda c: c.zero_optimization.mics_shard_size > 0, "MiCS sharding"),
    ("zero_optimization.zenflow", lambda c: c.zero_optimization.zenflow is not None, "ZenFlow"),
    ("fp16.fp16_master_weights_and_grads", lambda c: c.fp16.fp16_master_weights_and_grads, "fp16 master weights and gradients"),
    ("bf16.bf16_master_weights_and_grads", lambda c: c.bf16.bf16_master_weights_and_grads, "bf16 master weights and gradients"),
    ("bf16.bf16_optimizer_states", lambda c: c.bf16.bf16_optimizer_states, "bf16 optimizer states"),
    ("optimizer.params.bias_correction", lambda c: c.optimizer is not None and not c.optimizer.bias_correction, "Adam without bias correction"),
    ("data_types.param_dtype", lambda c: _raw(c, "data_types", "param_dtype") is not None, "a parameter dtype override"),
    ("data_types.buffer_dtype", lambda c: _raw(c, "data_types", "buffer_dtype") is not None, "a buffer dtype override"),
    ("gradient_allreduce_op", lambda c: str(_raw(c, "gradient_allreduce_op")).lower() == "sum", "summed (not averaged) gradient reduction"),
    ("managed_gradient_accumulation", lambda c: _raw(c, "managed_gradient_accumulation") is False, "unmanaged gradient accumulation"),
    ("sparse_gradients", lambda c: _raw(c, "sparse_gradients") is True, "sparse (CSR) gradients"),
    ("graph_harvesting", lambda c: _raw(c, "graph_harvesting") is True, "CUDA graph harvesting"),
    ("pipeline", lambda c: _raw(c, "pipeline") is not None, "pipeline parallelism"),
    ("amp", lambda c: _on(c, "amp"), "Apex AMP"),
    ("torch_autocast", lambda c: _on(c, "torch_autocast"), "torch.autocast mixed precision"),
    ("sparse_attention", lambda c: _raw(c, "sparse_attention") is not None, "sparse attention"),
    ("compression_training", lambda c: _raw(c, "compression_training") is not None, "compression training"),
    ("data_efficiency", lambda c: _on(c, "data_efficiency"), "the data efficiency library"),
    ("curriculum_learning", lambda c: _on(c, "curriculum_learning"), "curriculum learning"),
    ("elasticity", lambda c: _on(c, "elasticity"), "elastic training"),
    ("autotuning", lambda c: _on(c, "autotuning"), "the autotuner"),
    ("hybrid_engine", lambda c: _on(c, "hybrid_engine"), "the hybrid (RLHF) engine"),
    ("progressive_layer_drop", lambda c: _on(c, "progressive_layer_drop"), "progressive layer drop"),
    ("eigenvalue", lambda c: _on(c, "eigenvalue"), "eigenvalue computation"),
    ("quantize_training", lambda c: _on(c, "quantize_training"), "quantization-aware training (MoQ)"),
    ("tensor_parallel", lambda c: keys.tensor_parallel_size(_raw(c, "tensor_parallel")) > 1, "tensor parallelism (AutoTP)"),
    ("sequence_parallel_size", lambda c: (_raw(c, "sequence_parallel_size") or 1) > 1, "sequence parallelism"),
    ("expert_parallel", lambda c: _on(c, "expert_parallel"), "expert parallelism (AutoEP)"),
    ("compile", lambda c: _raw(c, "compile", "deepcompile") is True, "DeepCompile"),
    ("weight_quantization", lambda c: _raw(c, "weight_quantization") is not None, "weight quantization"),
    ("nebula", lambda c: _on(c, "nebula"), "the Nebula checkpoint engine"),
    ("datastates", lambda c: _on(c, "datastates"), "the DataStates checkpoint engine"),
)
# fmt: on


# ---------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------
OPTIMIZER_TYPES = ("Adam", "AdamW", "SGD")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The ``optimizer`` section: the torch optimizer the engine builds on each shard.

    As in DeepSpeed, type ``"Adam"`` means decoupled weight decay (AdamW) unless
    ``adam_w_mode`` is false, and ``"AdamW"`` is always decoupled; see
    :attr:`decoupled_weight_decay`. ``"auto"`` for lr/betas/eps/weight_decay (Hugging
    Face's Trainer fills these from its TrainingArguments) gives torch's defaults here.
    """

    #: "Adam", "AdamW" or "SGD" (the JSON may use any letter case).
    type: str
    #: Learning rate before any scheduler.
    lr: float = 1e-3
    #: Adam(W): decay rates of the first and second moment estimates.
    betas: tuple[float, float] = (0.9, 0.999)
    #: Adam(W): term added to the denominator.
    eps: float = 1e-8
    #: Weight decay; decoupled or L2 as :attr:`decoupled_weight_decay` says.
    weight_decay: float = 0.0
    #: Adam only: true = decoupled weight decay (AdamW), false = Adam with L2 decay.
    adam_w_mode: bool = True
    #: Adam(W): use the AMSGrad variant.
    amsgrad: bool = False
    #: Adam(W): bias-correct the moment estimates (DeepSpeed FusedAdam's switch).
    bias_correction: bool = True
    #: Adam(W): torch's ``fused`` flag; None lets torch choose.
    fused: bool | None = None
    #: SGD: momentum factor.
    momentum: float = 0.0
    #: SGD: dampening for momentum.
    dampening: float = 0.0
    #: SGD: Nesterov momentum (needs momentum > 0 and dampening 0).
    nesterov: bool = False

    def __post_init__(self) -> None:
        check(self.type in OPTIMIZER_TYPES, "type", f"expected one of {OPTIMIZER_TYPES}")
        betas = tuple(self.betas)
        object.__setattr__(self, "betas", betas)
        check(len(betas) == 2, "params.betas", f"expected two numbers, got {len(betas)}")
        for beta in betas:
            check(0.0 <= beta < 1.0, "params.betas", f"each beta must be in [0, 1), got {beta}")
        for name in ("lr", "eps", "weight_decay", "momentum", "dampening"):
            value = getattr(self, name)
            check(value >= 0, f"params.{name}", f"must be >= 0, got {value}")
        if self.type == "AdamW":
            check(
                self.adam_w_mode,
                "params.adam_w_mode",
                "AdamW always decouples weight decay; for L2 decay use type 'Adam' with "
                "adam_w_mode false",
            )
        if self.nesterov:
            check(
                self.momentum > 0 and self.dampening == 0,
                "params.nesterov",
                "Nesterov momentum needs momentum > 0 and dampening 0",
            )

    @property
    def decoupled_weight_decay(self) -> bool:
        """True for AdamW behaviour (decay applied to the weights, not the gradient)."""
        return self.type == "AdamW" or (self.type == "Adam" and self.adam_w_mode)


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The ``scheduler`` section: one of DeepSpeed's learning-rate schedules.

    ``params`` holds exactly the keys the config gave (checked against the type's
    parameter names and ranges); ``"auto"`` values stay the string ``"auto"`` for the
    scheduler factory to resolve, and defaults are the factory's business too.
    """

    #: "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle" or "LRRangeTest".
    type: str
    #: The given parameters, DeepSpeed's names.
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        known = keys.SCHEDULER_PARAMS.get(self.type)
        check(known is not None, "type", f"expected one of {tuple(keys.SCHEDULER_PARAMS)}")
        for name in self.params:
            check(name in known, f"params.{name}", f"not a parameter of {self.type}")
        object.__setattr__(self, "params", dict(self.params))


@dataclass(frozen=True, kw_only=True)
class FP16Config:
    """The ``fp16`` section: fp16 mixed precision with (dynamic) loss scaling."""

    #: Train in fp16 with fp32 master weights. "auto" reads as false.
    enabled: bool = False
    #: Cast floating-point inputs of the model's forward to fp16.
    auto_cast: bool = False
    #: Static loss scale; 0 selects dynamic loss scaling.
    loss_scale: float = 0.0
    #: Dynamic scaling starts at 2**initial_scale_power.
    initial_scale_power: int = 16
    #: Steps without overflow before the dynamic scale is doubled.
    loss_scale_window: int = 1000
    #: Overflows tolerated before the dynamic scale is halved.
    hysteresis: int = 2
    #: Refill the hysteresis budget after every step without overflow.
    consecutive_hysteresis: bool = False
    #: Floor of the dynamic loss scale.
    min_loss_scale: float = 1.0
    #: Keep master weights and gradients in fp16 (DeepSpeed CPU-Adam only).
    fp16_master_weights_and_grads: bool = False

    def __post_init__(self) -> None:
        check(self.loss_scale >= 0, "loss_scale", f"must be >= 0, got {self.loss_scale}")
        check(
            0 <= self.initial_scale_power <= 64,
            "initial_scale_power",
            f"must be in [0, 64], got {self.initial_scale_power}",
        )
        for name in ("loss_scale_window", "hysteresis"):
            check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        check(self.min_loss_scale > 0, "min_loss_scale", f"must be > 0, got {self.min_loss_scale}")

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == 0

    @property
    def initial_loss_scale(self) -> float:
        """The loss scale of the first step."""
        return float(2**self.initial_scale_power) if self.dynamic_loss_scale else self.loss_scale


@dataclass(frozen=True, kw_only=True)
class BF16Config:
    """The ``bf16`` section (legacy name ``bfloat16``): bf16 mixed precision, no loss
    scaling."""

    #: Train in bf16 with fp32 master weights. "auto" reads as false.
    enabled: bool = False
    #: Apply each gradient to the master weights as soon as it is reduced.
    immediate_grad_update: bool = False
    #: Check gradients for inf/nan and skip such steps, as fp16 does.
    check_grad_overflow: bool = False
    #: Keep master weights and gradients in bf16 (ZeRO stages 1-3).
    bf16_master_weights_and_grads: bool = False
    #: Keep optimizer states in bf16 (needs bf16_master_weights_and_grads).
    bf16_optimizer_states: bool = False

    def __post_init__(self) -> None:
        check(
            not self.bf16_optimizer_states or self.bf16_master_weights_and_grads,
            "bf16_optimizer_states",
            "needs bf16_master_weights_and_grads true",
        )


OFFLOAD_DEVICES = ("none", "cpu", "nvme")


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """``zero_optimization.offload_param`` or ``offload_optimizer``: where a ZeRO shard
    lives (device memory, CPU memory or NVMe files).

    ``kind`` says which of the two it is; some fields matter for one kind only (noted).
    """

    #: "param" (offload_param) or "optimizer" (offload_optimizer).
    kind: str
    #: "none" (stay on the device), "cpu" or "nvme".
    device: str = "none"
    #: Directory for NVMe swap files; required with device "nvme".
    nvme_path: str | None = None
    #: Use page-locked CPU buffers.
    pin_memory: bool = False
    #: NVMe buffer-pool size; None resolves to DeepSpeed's default, 5 (param) / 4
    #: (optimizer). Optimizer: 3 buffers of ``sub_group_size`` per sub-group in flight
    #: (one; two with pipeline_read/write), so at least 3 / 6; more are not allocated.
    buffer_count: int | None = None
    #: param only: elements per NVMe buffer.
    buffer_size: int = 100_000_000
    #: param only: parameter elements kept in CPU memory with NVMe offload.
    max_in_cpu: int = 1_000_000_000
    #: optimizer only: fast optimizer-state initialization with NVMe offload.
    fast_init: bool = False
    #: optimizer only: fraction of the optimizer step done on CPU (< 1 needs stage 3).
    ratio: float = 1.0
    #: optimizer only: overlap reading the next tile with the current tile's step.
    pipeline_read: bool = False
    #: optimizer only: overlap writing the previous tile with the current tile's step.
    pipeline_write: bool = False
    #: optimizer only: DeepSpeed's SuperOffload for superchips (stage 3).
    super_offload: bool = False
    #: optimizer only: convert gradients to fp32 on the CPU rather than the device.
    convert_grad_on_cpu: bool = True
    #: optimizer only: fraction of CPU cores for the CPU optimizer (SuperOffload).
    cpuadam_cores_perc: float = 0.8

    def __post_init__(self) -> None:
        check(self.kind in ("param", "optimizer"), "kind", "expected 'param' or 'optimizer'")
        check(self.device in OFFLOAD_DEVICES, "device", f"expected one of {OFFLOAD_DEVICES}")
        check(
            self.device != "nvme" or bool(self.nvme_path),
            "nvme_path",
            'device "nvme" needs nvme_path, the directory for the swap files',
        )
        if self.buffer_count is None:
            object.__setattr__(self, "buffer_count", 5 if self.kind == "param" else 4)
        for name in ("buffer_count", "buffer_size", "max_in_cpu"):
            check(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        if self.kind == "optimizer" and self.device == "nvme":
            # a sub-group in flight holds its master and both moments (the gradient stays
            # in CPU memory); pipeline_read/write keep a second sub-group in flight
            piped = self.pipeline_read or self.pipeline_write
            need = 3 * (2 if piped else 1)
            check(
                self.buffer_count >= need,
                "buffer_count",
                f"NVMe optimizer offload needs {need} sub-group buffers (master, exp_avg, "
                f"exp_avg_sq{' for two sub-groups, with pipeline_read/pipeline_write' if piped else ''}), "
                f"got {self.buffer_count}",
            )
        for name in ("ratio", "cpuadam_cores_perc"):
            value = getattr(self, name)
            check(0.0 <= value <= 1.0, name, f"must be in [0, 1], got {value}")

    @property
    def enabled(self) -> bool:
        return self.device != "none"


def _no_offload(kind: str) -> Callable[[], OffloadConfig]:
    return lambda: OffloadConfig(kind=kind)


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """The ``zero_optimization`` section. Every DeepSpeed key is parsed; stage-3 settings
    use their ``stage3_`` names here and accept the unprefixed names as aliases. Sizes
    are element counts."""

    #: 0 = plain data parallel, 1 = shard optimizer states, 2 = + gradients, 3 = + parameters.
    stage: int = 0
    #: Copy gradients into one contiguous buffer as they are produced.
    contiguous_gradients: bool = True
    #: Reduce gradients with reduce-scatter rather than all-reduce.
    reduce_scatter: bool = True
    #: Elements reduced per bucket.
    reduce_bucket_size: int = 500_000_000
    #: Reduce several ranks' buckets with one all-reduce.
    use_multi_rank_bucket_allreduce: bool = True
    #: Gather updated parameters with all-gather rather than broadcasts.
    allgather_partitions: bool = True
    #: Elements all-gathered per bucket.
    allgather_bucket_size: int = 500_000_000
    #: Overlap gradient reduction with the backward pass; None = True at stage 3 only.
    overlap_comm: bool | None = None
    #: On load, take fp32 master weights from the checkpoint's fp32 copies.
    load_from_fp32_weights: bool = True
    #: Legacy elastic checkpoints (ours are always resharding).
    elastic_checkpoint: bool = False
    #: Parameter offload (stage 3).
    offload_param: OffloadConfig = field(default_factory=_no_offload("param"))
    #: Optimizer-state offload and CPU optimizer step (stages 1-3).
    offload_optimizer: OffloadConfig = field(default_factory=_no_offload("optimizer"))
    #: Elements per optimizer-step tile (ZeRO-Offload/Infinity).
    sub_group_size: int = 1_000_000_000
    #: Deprecated: true = offload_optimizer on CPU (as given; folded into offload_optimizer).
    cpu_offload: bool | None = None
    #: Deprecated: true = offload_param on CPU (as given; folded into offload_param).
    cpu_offload_param: bool | None = None
    #: Deprecated: pin memory for the deprecated cpu_offload switches.
    cpu_offload_use_pin_memory: bool | None = None
    #: Stage 3: elements fetched ahead of use (alias prefetch_bucket_size).
    stage3_prefetch_bucket_size: int = 50_000_000
    #: Stage 3: parameters smaller than this stay unpartitioned (alias param_persistence_threshold).
    stage3_param_persistence_threshold: int = 100_000
    #: Stage 3: cap on unpartitioned elements (alias model_persistence_threshold).
    stage3_model_persistence_threshold: int = sys.maxsize
    #: Stage 3: gathered elements kept resident per rank (alias max_live_parameters).
    stage3_max_live_parameters: int = 1_000_000_000
    #: Stage 3: keep a parameter gathered if reused within this many elements (alias max_reuse_distance).
    stage3_max_reuse_distance: int = 1_000_000_000
    #: Stage 3: gather full 16-bit weights when saving the model (aliases
    #: gather_16bit_weights_on_model_save, stage3_gather_fp16_weights_on_model_save).
    stage3_gather_16bit_weights_on_model_save: bool = False
    #: Stage 3: modules finer than this are fetched as one unit (alias module_granularity_threshold).
    stage3_module_granularity_threshold: int = 0
    #: Stage 3: fetch parameters with all-reduce (alias use_all_reduce_for_fetch_params).
    stage3_use_all_reduce_for_fetch_params: bool = False
    #: Stage 3: all-gather parameters one by one, unbucketed (alias allgather_sequential).
    stage3_allgather_sequential: bool = False
    #: Stage 3: stream partitioning of huge parameters in chunks of this size, 0 = off
    #: (alias partition_stream_chunk_size).
    stage3_partition_stream_chunk_size: int = 0
    #: Tolerate parameters that get no gradient.
    ignore_unused_parameters: bool = True
    #: DeepSpeed's old stage-1 implementation (no effect here).
    legacy_stage1: bool = False
    #: Spread gradient copies to CPU across ranks round-robin (offload).
    round_robin_gradients: bool = False
    #: Stages 1/2: compute the global gradient norm at every step.
    compute_grad_norm: bool = True
    #: Stages 1/2: align each parameter in the flat buffers to 16 bytes.
    parameter_alignment: bool = False
    #: ZeRO++ hpZ: ranks in the secondary parameter partition group (1 = off).
    zero_hpz_partition_size: int = 1
    #: ZeRO++ qwZ: quantize weights for all-gather.
    zero_quantized_weights: bool = False
    #: ZeRO++: store frozen weights quantized.
    zero_quantized_nontrainable_weights: bool = False
    #: ZeRO++ qgZ: quantize gradients for reduction.
    zero_quantized_gradients: bool = False
    #: ZeRO++ LoCo error feedback ({"err_beta": float, "reset_T": int}) or None.
    zeropp_loco_param: dict[str, Any] | None = None
    #: MiCS: ranks per parameter shard group (-1 or 0 = off).
    mics_shard_size: int = -1
    #: MiCS: hierarchical parameter all-gather.
    mics_hierarchical_params_gather: bool = False
    #: Stage 3: memory-efficient linear layer.
    memory_efficient_linear: bool = True
    #: Stage 3: load checkpoints in pipeline mode.
    pipeline_loading_checkpoint: bool = False
    #: Stage 3: patch nn.Module.apply to gather parameters.
    override_module_apply: bool = True
    #: Stage 3: log trace-cache invalidations.
    log_trace_cache_warnings: bool = False
    #: Run internal sanity checks.
    enable_sanity_checks: bool = False
    #: Stage 3 + NVMe: keep the Muon momentum buffer in memory.
    save_muon_momentum_buffer_in_memory: bool = False
    #: Stage 3 leaf-module settings, kept as given.
    leaf_module: dict[str, Any] | None = None
    #: ZenFlow settings, kept as given (not built).
    zenflow: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        check(self.stage in (0, 1, 2, 3), "stage", f"expected one of 0, 1, 2, 3, got {self.stage}")
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        check(self.offload_param.kind == "param", "offload_param", "expected kind 'param'")
        check(
            self.offload_optimizer.kind == "optimizer",
            "offload_optimizer",
            "expected kind 'optimizer'",
        )
        for spec in fields(self):
            value = getattr(self, spec.name)
            if spec.type == "int" and spec.name not in ("stage", "mics_shard_size"):
                check(value >= 0, spec.name, f"must be >= 0, got {value}")
        check(self.mics_shard_size >= -1, "mics_shard_size", "must be -1 (off) or >= 0")
        if self.offload_param.enabled:
            check(
                self.stage == 3,
                "offload_param.device",
                f"parameter offload needs ZeRO stage 3 (stage is {self.stage})",
            )
        opt = self.offload_optimizer
        if opt.enabled:
            check(
                self.stage >= 1,
                "offload_optimizer.device",
                "optimizer offload needs ZeRO stage 1, 2 or 3 (stage is 0)",
            )
            check(
                opt.device != "nvme" or self.stage == 3,
                "offload_optimizer.device",
                f"NVMe optimizer offload needs ZeRO stage 3 (stage is {self.stage})",
            )
            check(
                opt.ratio == 1.0 or self.stage == 3,
                "offload_optimizer.ratio",
                f"partial offload (ratio < 1) needs ZeRO stage 3 (stage is {self.stage})",
            )


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointingConfig:
    """The ``activation_checkpointing`` section (DeepSpeed's checkpointing options). As in
    DeepSpeed it configures ``zeroshard.checkpointing.checkpoint``, the function the
    model calls; the engine applies it (``zeroshard.checkpointing.configure``) when the
    config has the section."""

    #: Partition checkpointed activations across model-parallel ranks. Accepted; no
    #: effect on memory (logged): without model parallelism no rank holds a copy of
    #: another's activations.
    partition_activations: bool = False
    #: Keep what checkpoint() keeps (its inputs) in CPU memory.
    cpu_checkpointing: bool = False
    #: Copy partitioned activations into one preallocated buffer (a CUDA allocator
    #: fragmentation optimization). Accepted; no effect.
    contiguous_memory_optimization: bool = False
    #: Number of checkpoints, to size that buffer (validated, otherwise unused).
    number_checkpoints: int | None = None
    #: Synchronize the device before and after each checkpoint().
    synchronize_checkpoint_boundary: bool = False
    #: Log the forward time of each checkpoint().
    profile: bool = False

    def __post_init__(self) -> None:
        if self.number_checkpoints is not None:
            check(self.number_checkpoints >= 1, "number_checkpoints", "must be >= 1")
        if self.contiguous_memory_optimization:
            check(
                self.partition_activations,
                "contiguous_memory_optimization",
                "needs partition_activations true",
            )
            check(
                self.number_checkpoints is not None,
                "number_checkpoints",
                "contiguous_memory_optimization needs number_checkpoints to size its buffer",
            )


@dataclass(frozen=True, kw_only=True)
class AIOConfig:
    """The ``aio`` section: asynchronous file I/O for NVMe offload."""

    #: Bytes per I/O request.
    block_size: int = 1_048_576
    #: Requests in flight.
    queue_depth: int = 8
    #: Parallel workers per request (legacy name thread_count).
    intra_op_parallelism: int = 1
    #: Submit requests one by one rather than as a batch.
    single_submit: bool = False
    #: Submit without waiting for earlier requests to complete.
    overlap_events: bool = True
    #: Use GPUDirect Storage.
    use_gds: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "queue_depth", "intra_op_parallelism"):
            check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """The ``checkpoint`` section."""

    #: Check that all ranks save under the same tag: "Ignore", "Warn" or "Fail".
    tag_validation: str = "Warn"
    #: Load a universal checkpoint (ours load at any world size anyway).
    load_universal: bool = False
    #: Save per node, for nodes without a shared file system.
    use_node_local_storage: bool = False
    #: Spread checkpoint writes over pipeline stages (checkpoint.parallel_write.pipeline_stage).
    parallel_write_pipeline_stage: bool = False

    def __post_init__(self) -> None:
        check(
            self.tag_validation in ("Ignore", "Warn", "Fail"),
            "tag_validation",
            "expected 'Ignore', 'Warn' or 'Fail'",
        )


DTYPES = ("fp32", "fp16", "bf16")
_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class Config:
    """A whole, validated config. Build it with :func:`load_config`."""

    #: Samples per optimizer step over all data-parallel ranks (resolved).
    train_batch_size: int
    #: Samples per rank per forward/backward (resolved).
    train_micro_batch_size_per_gpu: int
    #: Micro-batches accumulated per optimizer step (resolved).
    gradient_accumulation_steps: int
    #: The data-parallel world size the batch sizes were resolved for.
    dp_world_size: int = 1
    #: The optimizer to build, or None when the user passes one to initialize().
    optimizer: OptimizerConfig | None = None
    #: The learning-rate schedule, or None.
    scheduler: SchedulerConfig | None = None
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig
    )
    aio: AIOConfig = field(default_factory=AIOConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    #: Clip the global gradient norm to this value; 0 = off ("auto" reads as 0).
    gradient_clipping: float = 0.0
    #: Scale gradients by 1/world before the all-reduce rather than after.
    prescale_gradients: bool = False
    #: Divide gradients by this before the reduction, the rest after it.
    gradient_predivide_factor: float = 1.0
    #: Dtype of gradient communication, "fp32" | "fp16" | "bf16"; None = the gradients' own.
    communication_data_type: str | None = None
    #: Dtype gradients accumulate in (data_types.grad_accum_dtype); None = the model's.
    grad_accum_dtype: str | None = None
    #: Log progress every this many optimizer steps.
    steps_per_print: int = 10
    #: Seed for the engine's random state, if given.
    seed: int | None = None
    #: Time forward/backward/step (accepted; the engine may not report it yet).
    wall_clock_breakdown: bool = False
    #: Report memory use (accepted; the engine may not report it yet).
    memory_breakdown: bool = False
    #: Print the engine state after initialization.
    dump_state: bool = False
    #: Drop the last incomplete batch in the engine's data loader.
    dataloader_drop_last: bool = False
    #: Allow ZeRO with an optimizer zeroshard did not build.
    zero_allow_untested_optimizer: bool = False
    #: DeepSpeed: insist on its own CPU optimizer with offload (accepted, no effect).
    zero_force_ds_cpu_optimizer: bool = True
    #: Legacy: broadcast instead of all-gather of updated parameters (no effect).
    disable_allgather: bool = False
    #: Settings that are on but that zeroshard ignores, for the engine to warn about once:
    #: monitoring/logging sections, and offload the chosen ZeRO stage does not use.
    ignored_enabled: tuple[str, ...] = ()
    #: The config as given (after comment stripping), for checkpoints.
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        check(self.dp_world_size >= 1, "dp_world_size", "must be >= 1")
        train, micro, gas = (
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
        )
        for name, value in zip(keys.BATCH_KEYS, (train, micro, gas), strict=True):
            check(value >= 1, name, f"must be >= 1, got {value}")
        world = self.dp_world_size
        check(
            train == micro * gas * world,
            "train_batch_size",
            f"{_batch_rule(train, micro, gas, world)} = {micro * gas * world}",
        )
        check(
            not (self.fp16.enabled and self.bf16.enabled),
            "bf16.enabled",
            "fp16 and bf16 cannot both be enabled; choose one",
        )
        if self.bf16.bf16_master_weights_and_grads:
            check(
                self.zero_optimization.stage >= 1,
                "bf16.bf16_master_weights_and_grads",
                "needs ZeRO stage 1, 2 or 3",
            )
        check(
            self.gradient_clipping >= 0,
            "gradient_clipping",
            f"must be >= 0 (0 turns clipping off), got {self.gradient_clipping}",
        )
        check(
            self.gradient_predivide_factor > 0,
            "gradient_predivide_factor",
            f"must be > 0, got {self.gradient_predivide_factor}",
        )
        for name in ("communication_data_type", "grad_accum_dtype"):
            value = getattr(self, name)
            check(value is None or value in DTYPES, name, f"expected one of {DTYPES} or null")
        check(self.steps_per_print >= 1, "steps_per_print", "must be >= 1")

    @property
    def compute_dtype(self) -> torch.dtype:
        """bf16 if bf16 is enabled, fp16 if fp16 is, else fp32."""
        if self.bf16.enabled:
            return torch.bfloat16
        if self.fp16.enabled:
            return torch.float16
        return torch.float32


# ---------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------
def load_config(
    source: Mapping[str, Any] | str | os.PathLike[str], *, dp_world_size: int = 1
) -> Config:
    """Parse and validate a DeepSpeed config for ``dp_world_size`` data-parallel ranks.

    ``source`` is a dict or the path of a JSON file (``//``, ``#`` and ``/* */`` comments
    and trailing commas allowed). Raises :class:`ConfigError` on the first problem.
    """
    try:
        world = operator.index(dp_world_size)
    except TypeError:
        world = 0
    if isinstance(dp_world_size, bool) or world < 1:
        raise ValueError(f"dp_world_size must be a positive int, got {dp_world_size!r}")
    if isinstance(source, Mapping):
        raw = copy.deepcopy(dict(source))
        where = "config"
    elif isinstance(source, (str, os.PathLike)):
        raw = read_config_file(source)
        where = os.fspath(source)
    else:
        raise TypeError(f"config must be a dict or a path, got {type(source).__name__}")
    if not isinstance(raw, dict):
        raise ConfigError(where, f"expected a JSON object at the top level, got {describe(raw)}")
    from zeroshard._config_parse import parse_config  # the parsers use the classes above

    config = parse_config(raw, world)
    for path, predicate, feature in NOT_BUILT:
        if predicate(config):
            raise ConfigError(path, f"{feature} is not built yet in zeroshard")
    return config


def resolve_batch_sizes(
    train: int | None, micro: int | None, gas: int | None, dp_world_size: int
) -> tuple[int, int, int]:
    """DeepSpeed's batch rule: ``train = micro x gas x dp_world_size``, any one of the
    three (None = not given) derived from the other two. With only ``train`` given,
    gas is 1 and micro = train / world; with only ``micro`` given, gas is 1.
    Returns ``(train, micro, gas)``."""
    world = dp_world_size
    if train is None and micro is None:
        if gas is None:
            raise ConfigError(
                "train_batch_size",
                "no batch size given; set train_batch_size or train_micro_batch_size_per_gpu "
                "(or both; gradient_accumulation_steps is then derived)",
            )
        raise ConfigError(
            "train_micro_batch_size_per_gpu",
            f"only gradient_accumulation_steps ({gas}) is given; set "
            "train_micro_batch_size_per_gpu or train_batch_size too",
        )
    if train is None:
        gas = 1 if gas is None else gas
        return micro * gas * world, micro, gas
    if micro is None and gas is None:
        gas = 1
    if micro is None or gas is None:
        known = micro if micro is not None else gas
        if train % (known * world):
            raise ConfigError(
                "train_batch_size",
                f"{_batch_rule(train, micro, gas, world)}, but {train} is not a multiple of "
                f"{known} x {world} = {known * world}",
            )
        if micro is None:
            micro = train // (gas * world)
        else:
            gas = train // (micro * world)
    if train != micro * gas * world:
        raise ConfigError(
            "train_batch_size",
            f"{_batch_rule(train, micro, gas, world)} = {micro * gas * world}",
        )
    return train, micro, gas


def _batch_rule(train: int, micro: int | None, gas: int | None, world: int) -> str:
    def show(value: int | None) -> str:
        return "(?)" if value is None else f"({value})"

    return (
        f"train_batch_size ({train}) must equal train_micro_batch_size_per_gpu {show(micro)}"
        f" x gradient_accumulation_steps {show(gas)} x data-parallel world size ({world})"
    )
