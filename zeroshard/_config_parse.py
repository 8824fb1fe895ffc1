"""Parsers behind :func:`zeroshard.config.load_config`: one function per section, from
raw JSON (dicts) to the section dataclasses of :mod:`zeroshard.config`. Private.

The parsers check key names and JSON types (with the key path actually written, aliases
included); ranges and cross-field rules live in the dataclasses' ``__post_init__``, whose
errors :func:`prefixed` moves under the section's path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zeroshard import _config_keys as keys
from zeroshard._config_fields import (
    AUTO,
    ConfigError,
    Fields,
    as_choice,
    as_integer,
    as_number,
    check,
    describe,
    is_number,
    prefixed,
)
from zeroshard.config import (
    DTYPES,
    OFFLOAD_DEVICES,
    OPTIMIZER_TYPES,
    ActivationCheckpointingConfig,
    AIOConfig,
    BF16Config,
    CheckpointConfig,
    Config,
    FP16Config,
    OffloadConfig,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
    resolve_batch_sizes,
)


def parse_config(raw: dict[str, Any], dp_world_size: int) -> Config:
    """The whole config, validated and with the batch sizes resolved; NOT_BUILT is the
    caller's business."""
    top = Fields(raw, "", keys.TOP_LEVEL, hints=keys.TOP_LEVEL_HINTS)
    optimizer = _parse_optimizer(top.section("optimizer"))
    scheduler = _parse_scheduler(top.section("scheduler"))
    fp16 = _parse_fp16(top.section("fp16"))
    bf16_key = top.pick("bf16", "bfloat16")
    bf16 = _parse_bf16(top.section(bf16_key), bf16_key)
    zero, ignored_offload = _parse_zero(top)
    activation_checkpointing = _parse_activation_checkpointing(
        top.section("activation_checkpointing")
    )
    aio = _parse_aio(top.section("aio"))
    checkpoint = _parse_checkpoint(top.section("checkpoint"))
    grad_accum_dtype = _parse_data_types(top.section("data_types"))
    ignored_enabled = (*_parse_monitoring(top), *ignored_offload)
    _check_other_top_level(top)

    batch = [_batch_value(top, name) for name in keys.BATCH_KEYS]
    try:
        train, micro, gas = resolve_batch_sizes(*batch, dp_world_size)
    except ConfigError as err:
        if any(top.get(name) == AUTO for name in keys.BATCH_KEYS):
            raise ConfigError(
                err.path,
                f"{err.problem} ('auto' batch sizes are filled in by Hugging Face's Trainer; "
                "when loading the config yourself, give numbers)",
            ) from None
        raise
    return Config(
        train_batch_size=train,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=gas,
        dp_world_size=dp_world_size,
        optimizer=optimizer,
        scheduler=scheduler,
        fp16=fp16,
        bf16=bf16,
        zero_optimization=zero,
        activation_checkpointing=activation_checkpointing,
        aio=aio,
        checkpoint=checkpoint,
        gradient_clipping=top.number("gradient_clipping", 0.0, minimum=0, nullable=True),
        prescale_gradients=top.boolean("prescale_gradients", False),
        gradient_predivide_factor=top.number("gradient_predivide_factor", 1.0, above=0),
        communication_data_type=top.string(
            "communication_data_type", None, choices=DTYPES, nullable=True
        ),
        grad_accum_dtype=grad_accum_dtype,
        steps_per_print=top.integer("steps_per_print", 10, minimum=1, nullable=True),
        seed=top.integer("seed", None, minimum=0, nullable=True),
        wall_clock_breakdown=top.boolean("wall_clock_breakdown", False),
        memory_breakdown=top.boolean("memory_breakdown", False),
        dump_state=top.boolean("dump_state", False),
        dataloader_drop_last=top.boolean("dataloader_drop_last", False),
        zero_allow_untested_optimizer=top.boolean("zero_allow_untested_optimizer", False),
        zero_force_ds_cpu_optimizer=top.boolean("zero_force_ds_cpu_optimizer", True),
        disable_allgather=top.boolean("disable_allgather", False),
        ignored_enabled=ignored_enabled,
        raw=raw,
    )


def _build(prefix: str, cls: type[Any], **values: Any) -> Any:
    """``cls(**values)``, with its ``__post_init__`` errors moved under ``prefix``. The
    values are computed (and their own errors raised, with full paths) before this runs."""
    with prefixed(prefix):
        return cls(**values)


def _batch_value(top: Fields, key: str) -> int | None:
    """A batch-size key; absent, null, "auto" and 0 all mean "derive it"."""
    value = top.integer(key, None, minimum=0, nullable=True)
    return value or None


def _parse_optimizer(data: Mapping[str, Any] | None) -> OptimizerConfig | None:
    if data is None:
        return None
    f = Fields(data, "optimizer", ("type", "params", "legacy_fusion"))
    f.boolean("legacy_fusion", False)  # DeepSpeed's old fused-optimizer switch; no effect
    given = f.get("type")
    if given is None:
        raise ConfigError("optimizer.type", f"required; one of {', '.join(OPTIMIZER_TYPES)}")
    kind = _optimizer_type(given)
    params_known = keys.ADAM_PARAMS if kind in ("Adam", "AdamW") else keys.SGD_PARAMS
    takes = ", ".join(k for k in params_known if k != "max_grad_norm")
    hints = {
        k: f"'{k}' is not a parameter of {kind} (which takes {takes})"
        for k in keys.ADAM_PARAMS + keys.SGD_PARAMS
        if k not in params_known
    }
    p = Fields(f.section("params") or {}, "optimizer.params", params_known, hints=hints)
    if p.has("max_grad_norm"):
        raise ConfigError(
            p.at("max_grad_norm"),
            "not an optimizer parameter in DeepSpeed configs; use the top-level "
            "'gradient_clipping' instead",
        )
    values: dict[str, Any] = {
        "lr": p.number("lr", 1e-3, minimum=0),
        "weight_decay": p.number("weight_decay", 0.0, minimum=0),
    }
    if kind == "SGD":
        values["momentum"] = p.number("momentum", 0.0, minimum=0)
        values["dampening"] = p.number("dampening", 0.0)
        values["nesterov"] = p.boolean("nesterov", False)
    else:
        values["betas"] = _betas(p)
        values["eps"] = p.number("eps", 1e-8, minimum=0)
        values["amsgrad"] = p.boolean("amsgrad", False)
        values["adam_w_mode"] = p.boolean("adam_w_mode", True)
        values["bias_correction"] = p.boolean("bias_correction", True)
        values["fused"] = p.boolean("fused", None, nullable=True)
        # DeepSpeed: torch's Adam instead of its FusedAdam. Ours always is torch's.
        p.boolean("torch_adam", False)
    return _build("optimizer", OptimizerConfig, type=kind, **values)


def _optimizer_type(given: Any) -> str:
    path = "optimizer.type"
    if not isinstance(given, str):
        raise ConfigError(path, f"expected a string, got {describe(given)}")
    for kind in OPTIMIZER_TYPES:
        if kind.lower() == given.lower():
            return kind
    if given.lower() in keys.DEEPSPEED_ONLY_OPTIMIZERS:
        raise ConfigError(
            path,
            f"{given!r} is a DeepSpeed optimizer zeroshard does not provide (yet); use Adam, "
            "AdamW or SGD, or pass a torch optimizer to initialize()",
        )
    return as_choice(given, path, OPTIMIZER_TYPES)  # raises, with a suggestion if close


def _betas(p: Fields) -> tuple[float, float]:
    value = p.get("betas", AUTO)
    if value == AUTO:
        return (0.9, 0.999)
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(map(is_number, value)):
        raise ConfigError(p.at("betas"), f"expected a pair [beta1, beta2], got {describe(value)}")
    return (as_number(value[0], p.at("betas")), as_number(value[1], p.at("betas")))


def _parse_scheduler(data: Mapping[str, Any] | None) -> SchedulerConfig | None:
    if data is None:
        return None
    f = Fields(data, "scheduler", ("type", "params"))
    given = f.get("type")
    if given is None:
        raise ConfigError("scheduler.type", f"required; one of {', '.join(keys.SCHEDULER_PARAMS)}")
    kind = as_choice(given, "scheduler.type", keys.SCHEDULER_PARAMS)
    spec = keys.SCHEDULER_PARAMS[kind]
    p = Fields(f.section("params") or {}, "scheduler.params", spec)
    params: dict[str, Any] = {}
    for name, value in p.data.items():
        params[name] = (
            value if value in (AUTO, None) else _schedule_value(spec[name], value, p.at(name))
        )
    for name in keys.SCHEDULER_REQUIRED.get(kind, ()):
        check(params.get(name) is not None, p.at(name), f"required for {kind}")
    return _build("scheduler", SchedulerConfig, type=kind, params=params)


def _schedule_value(kind: str, value: Any, path: str) -> Any:
    if kind == "lr":  # one learning rate, or one per parameter group
        if isinstance(value, list):
            return [as_number(v, path, minimum=0) for v in value]
        return as_number(value, path, minimum=0)
    if kind == "bool":
        check(isinstance(value, bool), path, f"expected true or false, got {describe(value)}")
        return value
    if kind == "warmup_type":
        return as_choice(value, path, ("log", "linear"))
    bounds = {
        "steps": {"minimum": 0},
        "positive": {"minimum": 1},
        "iteration": {"minimum": -1},
    }
    if kind in bounds:
        return as_integer(value, path, **bounds[kind])
    if kind == "ratio":
        return as_number(value, path, minimum=0, maximum=1)
    return as_number(value, path, minimum=0)  # "rate"


def _parse_fp16(data: Mapping[str, Any] | None) -> FP16Config:
    f = Fields(data or {}, "fp16", keys.FP16)
    f.boolean("fused_mode", True)  # legacy DeepSpeed switch; no effect
    return _build(
        "fp16",
        FP16Config,
        enabled=f.boolean("enabled", False),
        auto_cast=f.boolean("auto_cast", False),
        loss_scale=f.number("loss_scale", 0.0, minimum=0),
        initial_scale_power=f.integer("initial_scale_power", 16, minimum=0),
        loss_scale_window=f.integer("loss_scale_window", 1000, minimum=1),
        hysteresis=f.integer("hysteresis", 2, minimum=1),
        consecutive_hysteresis=f.boolean("consecutive_hysteresis", False),
        min_loss_scale=f.number("min_loss_scale", 1.0, above=0),
        fp16_master_weights_and_grads=f.boolean("fp16_master_weights_and_grads", False),
    )


def _parse_bf16(data: Mapping[str, Any] | None, name: str) -> BF16Config:
    f = Fields(data or {}, name, keys.BF16)
    return _build(name, BF16Config, **{key: f.boolean(key, False) for key in keys.BF16})


def _parse_offload(data: Mapping[str, Any] | None, kind: str) -> OffloadConfig:
    path = f"zero_optimization.offload_{kind}"
    own = keys.OFFLOAD_PARAM if kind == "param" else keys.OFFLOAD_OPTIMIZER
    other = keys.OFFLOAD_OPTIMIZER if kind == "param" else keys.OFFLOAD_PARAM
    other_name = "offload_optimizer" if kind == "param" else "offload_param"
    hints = {k: f"'{k}' is an {other_name} setting" for k in other if k not in own}
    f = Fields(data or {}, path, own, hints=hints)
    values: dict[str, Any] = {
        "device": f.string("device", "none", choices=OFFLOAD_DEVICES),
        "nvme_path": f.string("nvme_path", None, nullable=True),
        "pin_memory": f.boolean("pin_memory", None),
        "buffer_count": f.integer("buffer_count", None, minimum=0),
    }
    if kind == "param":
        values["buffer_size"] = f.integer("buffer_size", 100_000_000, minimum=0)
        values["max_in_cpu"] = f.integer("max_in_cpu", 1_000_000_000, minimum=0)
    else:
        for name in ("fast_init", "pipeline_read", "pipeline_write", "super_offload"):
            values[name] = f.boolean(name, False)
        values["convert_grad_on_cpu"] = f.boolean("convert_grad_on_cpu", True)
        values["ratio"] = f.number("ratio", 1.0, minimum=0, maximum=1)
        values["cpuadam_cores_perc"] = f.number("cpuadam_cores_perc", 0.8, minimum=0, maximum=1)
    return _build(path, OffloadConfig, kind=kind, **values)


def _parse_zero(top: Fields) -> tuple[ZeroConfig, list[str]]:
    """The ZeRO section, and the names of offload settings it ignores (see below)."""
    data = top.get("zero_optimization")
    if isinstance(data, bool):  # DeepSpeed's deprecated form: true = stage 1
        bucket = top.integer("allgather_size", 500_000_000, minimum=0)
        return ZeroConfig(stage=1 if data else 0, allgather_bucket_size=bucket), []
    f = Fields(top.section("zero_optimization") or {}, "zero_optimization", keys.ZERO)
    values: dict[str, Any] = {}
    stage = f.get("stage", 0)
    if stage != AUTO:
        stage_ok = is_number(stage) and float(stage) in (0, 1, 2, 3)
        check(stage_ok, f.at("stage"), f"expected one of 0, 1, 2, 3, got {describe(stage)}")
        values["stage"] = int(stage)
    for name, (kind, default) in keys.ZERO_SCALARS.items():
        key = f.pick(name, *keys.ZERO_ALIASES.get(name, ()))
        if kind == "bool":
            values[name] = f.boolean(key, default, nullable=default is None)
        else:
            values[name] = f.integer(key, default, minimum=0 if name != "mics_shard_size" else -1)
    for name in ("zenflow", "leaf_module"):
        section = f.section(name)
        values[name] = dict(section) if section is not None else None
    values["zeropp_loco_param"] = _parse_loco(f.section("zeropp_loco_param"))

    # The deprecated switches fold into the offload sections they stand for. Like
    # DeepSpeed, we ignore parameter offload below stage 3 and optimizer offload at stage
    # 0 (DeepSpeed-Chat's generated configs rely on that); the engine warns about them.
    ignored: list[str] = []
    pin = values["cpu_offload_use_pin_memory"]
    used_from = {"param": 3, "optimizer": 1}
    for kind, switch in (("optimizer", "cpu_offload"), ("param", "cpu_offload_param")):
        section = f.section(f"offload_{kind}")
        if values[switch] is not None and section is not None:
            raise ConfigError(
                f.at(switch),
                f"deprecated alias of offload_{kind}; give only offload_{kind}",
            )
        if values[switch]:
            offload = OffloadConfig(kind=kind, device="cpu", pin_memory=pin)
        else:
            offload = _parse_offload(section, kind)
        if offload.enabled and values.get("stage", 0) < used_from[kind]:
            ignored.append(f.at(switch if values[switch] else f"offload_{kind}"))
            offload = OffloadConfig(kind=kind)
        values[f"offload_{kind}"] = offload
    return _build("zero_optimization", ZeroConfig, **values), ignored


def _parse_loco(data: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if data is None:
        return None
    f = Fields(data, "zero_optimization.zeropp_loco_param", ("err_beta", "reset_T"))
    return {
        "err_beta": f.number("err_beta", 0.8, minimum=0, maximum=1),
        "reset_T": f.integer("reset_T", 1024, minimum=1),
    }


def _parse_activation_checkpointing(
    data: Mapping[str, Any] | None,
) -> ActivationCheckpointingConfig:
    path = "activation_checkpointing"
    f = Fields(data or {}, path, keys.ACTIVATION_CHECKPOINTING)
    flags = {
        k: f.boolean(k, False) for k in keys.ACTIVATION_CHECKPOINTING if k != "number_checkpoints"
    }
    number = f.integer("number_checkpoints", None, minimum=1, nullable=True)
    return _build(path, ActivationCheckpointingConfig, number_checkpoints=number, **flags)


def _parse_aio(data: Mapping[str, Any] | None) -> AIOConfig:
    f = Fields(data or {}, "aio", keys.AIO)
    threads = f.pick("intra_op_parallelism", "thread_count")
    return _build(
        "aio",
        AIOConfig,
        block_size=f.integer("block_size", 1_048_576, minimum=1),
        queue_depth=f.integer("queue_depth", 8, minimum=1),
        intra_op_parallelism=f.integer(threads, 1, minimum=1),
        single_submit=f.boolean("single_submit", False),
        overlap_events=f.boolean("overlap_events", True),
        use_gds=f.boolean("use_gds", False),
    )


def _parse_checkpoint(data: Mapping[str, Any] | None) -> CheckpointConfig:
    f = Fields(data or {}, "checkpoint", keys.CHECKPOINT)
    parallel = Fields(
        f.section("parallel_write") or {}, f.at("parallel_write"), ("pipeline_stage",)
    )
    f.section("writer")  # DeepSpeed's fast checkpoint writers; ours is always the same writer
    return _build(
        "checkpoint",
        CheckpointConfig,
        dir=f.string("dir", None, nullable=True),
        tag_validation=f.string("tag_validation", "Warn", choices=("Ignore", "Warn", "Fail")),
        load_universal=f.boolean("load_universal", False),
        use_node_local_storage=f.boolean("use_node_local_storage", False),
        parallel_write_pipeline_stage=parallel.boolean("pipeline_stage", False),
    )


def _parse_data_types(data: Mapping[str, Any] | None) -> str | None:
    """data_types: returns grad_accum_dtype normalized ("fp32"|"fp16"|"bf16") or None."""
    f = Fields(data or {}, "data_types", ("grad_accum_dtype", "param_dtype", "buffer_dtype"))
    names = {}
    for key in ("grad_accum_dtype", "param_dtype", "buffer_dtype"):
        value = f.string(key, None, nullable=True)
        names[key] = None if value is None else _dtype_name(value, f.at(key))
    return names["grad_accum_dtype"]


def _dtype_name(value: str, path: str) -> str:
    for name, spellings in keys.DTYPE_SPELLINGS.items():
        if value.lower() in spellings:
            return name
    return as_choice(value, path, DTYPES)  # raises


def _parse_monitoring(top: Fields) -> tuple[str, ...]:
    """Check the monitoring/logging sections; return the names of those switched on."""
    on = [
        k
        for k in ("wall_clock_breakdown", "memory_breakdown", "dump_state")
        if top.boolean(k, False)
    ]
    sections = [(name, top.section(name), name) for name in keys.MONITORS]
    monitor_config = Fields(top.section("monitor_config") or {}, "monitor_config", keys.MONITORS)
    sections += [(n, monitor_config.section(n), f"monitor_config.{n}") for n in keys.MONITORS]
    for name, data, path in sections:
        f = Fields(data or {}, path, keys.MONITORS[name])
        if f.boolean("enabled", False):
            on.append(path)
    timers = Fields(top.section("timers") or {}, "timers", ("throughput",))
    throughput = Fields(
        timers.section("throughput") or {}, "timers.throughput", ("enabled", "synchronized")
    )
    throughput.boolean("synchronized", True)
    if throughput.boolean("enabled", None, nullable=True):
        on.append("timers.throughput")
    return tuple(on)


def _check_other_top_level(top: Fields) -> None:
    """Type-check the remaining accepted top-level keys (the values live in ``raw``)."""
    for name in keys.ACCEPTED_FLAGS:
        top.boolean(name, None, nullable=True)
    top.string("gradient_allreduce_op", "mean", choices=("mean", "sum"))
    top.string("seq_parallel_comm_data_type", "fp32", choices=DTYPES, nullable=True)
    top.string("log_level", None, nullable=True)
    top.integer("vocabulary_size", None, minimum=1, nullable=True)
    top.integer("sequence_parallel_size", 1, minimum=1, nullable=True)
    top.integer("allgather_size", None, minimum=0, nullable=True)
    for name in keys.FEATURE_SECTIONS:
        section = top.section(name)
        if section is not None and "enabled" in section:
            Fields(section, name, section.keys()).boolean("enabled", False)
    keys.tensor_parallel_size(top.section("tensor_parallel"))
    compile_section = top.section("compile")
    if compile_section is not None and "deepcompile" in compile_section:
        Fields(compile_section, "compile", compile_section.keys()).boolean("deepcompile", False)
