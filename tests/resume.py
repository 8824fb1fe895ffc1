"""The checkpoint tests' training setup and the resume check, shared by test_checkpoint.py
and test_cuda.py (which runs the same cases on a GPU)."""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

import cases
import parity
import torch

if TYPE_CHECKING:
    import pytest

ROWS = 6  # global batch: divisible by 1, 2 and 3 ranks
CPU = {"device": "cpu"}


def config(case: dict, world: int) -> dict:
    cfg = {
        "train_batch_size": ROWS,
        "optimizer": case.get(
            "optimizer", {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}
        ),
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": case["stage"],
            "reduce_bucket_size": 3000,
            "allgather_bucket_size": 3000,
            "stage3_param_persistence_threshold": 0,
            **case.get("zero", {}),
        },
        "steps_per_print": 10**6,
    }
    if case.get("scheduler", True):
        cfg["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-3},
        }
    if case.get("dtype") == "fp16":
        cfg["fp16"] = {
            "enabled": True,
            "initial_scale_power": 6,
            "loss_scale_window": 3,
            "hysteresis": 1,
        }
    if case.get("dtype") == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def make(case: dict, world: int):
    import zeroshard

    model = parity.build_model(case)
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=parity.param_groups(model), config=config(case, world)
    )
    return engine


def train(engine, rank: int, world: int, steps: range) -> list[float]:
    micro = ROWS // world
    losses = []
    for step in steps:
        x, y = (t.to(engine.device) for t in parity.batch(step, ROWS))
        loss = engine(x[rank * micro : (rank + 1) * micro], y[rank * micro : (rank + 1) * micro])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    return losses


RESUME_CASES: list[dict[str, Any]] = [
    {"stage": 0},
    {"stage": 1},
    {"stage": 2},
    {"stage": 3},
    {"stage": 2, "zero": {"offload_optimizer": CPU}},
    {"stage": 3, "zero": {"offload_optimizer": CPU, "offload_param": CPU}},
    {"stage": 1, "dtype": "fp16"},
    {"stage": 3, "dtype": "bf16"},
    # dropout: the resumed run draws the same masks only if the checkpoint restored
    # each rank's RNG state (a fresh process starts from the build seed)
    {"stage": 2, "dropout": 0.2},
    # SGD keeps no state until its first step: a fresh engine must still take the
    # saved momentum_buffer
    {"stage": 2, "optimizer": {"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9}}},
]


def case_name(case: dict) -> str:
    """A resume case's name in reports (``stage=2 zero.offload_optimizer.device=cpu``)."""
    return cases.label(case)


def _phase(rank: int, world: int, phase: str, ckpt: str, case: dict) -> dict | None:
    engine = make(case, world)
    if phase == "straight":
        losses = train(engine, rank, world, range(10))[5:]
    elif phase == "first":
        train(engine, rank, world, range(5))
        engine.save_checkpoint(ckpt, client_state={"epoch": 3})
        return None
    else:
        _, client = engine.load_checkpoint(ckpt)
        assert client == {"epoch": 3} and engine.global_steps == 5
        losses = train(engine, rank, world, range(5, 10))
    params = parity.full_params(engine)
    return {
        "losses": losses,
        "params": {k: v.flatten().tolist() for k, v in params.items()},
        "scale": engine.cur_scale,
        "lr": engine.get_lr(),
    }


def resume_phase(
    rank: int, world: int, phase: str, root: str, case_list: list[dict] | None = None
) -> dict[str, dict]:
    """One phase of the resume check for ``case_list`` (default RESUME_CASES), each case a
    named case (:mod:`cases`): "straight" trains 10 steps, "first" 5 and saves, "second"
    loads and trains the other 5."""
    case_list = RESUME_CASES if case_list is None else case_list
    return cases.run_named(
        (
            case_name(c),
            functools.partial(_phase, rank, world, phase, os.path.join(root, f"case{i}"), c),
        )
        for i, c in enumerate(case_list)
    )


def check_resume(
    subtests: pytest.Subtests, case_list: list[dict], straight: list, first: list, resumed: list
) -> None:
    """Per case, under its own subtest: the saving run ran, and the resumed run has rank
    0's losses, parameters, loss scale and lr of the straight run, bit for bit."""
    for case in case_list:
        name = case_name(case)
        with subtests.test(case=name):
            cases.values(first, name)  # the save ran on every rank
            a, b = cases.values(straight, name)[0], cases.values(resumed, name)[0]
            assert a["losses"] == b["losses"], (case, a["losses"], b["losses"])  # bitwise
            assert a["params"] == b["params"], case
            assert a["scale"] == b["scale"] and a["lr"] == b["lr"], case
