"""ZeRO-Offload's one-step delayed parameter update (offload_optimizer.delayed_update).

Against a hand-written single-process reference of the rule zeroshard builds (masters
``m``, the parameters ``w_t`` step t's gradient is taken at, warm-up ``W``)::

    m_{t+1} = AdamW step of m_t with g_t = grad(w_t)  (clipped on g_t)
    w_t = m_t for t <= W,  w_t = m_{t-1} for t > W

at stages 1-3 on 2 ranks, accumulation 1 and 2, on the CPU path and the GPU code path on
CPU (``staged``); a checkpoint saved right after a delayed step holds the step applied
and resumes identically; combinations not built are refused naming the key. The default
(off) is covered, unchanged, by tests/test_offload.py.
"""

from __future__ import annotations

import functools
import os
import tempfile
from typing import Any

import cases
import multirank
import parity
import pytest
import torch

from zeroshard.config import ConfigError, load_config

AFTER = 2  # exact warm-up steps in these tests
STEPS = 6
SCHED = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-3, "warmup_num_steps": 4, "warmup_type": "linear"}}  # fmt: skip


def _offload(**extra) -> dict:
    off = {"device": "cpu", "delayed_update": True, "delayed_update_after": AFTER}
    return {"zero_optimization": {"offload_optimizer": off, **extra}}


def _cases() -> list[dict]:
    out: list[dict[str, Any]] = []
    for stage in (1, 2, 3):
        for gas in (1, 2):
            case = {"stage": stage, "gas": gas, "micro": 1, "clip": 1.0, "steps": STEPS}
            out.append({**case, "extra": _offload(), "staged": gas == 2})
    # an lr schedule: step t must use the lr of step t, not the one set after it
    sched = {"stage": 2, "gas": 1, "micro": 2, "steps": STEPS, "staged": True}
    out.append({**sched, "extra": {**_offload(), "scheduler": SCHED}})
    # a client torch optimizer (the twin is made of it)
    out.append(
        {"stage": 1, "gas": 1, "micro": 2, "steps": STEPS, "client": True, "extra": _offload()}
    )
    param = {"offload_param": {"device": "cpu"}, "stage3_param_persistence_threshold": 0}
    out.append({"stage": 3, "gas": 2, "micro": 1, "steps": STEPS, "extra": _offload(**param)})
    return out


def delayed_reference(
    case: dict, world: int, after: int = AFTER, skip=(), landed=()
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process fp32 AdamW on the whole global batch, under the delayed rule.
    Returns per-step losses and the final masters (every step applied); ``after``
    large: the exact (undelayed) run. Steps in ``skip`` are skipped (inf/nan); after
    steps in ``landed`` a sync point (an eval forward) lands the step in flight."""
    from zeroshard.runtime.schedulers import build_scheduler

    work, master = parity.build_model(case), parity.build_model(case)
    lr = case.get("lr", parity.LR)
    groups = [g for g in parity.param_groups(master, lr=lr) if g["params"]]
    opt = torch.optim.AdamW(groups, lr=lr)
    sched = case["extra"].get("scheduler")
    if sched is not None:
        sched = build_scheduler(sched["type"], sched["params"], opt)
    if case.get("torch_sched"):
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _ramp)
    mp, wp = list(master.parameters()), list(work.parameters())
    rows = case.get("micro", 2) * case.get("gas", 1) * world

    def land() -> None:  # the parameters take the masters' values
        with torch.no_grad():
            for w, m in zip(wp, mp, strict=True):
                w.copy_(m)

    losses = []
    for step in range(case["steps"]):
        x, y = parity.batch(step, rows)
        loss = work(x, y)  # at w_t
        loss.backward()
        losses.append(loss.item())
        for m, w in zip(mp, wp, strict=True):
            m.grad = None if w.grad is None else w.grad.clone()
            w.grad = None
        land()  # the boundary: the step in flight lands first
        if step in skip:
            opt.zero_grad()
            continue
        trainable = [p for p in mp if p.requires_grad]
        if case.get("clip", 0.0) > 0:
            torch.nn.utils.clip_grad_norm_(trainable, case["clip"])
        opt.step()  # m_{t+1}
        opt.zero_grad()
        if sched is not None:
            sched.step()
        if step < after or step in landed:  # exact: w_{t+1} = m_{t+1}; else it stays m_t
            land()
    return losses, {n: p.detach().clone() for n, p in master.named_parameters()}


def _parity_case(rank: int, world: int, case: dict) -> dict:
    losses, engine = parity.train(case, rank, world)
    assert engine._delayed is not None and engine._delayed.in_flight  # step 5 in flight
    got = parity.full_params(engine)  # GatheredParameters: lands the last step
    ref_losses, ref = delayed_reference(case, world)
    exact_losses, _ = delayed_reference(case, world, after=10**9)
    out = {
        "losses": losses,
        "ref_losses": ref_losses,
        "exact_losses": exact_losses,
        "param_diff": parity.max_param_diff(got, ref),
        "movement": parity.max_param_diff(ref, parity.initial_params(case)),
    }
    engine.destroy()
    return out


def _parity(rank, world, case_list):
    return cases.run_named(
        (parity.case_name(c), functools.partial(_parity_case, rank, world, c)) for c in case_list
    )


def _check_delayed(case: dict, per_rank: list) -> None:
    losses = [sum(r["losses"][s] for r in per_rank) / 2 for s in range(STEPS)]
    r0 = per_rank[0]
    loss_diff = max(abs(a - b) for a, b in zip(losses, r0["ref_losses"], strict=True))
    param_diff = max(r["param_diff"] for r in per_rank)
    # the warm-up is exact; after it the delay changes the losses (a real delay)
    diffs = [abs(a - b) for a, b in zip(losses, r0["exact_losses"], strict=True)]
    exact, early = max(diffs), max(diffs[: AFTER + 1])
    ok = loss_diff <= parity.TOL and param_diff <= parity.TOL and r0["movement"] > 1e-3
    assert ok and early <= parity.TOL and exact > 50 * parity.TOL, (
        f"{case}: loss {loss_diff:.3g} param {param_diff:.3g} vs exact {exact:.3g} "
        f"(first {AFTER + 1} steps {early:.3g})"
    )


def test_delayed_update_follows_the_delayed_rule(subtests: pytest.Subtests) -> None:
    by_name = {parity.case_name(c): c for c in _cases()}
    results = multirank.run(_parity, 2, list(by_name.values()), timeout=600)
    check = lambda name, per_rank: _check_delayed(by_name[name], per_rank)  # noqa: E731
    cases.check_each(subtests, results, check, names=list(by_name))


def _ramp(step: int) -> float:
    return (step + 1) / 3


def _torch_scheduler(rank, world):
    """A client torch LR scheduler (it wraps ``optimizer.step`` on the instance): the
    thread still steps with the lr of its own step."""
    import zeroshard
    from zeroshard.offload.staging import STAGE_ON_CPU_ENV

    case: dict[str, Any] = {
        "stage": 2,
        "gas": 1,
        "micro": 1,
        "clip": 1.0,
        "steps": STEPS,
        "torch_sched": True,
    }
    case["extra"] = _offload()
    model = parity.build_model(case)
    os.environ[STAGE_ON_CPU_ENV] = "1"
    engine, *_ = zeroshard.initialize(
        model=model,
        config=parity.ds_config(case),
        model_parameters=parity.param_groups(model),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _ramp),
    )
    os.environ.pop(STAGE_ON_CPU_ENV)
    losses = []
    for step in range(STEPS):
        x, y = parity.batch(step, world)
        loss = engine(x[rank : rank + 1], y[rank : rank + 1])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    ref_losses, ref = delayed_reference(case, world)
    diff = parity.max_param_diff(parity.full_params(engine), ref)
    return {"losses": losses, "ref_losses": ref_losses, "param_diff": diff}


def test_a_client_torch_scheduler_applies_to_its_own_step() -> None:
    results = multirank.run(_torch_scheduler, 2, timeout=300)
    for r in results:
        assert r["param_diff"] <= parity.TOL, r["param_diff"]
    for s in range(STEPS):
        mean = sum(r["losses"][s] for r in results) / 2
        assert abs(mean - results[0]["ref_losses"][s]) <= parity.TOL, (s, mean)


SKIP, EVAL = AFTER + 2, AFTER + 3


def _skip_and_eval(rank, world):
    """A non-finite loss on one rank at a delayed step: the step in flight lands, the
    bad one is skipped on every rank and never applied later; an eval forward after a
    delayed step lands it (the next step is exact)."""
    case: dict[str, Any] = {
        "stage": 2,
        "gas": 1,
        "micro": 1,
        "clip": 1.0,
        "steps": 0,
        "staged": True,
    }
    case["extra"] = _offload()
    _, engine = parity.train(case, rank, world)
    losses, in_flight = [], []
    for step in range(AFTER + 6):
        x, y = parity.batch(step, world)
        loss = engine(x[rank : rank + 1], y[rank : rank + 1])
        if step == SKIP and rank == 0:
            loss = loss * float("nan")
        engine.backward(loss)
        engine.step()
        in_flight.append(engine._delayed.in_flight)
        if step == EVAL:
            engine.eval()
            with torch.no_grad():
                engine(x[:1], y[:1])
            engine.train()
            in_flight[-1] = engine._delayed.in_flight
        losses.append(loss.item())
    case = {**case, "steps": len(losses)}
    ref_losses, ref = delayed_reference(case, world, skip={SKIP}, landed={EVAL})
    out: dict[str, Any] = {"losses": losses, "ref_losses": ref_losses, "in_flight": in_flight}
    out["param_diff"] = parity.max_param_diff(parity.full_params(engine), ref)
    out["skipped"] = engine.skipped_steps
    engine.destroy()
    out["fp16"] = _fp16_overflows(rank, world)
    return out


def _fp16_overflows(rank, world) -> dict:
    """fp16 from a loss scale that overflows at first: each overflowing step is skipped
    (and lowers the scale) before anything is launched; only applied steps are in
    flight, and the losses match those of the exact engine until the first delayed
    step changes the parameters they see."""
    runs = {}
    for delayed in (True, False):
        case: dict[str, Any] = {"stage": 2, "micro": 1, "steps": 9, "dtype": "fp16", "staged": True}
        case["extra"] = {"fp16": {"initial_scale_power": 22}}
        if delayed:
            case["extra"] |= _offload()
            case["extra"]["zero_optimization"]["offload_optimizer"]["delayed_update_after"] = 0
        else:
            case["extra"] |= {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
        _, engine = parity.train({**case, "steps": 0}, rank, world)
        losses, flight, applied, scales = [], [], [], []
        for step in range(case["steps"]):
            x, y = parity.batch(step, world)
            loss = engine(x[rank : rank + 1], y[rank : rank + 1])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            applied.append(engine.was_step_applied())
            flight.append(engine._delayed is not None and engine._delayed.in_flight)
            scales.append(engine.cur_scale)
        runs[delayed] = {"losses": losses, "applied": applied, "in_flight": flight}
        runs[delayed] |= {"scales": scales, "skipped": engine.skipped_steps}
        engine.destroy()
    return {"delayed": runs[True], "exact": runs[False]}


def test_skipped_step_is_never_applied_late_and_eval_lands() -> None:
    results = multirank.run(_skip_and_eval, 2, timeout=300)
    steps = len(results[0]["losses"])
    want = [AFTER <= s != SKIP and s != EVAL for s in range(steps)]
    for r in results:
        assert r["skipped"] == 1 and r["in_flight"] == want, r
        assert r["param_diff"] <= parity.TOL, r["param_diff"]
    for s in range(steps):
        if s != SKIP:
            mean = sum(r["losses"][s] for r in results) / 2
            assert abs(mean - results[0]["ref_losses"][s]) <= parity.TOL, (s, mean)
    for r in results:
        d, e = r["fp16"]["delayed"], r["fp16"]["exact"]
        assert d["skipped"] > 0 and d["in_flight"] == d["applied"], d
        first = d["applied"].index(True)  # the first (delayed) step the scale allowed
        assert d["applied"][: first + 1] == e["applied"][: first + 1], (d, e)
        assert d["scales"][: first + 1] == e["scales"][: first + 1], (d, e)
        # up to the first applied step every step saw the initial parameters; the next
        # one still does with the delay (the first update is in flight), not without
        assert d["losses"][: first + 1] == e["losses"][: first + 1], (d, e)
        assert d["losses"][first + 1] != e["losses"][first + 1], (d, e)


def _checkpoint(rank, world, root):
    """Save right after a delayed step; the checkpoint holds it applied, and a fresh
    engine loading it trains on exactly as the saving engine does."""
    case: dict[str, Any] = {"stage": 2, "gas": 1, "micro": 1, "clip": 1.0, "steps": AFTER + 2}
    case |= {"extra": _offload(), "staged": True}
    _, engine = parity.train(case, rank, world)
    assert engine._delayed.in_flight
    engine.save_checkpoint(root, tag="t")
    assert not engine._delayed.in_flight
    saved = parity.full_params(engine)
    _, ref = delayed_reference(case, world)
    more = {**case, "steps": 3}
    # the reference's masters after AFTER + 2 steps: every step applied
    out = {"saved_vs_ref": parity.max_param_diff(saved, ref)}
    first = _continue(engine, more, rank, world, start=case["steps"])
    fresh = {**case, "steps": 0}
    _, loaded = parity.train(fresh, rank, world)
    loaded.load_checkpoint(root, tag="t")
    out["loaded_vs_saved"] = parity.max_param_diff(parity.full_params(loaded), saved)
    second = _continue(loaded, more, rank, world, start=case["steps"])
    out["same_losses"] = first[0] == second[0]
    out["continued_diff"] = parity.max_param_diff(first[1], second[1])
    return out


def _continue(engine, case, rank, world, start):
    losses = []
    for step in range(start, start + case["steps"]):
        x, y = parity.batch(step, world)
        loss = engine(x[rank : rank + 1], y[rank : rank + 1])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = parity.full_params(engine)
    engine.destroy()
    return losses, params


def test_checkpoint_after_a_delayed_step_holds_it_and_resumes_identically() -> None:
    with tempfile.TemporaryDirectory() as root:
        for r in multirank.run(_checkpoint, 2, os.path.join(root, "ck"), timeout=300):
            assert r["saved_vs_ref"] <= parity.TOL, r["saved_vs_ref"]
            assert r["loaded_vs_saved"] == 0.0, r["loaded_vs_saved"]
            assert r["same_losses"] and r["continued_diff"] == 0.0, r


def _cfg(zero: dict, **top) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero, **top}


@pytest.mark.parametrize(
    "zero,top,match",
    [
        ({"stage": 2, "offload_optimizer": {"delayed_update": True}}, {}, 'needs device "cpu"'),
        (
            {
                "stage": 3,
                "offload_optimizer": {
                    "device": "nvme",
                    "nvme_path": "/tmp",
                    "delayed_update": True,
                },
            },
            {},
            'needs device "cpu"',
        ),
        (
            {
                "stage": 3,
                "offload_optimizer": {"device": "cpu", "delayed_update": True},
                "offload_param": {"device": "nvme", "nvme_path": "/tmp"},
            },
            {},
            "NVMe swap files",
        ),
        (
            {
                "stage": 2,
                "overlap_param_gather": True,
                "offload_optimizer": {"device": "cpu", "delayed_update": True},
            },
            {},
            "overlap_param_gather",
        ),
        (
            {"stage": 1, "offload_optimizer": {"device": "cpu", "delayed_update": True}},
            {"pipeline": {"stages": 2}},
            "pipeline parallelism",
        ),
    ],
)
def test_refused_combinations_name_the_key(zero, top, match) -> None:
    with pytest.raises(ConfigError, match=r"offload_optimizer\.delayed_update: ") as info:
        load_config(_cfg(zero, **top))
    assert match in str(info.value)


def test_delayed_update_is_off_by_default() -> None:
    off = load_config(_cfg({"stage": 2, "offload_optimizer": {"device": "cpu"}}))
    assert off.zero_optimization.offload_optimizer.delayed_update is False
