# ruff: noqa: RUF009  (fields are made by key(), which returns a dataclasses.field)
"""The sections of a DeepSpeed config, each a frozen kw_only dataclass whose fields are the
schema (``key(default, status, doc=..., range, choices, aliases, ...)``, see
:mod:`zeroshard.config.schema`). Re-exported by :mod:`zeroshard.config`. No
collectives, no devices.

Key names and defaults are DeepSpeed's (facts from its documentation and config classes);
a default of ours that differs says so. INERT gives the reason a key means nothing in
zeroshard; NOT_BUILT names the feature refused when the key asks for it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from zeroshard.config.schema import (
    INERT,
    NOT_BUILT,
    ConfigError,
    Section,
    check,
    describe,
    key,
    specs,
)

OPTIMIZER_TYPES = ("Adam", "AdamW", "SGD")
SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
DTYPES = ("fp32", "fp16", "bf16")
_SPELLINGS = {"fp32": "fp32 float32 float torch.float32", "fp16": "fp16 float16 half torch.float16", "bf16": "bf16 bfloat16 torch.bfloat16"}  # fmt: skip
DTYPE_SPELLINGS = {s: name for name, spellings in _SPELLINGS.items() for s in spellings.split()}
# Optimizer types DeepSpeed builds itself that zeroshard does not (lower case).
_DEEPSPEED_ONLY = {"adagrad", "lamb", "lion", "muon", "onebitadam", "zerooneadam", "onebitlamb", "muadam", "muadamw", "musgd"}  # fmt: skip


def enabled(section: Any) -> bool:
    """A section (typed, or kept as JSON) switched on by ``"enabled": true``."""
    if isinstance(section, Mapping):
        return section.get("enabled") is True
    return bool(section is not None and section.enabled)


def enabled_is_boolean(value: Any, at: str) -> None:
    """For sections kept as JSON: their ``enabled`` switch, if given, is a boolean."""
    flag = value.get("enabled", False) if isinstance(value, Mapping) else False
    check(isinstance(flag, bool), f"{at}.enabled", f"expected true or false, got {describe(flag)}")


def _not_deepspeed_only(value: Any, at: str) -> None:
    if isinstance(value, str) and value.lower() in _DEEPSPEED_ONLY:
        raise ConfigError(
            at,
            f"{value!r} is a DeepSpeed optimizer zeroshard does not provide (yet); use Adam, "
            "AdamW or SGD, or pass a torch optimizer to initialize()",
        )


_ADAM, _SGD = ("Adam", "AdamW"), ("SGD",)
_param = functools.partial(key, under="params")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig(Section):
    """``optimizer``: the torch optimizer built over each shard. As in DeepSpeed, ``Adam``
    means decoupled weight decay (AdamW) unless ``adam_w_mode`` is false."""

    # fmt: off
    HINTS: ClassVar[dict[str, str]] = {"params.max_grad_norm": "not an optimizer parameter in DeepSpeed configs; use the top-level 'gradient_clipping' instead"}

    type: str = key(doc="Adam, AdamW or SGD (any letter case).", choices=OPTIMIZER_TYPES, check=_not_deepspeed_only)
    lr: float = _param(1e-3, doc="Learning rate before any scheduler.", min=0)
    weight_decay: float = _param(0.0, doc="Weight decay (decoupled or L2: adam_w_mode).", min=0)
    betas: tuple[float, float] = _param((0.9, 0.999), doc="Moment decay rates.", min=0, below=1, only=_ADAM)
    eps: float = _param(1e-8, doc="Term added to the denominator.", min=0, only=_ADAM)
    adam_w_mode: bool = _param(True, doc="Adam: decoupled weight decay (false: L2).", only=_ADAM)
    amsgrad: bool = _param(False, doc="The AMSGrad variant.", only=_ADAM)
    bias_correction: bool = _param(True, NOT_BUILT("Adam without bias correction"), doc="Bias-correct the moments.", only=_ADAM)
    fused: bool | None = _param(None, doc="torch's fused kernel; null: fused where torch has it.", only=_ADAM)
    torch_adam: bool = _param(False, INERT("zeroshard's Adam is always torch's"), doc="torch's Adam, not FusedAdam.", only=_ADAM)
    momentum: float = _param(0.0, doc="Momentum factor.", min=0, only=_SGD)
    dampening: float = _param(0.0, doc="Dampening of momentum.", min=0, only=_SGD)
    nesterov: bool = _param(False, doc="Nesterov momentum (momentum > 0, dampening 0).", only=_SGD)
    legacy_fusion: bool = key(False, INERT("a legacy fp16 fused-Adam switch; the optimizer is torch's"), doc="Legacy fusion.")
    # fmt: on

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "betas", tuple(self.betas))
        if self.type == "AdamW":
            check(self.adam_w_mode, "params.adam_w_mode", "AdamW always decouples weight decay; for L2 decay use type 'Adam' with adam_w_mode false")  # fmt: skip
        if self.nesterov:
            check(self.momentum > 0 and self.dampening == 0, "params.nesterov", "Nesterov momentum needs momentum > 0 and dampening 0")  # fmt: skip

    @property
    def decoupled_weight_decay(self) -> bool:
        """True for AdamW behaviour (decay applied to the weights, not the gradient)."""
        return self.type == "AdamW" or (self.type == "Adam" and self.adam_w_mode)


_WARMUP, _COSINE = ("WarmupLR", "WarmupDecayLR"), ("WarmupCosineLR",)
_CYCLE, _RANGE = ("OneCycle",), ("LRRangeTest",)
_sched = functools.partial(key, None, under="params")
_LR = "A learning rate, or one per parameter group."


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig(Section):
    """``scheduler``: one of DeepSpeed's learning-rate schedules. A parameter not given stays
    None and takes the schedule's default; :attr:`params` holds the given ones."""

    # fmt: off
    type: str = key(doc="The schedule.", choices=SCHEDULER_TYPES)
    warmup_min_lr: float | list[float] | None = _sched(doc=_LR, min=0, only=_WARMUP)
    warmup_max_lr: float | list[float] | None = _sched(doc=_LR, min=0, only=_WARMUP)
    warmup_num_steps: int | None = _sched(doc="Warm-up steps.", min=0, only=(*_WARMUP, *_COSINE))
    warmup_type: str | None = _sched(doc="Warm-up curve.", choices=("log", "linear"), only=(*_WARMUP, *_COSINE))
    total_num_steps: int | None = _sched(doc="Steps of the schedule.", min=1, only=("WarmupDecayLR", *_COSINE))
    warmup_min_ratio: float | None = _sched(doc="Start of warm-up, a ratio of lr.", min=0, max=1, only=_COSINE)
    cos_min_ratio: float | None = _sched(doc="End of the cosine, a ratio of lr.", min=0, max=1, only=_COSINE)
    cycle_min_lr: float | list[float] | None = _sched(doc=_LR, min=0, only=_CYCLE)
    cycle_max_lr: float | list[float] | None = _sched(doc=_LR, min=0, only=_CYCLE)
    decay_lr_rate: float | None = _sched(doc="lr decay after the cycle.", min=0, only=_CYCLE)
    cycle_first_step_size: int | None = _sched(doc="Steps of the rising half.", min=1, only=_CYCLE)
    cycle_second_step_size: int | None = _sched(doc="Steps of the falling half.", min=1, only=_CYCLE)
    cycle_first_stair_count: int | None = _sched(doc="Stairs of the rising half.", min=0, only=_CYCLE)
    cycle_second_stair_count: int | None = _sched(doc="Stairs of the falling half.", min=0, only=_CYCLE)
    decay_step_size: int | None = _sched(doc="Steps between decays after the cycle.", min=0, only=_CYCLE)
    cycle_momentum: bool | None = _sched(doc="Cycle momentum too.", only=_CYCLE)
    cycle_min_mom: float | None = _sched(doc="Lowest momentum.", min=0, max=1, only=_CYCLE)
    cycle_max_mom: float | None = _sched(doc="Highest momentum.", min=0, max=1, only=_CYCLE)
    decay_mom_rate: float | None = _sched(doc="Momentum decay after the cycle.", min=0, only=_CYCLE)
    lr_range_test_min_lr: float | list[float] | None = _sched(doc=_LR, min=0, only=_RANGE)
    lr_range_test_step_size: int | None = _sched(doc="Steps per increase.", min=1, only=_RANGE)
    lr_range_test_step_rate: float | None = _sched(doc="Increase per step size.", min=0, only=_RANGE)
    lr_range_test_staircase: bool | None = _sched(doc="Increase in stairs.", only=_RANGE)
    last_batch_iteration: int | None = _sched(doc="The step to resume from (-1: start).", min=-1)
    # fmt: on

    def __post_init__(self) -> None:
        super().__post_init__()
        required = {"OneCycle": ("cycle_min_lr", "cycle_max_lr")}.get(self.type, ())
        for name in (
            ("total_num_steps",) if "Decay" in self.type or "Cos" in self.type else required
        ):
            check(getattr(self, name) is not None, f"params.{name}", f"required for {self.type}")

    @property
    def params(self) -> dict[str, Any]:
        """The given parameters, DeepSpeed's names, for the schedule's constructor."""
        values = {s.attr: getattr(self, s.attr) for s in specs(type(self)) if s.key.under}
        return {name: value for name, value in values.items() if value is not None}


@dataclass(frozen=True, kw_only=True)
class FP16Config(Section):
    """``fp16``: fp16 mixed precision with fp32 masters and (dynamic) loss scaling."""

    # fmt: off
    enabled: bool = key(False, doc="Train in fp16.")
    auto_cast: bool = key(False, INERT("floating-point forward inputs are always cast to the compute dtype"), doc="Cast forward inputs to fp16.")
    loss_scale: float = key(0.0, doc="Static loss scale; 0 = dynamic.", min=0)
    initial_scale_power: int = key(16, doc="Dynamic scaling starts at 2**this.", min=0, max=64)
    loss_scale_window: int = key(1000, doc="Overflow-free steps before the scale doubles.", min=1)
    hysteresis: int = key(2, doc="Overflows tolerated before the scale halves.", min=1)
    consecutive_hysteresis: bool = key(False, doc="Refill the hysteresis after every good step.")
    min_loss_scale: float = key(1.0, doc="Floor of the dynamic scale.", above=0)
    fp16_master_weights_and_grads: bool = key(False, NOT_BUILT("fp16 master weights and gradients"), doc="fp16 masters, gradients.")
    # fmt: on

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == 0

    @property
    def initial_loss_scale(self) -> float:
        """The loss scale of the first step."""
        return float(2**self.initial_scale_power) if self.dynamic_loss_scale else self.loss_scale


@dataclass(frozen=True, kw_only=True)
class BF16Config(Section):
    """``bf16`` (legacy name ``bfloat16``): bf16 mixed precision, no loss scaling."""

    # fmt: off
    enabled: bool = key(False, doc="Train in bf16 with fp32 masters.")
    immediate_grad_update: bool = key(False, NOT_BUILT("bf16 immediate gradient updates"), doc="Fold gradients into fp32 as produced.")
    check_grad_overflow: bool | None = key(None, doc="Skip steps whose gradients hold inf/nan on any rank (null: as nonfinite_gradients says; false: never check).")
    bf16_master_weights_and_grads: bool = key(False, NOT_BUILT("bf16 master weights and gradients"), doc="bf16 masters, gradients.")
    bf16_optimizer_states: bool = key(False, NOT_BUILT("bf16 optimizer states"), doc="bf16 optimizer states.")
    # fmt: on


FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


@dataclass(frozen=True, kw_only=True)
class FP8Config(Section):
    """``fp8`` (zeroshard; DeepSpeed has no such section, it reaches fp8 through Transformer
    Engine layers in the model code): the model's ``nn.Linear`` layers run fp8 matmuls
    with dynamic scaling (torchao's float8 training, ``pip install 'zeroshard[fp8]'``);
    everything else computes in bf16, so it needs ``bf16.enabled``. Key names are
    torchtitan's ``float8`` section's (``recipe_name``, ``filter_fqns``,
    ``enable_fsdp_float8_all_gather``), the recipes torchao's
    ``Float8LinearConfig.from_recipe_name``'s; ``recipe`` and ``skip`` are aliases."""

    # fmt: off
    enabled: bool = key(False, doc="Run the Linear layers' matmuls in fp8 (needs bf16.enabled and torchao).")
    recipe_name: str = key("tensorwise", doc="tensorwise: one dynamic scale per tensor, e4m3 weights and activations, e5m2 gradients (fastest); rowwise: one scale per row, powers of 2, e4m3 throughout; rowwise_with_gw_hp: rowwise, with the weight gradient in bf16 (most accurate).", choices=FP8_RECIPES, aliases=("recipe",))
    filter_fqns: list[str] = key(doc="Linear layers kept in bf16: a layer whose name (as named_modules() gives it) contains one of these strings (torchtitan's rule); each must match at least one Linear layer.", factory=list, aliases=("skip",))
    enable_fsdp_float8_all_gather: bool = key(False, doc="ZeRO stage 3, tensorwise recipe: each fp8 Linear layer's weight is cast to e4m3 before its all-gather, with the whole weight's scale (one max all-reduce of the shards' amaxes), so the gather moves 1 byte per element instead of 2 and the fp8 matmul uses the gathered weight as it comes.")
    precompute_float8_dynamic_scale_for_fsdp: bool = key(False, NOT_BUILT("one all-reduce of every fp8 weight's amax after the step (fp8.precompute_float8_dynamic_scale_for_fsdp); with fp8.enable_fsdp_float8_all_gather each gather all-reduces its own amax"), doc="torchtitan's: the fp8 all-gather's scales for all weights from one all-reduce after each step.")
    # fmt: on

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "filter_fqns", list(self.filter_fqns))
        for i, name in enumerate(self.filter_fqns):
            check(isinstance(name, str) and name != "", f"filter_fqns[{i}]", f"expected a non-empty module name, got {name!r}")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class DataTypesConfig(Section):
    """``data_types``."""

    # fmt: off
    grad_accum_dtype: str | None = key(None, doc="Dtype gradients accumulate in; null = compute dtype.", choices=DTYPE_SPELLINGS)
    param_dtype: str | None = key(None, NOT_BUILT("a parameter dtype override"), doc="Parameter dtype.", choices=DTYPE_SPELLINGS)
    buffer_dtype: str | None = key(None, NOT_BUILT("a buffer dtype override"), doc="Buffer dtype.", choices=DTYPE_SPELLINGS)
    # fmt: on


@dataclass(frozen=True, kw_only=True)
class OffloadConfig(Section):
    """Where a ZeRO shard lives: device memory, CPU memory or NVMe files."""

    device: str = key("none", doc="none (the device), cpu or nvme.", choices=OFFLOAD_DEVICES)
    nvme_path: str | None = key(None, doc="Directory of the swap files (device nvme).")
    pin_memory: bool | None = key(None, doc="Page-locked CPU copies; null = pinned on CUDA.")
    buffer_count: int = key(4, doc="Swap buffers: 3 per sub-group in flight (NVMe).", min=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.device != "nvme" or bool(self.nvme_path), "nvme_path", 'device "nvme" needs nvme_path, the directory for the swap files')  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.device != "none"


@dataclass(frozen=True, kw_only=True)
class OffloadParamConfig(OffloadConfig):
    """``zero_optimization.offload_param`` (stage 3)."""

    # fmt: off
    buffer_count: int = key(5, doc="Parameter swap buffers (NVMe).", min=1)
    buffer_size: int = key(100_000_000, doc="Elements per parameter swap buffer.", min=1)
    max_in_cpu: int = key(1_000_000_000, INERT("the whole parameter shard lives in its swap file"), doc="Elements kept in RAM.", min=0)
    # fmt: on


@dataclass(frozen=True, kw_only=True)
class OffloadOptimizerConfig(OffloadConfig):
    """``zero_optimization.offload_optimizer``: masters and states off the device."""

    # fmt: off
    pipeline_read: bool = key(False, doc="Read the next sub-group during this one's step.")
    pipeline_write: bool = key(False, doc="Write the last sub-group during this one's step.")
    fast_init: bool = key(False, INERT("swap files are written once, at construction"), doc="Fast NVMe state init.")
    ratio: float = key(1.0, doc="ZeRO-Offload++ Twin-Flow: the share of this rank's optimizer (fp32 masters, optimizer states and their step), by elements, kept and stepped on the CPU; the rest stays and steps on the device, at the same time. Split at segment (bucket / stage-3 unit) boundaries: the first segments of the shard on the device, the last ones on the CPU (device nvme: in swap files), never more than 1 - ratio on the device. 1: all offloaded (plain offload); 0: all on the device. Device cpu at stages 1-3 (DeepSpeed: stage 3 only), nvme at stage 3.", min=0, max=1)
    super_offload: bool = key(False, NOT_BUILT("SuperOffload"), doc="DeepSpeed's SuperOffload.")
    cpuadam_cores_perc: float = key(0.8, INERT("a SuperOffload setting"), doc="CPU cores for SuperOffload.", min=0, max=1)
    delayed_update: bool = key(False, doc="zeroshard (DeepSpeed has no such key): ZeRO-Offload's one-step delayed parameter update (DPU), device cpu only. step() hands the reduced gradients to the CPU optimizer in a background thread and returns; the next step's forward and backward run on the parameters from before that update, which land at the next step boundary (or before any checkpoint, GatheredParameters, eval forward or engine.wait_param_gather()). Faster (the CPU step overlaps compute) but not the same training: each gradient is taken one update late, as in the ZeRO-Offload paper, which found it converges alike after a few dozen exact steps (delayed_update_after); off, training is unchanged.")
    delayed_update_after: int = key(40, doc="zeroshard: with delayed_update, the first this many optimizer steps (global_steps) are exact; the ZeRO-Offload paper turns DPU on after a few dozen, as early gradients change fast.", min=0)
    # fmt: on

    def __post_init__(self) -> None:
        super().__post_init__()
        check(not self.delayed_update or self.device == "cpu", "delayed_update", f'the delayed update overlaps the CPU optimizer step with compute: it needs device "cpu" (device is "{self.device}"; NVMe offload is not built with it)')  # fmt: skip
        if self.ratio < 1:
            check(self.device != "none", "ratio", 'a ratio below 1 keeps part of the optimizer on the device and offloads the rest: it needs device "cpu" or "nvme" (device is "none": everything is on the device already)')  # fmt: skip
            check(not self.delayed_update, "ratio", "a ratio below 1 with delayed_update (whose step runs on the CPU only): leave one out; Twin-Flow with the delayed update is not built yet in zeroshard")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class LocoConfig(Section):
    """``zero_optimization.zeropp_loco_param`` (ZeRO++ LoCo)."""

    err_beta: float = key(0.8, doc="Error-feedback decay.", min=0, max=1)
    reset_T: int = key(1024, doc="Steps between error resets.", min=1)


# DeepSpeed's default leaf classes: the MoE blocks of Mixtral, Qwen2-MoE and Qwen3-MoE
DEFAULT_LEAF_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


@dataclass(frozen=True, kw_only=True)
class LeafModuleConfig(Section):
    """``zero_optimization.leaf_module``: stage-3 modules gathered whole at their forward,
    whatever runs inside them (DeepSpeed's keys and default classes)."""

    classes: list[str] = key(
        doc="Classes, plain or qualified names.", factory=lambda: list(DEFAULT_LEAF_CLASSES)
    )
    names: list[str] = key(doc="Module names (as named_modules() gives them).", factory=list)
    name_suffixes: list[str] = key(doc="Module name endings.", factory=list)


_S3 = "Stage 3: "


@dataclass(frozen=True, kw_only=True)
class ZeroConfig(Section):
    """``zero_optimization``. Sizes are element counts; stage-3 keys take their names with
    or without the ``stage3_`` prefix."""

    # fmt: off
    stage: int = key(0, doc="0 data parallel, 1 shard optimizer states, 2 + gradients, 3 + parameters.", choices=(0, 1, 2, 3))
    contiguous_gradients: bool = key(True, INERT("gradients always go into flat, contiguous buffers"), doc="Contiguous gradients.")
    reduce_scatter: bool | None = key(None, doc="Reduce sharded gradients with the backend's reduce-scatter (true) or with an all-reduce keeping this rank's part (false); not given: the fastest per backend, point-to-point sends plus a local sum on gloo (whose own reduce-scatter is slower than its all-reduce), the reduce-scatter elsewhere.")
    reduce_bucket_size: int | None = key(None, doc="Elements per gradient bucket; 0 = each gradient alone; not given: 25 MiB of gradients, as DDP's buckets, so reductions overlap backward (DeepSpeed's 5e8 puts a model under 500M parameters in one bucket); \"auto\": the same.", min=0, auto=True)
    use_multi_rank_bucket_allreduce: bool = key(True, INERT("a detail of DeepSpeed's stage-1/2 all-reduce"), doc="Multi-rank buckets.")
    allgather_partitions: bool = key(True, INERT("updated parameters are always all-gathered"), doc="All-gather, not broadcast.")
    allgather_bucket_size: int | None = key(None, doc="Elements per all-gather bucket (buckets: the smaller size); not given or \"auto\": as reduce_bucket_size.", min=1, auto=True)
    overlap_comm: bool | None = key(None, doc="Overlap gradient reduction with backward; null = at stage 3.")
    overlap_param_gather: bool = key(False, doc="zeroshard (Megatron's name): stages 1-2 start the all-gather of updated parameters at the end of step() and each module's forward waits only for its own parameters; code reading parameters outside the engine before the next forward calls engine.wait_param_gather().")
    load_from_fp32_weights: bool = key(True, NOT_BUILT("loading the fp32 masters from the 16-bit weights"), doc="Masters from fp32 on load.")
    elastic_checkpoint: bool = key(False, INERT("checkpoints always load at any world size"), doc="Legacy elastic checkpoints.")
    offload_param: OffloadParamConfig = key(doc="Parameter offload (stage 3).", factory=OffloadParamConfig, nullable=True)
    offload_optimizer: OffloadOptimizerConfig = key(doc="Optimizer offload (stages 1-3).", factory=OffloadOptimizerConfig, nullable=True)
    sub_group_size: int = key(1_000_000_000, doc="Elements per optimizer-step tile (NVMe offload).", min=1)
    cpu_offload: bool | None = key(None, doc="Deprecated: true = offload_optimizer on CPU.")
    cpu_offload_param: bool | None = key(None, doc="Deprecated: true = offload_param on CPU.")
    cpu_offload_use_pin_memory: bool | None = key(None, doc="Deprecated: their pin_memory.")
    stage3_prefetch_bucket_size: int = key(50_000_000, doc=_S3 + "elements fetched ahead; 0 = none.", min=0, aliases=("prefetch_bucket_size",))
    stage3_param_persistence_threshold: int = key(100_000, doc=_S3 + "smaller parameters stay whole.", min=0, aliases=("param_persistence_threshold",))
    stage3_model_persistence_threshold: int = key(sys.maxsize, doc=_S3 + "cap on whole-parameter elements.", min=0, aliases=("model_persistence_threshold",))
    stage3_max_live_parameters: int = key(1_000_000_000, doc=_S3 + "gathered elements kept per rank.", min=0, aliases=("max_live_parameters",))
    stage3_max_reuse_distance: int = key(1_000_000_000, doc=_S3 + "after its forward, a unit whose next use (the rest of the forward, then the backward, in the order of the first step) comes within this many elements of units gathered in between stays gathered, within max_live_parameters; the default keeps a model under about 5e8 parameters gathered from forward through backward (no second all-gather); 0 frees each unit after its forward.", min=0, aliases=("max_reuse_distance",))
    stage3_gather_16bit_weights_on_model_save: bool = key(False, doc=_S3 + "let Hugging Face's save_model gather the whole weights (engine.zero_gather_16bit_weights_on_model_save(); save_16bit_model always does).", aliases=("gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"))
    stage3_module_granularity_threshold: int = key(0, INERT("gather units are whole modules, planned once"), doc=_S3 + "fuse small modules.", min=0, aliases=("module_granularity_threshold",))
    stage3_use_all_reduce_for_fetch_params: bool = key(False, INERT("parameters are always all-gathered"), doc=_S3 + "all-reduce fetch.", aliases=("use_all_reduce_for_fetch_params",))
    stage3_allgather_sequential: bool = key(False, INERT("a unit is one all-gather"), doc=_S3 + "unbucketed all-gathers.", aliases=("allgather_sequential",))
    ignore_unused_parameters: bool = key(True, NOT_BUILT("failing on parameters that get no gradient"), doc="Tolerate unused parameters.")
    legacy_stage1: bool = key(False, INERT("DeepSpeed's old stage-1 code path"), doc="Legacy stage 1.")
    round_robin_gradients: bool = key(False, INERT("each rank moves only its own gradient shard to the CPU"), doc="Round-robin copies.")
    zero_hpz_partition_size: int = key(1, NOT_BUILT("ZeRO++ hierarchical partitioning (hpZ)", lambda v: v > 1), doc="ZeRO++ hpZ group size.", min=0)
    zero_quantized_weights: bool = key(False, NOT_BUILT("ZeRO++ quantized weight communication (qwZ)"), doc="ZeRO++ qwZ.")
    zero_quantized_nontrainable_weights: bool = key(False, NOT_BUILT("ZeRO++ quantized frozen weights"), doc="Quantized frozen weights.")
    zero_quantized_gradients: bool = key(False, NOT_BUILT("ZeRO++ quantized gradient communication (qgZ)"), doc="ZeRO++ qgZ.")
    zeropp_loco_param: LocoConfig | None = key(None, NOT_BUILT("ZeRO++ LoCo error feedback"), doc="ZeRO++ LoCo settings.")
    mics_shard_size: int = key(-1, doc="Hybrid sharding (MiCS / HSDP): shard within groups of this many ranks, replicate across them (-1, 0: shard over every data-parallel rank).", min=-1)
    mics_hierarchical_params_gather: bool = key(False, NOT_BUILT("MiCS hierarchical all-gather"), doc="MiCS hierarchical gather.")
    memory_efficient_linear: bool = key(True, INERT("zeroshard does not replace nn.Linear"), doc=_S3 + "DeepSpeed's linear layer.")
    pipeline_loading_checkpoint: bool = key(False, INERT("checkpoints load into any pipeline layout: stage parameters keep their global names"), doc=_S3 + "pipeline-mode loading.")
    override_module_apply: bool = key(True, INERT("zeroshard does not patch nn.Module.apply"), doc=_S3 + "gather in Module.apply.")
    log_trace_cache_warnings: bool = key(False, INERT("no trace cache: units are planned once"), doc=_S3 + "log trace misses.")
    enable_sanity_checks: bool = key(False, doc=_S3 + "check before every gather that all ranks gather the same parameters (always done in the first forward and backward).")
    save_muon_momentum_buffer_in_memory: bool = key(False, INERT("no Muon optimizer"), doc="Muon with NVMe.")
    leaf_module: LeafModuleConfig = key(doc=_S3 + "modules gathered whole (MoE blocks).", factory=lambda: LeafModuleConfig())
    zenflow: dict[str, Any] | None = key(None, NOT_BUILT("ZenFlow"), doc="ZenFlow settings.")
    # fmt: on

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        stage, opt = self.stage, self.offload_optimizer
        check(not self.overlap_param_gather or stage in (1, 2), "overlap_param_gather", f"overlaps the all-gather of stages 1-2 (stage is {stage}; stage 3 gathers in forward with prefetch already)")  # fmt: skip
        check(not self.offload_param.enabled or stage == 3, "offload_param.device", f"parameter offload needs ZeRO stage 3 (stage is {stage})")  # fmt: skip
        check(not opt.enabled or stage >= 1, "offload_optimizer.device", "optimizer offload needs ZeRO stage 1, 2 or 3 (stage is 0)")  # fmt: skip
        if opt.delayed_update:
            check(self.offload_param.device != "nvme", "offload_optimizer.delayed_update", "is not built with parameters in NVMe swap files (offload_param.device nvme); use offload_param cpu or none")  # fmt: skip
            check(not self.overlap_param_gather, "offload_optimizer.delayed_update", "is not built with overlap_param_gather; leave one out")  # fmt: skip
        if opt.ratio < 1:
            check(not self.offload_param.enabled, "offload_optimizer.ratio", f"a ratio below 1 keeps part of the fp32 masters on the device, but offload_param.device {self.offload_param.device} keeps the parameter shard off it: use offload_param none; Twin-Flow with parameter offload is not built yet in zeroshard")  # fmt: skip
        if opt.device == "nvme":
            check(stage == 3, "offload_optimizer.device", f"NVMe optimizer offload needs ZeRO stage 3 (stage is {stage})")  # fmt: skip
            # a sub-group in flight holds its master and both moments (the gradient stays
            # in CPU memory); pipeline_read/write keep a second one in flight
            piped = opt.pipeline_read or opt.pipeline_write
            two = " for two sub-groups, with pipeline_read/pipeline_write" if piped else ""
            need = 6 if piped else 3
            check(opt.buffer_count >= need, "offload_optimizer.buffer_count", f"NVMe optimizer offload needs {need} sub-group buffers (master, exp_avg, exp_avg_sq{two}), got {opt.buffer_count}")  # fmt: skip

    @classmethod
    def json_compat(
        cls, values: dict, given: dict[str, str], note: Callable[[str, str], None]
    ) -> dict:
        """DeepSpeed's leniencies, when reading JSON: the deprecated ``cpu_offload`` switches
        stand for CPU offload sections, and offload the stage does not use (parameters
        below stage 3, optimizer at stage 0) is ignored, as DeepSpeed-Chat's generated
        configs expect, and reported as inert."""
        stage = values.get("stage", 0)
        for kind, switch, first, section in (("optimizer", "cpu_offload", 1, OffloadOptimizerConfig), ("param", "cpu_offload_param", 3, OffloadParamConfig)):  # fmt: skip
            name = f"offload_{kind}"
            if values.get(switch) is not None and name in given:
                raise ConfigError(given[switch], f"deprecated alias of {name}; give only {name}")
            if values.get(switch):
                values[name] = section(device="cpu", pin_memory=values.get("cpu_offload_use_pin_memory"))  # fmt: skip
            if name in values and values[name].enabled and stage < first:
                where = given[switch] if values.get(switch) else given[name]
                note(where, f"{kind} offload needs ZeRO stage {first} or more; ignored at stage {stage}, as DeepSpeed does")  # fmt: skip
                values[name] = section()
        return values


_AIO = "swap I/O is whole-chunk reads and writes by aio.queue_depth threads"


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointingConfig(Section):
    """``activation_checkpointing``: configures ``zeroshard.checkpointing.checkpoint``, as
    DeepSpeed's section configures its checkpoint function."""

    # fmt: off
    partition_activations: bool = key(False, INERT("under pure data parallelism every rank's activations are its own, so there is no copy to split (DeepSpeed splits them over an mpu's model-parallel ranks; with AutoTP, tensor_parallel.sequence_parallel does)"), doc="Split inputs over model-parallel ranks.")
    cpu_checkpointing: bool = key(False, doc="Keep checkpoint() inputs in CPU memory.")
    contiguous_memory_optimization: bool = key(False, INERT("it is DeepSpeed's preallocated buffer for partitioned activations (DeepSpeed also requires partition_activations and number_checkpoints with it)"), doc="One preallocated buffer.")
    number_checkpoints: int | None = key(None, INERT("it only sizes DeepSpeed's contiguous buffer"), doc="Checkpoints, to size it.", min=1)
    synchronize_checkpoint_boundary: bool = key(False, doc="Synchronize the device around checkpoint().")
    profile: bool = key(False, doc="Log the forward time of each checkpoint().")
    # fmt: on


@dataclass(frozen=True, kw_only=True)
class AIOConfig(Section):
    """``aio``: asynchronous file I/O for NVMe offload."""

    # fmt: off
    block_size: int = key(1_048_576, INERT(_AIO), doc="Bytes per I/O request.", min=1)
    queue_depth: int = key(8, doc="Swap requests in flight (= I/O threads).", min=1)
    intra_op_parallelism: int = key(1, INERT(_AIO), doc="Workers per request.", min=1, aliases=("thread_count",))
    single_submit: bool = key(False, INERT(_AIO), doc="Submit requests one by one.")
    overlap_events: bool = key(True, INERT(_AIO), doc="Overlap submission and completion.")
    use_gds: bool = key(False, INERT("no GPUDirect Storage path: swaps go through CPU memory"), doc="GPUDirect Storage.")
    # fmt: on


def _non_empty(value: Any, at: str) -> None:
    check(
        value is None or (isinstance(value, str) and value != ""),
        at,
        "expected a directory path, got an empty string",
    )


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig(Section):
    """``checkpoint``."""

    # fmt: off
    tag_validation: str = key("Warn", NOT_BUILT("checking that every rank saves under one tag", lambda v: v != "Ignore"), doc="Ignore, Warn or Fail.", choices=("Ignore", "Warn", "Fail"))
    load_universal: bool = key(False, INERT("every checkpoint loads at any world size or stage"), doc="Load a universal checkpoint.")
    use_node_local_storage: bool = key(False, NOT_BUILT("node-local checkpoint storage"), doc="Save per node.")
    parallel_write_pipeline_stage: bool = key(False, INERT("every rank writes its own pieces, so every pipeline stage writes in parallel already"), doc="Writes per pipeline stage.", name="parallel_write.pipeline_stage")
    writer: dict[str, Any] | None = key(None, INERT("checkpoints have one writer (safetensors)"), doc="DeepSpeed's writer settings.")
    dir: str | None = key(None, doc="zeroshard: the job's checkpoint directory: initialize() resumes from its latest and says so (created, with a warning, when missing: a first launch), SIGTERM saves there at the next step boundary and exits 0, and engine.destroy() saves the run's last step there.", nullable=True, check=_non_empty)
    # fmt: on
