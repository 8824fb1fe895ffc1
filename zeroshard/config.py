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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from zeroshard import _config_keys as keys
from zeroshard._config_fields import ConfigError, check, describe
from zeroshard._config_json import read_config_file
from zeroshard._config_sections import (
    OPTIMIZER_TYPES,
    ActivationCheckpointingConfig,
    AIOConfig,
    BF16Config,
    CheckpointConfig,
    FP16Config,
    OptimizerConfig,
    SchedulerConfig,
)
from zeroshard._config_zero import OFFLOAD_DEVICES, OffloadConfig, ZeroConfig

__all__ = [
    "DTYPES",
    "NOT_BUILT",
    "OFFLOAD_DEVICES",
    "OPTIMIZER_TYPES",
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
