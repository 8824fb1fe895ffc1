"""Sections of the DeepSpeed config beside ZeRO: optimizer, scheduler, fp16, bf16,
activation checkpointing, aio and checkpoint. Frozen, validated dataclasses; built by
``zeroshard._config_parse`` and re-exported by :mod:`zeroshard.config`. Private: no
collectives, no devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zeroshard import _config_keys as keys
from zeroshard._config_fields import check

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

    #: zeroshard's own key: the job's checkpoint directory. initialize() resumes from its
    #: ``latest`` when there is one, and a SIGTERM saves a checkpoint there at the next
    #: step boundary, then exits 0 (zeroshard.restart, zeroshard.preemption).
    dir: str | None = None
    #: Check that all ranks save under the same tag: "Ignore", "Warn" or "Fail".
    tag_validation: str = "Warn"
    #: Load a universal checkpoint (ours load at any world size anyway).
    load_universal: bool = False
    #: Save per node, for nodes without a shared file system.
    use_node_local_storage: bool = False
    #: Spread checkpoint writes over pipeline stages (checkpoint.parallel_write.pipeline_stage).
    parallel_write_pipeline_stage: bool = False

    def __post_init__(self) -> None:
        check(self.dir is None or self.dir.strip() != "", "dir", "must be a non-empty path")
        check(
            self.tag_validation in ("Ignore", "Warn", "Fail"),
            "tag_validation",
            "expected 'Ignore', 'Warn' or 'Fail'",
        )
