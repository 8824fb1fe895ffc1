# ruff: noqa: RUF009  (fields are made by key(), which returns a dataclasses.field)
"""DeepSpeed-compatible JSON config, read into frozen, validated dataclasses.

``load_config(source, dp_world_size=N)`` takes a dict or a JSON file (``//``, ``#`` and
``/* */`` comments and trailing commas allowed, as with DeepSpeed's hjson), checks every
key, resolves ``train_batch_size = micro x gradient_accumulation_steps x N`` (any one
derived from the other two; absent, null or 0 mean "derive it") and returns a
:class:`Config`. Problems raise one :class:`ConfigError` that reports every problem of
the keys at once (``err.errors``), each starting with its dotted key:
``zero_optimization.stage: expected one of 0, 1, 2, 3, got 4``. :func:`check_config_file`
is what ``zeroshard run`` checks before any worker starts (this module imports no torch).

The dataclasses are the schema: each field is one key (``key()``: name, default, range,
aliases, doc, status), and one reader walks them (``zeroshard.config.schema``). Every
key is wired (the code uses it), not built (asking for it fails at load: "<key>:
<feature> is not built yet in zeroshard") or inert (means nothing here, for the reason
on the field); :func:`schema_table` lists them. The inert keys a config sets, and the
offload sections its ZeRO stage does not use (ignored as in DeepSpeed), are in
:attr:`Config.inert`, which the engine logs once from rank 0.

``"auto"`` is an error naming the key: only the Hugging Face integration fills it in,
through ``auto_values={"optimizer.params.lr": 3e-4, ...}`` (canonical dotted key ->
value; it replaces "auto" at that key, as the Trainer's ``fill_match`` does).

From DeepSpeed (facts, not code): key names and defaults; ``Adam`` meaning decoupled
weight decay unless ``adam_w_mode`` is false; stage-3 keys with or without ``stage3_``;
``"zero_optimization": true`` (stage 1, ``allgather_size``); ``steps_per_print``
Infinity (accelerate's) or null meaning never; duplicate keys refused. Stricter: unknown
keys are errors everywhere, booleans must be JSON booleans, numbers may not be strings.
No collectives, no devices.
"""

from __future__ import annotations

import copy
import operator
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, is_dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from zeroshard import ArgumentError
from zeroshard.config import features, monitors, sections
from zeroshard.config.jsonc import read_config_file
from zeroshard.config.parallel import ExpertParallelConfig, PipelineConfig, TensorParallelConfig
from zeroshard.config.schema import (
    AUTO,
    INERT,
    NOT_BUILT,
    ConfigError,
    KeyInfo,
    Reading,
    Section,
    check,
    describe,
    key,
    read_section,
    schema_keys,
    specs,
)
from zeroshard.config.sections import (
    DEFAULT_LEAF_CLASSES,
    DTYPES,
    OFFLOAD_DEVICES,
    OPTIMIZER_TYPES,
    SCHEDULER_TYPES,
    ActivationCheckpointingConfig,
    AIOConfig,
    BF16Config,
    CheckpointConfig,
    DataTypesConfig,
    FP8Config,
    FP16Config,
    LeafModuleConfig,
    OffloadConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
)

if TYPE_CHECKING:  # torch is imported where a dtype is asked for: `zeroshard run` checks
    import torch  # a config before any worker starts, without torch's 1-2 s import

# fmt: off
#: DeepSpeed's name for the config error (``deepspeed.DeepSpeedConfigError``)
DeepSpeedConfigError = ConfigError

__all__ = [
    "DEFAULT_LEAF_CLASSES",
    "DTYPES",
    "OFFLOAD_DEVICES",
    "OPTIMIZER_TYPES",
    "SCHEDULER_TYPES",
    "AIOConfig",
    "ActivationCheckpointingConfig",
    "BF16Config",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataTypesConfig",
    "DeepSpeedConfigError",
    "FP8Config",
    "FP16Config",
    "LeafModuleConfig",
    "OffloadConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "check_config_file",
    "load_config",
    "read_config",
    "read_config_file",
    "read_section",
    "resolve_batch_sizes",
    "schema_table",
]
# fmt: on

_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _section(cls: type, doc: str, **meta: Any) -> Any:
    return key(doc=doc, factory=cls, nullable=True, **meta)


def _batch(doc: str) -> Any:
    return key(
        None, doc=doc + " Absent, null or 0: derived from the other two.", min=0, nullable=True
    )


def _feature(feature: str, on: Callable[[Any], bool] | None = None) -> Any:
    """A DeepSpeed section zeroshard keeps as JSON: refused when on (default: given)."""
    doc = f"DeepSpeed's {feature} settings, kept as given."
    return key(None, NOT_BUILT(feature, on), doc=doc, check=sections.enabled_is_boolean)


def _object_or_false(value: Any, at: str) -> None:
    check(isinstance(value, (Mapping, bool)), at, f"expected an object {{...}} or false, got {describe(value)}")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Config(Section):
    """A whole, validated config. Build it with :func:`load_config`."""

    HINTS: ClassVar[dict[str, str]] = {"allgather_size": "it is read only with the boolean form of 'zero_optimization'; use zero_optimization.allgather_bucket_size"}  # fmt: skip

    # fmt: off
    train_batch_size: int = _batch("Samples per optimizer step over all data-parallel ranks.")
    train_micro_batch_size_per_gpu: int = _batch("Samples per rank per forward/backward.")
    gradient_accumulation_steps: int = _batch("Micro-batches per optimizer step.")
    dp_world_size: int = 1  # what the batch sizes were resolved for (not a key)
    world_size: int | None = None  # given instead: dp is what tp x sp x pp leave (not a key)
    module_stages: int | None = None  # the PipelineModule's num_stages, if any (not a key)
    # only gradient_accumulation_steps given: leave the micro-batch size None for the engine
    # to take from the first batch (initialize without training_data; not a key)
    micro_batch_from_data: bool = False
    # False: checked before the ranks exist (zeroshard run's check): the batch-size rule and
    # the parallel degrees' fit to the world size wait for initialize (not a key)
    layout_known: bool = True
    optimizer: OptimizerConfig | None = key(None, doc="The optimizer to build; null: pass one to initialize().")
    scheduler: SchedulerConfig | None = key(None, doc="The learning-rate schedule, if any.")
    fp16: FP16Config = _section(FP16Config, "fp16 mixed precision.")
    bf16: BF16Config = _section(BF16Config, "bf16 mixed precision.", aliases=("bfloat16",))
    fp8: FP8Config = _section(FP8Config, "fp8 matmuls in the Linear layers, over bf16 (zeroshard; torchao's float8 training).")
    zero_optimization: ZeroConfig = _section(ZeroConfig, "ZeRO.")
    activation_checkpointing: ActivationCheckpointingConfig = _section(ActivationCheckpointingConfig, "Activation checkpointing.")
    aio: AIOConfig = _section(AIOConfig, "Asynchronous I/O for NVMe offload.")
    checkpoint: CheckpointConfig = _section(CheckpointConfig, "Checkpoints.")
    data_types: DataTypesConfig = _section(DataTypesConfig, "Dtype overrides.")
    gradient_clipping: float = key(0.0, doc="Clip the global gradient norm to this; 0 = off.", min=0, nullable=True)
    nonfinite_gradients: str = key("skip", doc="zeroshard: a step whose gradients or loss hold inf/nan on any rank is 'skip'ped on every rank (logged and counted), or makes every rank 'raise'; 'apply' steps anyway (DeepSpeed's bf16 without check_grad_overflow). fp16 skips overflows and lowers its loss scale.", choices=("skip", "raise", "apply"))
    prescale_gradients: bool = key(False, doc="Divide gradients by the world size before the reduction.")
    gradient_predivide_factor: float = key(1.0, doc="Divide gradients by this before the reduction, the rest after. 1.0 (the default): the whole average is taken before, fused into each gradient's copy into its bucket (as DDP does; round-off apart, the same result).", above=0)
    communication_data_type: str | None = key(None, doc="Dtype of gradient communication; null = the gradients'.", choices=DTYPES)
    seq_parallel_communication_data_type: str = key("fp32", INERT("sequence-parallel all-to-alls move activations in their own dtype"), doc="Sequence-parallel dtype.", choices=DTYPES)
    gradient_allreduce_op: str = key("mean", NOT_BUILT("summed (not averaged) gradient reduction"), doc="mean or sum.", choices=("mean", "sum"))
    steps_per_print: int | None = key(None, doc="Log progress every this many steps; null (the default, as in DeepSpeed) or Infinity = never.", min=1, infinity=None)
    seed: int | None = key(None, doc="Seed of Python's and torch's random state.", min=0)
    comm_timeout: float | None = key(None, doc="zeroshard: seconds a rank may block in one collective before the watchdog reports every rank's state and exits (0: off; null: ZEROSHARD_COMM_TIMEOUT or 600).", min=0)
    dataloader_drop_last: bool = key(False, doc="The engine's data loader drops the last incomplete batch.")
    wall_clock_breakdown: bool = key(False, doc="Print forward, backward (inner, allreduce) and step times every step (rank 0).")
    memory_breakdown: bool = key(False, doc="Print memory use before and after forward, backward and step (rank 0).")
    dump_state: bool = key(False, doc="Print the resolved config at start-up (rank 0).")
    zero_allow_untested_optimizer: bool = key(False, INERT("ZeRO takes any torch optimizer"), doc="ZeRO with a client optimizer.")
    zero_force_ds_cpu_optimizer: bool = key(True, INERT("CPU offload steps torch's fused CPU Adam"), doc="Insist on DeepSpeed's CPU Adam.")
    disable_allgather: bool = key(False, INERT("a legacy switch; updated parameters are always all-gathered"), doc="Broadcast, not all-gather.")
    vocabulary_size: int | None = key(None, INERT("DeepSpeed only checks it for tensor-core alignment"), doc="Vocabulary size.", min=1)
    sequence_parallel_size: int = key(1, doc="Sequence-parallel degree (DeepSpeed's Ulysses; ring attention with sequence_parallel_mode 'ring').", min=1, nullable=True)
    sequence_parallel_mode: str = key("ulysses", doc="zeroshard: 'ulysses' (all-to-all of heads) or 'ring' (ring attention, load-balanced causal chunks).", choices=("ulysses", "ring"))
    log_level: str | None = key(None, INERT("set the level of the 'zeroshard' logger with Python's logging"), doc="DeepSpeed's log level.")
    sparse_gradients: bool = key(False, NOT_BUILT("sparse (CSR) gradients"), doc="Sparse embedding gradients.")
    managed_gradient_accumulation: bool = key(True, NOT_BUILT("unmanaged gradient accumulation"), doc="Accumulate in the engine.")
    graph_harvesting: bool = key(False, NOT_BUILT("CUDA graph harvesting"), doc="CUDA graph harvesting.")
    use_data_before_expert_parallelism: bool = key(False, doc="Data vs expert rank order (true: refused with expert parallelism; zeroshard places an expert-parallel group's ranks next to each other).")
    timers: monitors.TimersConfig = _section(monitors.TimersConfig, "Timers.")
    tensorboard: monitors.TensorBoardConfig = monitors.monitor(monitors.TensorBoardConfig, "TensorBoard monitor")
    wandb: monitors.WandbConfig = monitors.monitor(monitors.WandbConfig, "Weights & Biases monitor")
    csv_monitor: monitors.CSVMonitorConfig = monitors.monitor(monitors.CSVMonitorConfig, "CSV monitor")
    comet: monitors.CometConfig = monitors.monitor(monitors.CometConfig, "Comet monitor")
    comms_logger: monitors.CommsLoggerConfig = monitors.monitor(monitors.CommsLoggerConfig, "communication logger")
    flops_profiler: monitors.FlopsProfilerConfig = monitors.monitor(monitors.FlopsProfilerConfig, "flops profiler")
    pipeline: PipelineConfig = _section(PipelineConfig, "Pipeline parallelism (the model is a zeroshard.pipe.PipelineModule).")
    amp: features.AmpConfig = _section(features.AmpConfig, "Apex AMP (removed in DeepSpeed 0.19).")
    torch_autocast: features.TorchAutocastConfig = _section(features.TorchAutocastConfig, "torch.autocast mixed precision.")
    sparse_attention: dict[str, Any] | None = _feature("sparse attention")
    compression_training: dict[str, Any] | None = _feature("compression training")
    data_efficiency: features.DataEfficiencyConfig = _section(features.DataEfficiencyConfig, "The data efficiency library.")
    curriculum_learning: features.CurriculumLearningConfig = _section(features.CurriculumLearningConfig, "Legacy curriculum learning (removed in DeepSpeed 0.19).")
    elasticity: features.ElasticityConfig = _section(features.ElasticityConfig, "Elastic training (removed in DeepSpeed 0.19).")
    autotuning: features.AutotuningConfig = _section(features.AutotuningConfig, "The autotuner.")
    hybrid_engine: features.HybridEngineConfig = _section(features.HybridEngineConfig, "The hybrid (RLHF) engine.")
    progressive_layer_drop: features.ProgressiveLayerDropConfig = _section(features.ProgressiveLayerDropConfig, "Progressive layer drop (removed in DeepSpeed 0.19).")
    eigenvalue: features.EigenvalueConfig = _section(features.EigenvalueConfig, "Eigenvalue computation (removed in DeepSpeed 0.19).")
    quantize_training: features.QuantizeTrainingConfig = _section(features.QuantizeTrainingConfig, "MoQ (removed in DeepSpeed 0.19).")
    tensor_parallel: TensorParallelConfig = _section(TensorParallelConfig, "Tensor parallelism (AutoTP).")
    expert_parallel: ExpertParallelConfig = _section(ExpertParallelConfig, "Expert parallelism for Hugging Face MoE models (AutoEP).")
    compile: features.CompileConfig = _section(features.CompileConfig, "torch.compile and DeepCompile.")
    weight_quantization: dict[str, Any] | None = _feature("weight quantization")
    nebula: features.NebulaConfig = _section(features.NebulaConfig, "The Nebula checkpoint engine (removed in DeepSpeed 0.19).")
    datastates_ckpt: object | None = key(None, NOT_BUILT("the DataStates checkpoint engine", lambda v: v is not False), doc="DeepSpeed's DataStates checkpoint engine settings (on unless false).", check=_object_or_false)
    # fmt: on
    #: Keys this config sets that mean nothing here, as (dotted key, reason); the engine
    #: logs them once from rank 0.
    inert: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    #: Features this config asks for that are not built, as (dotted key, feature); only
    #: :func:`read_config` returns such a config (:func:`load_config` refuses it).
    not_built: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    #: The config as given (comments stripped, "auto" values filled), for checkpoints.
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        given, module = self.pipeline.stages, self.module_stages
        check(
            given is None or module is None or given == module,
            "pipeline.stages",
            f"{given}, but the PipelineModule was built with num_stages={module}",
        )
        if self.world_size is not None:
            object.__setattr__(self, "dp_world_size", self._dp_of(self.world_size))
        check(self.dp_world_size >= 1, "dp_world_size", "must be >= 1")
        train, micro, gas = (getattr(self, name) or None for name in _BATCH)  # 0: derive it
        resolved: tuple[int | None, int | None, int | None]
        if not self.layout_known:
            resolved = (train, micro, gas)  # initialize resolves them for its mesh
        elif self.micro_batch_from_data and train is None and micro is None and gas is not None:
            resolved = (None, None, gas)  # zeroshard/runtime/first_batch.py fills them in
        else:
            resolved = resolve_batch_sizes(train, micro, gas, self.dp_world_size)
        for name, value in zip(_BATCH, resolved, strict=True):
            object.__setattr__(self, name, value)
        mb = self.pipeline.micro_batches
        check(
            mb is None
            or self.gradient_accumulation_steps is None
            or mb == self.gradient_accumulation_steps,
            "pipeline.micro_batches",
            f"{mb}, but gradient_accumulation_steps is {self.gradient_accumulation_steps} (a "
            "pipeline runs gradient_accumulation_steps micro-batches per train_batch; give one)",
        )
        object.__setattr__(self, "inert", tuple(self.inert))
        object.__setattr__(self, "not_built", tuple(self.not_built))
        both = self.fp16.enabled and self.bf16.enabled
        check(
            not (
                self.zero_optimization.offload_optimizer.delayed_update and self.pipeline_stages > 1
            ),
            "zero_optimization.offload_optimizer.delayed_update",
            "is not built with pipeline parallelism (a pipeline engine steps inside "
            "train_batch()); leave it out with pipeline stages",
        )
        check(not both, "bf16.enabled", "fp16 and bf16 cannot both be enabled; choose one")
        check(
            not (
                self.activation_checkpointing.partition_activations
                and self.tensor_parallel.size > 1
            ),
            "activation_checkpointing.partition_activations",
            "splitting the checkpointed inputs over the tensor-parallel ranks is not built yet "
            "in zeroshard; tensor_parallel.sequence_parallel (Megatron-SP) splits activations "
            "over them",
        )
        if self.fp8.enabled:  # fp8 matmuls take bf16 operands and give bf16 results
            other = "fp16 (fp16.enabled)" if self.fp16.enabled else "fp32 (no bf16 or fp16 section enabled)"  # fmt: skip
            check(self.bf16.enabled, "fp8.enabled", f"fp8 matmuls run inside bf16 training: set bf16.enabled true (the config trains in {other}; fp8 with fp16 or fp32 compute is not supported)")  # fmt: skip
        if self.fp8.enable_fsdp_float8_all_gather:
            self._check_fp8_all_gather()

    def _check_fp8_all_gather(self) -> None:
        """Where the fp8 all-gather of stage-3 weights cannot work, refused by name."""
        key_ = "fp8.enable_fsdp_float8_all_gather"
        stage = self.zero_optimization.stage
        check(self.fp8.enabled, key_, "it casts the weights of the fp8 Linear layers: set fp8.enabled true too")  # fmt: skip
        check(stage == 3, key_, f"only ZeRO stage 3 gathers weights before their use (zero_optimization.stage is {stage}: the weights stay whole, in bf16, on every rank)")  # fmt: skip
        check(self.fp8.recipe_name == "tensorwise", key_, f"the fp8 all-gather needs the tensorwise recipe (one scale per weight, taken before the gather; fp8.recipe_name is {self.fp8.recipe_name!r}, whose per-row scales torchao does not gather in fp8 either)")  # fmt: skip
        check(self.tensor_parallel.size == 1, key_, "with tensor parallelism is not built yet (the tensor-parallel layers' weights would need their amax reduced over the tp group too); leave it out with tensor_parallel")  # fmt: skip

    @classmethod
    def json_compat(cls, values: dict, given: dict[str, str], note: Callable[[str, str], None]) -> dict:  # fmt: skip
        """As in DeepSpeed, prescaling divides by the world size and ignores the factor."""
        if values.get("prescale_gradients") and values.get("gradient_predivide_factor", 1) != 1:
            note(given["gradient_predivide_factor"], "unused with prescale_gradients true: gradients are divided by the world size before the reduction, as in DeepSpeed")  # fmt: skip
        return values

    @property
    def pipeline_stages(self) -> int:
        """Pipeline stages: ``pipeline.stages``, else the PipelineModule's (1: none)."""
        return self.pipeline.stages or self.module_stages or 1

    def _dp_of(self, world: int) -> int:
        tp, sp, pp = self.tensor_parallel.size, self.sequence_parallel_size, self.pipeline_stages
        check(
            world % (tp * sp * pp) == 0,
            "tensor_parallel.autotp_size",
            f"tensor_parallel.autotp_size ({tp}) x sequence_parallel_size ({sp}) x "
            f"pipeline.stages ({pp}) = {tp * sp * pp} does not divide the world size ({world})",
        )
        return world // (tp * sp * pp)

    @property
    def compute_dtype(self) -> torch.dtype:
        """bf16 if bf16 is enabled, fp16 if fp16 is, else fp32."""
        import torch

        return torch.bfloat16 if self.bf16.enabled else torch.float16 if self.fp16.enabled else torch.float32  # fmt: skip

    @property
    def grad_accum_dtype(self) -> str | None:
        """``data_types.grad_accum_dtype`` ("fp32", "fp16" or "bf16"), or None."""
        return self.data_types.grad_accum_dtype


# -- loading -----------------------------------------------------------------------------
def load_config(
    source: Mapping[str, Any] | str | os.PathLike[str],
    *,
    dp_world_size: int = 1,
    world_size: int | None = None,
    auto_values: Mapping[str, Any] | None = None,
    module_stages: int | None = None,
    micro_batch_from_data: bool = False,
) -> Config:
    """Read and validate a DeepSpeed config for ``dp_world_size`` data-parallel ranks.

    ``source`` is a dict or the path of a JSON file (``//``, ``#`` and ``/* */`` comments
    and trailing commas allowed). ``auto_values`` maps dotted keys (``"optimizer.params.lr"``,
    ``"train_micro_batch_size_per_gpu"``) to the values that replace ``"auto"`` there; it
    is the Hugging Face integration's hook, and a key it names must be one the schema
    knows. ``world_size`` instead of ``dp_world_size``: the data-parallel size is what
    the config's tensor, sequence and pipeline degrees leave of it; ``module_stages``:
    the stages of the PipelineModule being trained (``pipeline.stages`` must agree);
    ``micro_batch_from_data``: a config giving only ``gradient_accumulation_steps`` leaves
    ``train_micro_batch_size_per_gpu`` and ``train_batch_size`` None (the engine takes them
    from the first batch) instead of being refused. Raises one :class:`ConfigError`
    reporting every problem of the keys (``err.errors``), features not built included.
    """
    return _read(
        source,
        Reading(Config, refuse_not_built=True),
        dp_world_size=dp_world_size,
        world_size=world_size,
        auto_values=auto_values,
        module_stages=module_stages,
        micro_batch_from_data=micro_batch_from_data,
    )


def read_config(
    source: Mapping[str, Any] | str | os.PathLike[str],
    *,
    dp_world_size: int = 1,
    world_size: int | None = None,
    auto_values: Mapping[str, Any] | None = None,
    module_stages: int | None = None,
    micro_batch_from_data: bool = False,
) -> Config:
    """:func:`load_config` for tools that inspect configs: a config asking for features
    that are not built is returned, with them in :attr:`Config.not_built`."""
    return _read(
        source,
        Reading(Config),
        dp_world_size=dp_world_size,
        world_size=world_size,
        auto_values=auto_values,
        module_stages=module_stages,
        micro_batch_from_data=micro_batch_from_data,
    )


def check_config_file(path: str | os.PathLike[str]) -> None:
    """What ``zeroshard run`` checks before it starts any worker: the file, every key
    (features not built refused), and the rules that need no world size. ``"auto"`` reads
    as the default (the Hugging Face integration fills it in later); the batch-size rule
    and the parallel degrees' fit to the world size are left to ``initialize``, which knows
    the mesh (an ``mpu`` may shape it). Raises one :class:`ConfigError` reporting every
    problem found. Imports no torch."""
    _read(path, Reading(Config, refuse_not_built=True, auto_ok=True), layout_known=False)


def _read(
    source: Mapping[str, Any] | str | os.PathLike[str],
    reading: Reading,
    *,
    dp_world_size: int = 1,
    auto_values: Mapping[str, Any] | None = None,
    **extra: Any,
) -> Config:
    try:
        world = operator.index(dp_world_size)
    except TypeError:
        world = 0
    if isinstance(dp_world_size, bool) or world < 1:
        raise ArgumentError(f"dp_world_size must be a positive int, got {dp_world_size!r}")
    if isinstance(source, Mapping):
        raw, where = copy.deepcopy(dict(source)), "the config"
    elif isinstance(source, (str, os.PathLike)):
        raw, where = read_config_file(source), os.fspath(source)
    else:
        raise TypeError(f"config must be a dict or a path, got {type(source).__name__}")
    if not isinstance(raw, dict):
        raise ConfigError("config" if isinstance(source, Mapping) else where, f"expected a JSON object at the top level, got {describe(raw)}")  # fmt: skip
    _fill_auto(raw, auto_values or {})
    data = dict(raw)
    if isinstance(data.get("zero_optimization"), bool):  # DeepSpeed's deprecated form
        data["zero_optimization"] = {"stage": int(data["zero_optimization"])}
        if "allgather_size" in data:
            data["zero_optimization"]["allgather_bucket_size"] = data.pop("allgather_size")
    pipe = data.get("pipeline")
    if isinstance(pipe, dict) and pipe.get("stages") == AUTO:  # DeepSpeed's default value
        data["pipeline"] = {**pipe, "stages": None}  # the PipelineModule's num_stages
    reading.where = where
    config: Config = read_section(
        Config,
        data,
        "",
        reading,
        dp_world_size=world,
        raw=raw,
        inert=reading.inert,
        not_built=reading.not_built,
        **extra,
    )
    return config


def _fill_auto(raw: dict[str, Any], auto_values: Mapping[str, Any]) -> None:
    """Put ``auto_values`` where ``raw`` says "auto" (a key may be spelled by an alias)."""
    node: Any  # the JSON object holding the key, None where the path has none
    for path, value in auto_values.items():
        cls, node, rest = Config, raw, tuple(path.split("."))
        while True:
            found = [s for s in specs(cls) if s.path == rest[: len(s.path)]]
            if not found or (len(rest) > len(found[0].path) and not is_dataclass(found[0].type)):
                raise ArgumentError(f"auto_values: {path!r} is not a key of the config schema")
            spec = found[0]
            for part in spec.path[:-1]:  # sub-objects, e.g. optimizer.params
                node = node.get(part) if isinstance(node, dict) else None
            names = (spec.path[-1], *spec.key.aliases)
            name = next((n for n in names if isinstance(node, dict) and n in node), None)
            rest = rest[len(spec.path) :]
            if not rest:
                if name is not None and node[name] == AUTO:
                    node[name] = copy.deepcopy(value)
                break
            cls, node = spec.type, node[name] if name is not None else None


def schema_table() -> list[KeyInfo]:
    """Every key the config accepts: ``.path`` (dotted), ``.status.kind`` ("wired", "not
    built" or "inert"; a key inside a refused section shares its status), ``.status.text``
    (the feature or the reason) and ``.spec`` (the field: attr, type, default, key)."""
    return list(schema_keys(Config))


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
        assert micro is not None  # train and micro both None raised above
        gas = 1 if gas is None else gas
        return micro * gas * world, micro, gas
    if micro is None:
        gas = 1 if gas is None else gas
        _check_multiple(train, micro, gas, gas, world)
        micro = train // (gas * world)
    elif gas is None:
        _check_multiple(train, micro, gas, micro, world)
        gas = train // (micro * world)
    if train != micro * gas * world:
        raise ConfigError(
            "train_batch_size", f"{_batch_rule(train, micro, gas, world)} = {micro * gas * world}"
        )
    return train, micro, gas


def _check_multiple(train: int, micro: int | None, gas: int | None, known: int, world: int) -> None:
    if train % (known * world):
        raise ConfigError(
            "train_batch_size",
            f"{_batch_rule(train, micro, gas, world)}, but {train} is not a multiple of "
            f"{known} x {world} = {known * world}",
        )


def _batch_rule(train: int, micro: int | None, gas: int | None, world: int) -> str:
    def show(value: int | None) -> str:
        return "(?)" if value is None else f"({value})"

    return (
        f"train_batch_size ({train}) must equal train_micro_batch_size_per_gpu {show(micro)}"
        f" x gradient_accumulation_steps {show(gas)} x data-parallel world size ({world})"
    )
