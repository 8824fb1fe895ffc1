"""Non-finite steps (issue 15): a NaN or inf in the loss or the gradients (one element
of one parameter, the loss finite) on one rank
skips the step on every rank (fp32, bf16; with or without clipping; every ZeRO stage),
is counted and logged, and training goes on exactly as if that step had not happened;
``nonfinite_gradients: "raise"`` raises on every rank instead; fp16 overflowing at its
minimum loss scale raises instead of skipping forever. One 2-rank spawn."""

from __future__ import annotations

import functools
from typing import Any

import cases
import multirank
import parity
import pytest
import torch

TOL = parity.TOL
BAD_STEP = 1  # the step whose loss is NaN on rank 1


def _train(case: dict, rank: int, world: int) -> dict:
    """Train 4 steps; at BAD_STEP rank 1 multiplies its loss by NaN (or inf)."""
    import zeroshard

    model = parity.build_model(case)
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=parity.param_groups(model), config=parity.ds_config(case)
    )
    applied, errors = [], []
    at = {"step": -1}
    if "grad_poison" in case and rank == 1:  # one inf gradient element, the loss finite
        trainable = [p for p in model.parameters() if p.requires_grad]
        target = trainable[case["grad_poison"]]

        def poison(g):
            if at["step"] != BAD_STEP:
                return g
            g = g.clone()
            g.view(-1)[g.numel() // 2] = float("inf")
            return g

        target.register_hook(poison)
    for step in range(4):
        at["step"] = step
        x, y = parity.batch(step, 2 * world)
        loss = engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
        if step == BAD_STEP and rank == 1 and "grad_poison" not in case:
            loss = loss * case.get("poison", float("nan"))
        engine.backward(loss)
        try:
            engine.step()
        except FloatingPointError as exc:
            errors.append(str(exc))
            break
        applied.append(engine.was_step_applied())
    return {
        "applied": applied,
        "skipped": engine.skipped_steps,
        "errors": errors,
        "params": {n: t.tolist() for n, t in parity.full_params(engine).items()},
    }


def _reference_without_bad_step(case: dict, world: int) -> dict[str, torch.Tensor]:
    """Single-process torch that never takes step BAD_STEP."""
    model = parity.build_model(case)
    _, cls, kwargs = parity.OPTS[case.get("opt", "AdamW")]
    groups = [g for g in parity.param_groups(model) if any(p.requires_grad for p in g["params"])]
    opt = cls(groups, lr=parity.LR, **kwargs)
    for step in range(4):
        x, y = parity.batch(step, 2 * world)
        model(x, y).backward()
        if case.get("clip"):
            torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.requires_grad], case["clip"]
            )
        if step != BAD_STEP:
            opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _fp16_stuck(rank: int, world: int) -> list[str]:
    """fp16 whose gradients overflow at every step (an inf in the loss)."""
    import zeroshard

    case = {"stage": 1, "dtype": "fp16"}
    cfg = parity.ds_config(case)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 3, "hysteresis": 2, "min_loss_scale": 1}
    model = parity.build_model(case)
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=parity.param_groups(model), config=cfg
    )
    x, y = parity.batch(0, 2 * world)
    for _ in range(50):
        loss = engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]) * float("inf")
        engine.backward(loss)
        try:
            engine.step()
        except FloatingPointError as exc:
            return [str(exc), str(engine.skipped_steps)]
    return []


CASES: list[dict[str, Any]] = [
    {"stage": stage, "clip": clip, "frozen": False} for stage in (0, 1, 2, 3) for clip in (0.0, 1.0)
] + [
    # stage 0 checks 1/N of the all-reduced gradient per rank: the first and the last
    # trainable parameter lie in different ranks' shares
    {"stage": 0, "grad_poison": 0, "frozen": False},
    {"stage": 0, "grad_poison": -1, "frozen": False, "clip": 1.0},
    {"stage": 1, "grad_poison": -1, "frozen": False},
    {"stage": 2, "dtype": "bf16"},
    {"stage": 3, "dtype": "bf16", "clip": 1.0, "poison": float("inf")},
    {"stage": 2, "extra": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}},
    {"stage": 1, "extra": {"nonfinite_gradients": "raise"}},
    {
        "stage": 2,
        "dtype": "bf16",
        "extra": {"bf16": {"enabled": True, "check_grad_overflow": False}},
    },
]


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return cases.run_named(
        [
            *((cases.label(c), functools.partial(_train, c, rank, world)) for c in CASES),
            ("fp16", lambda: _fp16_stuck(rank, world)),
        ]
    )


@pytest.fixture(scope="module")
def results():
    return multirank.run(_worker, 2, timeout=600)


def test_a_nan_on_one_rank_skips_the_step_everywhere(results, subtests):
    by_name = {cases.label(c): c for c in CASES[:-2]}

    def check(name: str, per_rank: list) -> None:
        case = by_name[name]
        ref = _reference_without_bad_step(case, 2)
        for got in per_rank:
            assert got["applied"] == [True, False, True, True], (case, got["applied"])
            assert got["skipped"] == 1, case
            diff = max((torch.tensor(got["params"][n]) - ref[n]).abs().max().item() for n in ref)
            tol = parity.BF16_TOL[1] if case.get("dtype") == "bf16" else TOL
            assert diff <= tol, (case, diff)

    cases.check_each(subtests, results, check, names=list(by_name))


def test_policy_raise_and_apply(results):
    raise_, apply = (cases.label(c) for c in CASES[-2:])
    for r in cases.by_rank(results, raise_, apply):
        raised = r[raise_]
        assert raised["errors"] and "nonfinite_gradients" in raised["errors"][0], raised
        applied = r[apply]  # check_grad_overflow false: DeepSpeed's way
        assert applied["applied"][BAD_STEP] is True and applied["skipped"] == 0
        assert any(v != v for vals in applied["params"].values() for v in _flat(vals))  # NaN


def _flat(v):
    return [x for sub in v for x in _flat(sub)] if isinstance(v, list) else [v]


def test_fp16_at_its_minimum_scale_raises(results):
    for message, skipped in cases.values(results, "fp16"):
        assert "min_loss_scale" in message and "bf16" in message, message
        assert int(skipped) >= 3  # 8 -> 4 -> 2 -> 1, with hysteresis 2
