"""Tests of zeroshard.config: pure parsing, no processes, no devices.

Real configs from public projects live in tests/configs/real/ (sources in its README).
Where a real config asks for a feature that is not built yet, its test asserts the
"not built yet" error and says which key's status to flip when the feature lands. The
ones written for Hugging Face's Trainer ("auto" values) load with the values the Trainer
fills in (``auto_values``).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from zeroshard.config import (
    Config,
    ConfigError,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    ZeroConfig,
    load_config,
    read_config,
    resolve_batch_sizes,
    schema_table,
)
from zeroshard.config.jsonc import loads_relaxed

REAL = Path(__file__).parent / "configs" / "real"


def real(name: str) -> dict[str, Any]:
    """A real config as a dict (verbatim file, parsed)."""
    return json.loads((REAL / name).read_text())


HF_LR = 5e-5  # TrainingArguments' default learning_rate


def hf_auto(micro: int = 4, gas: int = 1, world: int = 1, zero3: bool = False) -> dict:
    """What Hugging Face's Trainer fills into "auto" keys with default TrainingArguments
    (transformers' HfTrainerDeepSpeedConfig: trainer_config_process and _finalize, for a
    model of hidden size 64 and 100 training steps without warm-up)."""
    hidden, steps = 64, 100
    values = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": micro * gas * world,
        "gradient_clipping": 1.0,
        "optimizer.params.lr": HF_LR,
        "optimizer.params.betas": [0.9, 0.999],
        "optimizer.params.eps": 1e-8,
        "optimizer.params.weight_decay": 0.0,
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": HF_LR,
        "scheduler.params.total_num_steps": steps,
        "scheduler.params.warmup_num_steps": 1,  # max(1, warm-up steps)
        "fp16.enabled": False,
        "bf16.enabled": False,
        "zero_optimization.reduce_bucket_size": hidden * hidden,
    }
    if zero3:
        values["zero_optimization.stage3_prefetch_bucket_size"] = int(0.9 * hidden * hidden)
        values["zero_optimization.stage3_param_persistence_threshold"] = 10 * hidden
    return values


def parsed(raw: Any, world: int = 1, **kwargs: Any) -> Config:
    """Read without refusing unbuilt features, to inspect configs that ask for them."""
    return read_config(copy.deepcopy(raw), dp_world_size=world, **kwargs)


def inert_keys(cfg: Config) -> list[str]:
    return [path for path, _ in cfg.inert]


def error_of(source: Any, world: int = 1) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(source, dp_world_size=world)
    return str(info.value)


def errors_of(source: Any, world: int = 1) -> tuple[ConfigError, ...]:
    """Every problem one load of ``source`` reports, in the order found."""
    with pytest.raises(ConfigError) as info:
        load_config(source, dp_world_size=world)
    return info.value.errors


def assert_not_built(source: Any, path: str, world: int = 1) -> None:
    message = error_of(source, world)
    assert message.startswith(f"{path}: "), message
    assert message.endswith("is not built yet in zeroshard"), message


# ---------------------------------------------------------------------------------------
# Real configs
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_real_megatron_zero3_examples_loads(world: int) -> None:
    path = REAL / "dse_megatron_zero3_examples_ds_config.json"
    cfg = load_config(path, dp_world_size=world)
    assert cfg.wall_clock_breakdown
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (8 * world, 8)
    assert cfg.gradient_accumulation_steps == 1
    assert cfg.fp16.enabled and cfg.fp16.dynamic_loss_scale
    assert cfg.fp16.initial_scale_power == 10 and cfg.fp16.initial_loss_scale == 1024.0
    assert cfg.compute_dtype == torch.float16
    assert cfg.gradient_clipping == 1.0
    assert cfg.optimizer is None and cfg.zero_optimization.stage == 0
    assert cfg.not_built == ()


@pytest.mark.parametrize(("world", "gas"), [(1, 16), (2, 8), (8, 2)])
def test_real_qanet_one_cycle_loads(world: int, gas: int) -> None:
    cfg = load_config(REAL / "dse_qanet_ds_bsz512_1cycle.json", dp_world_size=world)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (512, 32)
    assert cfg.gradient_accumulation_steps == gas
    opt = cfg.optimizer
    assert opt is not None and opt.type == "Adam" and opt.decoupled_weight_decay
    assert opt.betas == (0.8, 0.999) and opt.weight_decay == 3e-7
    assert cfg.scheduler is not None and cfg.scheduler.type == "OneCycle"
    assert cfg.scheduler.params == {
        "cycle_min_lr": 0.004,
        "cycle_max_lr": 0.015,
        "cycle_first_step_size": 1000,
        "cycle_second_step_size": 100,
        "cycle_first_stair_count": 100,
        "cycle_second_stair_count": 100,
        "decay_step_size": 1000,
        "decay_lr_rate": 0.01,
    }


def test_real_qanet_one_cycle_three_ranks_is_not_divisible() -> None:
    message = error_of(REAL / "dse_qanet_ds_bsz512_1cycle.json", world=3)
    assert message.startswith("train_batch_size: train_batch_size (512)")
    assert "train_micro_batch_size_per_gpu (32)" in message
    assert "gradient_accumulation_steps" in message and "world size (3)" in message


@pytest.mark.parametrize(("world", "micro"), [(1, 32), (2, 16), (8, 4)])
def test_real_qanet_warmup_loads(world: int, micro: int) -> None:
    cfg = load_config(REAL / "dse_qanet_ds_bsz512_warmup.json", dp_world_size=world)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (micro, 1)
    assert cfg.scheduler is not None and cfg.scheduler.type == "WarmupLR"
    assert cfg.scheduler.params["warmup_num_steps"] == 1000
    assert cfg.compute_dtype == torch.float32


def test_real_llava_next_zero2() -> None:
    # Verbatim, "auto" is an error naming every key that has it, in one line.
    with pytest.raises(ConfigError) as info:
        load_config(REAL / "llava_next_zero2.json")
    first = info.value.errors[0]
    assert str(first).startswith("train_batch_size: 'auto' is filled in only by the Hugging Face")
    lines = str(info.value).splitlines()
    assert lines[0] == f"{len(info.value.errors)} problems in {REAL / 'llava_next_zero2.json'}:"
    assert len(lines) == 2 and lines[1].startswith("  train_batch_size, "), lines
    # Filled in as Hugging Face's Trainer does, it loads.
    path = REAL / "llava_next_zero2.json"
    cfg = load_config(path, dp_world_size=2, auto_values=hf_auto(micro=4, world=2))
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (8, 1)
    zero = cfg.zero_optimization
    assert zero.stage == 2 and not zero.offload_optimizer.enabled
    assert zero.offload_optimizer.pin_memory is True
    assert zero.reduce_bucket_size == zero.allgather_bucket_size == 200_000_000
    assert isinstance(zero.reduce_bucket_size, int)
    assert zero.overlap_comm is False and zero.contiguous_gradients
    assert not cfg.fp16.enabled and not cfg.bf16.enabled  # filled: TrainingArguments' fp16/bf16
    assert cfg.optimizer == OptimizerConfig(type="AdamW", lr=HF_LR)
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print == 100
    assert cfg.raw["optimizer"]["params"]["lr"] == HF_LR  # raw holds the filled values


def test_real_hf_transformers_zero2() -> None:
    path = REAL / "hf_transformers_ds_config_zero2.json"
    assert "'auto'" in error_of(path)
    cfg = load_config(path, auto_values=hf_auto())  # CPU optimizer offload is built
    assert cfg.zero_optimization.offload_optimizer == OffloadOptimizerConfig(
        device="cpu", pin_memory=True
    )
    assert cfg.scheduler is not None
    assert cfg.scheduler.params == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": HF_LR,
        "warmup_num_steps": 1,
    }
    assert cfg.inert == ()  # the ZeRO keys it sets are at DeepSpeed's defaults


def test_real_hf_transformers_zero2_bf16_legacy_key() -> None:
    raw = real("hf_transformers_ds_config_zero2_bf16.json")
    # "auto" under the legacy name bfloat16 is filled by the key's canonical name
    assert load_config(raw, auto_values=hf_auto()).compute_dtype == torch.float32
    cfg = load_config(raw, auto_values={**hf_auto(), "bf16.enabled": True})
    assert cfg.compute_dtype == torch.bfloat16 and cfg.raw["bfloat16"]["enabled"] is True


def test_real_hf_transformers_zero3() -> None:
    raw = real("hf_transformers_ds_config_zero3.json")  # no "auto", and no batch size:
    raw["train_micro_batch_size_per_gpu"] = 2  # the test that uses it sets one
    cfg = load_config(raw, dp_world_size=4)  # ZeRO-3 with CPU offload is built
    zero = cfg.zero_optimization
    assert zero.stage == 3 and zero.overlap_comm is True
    # reduce_bucket_size 0: as in DeepSpeed, each gradient is reduced on its own
    assert zero.sub_group_size == 10**14 and zero.reduce_bucket_size == 0
    assert zero.stage3_prefetch_bucket_size == 0 and zero.stage3_param_persistence_threshold == 0
    assert zero.stage3_gather_16bit_weights_on_model_save is True  # via the fp16 alias
    assert zero.offload_param.device == zero.offload_optimizer.device == "cpu"
    assert zero.offload_param.buffer_count == 5 and zero.offload_optimizer.buffer_count == 4
    # the gather key is wired: engine.zero_gather_16bit_weights_on_model_save()
    assert inert_keys(cfg) == []


@pytest.mark.parametrize("world", [1, 2])
def test_real_deepspeed_examples_cifar(world: int) -> None:
    # CPU offload is built; fp16 master weights and gradients are next (flip when they land).
    assert_not_built(REAL / "dse_cifar_ds_config.json", "fp16.fp16_master_weights_and_grads", world)
    cfg = parsed(real("dse_cifar_ds_config.json"), world)
    assert cfg.train_micro_batch_size_per_gpu == 4 // world
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"  # the deprecated switch
    assert cfg.fp16.loss_scale_window == 500 and cfg.fp16.initial_scale_power == 15
    assert cfg.zero_optimization.reduce_bucket_size == 50_000_000


def test_real_deepspeed_examples_cifar_three_ranks() -> None:
    # both problems in one report: a feature not built does not hide the batch rule
    errors = errors_of(REAL / "dse_cifar_ds_config.json", world=3)
    assert [e.path for e in errors] == ["fp16.fp16_master_weights_and_grads", "train_batch_size"]
    assert "world size (3)" in str(errors[1])


def test_inert_activation_checkpointing_keys_are_accepted_alone() -> None:
    # DeepSpeed needs partition_activations and number_checkpoints with
    # contiguous_memory_optimization to size its buffer; zeroshard builds none, so each
    # key alone is accepted and named once, with its reason, never refused
    cfg = load_config(_with(activation_checkpointing={"contiguous_memory_optimization": True}))
    ((path, reason),) = cfg.inert
    assert path == "activation_checkpointing.contiguous_memory_optimization"
    assert "DeepSpeed also requires partition_activations and number_checkpoints" in reason
    both = {"contiguous_memory_optimization": True, "partition_activations": True}
    cfg = load_config(_with(activation_checkpointing=both))
    assert sorted(inert_keys(cfg)) == [f"activation_checkpointing.{k}" for k in sorted(both)]


def test_real_megatron_zero2_partitioned_activations() -> None:
    # partition_activations is inert without model parallelism (reported at start-up).
    path = REAL / "dse_megatron_ds_zero2_config.json"
    cfg = load_config(path, dp_world_size=2)
    assert inert_keys(cfg) == ["activation_checkpointing.partition_activations"]
    ac = cfg.activation_checkpointing
    assert ac.partition_activations and not ac.contiguous_memory_optimization
    assert not ac.cpu_checkpointing and ac.number_checkpoints is None
    cfg = parsed(real(path.name), world=8)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (2, 1)
    assert cfg.zero_optimization.stage == 2 and cfg.optimizer is not None
    assert cfg.optimizer.lr == 0.00015


def test_real_megatron_legacy_config() -> None:
    message = error_of(REAL / "dse_megatron_ds_config_legacy.json")
    assert message.startswith("optimizer.params.max_grad_norm: ") and "gradient_clipping" in message
    raw = real("dse_megatron_ds_config_legacy.json")
    del raw["optimizer"]["params"]["max_grad_norm"]
    cfg = load_config(raw, dp_world_size=4)
    assert cfg.zero_optimization.stage == 1  # "zero_optimization": true, the old form
    assert cfg.train_micro_batch_size_per_gpu == 4


def test_real_zero_infinity_config_has_a_typo() -> None:
    message = error_of(REAL / "dse_megatron_zero3_ds_zero_stage_infinity_config.json")
    assert message == (
        "zero_optimization.stage3_param_persitance_threshold: unknown key; "
        "did you mean 'stage3_param_persistence_threshold'?"
    )
    raw = real("dse_megatron_zero3_ds_zero_stage_infinity_config.json")
    zero = raw["zero_optimization"]
    zero["stage3_param_persistence_threshold"] = zero.pop("stage3_param_persitance_threshold")
    # ZeRO-3 with NVMe offload and wall_clock_breakdown: true are built
    cfg = load_config(raw)
    assert cfg.not_built == () and cfg.wall_clock_breakdown
    assert cfg.aio.queue_depth == 16 and cfg.aio.intra_op_parallelism == 2  # legacy thread_count
    assert inert_keys(cfg) == [
        "zero_optimization.offload_param.max_in_cpu",
        "aio.thread_count",
    ]
    assert cfg.zero_optimization.offload_param.max_in_cpu == 1
    assert cfg.zero_optimization.offload_optimizer.nvme_path == "/nvme_data"
    assert cfg.fp16.loss_scale == 1024 and not cfg.fp16.dynamic_loss_scale


def test_real_bing_bert_squad_max_grad_norm() -> None:
    errors = errors_of(REAL / "dse_bingbertsquad_deepspeed_bsz24_config.json")
    paths = ["optimizer.params.max_grad_norm", "optimizer.params.bias_correction"]
    assert [e.path for e in errors] == paths


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("dse_bing_bert_deepspeed_bsz64k_lamb_config_seq128.json", "Lamb"),
        ("dse_cifar_ds_config_onebitlamb.json", "OneBitLamb"),
    ],
)
def test_real_deepspeed_only_optimizers(name: str, kind: str) -> None:
    assert str(errors_of(REAL / name)[0]) == (
        f"optimizer.type: '{kind}' is a DeepSpeed optimizer zeroshard does not provide (yet); "
        "use Adam, AdamW or SGD, or pass a torch optimizer to initialize()"
    )


def test_real_bing_bert_no_bias_correction() -> None:
    path = REAL / "dse_bing_bert_deepspeed_bsz4k_progressive_layer_drop_config_seq128.json"
    # Flip when Adam without bias correction lands.
    assert_not_built(path, "optimizer.params.bias_correction", world=8)
    cfg = parsed(real(path.name), world=8)
    assert cfg.gradient_accumulation_steps == 32
    assert cfg.prescale_gradients and cfg.gradient_predivide_factor == 8.0


def test_real_stanford_alpaca_zero3_offload() -> None:
    path = REAL / "stanford_alpaca_default_offload_opt_param.json"
    assert str(errors_of(path)[0]).startswith("train_batch_size: 'auto' is filled in only by")
    # ZeRO-3 with CPU offload is built
    cfg = load_config(path, dp_world_size=2, auto_values=hf_auto(world=2, zero3=True))
    assert cfg.scheduler is not None and cfg.scheduler.type == "WarmupDecayLR"
    assert cfg.scheduler.params == {
        "total_num_steps": 100,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": HF_LR,
        "warmup_num_steps": 1,
    }
    assert cfg.zero_optimization.reduce_bucket_size == 64 * 64  # hidden_size squared
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == int(0.9 * 64 * 64)
    assert cfg.zero_optimization.stage3_param_persistence_threshold == 640
    assert not cfg.bf16.enabled and cfg.train_batch_size == 8


def test_real_fastchat_stage2_offload() -> None:
    path = REAL / "fastchat_deepspeed_config_s2.json"
    assert "'auto'" in error_of(path)
    cfg = load_config(path, auto_values=hf_auto(micro=2, gas=4))  # CPU optimizer offload is built
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (2, 4)


def test_every_real_config_is_documented_and_tested() -> None:
    readme = (REAL / "README.md").read_text()
    source = Path(__file__).read_text()
    for path in REAL.glob("*.json"):
        assert f"`{path.name}`" in readme, path.name
        assert path.name in source, path.name


# ---------------------------------------------------------------------------------------
# Bad configs: one clear error naming the key
# ---------------------------------------------------------------------------------------
def _with(**changes: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"train_batch_size": 8}
    config.update(changes)
    return config


def _zero(**zero: Any) -> dict[str, Any]:
    return _with(zero_optimization={"stage": 2, **zero})


def _adam(**params: Any) -> dict[str, Any]:
    return _with(optimizer={"type": "Adam", "params": params})


BAD = {
    # misspellings get a suggestion
    "train_batch_szie": (
        {"train_batch_szie": 8},
        "train_batch_szie",
        "did you mean 'train_batch_size'?",
    ),
    "zero_optimisation": (
        _with(zero_optimisation={"stage": 2}),
        "zero_optimisation",
        "did you mean 'zero_optimization'?",
    ),
    "offload_optimiser": (
        _zero(offload_optimiser={"device": "cpu"}),
        "zero_optimization.offload_optimiser",
        "did you mean 'offload_optimizer'?",
    ),
    "stgae": (
        _with(zero_optimization={"stgae": 2}),
        "zero_optimization.stgae",
        "did you mean 'stage'?",
    ),
    "cpu_offload_params": (
        _zero(cpu_offload_params=True),
        "zero_optimization.cpu_offload_params",
        "did you mean 'cpu_offload_param'?",
    ),
    "tensorboard_enabeld": (
        _with(tensorboard={"enabeld": True}),
        "tensorboard.enabeld",
        "did you mean 'enabled'?",
    ),
    "optimizer_type_typo": (
        _with(optimizer={"type": "Adma"}),
        "optimizer.type",
        "did you mean 'Adam'?",
    ),
    "stage_at_top_level": (_with(stage=2), "stage", "belongs under 'zero_optimization'"),
    "lr_at_top_level": (_with(lr=0.1), "lr", "belongs under 'optimizer.params'"),
    # wrong types and impossible values
    "stage_word": (
        _with(zero_optimization={"stage": "two"}),
        "zero_optimization.stage",
        "0, 1, 2, 3",
    ),
    "stage_4": (_with(zero_optimization={"stage": 4}), "zero_optimization.stage", "got 4"),
    "zero_not_object": (_with(zero_optimization=[2]), "zero_optimization", "expected an object"),
    "fp16_enabled_yes": (_with(fp16={"enabled": "yes"}), "fp16.enabled", "expected true or false"),
    "bf16_enabled_1": (_with(bf16={"enabled": 1}), "bf16.enabled", "expected true or false"),
    "overlap_comm_string": (
        _zero(overlap_comm="true"),
        "zero_optimization.overlap_comm",
        "true or false",
    ),
    "bucket_negative": (
        _zero(reduce_bucket_size=-1),
        "zero_optimization.reduce_bucket_size",
        ">= 0",
    ),
    # a size of 0 that would mean nothing (reduce_bucket_size 0 is DeepSpeed's "each
    # gradient on its own"; stage3_prefetch_bucket_size 0 is "no prefetch")
    "allgather_bucket_zero": (
        _zero(allgather_bucket_size=0),
        "zero_optimization.allgather_bucket_size",
        ">= 1",
    ),
    "sub_group_size_zero": (_zero(sub_group_size=0), "zero_optimization.sub_group_size", ">= 1"),
    "buffer_count_zero": (
        _zero(offload_optimizer={"device": "cpu", "buffer_count": 0}),
        "zero_optimization.offload_optimizer.buffer_count",
        ">= 1",
    ),
    "buffer_size_zero": (
        _with(zero_optimization={"stage": 3, "offload_param": {"buffer_size": 0}}),
        "zero_optimization.offload_param.buffer_size",
        ">= 1",
    ),
    "alias_range": (
        _zero(prefetch_bucket_size=-5),
        "zero_optimization.prefetch_bucket_size",
        ">= 0",
    ),
    "bucket_fraction": (
        _zero(allgather_bucket_size=2.5),
        "zero_optimization.allgather_bucket_size",
        "whole number",
    ),
    "bucket_string": (
        _zero(reduce_bucket_size="5e8"),
        "zero_optimization.reduce_bucket_size",
        "whole number",
    ),
    "betas_single": (_adam(betas=[0.9]), "optimizer.params.betas", "list of 2 numbers"),
    "betas_out_of_range": (_adam(betas=[0.9, 1.5]), "optimizer.params.betas", ">= 0 and < 1"),
    "lr_negative": (_adam(lr=-1e-3), "optimizer.params.lr", ">= 0"),
    "lr_nan": (_adam(lr=float("nan")), "optimizer.params.lr", "finite"),
    "momentum_for_adam": (
        _adam(momentum=0.9),
        "optimizer.params.momentum",
        "not a parameter of Adam",
    ),
    "max_grad_norm": (
        _adam(max_grad_norm=1.0),
        "optimizer.params.max_grad_norm",
        "gradient_clipping",
    ),
    "optimizer_without_type": (
        _with(optimizer={"params": {"lr": 1}}),
        "optimizer.type",
        "required",
    ),
    "lamb": (_with(optimizer={"type": "Lamb"}), "optimizer.type", "does not provide (yet)"),
    "adamw_l2": (
        _with(optimizer={"type": "AdamW", "params": {"adam_w_mode": False}}),
        "optimizer.params.adam_w_mode",
        "AdamW always decouples",
    ),
    "nesterov_without_momentum": (
        _with(optimizer={"type": "SGD", "params": {"nesterov": True}}),
        "optimizer.params.nesterov",
        "momentum > 0",
    ),
    "scheduler_type": (_with(scheduler={"type": "CosineLR"}), "scheduler.type", "WarmupCosineLR"),
    "scheduler_missing_total": (
        _with(scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}),
        "scheduler.params.total_num_steps",
        "required for WarmupDecayLR",
    ),
    "scheduler_warmup_type": (
        _with(scheduler={"type": "WarmupLR", "params": {"warmup_type": "cosine"}}),
        "scheduler.params.warmup_type",
        "'log', 'linear'",
    ),
    "scheduler_foreign_param": (
        _with(scheduler={"type": "WarmupLR", "params": {"cycle_max_lr": 0.1}}),
        "scheduler.params.cycle_max_lr",
        "unknown key",
    ),
    "scheduler_negative_steps": (
        _with(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": -5}}),
        "scheduler.params.warmup_num_steps",
        ">= 0",
    ),
    "fp16_and_bf16": (
        _with(fp16={"enabled": True}, bf16={"enabled": True}),
        "bf16.enabled",
        "cannot both be enabled",
    ),
    "bf16_and_bfloat16": (_with(bf16={}, bfloat16={}), "bfloat16", "same setting"),
    "gradient_clipping_negative": (_with(gradient_clipping=-1.0), "gradient_clipping", ">= 0"),
    "predivide_zero": (_with(gradient_predivide_factor=0), "gradient_predivide_factor", "> 0"),
    "fp16_loss_scale_negative": (_with(fp16={"loss_scale": -1}), "fp16.loss_scale", ">= 0"),
    "fp16_hysteresis_zero": (_with(fp16={"hysteresis": 0}), "fp16.hysteresis", ">= 1"),
    "offload_device": (
        _zero(offload_optimizer={"device": "gpu"}),
        "zero_optimization.offload_optimizer.device",
        "'none', 'cpu', 'nvme'",
    ),
    "nvme_without_path": (
        _with(zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}}),
        "zero_optimization.offload_param.nvme_path",
        "needs nvme_path",
    ),
    "nvme_optimizer_pipeline_buffers": (
        _with(
            zero_optimization={
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "pipeline_read": True},
            }
        ),
        "zero_optimization.offload_optimizer.buffer_count",
        "needs 6 sub-group buffers (master, exp_avg, exp_avg_sq for two sub-groups",
    ),
    "nvme_optimizer_buffers": (
        _with(
            zero_optimization={
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "buffer_count": 2},
            }
        ),
        "zero_optimization.offload_optimizer.buffer_count",
        "needs 3 sub-group buffers",
    ),
    "param_key_in_optimizer_offload": (
        _zero(offload_optimizer={"device": "cpu", "max_in_cpu": 10}),
        "zero_optimization.offload_optimizer.max_in_cpu",
        "belongs under 'zero_optimization.offload_param'",
    ),
    "allgather_size_with_object_zero": (
        _zero() | {"allgather_size": 1000},
        "allgather_size",
        "boolean form of 'zero_optimization'",
    ),
    "alias_and_canonical": (
        _zero(prefetch_bucket_size=1, stage3_prefetch_bucket_size=2),
        "zero_optimization.",
        "name the same setting",
    ),
    "deprecated_and_new_offload": (
        _zero(cpu_offload=True, offload_optimizer={"device": "cpu"}),
        "zero_optimization.cpu_offload",
        "deprecated alias of offload_optimizer",
    ),
    "communication_dtype": (
        _with(communication_data_type="fp8"),
        "communication_data_type",
        "'fp32'",
    ),
    "grad_accum_dtype": (
        _with(data_types={"grad_accum_dtype": "int8"}),
        "data_types.grad_accum_dtype",
        "expected one of",
    ),
    "number_checkpoints_zero": (
        _with(activation_checkpointing={"number_checkpoints": 0}),
        "activation_checkpointing.number_checkpoints",
        ">= 1",
    ),
    "partition_activations_under_tp": (
        _with(
            tensor_parallel={"autotp_size": 2},
            activation_checkpointing={"partition_activations": True},
        ),
        "activation_checkpointing.partition_activations",
        "tensor_parallel.sequence_parallel",
    ),
    "number_checkpoints_fraction": (
        _with(activation_checkpointing={"number_checkpoints": 2.5}),
        "activation_checkpointing.number_checkpoints",
        "whole number",
    ),
    "cpu_checkpointing_string": (
        _with(activation_checkpointing={"cpu_checkpointing": "true"}),
        "activation_checkpointing.cpu_checkpointing",
        "true or false",
    ),
    "steps_per_print_zero": (_with(steps_per_print=0), "steps_per_print", ">= 1"),
    "seed_negative": (_with(seed=-1), "seed", ">= 0"),
    "tag_validation": (
        _with(checkpoint={"tag_validation": "Maybe"}),
        "checkpoint.tag_validation",
        "'Warn'",
    ),
    "aio_two_names": (
        _with(aio={"thread_count": 2, "intra_op_parallelism": 2}),
        "aio.",
        "name the same setting",
    ),
    "amp_enabled_string": (_with(amp={"enabled": "yes"}), "amp.enabled", "true or false"),
    "monitor_not_object": (_with(wandb=True), "wandb", "expected an object"),
    "batch_negative": (_with(train_batch_size=-8), "train_batch_size", ">= 0"),
    "batch_string": (
        {"train_micro_batch_size_per_gpu": "8"},
        "train_micro_batch_size_per_gpu",
        "whole number",
    ),
    "batch_fraction": (
        {"train_micro_batch_size_per_gpu": 2.5},
        "train_micro_batch_size_per_gpu",
        "whole number",
    ),
    "loco_key": (
        _zero(zeropp_loco_param={"err_beta": 0.8, "reset_t": 10}),
        "zero_optimization.zeropp_loco_param.reset_t",
        "did you mean 'reset_T'?",
    ),
    "steps_per_print_minus_infinity": (
        _with(steps_per_print=float("-inf")),
        "steps_per_print",
        "whole number",
    ),
    "steps_per_print_nan": (_with(steps_per_print=float("nan")), "steps_per_print", "whole number"),
    "lr_infinity": (_adam(lr=float("inf")), "optimizer.params.lr", "finite"),
    "not_a_deepspeed_key": (_with(monitor_config={}), "monitor_config", "unknown key"),
    "old_invented_zero_key": (
        _zero(compute_grad_norm=True),
        "zero_optimization.compute_grad_norm",
        "unknown key",
    ),
}


@pytest.mark.parametrize(("config", "path", "fragment"), BAD.values(), ids=BAD.keys())
def test_bad_config_names_the_key(config: dict[str, Any], path: str, fragment: str) -> None:
    message = error_of(config)
    assert message.startswith(path), message
    assert fragment in message, message


def test_there_are_many_distinct_bad_configs() -> None:
    assert len(BAD) >= 25


def test_keys_must_be_strings() -> None:
    assert error_of({"train_batch_size": 8, 3: 4}).startswith("config: keys must be strings")


# ---------------------------------------------------------------------------------------
# Not built yet
# ---------------------------------------------------------------------------------------
NOT_BUILT_CASES = {
    "hpz": (_zero(zero_hpz_partition_size=8), "zero_optimization.zero_hpz_partition_size"),
    "qwz": (_zero(zero_quantized_weights=True), "zero_optimization.zero_quantized_weights"),
    "qgz": (_zero(zero_quantized_gradients=True), "zero_optimization.zero_quantized_gradients"),
    "amp": (_with(amp={"enabled": True}), "amp.enabled"),
    "torch_autocast": (_with(torch_autocast={"enabled": True}), "torch_autocast.enabled"),
    "sparse_attention": (_with(sparse_attention={"mode": "fixed"}), "sparse_attention"),
    "compression": (
        _with(compression_training={"weight_quantization": {}}),
        "compression_training",
    ),
    "data_efficiency": (_with(data_efficiency={"enabled": True}), "data_efficiency.enabled"),
    # DeepSpeed reads these switches whatever data_efficiency.enabled says
    "random_ltd": (
        _with(data_efficiency={"data_routing": {"random_ltd": {"enabled": True}}}),
        "data_efficiency.data_routing",
    ),
    "data_sampling": (
        _with(data_efficiency={"data_sampling": {"curriculum_learning": {"enabled": True}}}),
        "data_efficiency.data_sampling",
    ),
    "curriculum": (_with(curriculum_learning={"enabled": True}), "curriculum_learning.enabled"),
    "elasticity": (_with(elasticity={"enabled": True}), "elasticity.enabled"),
    "autotuning": (_with(autotuning={"enabled": True}), "autotuning.enabled"),
    "hybrid_engine": (_with(hybrid_engine={"enabled": True}), "hybrid_engine.enabled"),
    "pld": (_with(progressive_layer_drop={"enabled": True}), "progressive_layer_drop.enabled"),
    "eigenvalue": (_with(eigenvalue={"enabled": True}), "eigenvalue.enabled"),
    "quantize_training": (
        _with(quantize_training={"enabled": True}),
        "quantize_training.enabled",
    ),
    "expert_parallel": (
        _with(expert_parallel={"enabled": True, "expert_tensor_parallel_size": 2}),
        "expert_parallel.expert_tensor_parallel_size",
    ),
    # DeepCompile's keys (DeepSpeed 0.14's torch.compile switch is wired: issue 32)
    "deepcompile": (_with(compile={"deepcompile": True}), "compile.deepcompile"),
    "deepcompile_key": (_with(compile={"free_activation": True}), "compile.free_activation"),
    "datastates": (_with(datastates_ckpt={}), "datastates_ckpt"),
    "sparse_gradients": (_with(sparse_gradients=True), "sparse_gradients"),
    "bf16_master": (
        _zero() | {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
        "bf16.bf16_master_weights_and_grads",
    ),
    "allreduce_sum": (_with(gradient_allreduce_op="SUM"), "gradient_allreduce_op"),
    # accepted with no effect before issue 12; built (Twin-Flow, tests/test_twin_flow.py)
    # but not with the parameter shard offloaded
    "partial_offload_with_offload_param": (
        _with(
            zero_optimization={
                "stage": 3,
                "offload_optimizer": {"device": "cpu", "ratio": 0.5},
                "offload_param": {"device": "cpu"},
            }
        ),
        "zero_optimization.offload_optimizer.ratio",
    ),
    "bf16_immediate": (_with(bf16={"immediate_grad_update": True}), "bf16.immediate_grad_update"),
    "fp32_weights": (
        _zero(load_from_fp32_weights=False),
        "zero_optimization.load_from_fp32_weights",
    ),
    "unused_params": (
        _zero(ignore_unused_parameters=False),
        "zero_optimization.ignore_unused_parameters",
    ),
    "loco": (_zero(zeropp_loco_param={"err_beta": 0.5}), "zero_optimization.zeropp_loco_param"),
    "mics_hierarchical": (
        _zero(mics_hierarchical_params_gather=True),
        "zero_optimization.mics_hierarchical_params_gather",
    ),
    "tag_validation": (_with(checkpoint={"tag_validation": "Fail"}), "checkpoint.tag_validation"),
    "node_local": (
        _with(checkpoint={"use_node_local_storage": True}),
        "checkpoint.use_node_local_storage",
    ),
    "param_dtype": (_with(data_types={"param_dtype": "bf16"}), "data_types.param_dtype"),
}


@pytest.mark.parametrize(("config", "path"), NOT_BUILT_CASES.values(), ids=NOT_BUILT_CASES.keys())
def test_not_built_features_fail_at_load(config: dict[str, Any], path: str) -> None:
    assert_not_built(config, path)


def test_activation_checkpointing_section_is_accepted() -> None:
    """Every DeepSpeed activation_checkpointing key loads (none is "not built")."""
    ac = load_config(
        _with(
            activation_checkpointing={
                "partition_activations": True,
                "cpu_checkpointing": True,
                "contiguous_memory_optimization": True,
                "number_checkpoints": 4.0,
                "synchronize_checkpoint_boundary": True,
                "profile": True,
            }
        )
    ).activation_checkpointing
    assert ac.partition_activations and ac.cpu_checkpointing
    assert ac.contiguous_memory_optimization and ac.synchronize_checkpoint_boundary
    assert ac.number_checkpoints == 4 and isinstance(ac.number_checkpoints, int)
    assert ac.profile


FEATURE_SECTIONS = [
    "amp",
    "torch_autocast",
    "data_efficiency",
    "curriculum_learning",
    "elasticity",
    "autotuning",
    "hybrid_engine",
    "progressive_layer_drop",
    "eigenvalue",
    "quantize_training",
    "expert_parallel",
    "compile",
    "nebula",
]


@pytest.mark.parametrize("section", FEATURE_SECTIONS)
def test_disabled_feature_sections_check_their_keys(section: str) -> None:
    """A switched-off feature section loads; a key DeepSpeed 0.19 does not read there is
    an error naming it, with "did you mean" for a near miss."""
    assert load_config(_with(**{section: {"enabled": False}})).inert == ()
    message = error_of(_with(**{section: {"enabled": False, "anything": 1}}))
    assert message.startswith(f"{section}.anything: unknown key"), message
    message = error_of(_with(**{section: {"enabeld": False}}))
    assert message.startswith(f"{section}.enabeld: unknown key; did you mean 'enabled'?"), message


def test_feature_section_keys_are_deepspeeds() -> None:
    """Keys of DeepSpeed 0.19's models load (off: their feature is not built), those set
    away from their default reported as inert; the sections DeepSpeed 0.19 removed take
    only their switch, and say so."""
    ds_chat = {
        "enabled": False,
        "max_out_tokens": 512,
        "inference_tp_size": 1,
        "release_inference_cache": False,
        "pin_parameters": True,
        "tp_gather_partition_size": 8,
        "enable_cuda_graph": False,
    }
    assert load_config(_with(hybrid_engine=ds_chat)).inert == ()
    cfg = load_config(
        _with(
            compile={"enabled": False, "backend": "eager", "double_buffer": True},
            autotuning={"enabled": False, "fast": False, "metric": "latency"},
            expert_parallel={"top_k": 2, "routed_scaling_factor": "auto"},
            torch_autocast={"enabled": False, "dtype": "bf16"},
            data_efficiency={"seed": 7, "data_sampling": {"enabled": False}},
        )
    )
    assert sorted(inert_keys(cfg)) == [
        "autotuning.fast",
        "autotuning.metric",
        "compile.backend",
        "data_efficiency.seed",
        "expert_parallel.top_k",
        "torch_autocast.dtype",
    ], cfg.inert
    assert "compile.enabled true" in dict(cfg.inert)["compile.backend"]
    message = error_of(_with(autotuning={"metric": "speed"}))
    assert message.startswith("autotuning.metric: expected one of"), message
    message = error_of(_with(amp={"enabled": False, "opt_level": "O1"}))
    assert message.startswith("amp.opt_level: unknown key;") and "DeepSpeed 0.19" in message
    message = error_of(_with(datastates={}))  # DeepSpeed's key is datastates_ckpt
    assert message.startswith("datastates: unknown key; did you mean 'datastates_ckpt'?")
    assert load_config(_with(datastates_ckpt=False)).inert == ()


def test_disabled_monitors_are_accepted() -> None:
    cfg = load_config(
        _with(
            wall_clock_breakdown=False,
            tensorboard={"enabled": False, "output_path": "logs/", "job_name": "x"},
            wandb={"enabled": False, "project": "p"},
            flops_profiler={"enabled": False, "detailed": False},
            timers={"throughput": {"enabled": False, "synchronized": False}},
        )
    )
    assert cfg.inert == () and cfg.not_built == ()


# ---------------------------------------------------------------------------------------
# Defaults and semantics
# ---------------------------------------------------------------------------------------
def test_minimal_config_defaults() -> None:
    cfg = load_config({"train_batch_size": 8})
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (8, 8)
    assert cfg.gradient_accumulation_steps == 1 and cfg.dp_world_size == 1
    assert cfg.optimizer is None and cfg.scheduler is None
    assert cfg.compute_dtype == torch.float32
    zero = cfg.zero_optimization
    assert zero.stage == 0 and zero.overlap_comm is False
    # not given: the engine picks 25 MiB buckets (tests/test_engine.py); DeepSpeed's 5e8
    # would put any model under 500M parameters in one bucket (nothing overlaps)
    assert zero.reduce_bucket_size is None and zero.allgather_bucket_size is None
    assert zero.stage3_prefetch_bucket_size == 50_000_000
    assert zero.offload_param.buffer_count == 5 and zero.offload_optimizer.buffer_count == 4
    assert not zero.offload_param.enabled and not zero.offload_optimizer.enabled
    assert cfg.gradient_clipping == 0.0 and cfg.steps_per_print is None  # DeepSpeed 0.19: never
    assert cfg.fp16.initial_loss_scale == 2.0**16
    assert cfg.inert == () and cfg.not_built == () and cfg.seed is None
    assert cfg.checkpoint.tag_validation == "Warn" and cfg.aio.block_size == 1_048_576


@pytest.mark.parametrize(
    ("optimizer", "kind", "decoupled"),
    [
        ({"type": "adam"}, "Adam", True),
        ({"type": "Adam", "params": {"adam_w_mode": False}}, "Adam", False),
        ({"type": "ADAMW"}, "AdamW", True),
        ({"type": "sgd", "params": {"lr": 0.1, "momentum": 0.9}}, "SGD", False),
    ],
)
def test_optimizer_types(optimizer: dict[str, Any], kind: str, decoupled: bool) -> None:
    opt = load_config(_with(optimizer=optimizer)).optimizer
    assert opt is not None and opt.type == kind and opt.decoupled_weight_decay is decoupled


def test_optimizer_params() -> None:
    params = {"lr": 3e-4, "betas": [0.9, 0.95], "fused": True, "torch_adam": True, "amsgrad": True}
    cfg = load_config(_adam(**params))
    opt = cfg.optimizer
    assert opt is not None and opt.betas == (0.9, 0.95) and opt.fused and opt.amsgrad
    assert inert_keys(cfg) == ["optimizer.params.torch_adam"]


AUTO_KEYS = {  # where "auto" used to become a silent default (issue 12)
    "optimizer.params.lr": _adam(lr="auto"),
    "optimizer.params.weight_decay": _adam(weight_decay="auto"),
    "optimizer.params.betas": _adam(betas="auto"),
    "gradient_clipping": _with(gradient_clipping="auto"),
    "fp16.enabled": _with(fp16={"enabled": "auto"}),
    "zero_optimization.stage3_prefetch_bucket_size": _zero(stage3_prefetch_bucket_size="auto"),
    "zero_optimization.stage": _with(zero_optimization={"stage": "auto"}),
    "scheduler.params.warmup_max_lr": _with(
        scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}
    ),
    "train_micro_batch_size_per_gpu": {"train_micro_batch_size_per_gpu": "auto"},
    "zero_optimization": _with(zero_optimization="auto"),
}


@pytest.mark.parametrize(("path", "config"), AUTO_KEYS.items(), ids=AUTO_KEYS.keys())
def test_auto_is_an_error_naming_the_key(path: str, config: dict[str, Any]) -> None:
    assert error_of(config) == (
        f"{path}: 'auto' is filled in only by the Hugging Face integration; give a value "
        "here (or pass one as load_config(..., auto_values={...}))"
    )


def test_auto_values_fill_only_auto() -> None:
    raw = _adam(lr="auto", weight_decay=0.1) | {"gradient_clipping": "auto"}
    values = {"optimizer.params.lr": 3e-4, "optimizer.params.weight_decay": 0.0}
    values |= {"gradient_clipping": 0.5, "zero_optimization.stage": 3}
    cfg = load_config(raw, auto_values=values)
    assert cfg.optimizer is not None and cfg.optimizer.lr == 3e-4
    assert cfg.optimizer.weight_decay == 0.1  # given: not replaced (as the Trainer's fill)
    assert cfg.gradient_clipping == 0.5 and cfg.zero_optimization.stage == 0  # absent: untouched
    assert raw["optimizer"]["params"]["lr"] == "auto"  # the caller's dict is not changed
    # values are checked like the file's own
    with pytest.raises(ConfigError, match=r"^optimizer\.params\.lr: must be >= 0"):
        load_config(raw, auto_values={"optimizer.params.lr": -1.0, "gradient_clipping": 1.0})
    # a key the schema does not know is the integration's bug
    with pytest.raises(ValueError, match=r"auto_values: 'optimizer\.params\.learning_rate'"):
        load_config(raw, auto_values={"optimizer.params.learning_rate": 1.0})


def test_steps_per_print_infinity_means_never() -> None:
    # accelerate writes json.dumps(float("inf")), i.e. Infinity
    text = '{"train_batch_size": 8, "steps_per_print": Infinity}'
    assert load_config(loads_relaxed(text)).steps_per_print is None
    assert load_config(_with(steps_per_print=float("inf"))).steps_per_print is None
    assert load_config(_with(steps_per_print=None)).steps_per_print is None  # as DeepSpeed's


def test_zero_aliases_and_integral_floats() -> None:
    cfg = load_config(
        _zero(
            prefetch_bucket_size=1e7,
            param_persistence_threshold=1e4,
            max_live_parameters=3e8,
            gather_16bit_weights_on_model_save=True,
            reduce_bucket_size=5e8,
        )
    )
    zero = cfg.zero_optimization
    assert zero.stage3_prefetch_bucket_size == 10_000_000
    assert zero.stage3_param_persistence_threshold == 10_000
    assert zero.stage3_max_live_parameters == 300_000_000
    assert zero.stage3_gather_16bit_weights_on_model_save is True
    assert type(zero.reduce_bucket_size) is int


def test_stage3_defaults_overlap_comm_on() -> None:
    assert ZeroConfig(stage=3).overlap_comm is True
    assert ZeroConfig(stage=3, overlap_comm=False).overlap_comm is False
    assert ZeroConfig(stage=2).overlap_comm is False


def test_deprecated_cpu_offload_param_folds_into_offload_param() -> None:
    raw = _with(zero_optimization={"stage": 3, "cpu_offload_param": True})
    raw["zero_optimization"]["cpu_offload_use_pin_memory"] = True
    offload = parsed(raw).zero_optimization.offload_param
    assert offload == OffloadParamConfig(device="cpu", pin_memory=True)


def test_offload_the_stage_does_not_use_is_ignored_as_in_deepspeed() -> None:
    # The shape of DeepSpeed-Chat's generated configs (dschat utils/ds_utils.py
    # get_train_ds_config / get_eval_ds_config): offload sections at every stage.
    def ds_chat(stage: int, device: str) -> dict[str, Any]:
        return {
            "train_batch_size": 32,
            "train_micro_batch_size_per_gpu": 4,
            "steps_per_print": 10,
            "zero_optimization": {
                "stage": stage,
                "offload_param": {"device": device, "pin_memory": True},
                "offload_optimizer": {"device": device, "pin_memory": True},
                "stage3_param_persistence_threshold": 1e4,
                "stage3_max_live_parameters": 3e7,
                "stage3_prefetch_bucket_size": 3e7,
                "memory_efficient_linear": False,
            },
            "bf16": {"enabled": True},
            "gradient_clipping": 1.0,
            "prescale_gradients": False,
            "wall_clock_breakdown": False,
            "hybrid_engine": {
                "enabled": False,
                "max_out_tokens": 512,
                "inference_tp_size": 1,
                "release_inference_cache": False,
                "pin_parameters": True,
                "tp_gather_partition_size": 8,
            },
            "tensorboard": {"enabled": False, "output_path": "./ds_logs/", "job_name": "x"},
        }

    linear = "zero_optimization.memory_efficient_linear"  # false: inert, reported
    cfg = load_config(ds_chat(2, "none"), dp_world_size=4)
    assert cfg.gradient_accumulation_steps == 2 and inert_keys(cfg) == [linear]
    assert cfg.zero_optimization.stage3_max_live_parameters == 30_000_000
    # Reference model: stage 0 with offload asked for; DeepSpeed ignores both sections.
    cfg = load_config(ds_chat(0, "cpu"), dp_world_size=8)
    assert not cfg.zero_optimization.offload_param.enabled
    assert not cfg.zero_optimization.offload_optimizer.enabled
    assert inert_keys(cfg) == [
        linear,
        "zero_optimization.offload_optimizer",
        "zero_optimization.offload_param",
    ]
    assert "needs ZeRO stage 3 or more; ignored at stage 0" in cfg.inert[2][1]
    # Stage 2 with offload: parameter offload ignored, optimizer offload used.
    assert load_config(
        ds_chat(2, "cpu"), dp_world_size=8
    ).zero_optimization.offload_optimizer.enabled
    assert inert_keys(parsed(ds_chat(2, "cpu"), 8)) == [linear, "zero_optimization.offload_param"]
    deprecated = _with(zero_optimization={"stage": 1, "cpu_offload_param": True})
    assert inert_keys(load_config(deprecated)) == ["zero_optimization.cpu_offload_param"]
    # Built directly (not read from JSON), the same combination is a programming error.
    with pytest.raises(ConfigError, match=r"^offload_param\.device: .*needs ZeRO stage 3"):
        ZeroConfig(stage=2, offload_param=OffloadParamConfig(device="cpu"))


def test_monitors_switched_on_load() -> None:
    """Issue 16 built them: every monitoring section loads, and a key of them is read."""
    cfg = load_config(
        _with(
            wall_clock_breakdown=True,
            memory_breakdown=False,
            tensorboard={"enabled": True, "output_path": "logs/", "job_name": "x"},
            wandb={"enabled": False, "project": "p"},
            csv_monitor={"enabled": True},
            comms_logger={"enabled": True, "prof_ops": ["all_reduce"]},
            flops_profiler={"enabled": True, "profile_step": 1},
            timers={"throughput": {"enabled": True, "synchronized": False}},
            steps_per_print=50,
        )
    )
    assert cfg.not_built == () and cfg.inert == ()
    assert cfg.wall_clock_breakdown and cfg.tensorboard.job_name == "x"
    assert cfg.comms_logger.prof_ops == ["all_reduce"] and cfg.flops_profiler.profile_step == 1
    assert cfg.timers.throughput.enabled and not cfg.timers.throughput.synchronized
    assert cfg.steps_per_print == 50


def test_monitor_keys_are_checked() -> None:
    message = error_of(_with(comms_logger={"enabled": True, "prof_ops": ["allreduce"]}))
    assert message.startswith("comms_logger.prof_ops: unknown collective 'allreduce'"), message
    message = error_of(_with(flops_profiler={"enabled": True, "module_depth": -2}))
    assert message.startswith("flops_profiler.module_depth: must be >= -1"), message
    message = error_of(_with(comet={"enabled": True, "mode": "resume"}))
    assert message.startswith("comet.mode: expected one of 'get', 'create'"), message
    inert = load_config(_with(flops_profiler={"enabled": True, "recompute_fwd_factor": 1.0}))
    assert [k for k, _ in inert.inert] == ["flops_profiler.recompute_fwd_factor"]


def test_inert_keys_are_accepted_and_reported() -> None:
    cfg = load_config(
        _with(
            zero_allow_untested_optimizer=True,
            zero_force_ds_cpu_optimizer=False,
            checkpoint={
                "tag_validation": "ignore",
                "load_universal": True,
                "use_node_local_storage": False,
                "parallel_write": {"pipeline_stage": True},
            },
            aio={"block_size": 262144, "queue_depth": 32, "single_submit": True, "use_gds": False},
            disable_allgather=False,
            prescale_gradients=True,
            dataloader_drop_last=True,
            vocabulary_size=50304,
            gradient_allreduce_op="mean",
            amp={"enabled": False},
            sequence_parallel_size=1,
            tensor_parallel={"autotp_size": 1},
            seed=1234,
        )
    )
    assert cfg.checkpoint.tag_validation == "Ignore"
    assert cfg.checkpoint.parallel_write_pipeline_stage
    assert cfg.aio.queue_depth == 32 and cfg.aio.single_submit
    assert cfg.zero_allow_untested_optimizer and not cfg.zero_force_ds_cpu_optimizer
    assert cfg.dataloader_drop_last and cfg.seed == 1234
    assert inert_keys(cfg) == [
        "aio.block_size",
        "aio.single_submit",
        "checkpoint.load_universal",
        "checkpoint.parallel_write.pipeline_stage",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "vocabulary_size",
    ]
    reasons = dict(cfg.inert)
    assert (
        reasons["checkpoint.load_universal"] == "every checkpoint loads at any world size or stage"
    )
    # prescaling divides by the world size; the predivide factor is then unused (DeepSpeed)
    cfg = load_config(_with(prescale_gradients=True, gradient_predivide_factor=8.0))
    assert inert_keys(cfg) == ["gradient_predivide_factor"]


def test_dtype_names_are_normalized() -> None:
    cfg = load_config(
        _with(
            communication_data_type="FP16",
            data_types={"grad_accum_dtype": "bfloat16"},
            bf16={"enabled": True},
        )
    )
    assert cfg.communication_data_type == "fp16" and cfg.grad_accum_dtype == "bf16"
    assert cfg.compute_dtype == torch.bfloat16


def test_scheduler_params_keep_given_keys() -> None:
    cfg = load_config(
        _with(
            scheduler={
                "type": "warmupcosinelr",
                "params": {
                    "total_num_steps": 1e4,
                    "warmup_num_steps": "auto",
                    "cos_min_ratio": 0.1,
                },
            }
        ),
        auto_values={"scheduler.params.warmup_num_steps": 100},
    )
    assert cfg.scheduler is not None and cfg.scheduler.type == "WarmupCosineLR"
    assert cfg.scheduler.params == {
        "total_num_steps": 10_000,
        "warmup_num_steps": 100,
        "cos_min_ratio": 0.1,
    }
    per_group = {"warmup_min_lr": [0, 0], "warmup_max_lr": [1e-3, 1e-4]}
    cfg = load_config(_with(scheduler={"type": "WarmupLR", "params": per_group}))
    assert cfg.scheduler is not None and cfg.scheduler.params["warmup_max_lr"] == [1e-3, 1e-4]


def test_raw_is_kept_apart_from_equality_and_the_input_is_not_changed() -> None:
    source = _zero(reduce_bucket_size=1e6)
    before = copy.deepcopy(source)
    a = load_config(source)
    b = load_config({**source, "steps_per_print": None})  # the default, spelled out
    assert source == before and a.raw == before and a.raw is not source
    assert a == b and "raw" not in repr(a)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.train_batch_size = 4  # type: ignore[misc]


def test_sections_validate_when_built_directly() -> None:
    with pytest.raises(ConfigError, match=r"^stage: expected one of 0, 1, 2, 3, got 5$"):
        ZeroConfig(stage=5)
    with pytest.raises(ConfigError, match=r"^nvme_path: "):
        OffloadOptimizerConfig(device="nvme")
    with pytest.raises(ConfigError, match=r"^lr: must be >= 0, got -1"):
        OptimizerConfig(type="SGD", lr=-1)
    with pytest.raises(ConfigError, match=r"^train_batch_size: "):
        Config(train_batch_size=8, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1)


def test_config_error_shapes() -> None:
    err = ConfigError("zero_optimization.stage", "bad")
    assert str(err) == "zero_optimization.stage: bad" and isinstance(err, ValueError)
    again = pickle.loads(pickle.dumps(err))
    assert (again.path, again.problem, str(again)) == (err.path, err.problem, str(err))
    one = ConfigError("optimizer: no optimizer given")
    assert (one.path, one.problem) == ("optimizer", "no optimizer given")


def test_bad_arguments_are_type_or_value_errors() -> None:
    with pytest.raises(ValueError, match="dp_world_size"):
        load_config({"train_batch_size": 8}, dp_world_size=0)
    with pytest.raises(TypeError):
        load_config(42)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# Batch-size rule
# ---------------------------------------------------------------------------------------
# (train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps, world)
# -> (train, micro, gas); MISSING entries are left out of the config.
MISSING = object()
BATCH_OK = [
    ((32, 4, 2, 4), (32, 4, 2)),
    ((32, 4, MISSING, 1), (32, 4, 8)),
    ((32, 4, MISSING, 2), (32, 4, 4)),
    ((32, 4, MISSING, 8), (32, 4, 1)),
    ((48, 4, MISSING, 3), (48, 4, 4)),
    ((32, MISSING, MISSING, 1), (32, 32, 1)),
    ((32, MISSING, MISSING, 2), (32, 16, 1)),
    ((32, MISSING, MISSING, 8), (32, 4, 1)),
    ((48, MISSING, 2, 3), (48, 8, 2)),
    ((64, MISSING, 4, 8), (64, 2, 4)),
    ((MISSING, 4, MISSING, 3), (12, 4, 1)),
    ((MISSING, 4, 2, 3), (24, 4, 2)),
    ((MISSING, 1, 16, 8), (128, 1, 16)),
    ((0, 4, 0, 8), (32, 4, 1)),  # 0 means "computed", as in DeepSpeed's tutorials
    ((None, 2, None, 3), (6, 2, 1)),
    ((24, 4, 2, 3), (24, 4, 2)),
]
BATCH_BAD = [
    ((32, 4, 2, 1), "train_batch_size", "= 8"),
    ((25, 4, 2, 3), "train_batch_size", "= 24"),
    ((32, 4, MISSING, 3), "train_batch_size", "not a multiple of 4 x 3 = 12"),
    ((32, MISSING, MISSING, 3), "train_batch_size", "not a multiple of 1 x 3 = 3"),
    ((48, MISSING, 5, 3), "train_batch_size", "not a multiple of 5 x 3 = 15"),
    (
        (MISSING, MISSING, 2, 1),
        "train_micro_batch_size_per_gpu",
        "only gradient_accumulation_steps",
    ),
    ((MISSING, MISSING, MISSING, 8), "train_batch_size", "no batch size given"),
    (("auto", "auto", "auto", 2), "train_batch_size", "'auto'"),
    (("auto", 4, MISSING, 2), "train_batch_size", "Hugging Face integration"),
    ((MISSING, 4, "auto", 2), "gradient_accumulation_steps", "Hugging Face integration"),
]


def _batch_config(train: Any, micro: Any, gas: Any) -> dict[str, Any]:
    values = zip(
        ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"),
        (train, micro, gas),
        strict=True,
    )
    return {k: v for k, v in values if v is not MISSING}


@pytest.mark.parametrize(("given", "expected"), BATCH_OK)
def test_batch_rule_resolves(given: tuple[Any, ...], expected: tuple[int, int, int]) -> None:
    *values, world = given
    cfg = load_config(_batch_config(*values), dp_world_size=world)
    resolved = (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    )
    assert resolved == expected
    assert (
        cfg.train_batch_size
        == cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps * world
    )


@pytest.mark.parametrize(("given", "path", "fragment"), BATCH_BAD)
def test_batch_rule_errors(given: tuple[Any, ...], path: str, fragment: str) -> None:
    *values, world = given
    message = str(errors_of(_batch_config(*values), world)[0])
    assert message.startswith(f"{path}: "), message
    assert fragment in message, message
    if "must equal" in message:  # inconsistent or not divisible: all three keys and the world
        for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            assert key in message
        assert f"world size ({world})" in message


def test_resolve_batch_sizes_directly() -> None:
    assert resolve_batch_sizes(None, 4, None, 2) == (8, 4, 1)
    assert resolve_batch_sizes(16, None, None, 2) == (16, 8, 1)


# ---------------------------------------------------------------------------------------
# The JSON reader: comments, trailing commas, errors naming file:line
# ---------------------------------------------------------------------------------------
COMMENTED = """\
// A DeepSpeed config with comments.
{
  /* batch: micro x accumulation x world */
  "train_micro_batch_size_per_gpu": 2,  // per rank
  "gradient_accumulation_steps": 4,     # hjson-style comment
  "zero_optimization": {
    "stage": 3,
    "offload_param": {
      "device": "nvme",
      "nvme_path": "//mnt/nvme/*scratch*/",  /* the path keeps its slashes */
    },
  },
  "wandb": {"enabled": false, "project": "a \\" // quoted", "group": "#1"},
}
"""


def test_reader_strips_comments_and_trailing_commas(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(COMMENTED)
    raw = parsed(loads_relaxed(COMMENTED), world=2).raw
    assert raw["zero_optimization"]["offload_param"]["nvme_path"] == "//mnt/nvme/*scratch*/"
    assert raw["wandb"] == {"enabled": False, "project": 'a " // quoted', "group": "#1"}
    # The file (NVMe offload at stage 3) loads from a Path and from a str.
    assert load_config(path, dp_world_size=2).zero_optimization.offload_param.device == "nvme"
    assert load_config(str(path), dp_world_size=2).zero_optimization.offload_param.device == "nvme"


def test_reader_error_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{\n  /* a\n     b */\n  "train_batch_size": 8\n  "steps_per_print": 1\n}\n')
    message = error_of(path)
    assert message.startswith(f"{path}:5:"), message
    assert "invalid JSON" in message


def test_reader_unterminated_comment(tmp_path: Path) -> None:
    path = tmp_path / "open.json"
    path.write_text('{\n  "train_batch_size": 8\n  /* never closed\n}\n')
    assert error_of(path).startswith(f"{path}:3: unterminated /* comment")


def test_reader_duplicate_keys(tmp_path: Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "train_batch_size": 16\n}\n')
    message = error_of(path)
    assert message.startswith(f"{path}:3: ") and "duplicate key 'train_batch_size'" in message


def test_reader_missing_file_and_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "ds_config.json"
    assert error_of(missing) == f"{missing}: config file not found"
    assert error_of(str(missing)) == f"{missing}: config file not found"
    assert error_of(tmp_path).startswith(f"{tmp_path}: is a directory")


def test_reader_other_file_problems(tmp_path: Path) -> None:
    top_list = tmp_path / "list.json"
    top_list.write_text("[1, 2]")
    assert error_of(top_list).startswith(f"{top_list}: expected a JSON object at the top level")
    binary = tmp_path / "binary.json"
    binary.write_bytes(b'{"train_batch_size": 8, "x": "\xff"}')
    assert error_of(binary).startswith(f"{binary}: not UTF-8")
    bom = tmp_path / "bom.json"
    bom.write_bytes(b'\xef\xbb\xbf{"train_batch_size": 8}')
    assert load_config(bom).train_batch_size == 8


def test_reader_keeps_strict_json_otherwise() -> None:
    with pytest.raises(ConfigError, match=r"^<string>:1:\d+: invalid JSON"):
        loads_relaxed("{train_batch_size: 8}")
    assert loads_relaxed('{"a": [1, 2,], "b": "x,]"}') == {"a": [1, 2], "b": "x,]"}


def test_offloaded_masters_are_pinned_on_cuda_unless_pin_memory_is_false() -> None:
    """The issue's "(pinned, when CUDA) CPU memory": unset pin_memory means pinned fp32
    masters on a GPU (their uploads must not block the host); an explicit false, as
    DeepSpeed's default, keeps them pageable; on a CPU-only run nothing is pinned."""
    import torch

    from zeroshard.offload.placement import Placement

    def pinned(offload: dict, device: str) -> bool:
        zero = parsed(_zero(offload_optimizer=offload)).zero_optimization
        return Placement.from_config(zero, torch.device(device)).pin_memory

    assert (
        parsed(
            _zero(offload_optimizer={"device": "cpu"})
        ).zero_optimization.offload_optimizer.pin_memory
        is None
    )
    assert pinned({"device": "cpu"}, "cuda")
    assert pinned({"device": "cpu", "pin_memory": True}, "cuda")
    assert not pinned({"device": "cpu", "pin_memory": False}, "cuda")
    assert not pinned({"device": "cpu"}, "cpu")


def test_buffer_count_is_not_checked_on_an_ignored_offload_section() -> None:
    """Like DeepSpeed, optimizer offload at stage 0 is ignored (with a warning): its
    buffer_count is not held against it."""
    off = {"device": "nvme", "nvme_path": "/x", "pipeline_read": True}
    cfg = parsed(_with(zero_optimization={"stage": 0, "offload_optimizer": off}))
    assert not cfg.zero_optimization.offload_optimizer.enabled
    assert inert_keys(cfg) == ["zero_optimization.offload_optimizer"]


# ---------------------------------------------------------------------------------------
# Every key the schema accepts: wired, refused (not built) or inert with a reason
# ---------------------------------------------------------------------------------------
PACKAGE = Path(__file__).parent.parent / "zeroshard"
CONFIG_MODULES = {f"config/{m}.py" for m in ("__init__", "__main__", "training", "schema", "sections", "jsonc", "monitors")}  # fmt: skip
# Wired keys the code reads by another route than ``.<attribute>``, and how.
WIRED_ELSEWHERE = {
    # folded into offload_optimizer / offload_param by ZeroConfig.json_compat
    # (test_deprecated_cpu_offload_param_folds_into_offload_param, the cifar config)
    "zero_optimization.cpu_offload": "json_compat",
    "zero_optimization.cpu_offload_param": "json_compat",
    "zero_optimization.cpu_offload_use_pin_memory": "json_compat",
    # Config.__post_init__ checks it equals gradient_accumulation_steps (config/training.py)
    "pipeline.micro_batches": "Config.__post_init__",
}


def _leaves() -> list[Any]:
    infos = schema_table()
    parents = {info.path.rpartition(".")[0] for info in infos}
    return [info for info in infos if info.path not in parents]


def test_every_key_is_wired_refused_or_inert() -> None:
    from zeroshard.checkpointing import Settings
    from zeroshard.runtime.schedulers import SCHEDULERS

    source = "\n".join(
        p.read_text()
        for p in PACKAGE.rglob("*.py")
        if p.relative_to(PACKAGE).as_posix() not in CONFIG_MODULES
    )
    leaves = _leaves()
    assert len(leaves) > 150
    unproven = []
    for info in leaves:
        assert info.spec.key.doc, info.path
        kind, text = info.status.kind, info.status.text
        assert kind in ("wired", "not built", "inert"), info.path
        if kind != "wired":
            assert text, f"{info.path}: a {kind} key needs its feature or reason"
            continue
        if info.path.startswith("scheduler.params."):
            # passed by name to the schedule's constructor (SchedulerConfig.params)
            for kind_name in info.spec.key.only or tuple(SCHEDULERS):
                assert info.spec.attr in inspect.signature(SCHEDULERS[kind_name]).parameters
        elif info.path.startswith("activation_checkpointing."):
            assert info.spec.attr in Settings.__dataclass_fields__, info.path  # by name
        elif info.path not in WIRED_ELSEWHERE and not re.search(rf"\.{info.spec.attr}\b", source):
            unproven.append(info.path)
    assert not unproven, f"keys said to be wired that no module reads: {unproven}"


def _config_setting(info: Any, value: Any) -> dict[str, Any]:
    """A minimal config that gives ``info``'s key ``value``."""
    config: dict[str, Any] = {"train_batch_size": 8}
    if info.path.startswith(("optimizer.", "scheduler.")):
        kind = (
            info.spec.key.only[0]
            if info.spec.key.only
            else "Adam"
            if info.path[0] == "o"
            else "WarmupLR"
        )
        config[info.path.partition(".")[0]] = {"type": kind}
    if info.path.startswith("zero_optimization."):
        config["zero_optimization"] = {"stage": 3}
    node = config
    *parents, last = info.path.split(".")
    for name in parents:
        node = node.setdefault(name, {})
    node[last] = value
    return config


def test_every_refused_or_inert_switch_does_what_its_status_says() -> None:
    """Each boolean key that is not built is refused when switched from its default,
    naming itself; each inert one is accepted and reported with its reason."""

    checked = 0
    for info in _leaves():
        spec = info.spec
        if spec.type is not bool or info.status.kind == "wired" or spec.key.status.kind == "wired":
            continue  # (keys inside a refused monitor section: the section's own switch)
        flipped = not spec.default if spec.default is not None else True
        config = _config_setting(info, flipped)
        if info.status.kind == "not built":
            assert_not_built(config, info.path)
        else:
            assert dict(load_config(config).inert)[info.path] == info.status.text, info.path
        checked += 1
    assert checked > 40


def test_auto_bucket_sizes_mean_the_default() -> None:
    # zeroshard chooses the gradient / all-gather buckets when they say "auto" (as when
    # they are left out); "auto" elsewhere stays an error naming its key.
    base = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    for k in ("reduce_bucket_size", "allgather_bucket_size"):
        cfg = load_config({**base, "zero_optimization": {"stage": 2, k: "auto"}})
        assert getattr(cfg.zero_optimization, k) is None
    bad = {**base, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}}
    with pytest.raises(ConfigError, match="stage3_prefetch_bucket_size: 'auto'"):
        load_config(bad)


# -- every problem at once (issue 29.6) ----------------------------------------------------
def test_every_problem_of_a_config_is_reported_at_once() -> None:
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_acumulation_steps": 1,  # typo at the top
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betaz": [0.9, 0.95]}},
        "zero_optimization": {"stage": 5, "overlap_com": True},  # a bad value, a typo
        "fp16": {"enabled": "yes"},
        "sparse_attention": {"mode": "fixed"},  # not built: refused in the same report
    }
    with pytest.raises(ConfigError) as info:
        load_config(config)
    err = info.value
    assert [str(e) for e in err.errors] == [
        "gradient_acumulation_steps: unknown key; did you mean 'gradient_accumulation_steps'?",
        "optimizer.params.betaz: unknown key; did you mean 'betas'?",
        "fp16.enabled: expected true or false, got 'yes' (a string)",
        "zero_optimization.overlap_com: unknown key; did you mean 'overlap_comm'?",
        "zero_optimization.stage: expected one of 0, 1, 2, 3, got 5 (a number)",
        "sparse_attention: sparse attention is not built yet in zeroshard",
    ]
    lines = str(err).splitlines()
    assert lines[0] == "6 problems in the config:" and len(lines) == 7
    assert (err.path, err.problem) == ("gradient_acumulation_steps", err.errors[0].problem)
    copy_ = pickle.loads(pickle.dumps(err))  # it crosses processes (the launcher's report)
    assert str(copy_) == str(err) and len(copy_.errors) == 6


def test_cross_key_rules_wait_for_clean_keys() -> None:
    # A typo'd batch key must not also produce the "no batch size given" it causes ...
    errors = load_errors({"train_micro_batch_sise_per_gpu": 8})
    assert [e.path for e in errors] == ["train_micro_batch_sise_per_gpu"]
    # ... nor the fp16-with-bf16 rule of the level above a bad key (it waits for the next
    # read: rules that relate keys run only where every key below read cleanly)
    config = {"train_batch_size": 8, "optimizer": {"type": "Adma"}, "fp16": {"enabled": True}}
    errors = load_errors({**config, "bf16": {"enabled": True}})
    assert [str(e) for e in errors] == [
        "optimizer.type: expected one of 'Adam', 'AdamW', 'SGD', got 'Adma' (a string); did you mean 'Adam'?",
    ]
    config["optimizer"] = {"type": "Adam"}
    errors = load_errors({**config, "bf16": {"enabled": True}})
    assert [e.path for e in errors] == ["bf16.enabled"]


def load_errors(config: dict[str, Any], world: int = 1) -> list[ConfigError]:
    with pytest.raises(ConfigError) as info:
        load_config(config, dp_world_size=world)
    return list(info.value.errors)


def test_check_config_file_before_the_ranks_exist(tmp_path: Path) -> None:
    """What `zeroshard run` checks: no world size (no batch rule), "auto" allowed (the
    Trainer fills it in later), everything else as initialize would; no torch import."""
    import subprocess
    import sys

    from zeroshard.config import check_config_file

    good = tmp_path / "ds.json"
    good.write_text(json.dumps({"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}))  # fmt: skip
    check_config_file(good)  # 7 = 2 x ? x world: initialize's to judge
    with pytest.raises(ConfigError, match="train_batch_size: "):
        load_config(good, dp_world_size=2, auto_values={"optimizer.params.lr": 1e-3})
    check_config_file(REAL / "stanford_alpaca_default_offload_opt_param.json")  # "auto"s
    bad = tmp_path / "bad.json"
    bad.write_text('{"steps_per_print": 0, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "gpu"}}}')  # fmt: skip
    with pytest.raises(ConfigError) as info:
        check_config_file(bad)
    assert [e.path for e in info.value.errors] == ["zero_optimization.offload_optimizer.device", "steps_per_print"]  # fmt: skip
    code = "import sys, zeroshard.config as c; c.check_config_file(sys.argv[1]); print('torch' in sys.modules)"  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, str(good)], capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == "False", out
