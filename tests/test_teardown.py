"""Teardown: ``engine.destroy()`` removes every hook and leaves the model whole and
usable; ``initialize`` a second time on the same model tears the first engine down, so
the hook counts equal those of one ``initialize``. One 2-rank spawn runs every case."""

from __future__ import annotations

import functools

import cases
import multirank
import parity
import pytest
import torch

TOL = parity.TOL


def _hook_counts(model: torch.nn.Module) -> dict[str, int]:
    mods = list(model.modules())
    return {
        "forward_pre": sum(len(m._forward_pre_hooks) for m in mods),
        "forward": sum(len(m._forward_hooks) for m in mods),
        "grad": sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()),
        "tracked": sum(type(m._parameters) is not dict for m in mods),
    }


def _case(stage: int, dtype: str, offload: bool) -> dict:
    z: dict = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
    if offload:
        z["offload_optimizer"] = {"device": "cpu"}
    return {"stage": stage, "dtype": dtype, "staged": offload, "extra": {"zero_optimization": z}}


REINIT = [
    (0, "bf16", False),
    (1, "fp32", True),
    (2, "bf16", False),
    (3, "bf16", False),
    (3, "fp32", True),
]


def _reinit(rank: int, world: int, stage: int, dtype: str, offload: bool) -> dict:
    import zeroshard

    case = {**_case(stage, dtype, offload), "steps": 2}
    _, first = parity.train(case, rank, world)
    model = first.module
    once = _hook_counts(model)
    before = parity.full_params(first)
    # a second initialize on the same model, without destroy()
    cfg = parity.ds_config(case)
    second, *_ = zeroshard.initialize(
        model=model, model_parameters=parity.param_groups(model), config=cfg
    )
    twice = _hook_counts(model)
    stale = ""
    try:
        first.step()
    except RuntimeError as exc:
        stale = str(exc)
    kept = parity.max_param_diff(parity.full_params(second), before)
    # the second engine trains
    x, y = parity.batch(7, 2 * world)
    second.backward(second(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
    second.step()
    trained = parity.max_param_diff(parity.full_params(second), before)
    # destroy: no hooks left, parameters whole, plain torch runs on them
    whole = parity.full_params(second)
    second.destroy()
    gone = _hook_counts(model)
    plain = {n: p.detach().float() for n, p in model.named_parameters()}
    loss = model(x[:2], y[:2]).float().item()
    return {
        "case": [stage, dtype, offload],
        "once": once,
        "twice": twice,
        "gone": gone,
        "stale": stale,
        "kept": kept,
        "trained": trained,
        "destroyed_equal": parity.max_param_diff(plain, whole),
        "loss_finite": bool(torch.isfinite(torch.tensor(loss))),
    }


def _name(stage: int, dtype: str, offload: bool) -> str:
    return f"stage={stage} {dtype} offload={offload}"


def _worker(rank: int, world: int) -> dict:
    return cases.run_named((_name(*c), functools.partial(_reinit, rank, world, *c)) for c in REINIT)


def _misuse(rank: int, world: int) -> list[str]:
    """loss.backward() and optimizer.step() on an engine: errors naming the right calls."""
    out = []
    _, engine = parity.train({"stage": 2, "steps": 1}, rank, world)
    x, y = parity.batch(3, 2 * world)
    try:
        engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]).backward()
    except RuntimeError as exc:
        out.append(str(exc))
    try:
        engine.optimizer.step()
    except RuntimeError as exc:
        out.append(str(exc))
    return out


def test_misuse_is_named_at_its_first_occurrence() -> None:
    for backward, step in multirank.run(_misuse, 2, timeout=300):
        assert "engine.backward(loss)" in backward and "not loss.backward()" in backward
        assert "call engine.step()" in step


def _check_reinit(name: str, per_rank: list) -> None:
    for r in per_rank:
        assert r["once"] == r["twice"], r
        assert r["once"]["grad"] > 0, r  # the reducer's hooks were there
        assert r["gone"] == {"forward_pre": 0, "forward": 0, "grad": 0, "tracked": 0}, r
        assert "destroyed" in r["stale"], r
        assert r["kept"] == 0.0 and r["trained"] > 0, r
        assert r["destroyed_equal"] == 0.0 and r["loss_finite"], r


def test_reinitialize_and_destroy(subtests: pytest.Subtests) -> None:
    results = multirank.run(_worker, 2, timeout=300)
    cases.check_each(subtests, results, _check_reinit, names=[_name(*c) for c in REINIT])


def test_failed_initialize_leaves_no_hooks(tmp_path) -> None:
    """An initialize() that fails once the reducer and the stage-3 gatherer are built
    (here: NVMe optimizer offload with an optimizer of the user's, refused when the
    optimizer is made) removes their hooks, so the model trains under the next
    initialize() (it used to keep them: the retry's backward failed with 'a gradient
    arrived outside engine.backward()')."""
    import zeroshard
    from zeroshard.config import ConfigError

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    zc = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}
    refused = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zc}
    user_optimizer = torch.optim.AdamW(model.parameters())
    try:
        zeroshard.initialize(model=model, optimizer=user_optimizer, config=refused)
    except ConfigError as exc:
        assert "pass no optimizer to initialize()" in str(exc), exc
    else:
        raise AssertionError("initialize() did not refuse a user's optimizer with NVMe offload")
    assert _hook_counts(model) == {"forward_pre": 0, "forward": 0, "grad": 0, "tracked": 0}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3},
    }
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    engine.backward(engine(torch.randn(2, 8)).sum())
    engine.step()
    assert engine.global_steps == 1 and engine.was_step_applied()
    engine.destroy()
