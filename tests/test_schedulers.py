"""Tests for zeroshard.runtime.schedulers.

``tests/data/lr_schedules_reference.json`` holds lr (and, for OneCycle with Adam, betas)
sequences produced by DeepSpeed 0.19.8's own ``deepspeed.runtime.lr_schedules`` classes
(torch 2.13.0, CPU) with ``tests/data/make_lr_reference.py``; that script needs DeepSpeed
and is not run here.  Point 0 of each sequence is the value after construction (the lr of
the first optimizer step), point k the value after the k-th ``scheduler.step(...)``.
"""

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from zeroshard.runtime.schedulers import (
    SCHEDULERS,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

REFERENCE = json.loads((Path(__file__).parent / "data" / "lr_schedules_reference.json").read_text())
CASES = REFERENCE["cases"]
REL = 1e-12


def make_optimizer(kind="adam", group_lrs=(0.05,)):
    groups = [{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in group_lrs]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=group_lrs[0], momentum=0.9)
    return torch.optim.Adam(groups, lr=group_lrs[0], betas=(0.9, 0.999))


def snapshot(opt):
    betas = [list(g["betas"]) for g in opt.param_groups if "betas" in g]
    return [float(g["lr"]) for g in opt.param_groups], betas


def case_id(case):
    return case["type"] + "-" + "-".join(f"{k}={v}" for k, v in case["params"].items())


def build_case(case):
    opt = make_optimizer(case["optimizer"], case["group_lrs"])
    return opt, SCHEDULERS[case["type"]](opt, **case["params"])


def assert_close(actual, expected, where):
    assert actual == pytest.approx(expected, rel=REL, abs=0.0), where


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_matches_deepspeed_reference(case):
    opt, sched = build_case(case)
    step_args = case["step_args"] or [None] * (len(case["lr"]) - 1)
    for k, arg in enumerate([None, *step_args]):
        if k:
            sched.step() if arg is None else sched.step(arg)
        lrs, betas = snapshot(opt)
        assert_close(lrs, case["lr"][k], f"lr at point {k}")
        if case["betas"] is not None:
            for got, want in zip(betas, case["betas"][k], strict=True):
                assert_close(got, want, f"betas at point {k}")
        if k or case["params"].get("last_batch_iteration", -1) == -1:
            assert_close(sched.get_last_lr(), case["lr"][k], f"get_last_lr at point {k}")
    assert sched.state_dict() == case["state_dict"]


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_state_dict_resume_mid_schedule(case):
    if case["step_args"] is not None:
        pytest.skip("explicit step arguments")
    n = len(case["lr"]) - 1
    cut = n // 3
    _, first = build_case(case)
    for _ in range(cut):
        first.step()
    state = json.loads(json.dumps(first.state_dict()))  # must be plain JSON
    opt, resumed = build_case(case)
    resumed.load_state_dict(state)
    assert snapshot(opt)[0] == pytest.approx(case["lr"][cut], rel=REL, abs=0.0)
    for k in range(cut + 1, n + 1):
        resumed.step()
        lrs, betas = snapshot(opt)
        assert_close(lrs, case["lr"][k], f"resumed lr at point {k}")
        if case["betas"] is not None:
            assert_close([b[0] for b in betas], [b[0] for b in case["betas"][k]], f"betas {k}")


ONE_STEP_WARMUP = [c for c in CASES if c["params"].get("warmup_num_steps") == 1]


@pytest.mark.parametrize("case", ONE_STEP_WARMUP, ids=[case_id(c) for c in ONE_STEP_WARMUP])
def test_zero_warmup_steps_clamped_like_one(case):
    # DeepSpeed clamps warmup_num_steps to >= 2 (log warmup divides by log(n)); 0, which
    # "auto" resolves to, is clamped the same way (DeepSpeed 0.19 rejects 0 instead).
    opt = make_optimizer(case["optimizer"], case["group_lrs"])
    sched: Any = SCHEDULERS[case["type"]](opt, **{**case["params"], "warmup_num_steps": 0})
    assert sched.warmup_num_steps == 2
    for k in range(len(case["lr"])):
        if k:
            sched.step()
        assert_close(snapshot(opt)[0], case["lr"][k], f"lr at point {k}")


def test_first_step_semantics():
    opt = make_optimizer()
    sched = WarmupLR(opt, warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=10)
    assert opt.param_groups[0]["lr"] == 0.01  # first optimizer step
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.01  # second: log(1) == 0
    sched.step()
    assert opt.param_groups[0]["lr"] > 0.01
    opt = make_optimizer()
    WarmupCosineLR(opt, total_num_steps=100, warmup_min_ratio=0.5)
    assert opt.param_groups[0]["lr"] == 0.0
    opt = make_optimizer()
    cycle = OneCycle(opt, cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=10)
    assert opt.param_groups[0]["lr"] == 0.001
    assert opt.param_groups[0]["betas"] == (0.8, 0.99)
    assert cycle.get_last_lr() == [0.001]


def test_onecycle_sgd_momentum_matches_adam_betas():
    kw: dict[str, Any] = dict(cycle_min_lr=1e-3, cycle_max_lr=1e-2, cycle_first_step_size=20)
    kw.update(decay_lr_rate=0.5, decay_step_size=4, decay_mom_rate=0.01)
    adam, sgd = make_optimizer("adam"), make_optimizer("sgd")
    a, s = OneCycle(adam, **kw), OneCycle(sgd, **kw)
    for _ in range(60):
        assert sgd.param_groups[0]["momentum"] == adam.param_groups[0]["betas"][0]
        assert sgd.param_groups[0]["lr"] == adam.param_groups[0]["lr"]
        a.step()
        s.step()
    plain = torch.optim.Adagrad([torch.zeros(1, requires_grad=True)], lr=0.1)
    assert not OneCycle(plain, **kw).cycle_momentum


def test_onecycle_get_mom_is_deepspeeds_betas():
    """DeepSpeed's OneCycle.get_mom() returns each group's betas, ``(beta1, 0.99)``, as its
    unit tests read it (``get_mom()[0][0]``); for SGD, whose momentum DeepSpeed does not
    cycle, the momentum alone."""
    kw: dict[str, Any] = dict(cycle_min_lr=1e-3, cycle_max_lr=1e-2, cycle_first_step_size=4)
    kw.update(cycle_min_mom=0.08, cycle_max_mom=0.09, decay_mom_rate=0.001, decay_step_size=4)
    adam, sgd = make_optimizer("adam"), make_optimizer("sgd")
    a, s = OneCycle(adam, **kw), OneCycle(sgd, **kw)
    moms: list[Any] = []
    for _ in range(12):
        moms.append(a.get_mom())
        assert s.get_mom() == [m for m, _ in moms[-1]]
        a.step()
        s.step()
        assert [adam.param_groups[0]["betas"]] == a.get_mom()
    assert moms[0] == [(0.09, 0.99)]
    assert moms[4] == [(0.08, 0.99)]  # the peak of the cycle: lowest momentum
    assert moms[11][0][0] > 0.09  # decay phase: momentum grows past max
    plain = torch.optim.Adagrad([torch.zeros(1, requires_grad=True)], lr=0.1)
    assert OneCycle(plain, **kw).get_mom() is None


def test_tensor_lr_updated_in_place():
    param = torch.zeros(1, requires_grad=True)
    opt = torch.optim.Adam([param], lr=torch.tensor(0.01))
    lr_tensor = opt.param_groups[0]["lr"]
    sched = WarmupLR(opt, warmup_min_lr=0.001, warmup_num_steps=5, warmup_type="linear")
    for _ in range(7):
        sched.step()
    assert opt.param_groups[0]["lr"] is lr_tensor
    assert float(lr_tensor) == pytest.approx(0.01)
    assert sched.get_last_lr() == [pytest.approx(0.01)]


def test_get_last_lr_before_any_value_raises():
    sched = WarmupLR(make_optimizer(), warmup_num_steps=5, last_batch_iteration=3)
    with pytest.raises(RuntimeError, match="step"):
        sched.get_last_lr()


def test_validation_errors():
    opt = make_optimizer()
    with pytest.raises(ValueError, match="warmup_num_steps"):
        WarmupLR(opt, warmup_num_steps=-1)
    with pytest.raises(ValueError, match="warmup_num_steps"):
        WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=2.5)  # type: ignore[arg-type]  # a float on purpose
    with pytest.raises(ValueError, match="cycle_first_step_size"):
        OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=0)
    with pytest.raises(ValueError, match="expected 1 values for warmup_max_lr"):
        WarmupLR(opt, warmup_max_lr=[0.1, 0.2])
    with pytest.raises(ValueError, match="lr_range_test_step_size"):
        LRRangeTest(opt, lr_range_test_step_size=0)


# ---------------------------------------------------------------- build_scheduler


def test_registry():
    assert set(SCHEDULERS) == {
        "WarmupLR",
        "WarmupDecayLR",
        "WarmupCosineLR",
        "OneCycle",
        "LRRangeTest",
    }


def test_build_resolves_auto():
    opt = make_optimizer(group_lrs=(0.02, 0.5))
    params = {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}
    sched = build_scheduler("WarmupLR", params, opt)
    assert isinstance(sched, WarmupLR)
    assert sched.min_lrs == [0.0, 0.0]
    assert sched.max_lrs == [0.02, 0.02]
    assert sched.warmup_num_steps == 2
    assert params["warmup_max_lr"] == "auto"  # caller's dict untouched

    opt = make_optimizer(group_lrs=(0.03,))
    cycle: Any = build_scheduler(
        "OneCycle",
        {"cycle_min_lr": 1e-4, "cycle_max_lr": "auto", "cycle_first_step_size": 5},
        opt,
    )
    assert cycle.max_lrs == [0.03]
    assert opt.param_groups[0]["lr"] == 1e-4

    sched = build_scheduler(
        "WarmupDecayLR", {"total_num_steps": 50, "warmup_max_lr": 0.1}, make_optimizer()
    )
    assert isinstance(sched, WarmupDecayLR) and sched.total_num_steps == 50


@pytest.mark.parametrize("type_name", ["WarmupDecayLR", "WarmupCosineLR"])
def test_build_total_num_steps_auto_raises(type_name):
    msg = (
        "scheduler.params.total_num_steps: 'auto' needs the number of training steps, "
        "which zeroshard cannot infer; set it"
    )
    with pytest.raises(ValueError) as info:
        build_scheduler(type_name, {"total_num_steps": "auto"}, make_optimizer())
    assert str(info.value) == msg


def test_build_errors():
    opt = make_optimizer()
    with pytest.raises(ValueError, match=r"scheduler\.type.*'CosineAnnealing'"):
        build_scheduler("CosineAnnealing", {}, opt)
    with pytest.raises(ValueError, match=r"scheduler\.params\.warmup_steps"):
        build_scheduler("WarmupLR", {"warmup_steps": 10}, opt)
    with pytest.raises(ValueError, match=r"scheduler\.params\.total_num_steps: required"):
        build_scheduler("WarmupCosineLR", {}, opt)
    with pytest.raises(ValueError, match=r"scheduler\.params\.cycle_min_lr: 'auto'"):
        build_scheduler("OneCycle", {"cycle_min_lr": "auto", "cycle_max_lr": 1.0}, opt)


def test_build_defaults_match_direct_construction():
    a, b = make_optimizer(), make_optimizer()
    built = build_scheduler("WarmupCosineLR", {"total_num_steps": 40, "warmup_num_steps": 8}, a)
    direct = WarmupCosineLR(b, total_num_steps=40, warmup_num_steps=8)
    for _ in range(50):
        built.step()
        direct.step()
        assert a.param_groups[0]["lr"] == b.param_groups[0]["lr"]
    assert math.isclose(a.param_groups[0]["lr"], 0.05 * 0.0001)
