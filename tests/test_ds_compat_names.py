"""The DeepSpeed names the peers' own test suites import (DeepSpeed's tests/unit,
accelerate's tests/deepspeed, transformers' DeepSpeed trainer tests), and zeroshard's
answers: real behaviour, or a "not built yet" raised where the feature is used.

``PEER_NAMES`` was taken from a grep of those suites' imports (DeepSpeed v0.16.5's
tests/unit runtime/zero, checkpoint, runtime/activation_checkpointing, runtime/utils and
its helpers; accelerate 1.15's tests/deepspeed; transformers 5.24's
tests/trainer/distributed/test_trainer_distributed_deepspeed.py). test_hf_names.py covers
what the libraries themselves import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from multirank import run

from zeroshard.compat import ds_ops, ds_runtime_utils, ds_version, ds_zero_names
from zeroshard.moe import layer as moe_layer
from zeroshard.moe import utils as moe_utils

PEER_NAMES = [
    "deepspeed.runtime.lr_schedules.WARMUP_LR",
    "deepspeed.runtime.lr_schedules.WarmupLR",
    "deepspeed.runtime.lr_schedules.LR_RANGE_TEST_STAIRCASE",
    "deepspeed.runtime.config.ADAM_OPTIMIZER",
    "deepspeed.runtime.dataloader.RepeatingLoader",
    "deepspeed.utils.RepeatingLoader",
    "deepspeed.utils.groups._create_expert_and_data_parallel",
    "deepspeed.DeepSpeedConfigError",
    "deepspeed.accelerator.is_current_accelerator_supported",
    "deepspeed.comm.new_group",
    "deepspeed.comm.destroy_process_group",
    "deepspeed.git_version_info.torch_info",
    "deepspeed.ops.__compatible_ops__",
    "deepspeed.ops.aio.AsyncIOBuilder",
    "deepspeed.ops.op_builder.CPUAdamBuilder",
    "deepspeed.ops.op_builder.FusedAdamBuilder",
    "deepspeed.ops.op_builder.FusedLambBuilder",
    "deepspeed.moe.layer.MoE",
    "deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer",
    "deepspeed.moe.utils.is_moe_param",
    "deepspeed.moe.sharded_moe.top1gating",
    "deepspeed.moe.sharded_moe.topkgating",
    "deepspeed.pipe.PipelineModule",
    "deepspeed.pipe.LayerSpec",
    "deepspeed.checkpointing.checkpoint",
    "deepspeed.checkpoint.UNIVERSAL_CHECKPOINT_INFO",
    "deepspeed.checkpoint.utils.get_model_ckpt_name_for_rank",
    "deepspeed.runtime.activation_checkpointing.checkpointing.non_reentrant_checkpoint",
    "deepspeed.runtime.engine.DeepSpeedEngine",
    "deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer",
    "deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer",
    "deepspeed.runtime.utils.partition_uniform",
    "deepspeed.runtime.utils.partition_balanced",
    "deepspeed.runtime.utils.prefix_sum_inc",
    "deepspeed.runtime.utils.PartitionedTensor",
    "deepspeed.runtime.utils.see_memory_usage",
    "deepspeed.runtime.utils.move_to_device",
    "deepspeed.runtime.utils.call_to_str",
    "deepspeed.runtime.zero.unwrap_model_for_generation",
    "deepspeed.runtime.zero.config.DeepSpeedZeroConfig",
    "deepspeed.runtime.zero.config.DeepSpeedZeroOffloadParamConfig",
    "deepspeed.runtime.zero.config.DeepSpeedZeroOffloadOptimizerConfig",
    "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum",
    "deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum",
    "deepspeed.runtime.zero.offload_config.DeepSpeedZeroOffloadOptimizerConfig",
    "deepspeed.runtime.zero.partition_parameters.Init",
    "deepspeed.runtime.zero.partition_parameters.ZeroParamStatus",
    "deepspeed.runtime.zero.partition_parameters.partitioned_param_data_shape",
    "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer",
    "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3",
    "deepspeed.runtime.zero.utils.ZeRORuntimeException",
    "deepspeed.utils.torch.required_torch_version",
    "deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint",
    "deepspeed.utils.zero_to_fp32.load_state_dict_from_zero_checkpoint",
    "deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict",
    "deepspeed.utils.get_z3_leaf_modules",
    "deepspeed.utils.safe_get_full_grad",
    "deepspeed.utils.safe_get_full_fp32_param",
    "deepspeed.utils.safe_set_full_fp32_param",
    "deepspeed.utils.safe_get_local_fp32_param",
    "deepspeed.zero.MiCS_Init",
]

# DeepSpeed modules the suites import whose feature zeroshard does not build: importing
# them raises ImportError naming the feature (only the tests of that feature import them)
PEER_NOT_BUILT = [
    "deepspeed.runtime.zero.tiling",
    "deepspeed.runtime.zero.offload_states",
    "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine",
    "deepspeed.runtime.pipe.topology",
    "deepspeed.checkpoint.ds_to_universal",
    "deepspeed.checkpoint.model_3d_desc",
    "deepspeed.moe.mappings",
]

TESTS = os.path.dirname(os.path.abspath(__file__))

_RESOLVE = """
import importlib, json, sys
import zeroshard.as_deepspeed
names, not_built = json.loads(sys.argv[1]), json.loads(sys.argv[2])
sys.path.insert(0, sys.argv[-1])  # tests/, for alias_names
from alias_names import unresolved
bad = unresolved(names)
for mod in not_built:
    try:
        importlib.import_module(mod)
        bad.append(f"{mod} imported")
    except ImportError as e:
        if "not built yet in zeroshard" not in str(e):
            bad.append(f"{mod}: {e}")
import deepspeed
from deepspeed.ops.op_builder import CPUAdamBuilder, FusedLambBuilder
assert deepspeed.ops.__compatible_ops__[CPUAdamBuilder.NAME] is True
assert deepspeed.ops.__compatible_ops__[FusedLambBuilder.NAME] is False
assert deepspeed.__git_hash__ and deepspeed.__git_branch__
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from zeroshard.zero.optim.optimizer import ShardedOptimizer
assert DeepSpeedZeroOptimizer_Stage3 is ShardedOptimizer
print(json.dumps(bad))
"""


def test_every_peer_name_resolves_through_the_alias() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _RESOLVE, json.dumps(PEER_NAMES), json.dumps(PEER_NOT_BUILT), TESTS],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_deepspeed_moe_names_are_the_built_layer() -> None:
    """``deepspeed.moe.layer.MoE`` and ``deepspeed.moe.utils`` are zeroshard's MoE (issue
    34): the layer builds and runs, its experts are marked and split into groups of
    their own; a model without experts comes back as given."""
    moe = moe_layer.MoE(hidden_size=4, expert=torch.nn.Linear(4, 4), num_experts=2)
    out, l_aux, counts = moe(torch.randn(2, 4, 4))  # top-1 of 8 tokens, capacity 4
    assert out.shape == (2, 4, 4) and l_aux.ndim == 0 and int(counts.sum()) == 8
    assert moe_utils.has_moe_layers(torch.nn.Sequential(moe)) == (True, 2)
    assert moe_utils.has_moe_layers(torch.nn.Linear(2, 2)) == (False, 0)
    p = torch.nn.Parameter(torch.ones(2))
    groups = [{"params": [p], "name": "g"}]
    assert moe_utils.split_params_into_different_moe_groups_for_optimizer(groups) == groups
    assert moe_utils.split_params_into_different_moe_groups_for_optimizer(groups[0]) == groups
    experts = [q for q in moe.parameters() if moe_utils.is_moe_param(q)]
    assert experts and len(experts) < len(list(moe.parameters()))
    split = moe_utils.split_params_into_different_moe_groups_for_optimizer(
        [{"params": list(moe.parameters()), "name": "g"}]
    )
    assert [g.get("moe", False) for g in split] == [False, True]
    assert {id(q) for q in split[1]["params"]} == {id(q) for q in experts}


def test_not_built_is_refused_where_used() -> None:
    p = torch.nn.Parameter(torch.ones(2))

    import zeroshard.utils

    with pytest.raises(NotImplementedError, match=r"safe_get_full_grad: .*not built yet"):
        zeroshard.utils.safe_get_full_grad(p)
    with pytest.raises(AttributeError):
        zeroshard.utils.no_such_name  # noqa: B018
    cpu_adam, lamb = ds_ops.BUILDERS["CPUAdamBuilder"](), ds_ops.BUILDERS["FusedLambBuilder"]()
    assert cpu_adam.is_compatible() and not lamb.is_compatible()
    with pytest.raises(
        NotImplementedError, match=r"compiles no C\+\+/CUDA ops; use deepspeed\.ops\.adam"
    ):
        cpu_adam.load()
    with pytest.raises(NotImplementedError, match=r"fused_lamb.*not built yet"):
        lamb.load()
    with pytest.raises(NotImplementedError, match="fp16 optimizer wrappers are not built"):
        ds_zero_names.FP16_Optimizer()


def test_partition_helpers_answer_as_deepspeed() -> None:
    u = ds_runtime_utils
    assert u.prefix_sum_inc([3, 4, 5]) == [3, 7, 12]
    assert u.partition_uniform(2, 4) == [0, 1, 2, 2, 2]
    assert u.partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert u.partition_balanced([1, 1], 4) == [0, 1, 2, 2, 2]
    assert u.partition_balanced([1] * 8, 4) == [0, 2, 4, 6, 8]
    # the least spread between the heaviest and lightest part; ties to the later cut
    assert u.partition_balanced([0, 1, 2, 3, 3, 3], 4) == [0, 3, 4, 5, 6]
    assert u.partition_balanced([0.0, 1.1, 30, 3.0], 3) == [0, 2, 3, 4]
    assert u.partition_balanced([1] * 10, 1) == [0, 10]
    t: Any = [torch.ones(2), (torch.zeros(1), {"k": torch.ones(3, dtype=torch.int64)})]
    moved = u.move_to_device(t, "cpu", lambda x: torch.is_tensor(x) and x.is_floating_point())
    assert moved[0] is t[0] and moved[1][1]["k"] is t[1][1]["k"]
    assert u.call_to_str("int") == "int()"
    assert u.call_to_str("f", 3, "jeff") == "f(3, 'jeff')"
    assert u.call_to_str("f", 1138, val=3, s="x") == "f(1138, val=3, s='x')"


def test_zero_config_classes_read_through_the_schema() -> None:
    z = ds_zero_names
    c = z.DeepSpeedZeroConfig(stage3_prefetch_bucket_size=12345, stage=3)
    assert c.prefetch_bucket_size == 12345 and c.overlap_comm is True
    assert z.DeepSpeedZeroConfig(stage=1).overlap_comm is False
    assert z.DeepSpeedZeroConfig(
        stage3_gather_fp16_weights_on_model_save=True
    ).gather_16bit_weights_on_model_save
    assert z.DeepSpeedZeroConfig().offload_param is None
    assert isinstance(
        z.DeepSpeedZeroConfig(cpu_offload=True).offload_optimizer,
        z.DeepSpeedZeroOffloadOptimizerConfig,
    )
    section = z.DeepSpeedZeroConfig(offload_param={}).offload_param
    assert section is not None and section.device == "none"
    assert z.DeepSpeedZeroOffloadOptimizerConfig(pipeline_write=True).pipeline
    from zeroshard.config import ConfigError

    with pytest.raises(ConfigError, match=r"zero_optimization\.stage"):
        z.DeepSpeedZeroConfig(stage=7)
    with pytest.raises(ConfigError, match="no_such_key"):
        z.DeepSpeedZeroConfig(no_such_key=1)


def test_versions_and_accelerator() -> None:
    assert ds_version.required_torch_version(min_version=1.8)
    assert not ds_version.required_torch_version(min_version=99)
    assert not ds_version.required_torch_version(max_version="1.0")
    info = ds_version.torch_info()
    assert info["version"] == ".".join(torch.__version__.split(".")[:2])
    line = ds_version.startup_line()
    assert line.startswith(f"DeepSpeed info: version={ds_version.DEEPSPEED_VERSION}, git-hash=")
    from zeroshard.accelerator import get_accelerator

    acc = get_accelerator()
    acc.set_device(0)  # the CPU has one device: nothing to select
    assert acc.max_memory_allocated() >= acc.memory_allocated() > 0
    import zeroshard

    assert zeroshard.get_accelerator() is acc  # deepspeed.get_accelerator, as DeepSpeed's
    assert acc.supported_dtypes() == [torch.float32, torch.bfloat16]  # the CPU: no fp16


def test_cpu_device_count_reads_local_size_as_deepspeed(monkeypatch, tmp_path) -> None:
    """DeepSpeed's CPU accelerator counts LOCAL_SIZE (the launcher's local ranks) when set,
    else the NUMA nodes that have cores; its unit-test harness skips a 2-rank test when
    device_count() < 2."""
    from zeroshard.compat import accelerator

    acc = accelerator.get_accelerator()
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert acc.device_count() == 4
    monkeypatch.setenv("LOCAL_SIZE", "0")
    assert acc.device_count() == accelerator._numa_nodes_with_cores() >= 1
    monkeypatch.setenv("LOCAL_SIZE", "four")
    with pytest.raises(ValueError, match="LOCAL_SIZE='four'"):
        acc.device_count()
    for name, cpus in (("node0", "0-3"), ("node1", ""), ("node2", "4-7"), ("online", "0-2")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "cpulist").write_text(cpus + "\n")
    assert accelerator._numa_nodes_with_cores(str(tmp_path)) == 2  # node1: memory only
    assert accelerator._numa_nodes_with_cores(str(tmp_path / "absent")) == 1


def _partitioned(rank: int, world: int) -> list:
    import torch.distributed as dist

    from zeroshard.compat.ds_runtime_utils import PartitionedTensor

    out = []
    for rows, cols in ((world * 4, 3), (world * 4 - 1, world + 1)):
        torch.manual_seed(0)
        full = torch.rand(rows, cols)
        part = PartitionedTensor(full, group=dist.group.WORLD)
        again = PartitionedTensor.from_meta(part.to_meta(), part.data(), dist.group.WORLD)
        out.append(
            [
                part.local_size()[0],
                torch.equal(part.full(), full),
                torch.equal(again.full(), full),
                part.full_size() == [rows, cols],
            ]
        )
    return out


def test_partitioned_tensor_two_ranks() -> None:
    res = run(_partitioned, 2)
    # even split: 12 elements each; uneven (7x3 = 21): 11 and 10
    assert [r[0] for r in res] == [[12, True, True, True], [12, True, True, True]]
    assert [r[1][0] for r in res] == [11, 10] and all(all(r[1][1:]) for r in res)


_STARTUP = """
import logging, os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
if sys.argv[1] == "alias":
    import zeroshard.as_deepspeed
import torch, zeroshard
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s", stream=sys.stdout)
engine, *_ = zeroshard.initialize(model=torch.nn.Linear(2, 2), config={
    "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
"""


@pytest.mark.parametrize("mode", ["alias", "plain"])
def test_startup_line_as_deepspeed(mode: str) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    out = subprocess.run(
        [sys.executable, "-c", _STARTUP, mode, port],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ZEROSHARD_ACCELERATOR": "cpu"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if "DeepSpeed info" in line]
    if mode == "plain":  # zeroshard under its own name says nothing of DeepSpeed
        assert lines == []
        return
    assert len(lines) == 1, out.stdout
    version = ds_version.DEEPSPEED_VERSION
    assert lines[0].startswith(f"zeroshard DeepSpeed info: version={version}, git-hash=")
    assert ", git-branch=" in lines[0]


# run in a fresh interpreter: ``import zeroshard.as_deepspeed`` is refused once
# transformers decided DeepSpeed is absent, as earlier tests in this process make it
_LR_SCHEDULES = r"""
import importlib

import torch

import zeroshard.as_deepspeed  # noqa: F401  (first: deepspeed is zeroshard from here)
from zeroshard import NotBuiltError
from zeroshard.runtime.schedulers import build_scheduler

ls = importlib.import_module("deepspeed.runtime.lr_schedules")
repeating_loader = importlib.import_module("deepspeed.utils").RepeatingLoader
groups = importlib.import_module("deepspeed.utils.groups")

opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
params = {ls.WARMUP_MIN_LR: 0.0, ls.WARMUP_MAX_LR: 0.5, ls.WARMUP_NUM_STEPS: 4}
sched = build_scheduler(ls.WARMUP_LR, {**params, ls.WARMUP_TYPE: ls.WARMUP_LINEAR_RATE}, opt)
assert isinstance(sched, ls.WarmupLR)
names = [ls.LR_RANGE_TEST, ls.ONE_CYCLE, ls.WARMUP_LR, ls.WARMUP_DECAY_LR, ls.WARMUP_COSINE_LR]
assert sorted(names) == ls.VALID_LR_SCHEDULES, names
it = repeating_loader([1, 2])
got = [next(it) for _ in range(5)]
assert got == [1, 2, 1, 2, 1], got
try:
    groups._create_expert_and_data_parallel(2)
except NotBuiltError as e:
    assert "_create_expert_and_data_parallel: " in str(e) and "ep_size" in str(e), e
else:
    raise AssertionError("_create_expert_and_data_parallel did not refuse")
print("ok")
"""


def test_lr_schedule_names_and_repeating_loader() -> None:
    """DeepSpeed's constants are its config keys: a config written with them builds the
    schedule they name; RepeatingLoader starts its loader again when it runs out; the
    expert-parallel group registry (zeroshard builds the ep groups at initialize) refuses
    by name when called."""
    out = subprocess.run(
        [sys.executable, "-c", _LR_SCHEDULES], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
