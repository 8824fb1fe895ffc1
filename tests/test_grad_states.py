"""The gradient reducer's transition tables (zeroshard/zero/grads/states.py), walked by
real engines on 4 gloo ranks (one spawn): stages 0, 1, 2, 3, hybrid stage 1 (2
replicas x 2 shards, for the replicas' all-reduce) and stage 2 with the optimizer
offloaded under the fake device runtime (the micro-steps before the boundary held on
the device: phase BACKWARD_HOLDING, window ON_DEVICE); and stages 0, 2 and 3 again with
a DeepSpeed MoE layer over ep 2 (expert segments reduced over the expert-data-parallel
group), which must take the very rows of the dense walk. Each engine runs the same call
sequence, the orders a user (or accelerate, or the pipeline engine) makes: steps with
no backward, two backwards per step, the boundary unset and set again, a step right
after an unset backward, zero_grad mid-window, a backward that raises, the pipeline's
flush and tied-gradient sums. Every move is recorded; the test asserts that every row
of every table was taken (a row no sequence reaches is dead, or the walk is missing a
case) and that each illegal order a tired user makes ends in a named error. Removing
a row from a table makes the walk raise InternalError at that row (mutation check).
The numbers of these orders are checked against torch in test_grad_arrivals.py.
"""

from __future__ import annotations

import contextlib
import functools

import cases
import multirank
import pytest
import torch
from state_walks import error_of, row_key
from torch import nn
from torch.utils.checkpoint import checkpoint

from zeroshard.zero.grads import states

WORLD = 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 2)
        self.extra = nn.Parameter(torch.zeros(2))  # used only when asked

    def forward(self, x, *, extra: bool = False, reentrant: bool = False):
        h = self.fc1(x)
        if reentrant:  # fc1 inside a reentrant checkpoint and again outside: two arrivals
            h = checkpoint(self.fc1, h, use_reentrant=True)
        out = self.fc2(torch.tanh(h))
        return out + self.extra if extra else out


class MoENet(Net):
    """Net with a DeepSpeed MoE layer of two experts split over ep 2 (one per rank):
    the expert segments are reduced over the expert-data-parallel ranks."""

    def __init__(self) -> None:
        super().__init__()
        from zeroshard.moe.layer import MoE

        self.moe = MoE(4, nn.Linear(4, 4), num_experts=2, ep_size=2, drop_tokens=False, min_capacity=0)  # fmt: skip

    def forward(self, x, *, extra: bool = False, reentrant: bool = False):
        h = self.fc1(x)
        h = h + self.moe(h)[0]
        if reentrant:
            h = checkpoint(self.fc1, h, use_reentrant=True)
        out = self.fc2(torch.tanh(h))
        return out + self.extra if extra else out


class _Boom(torch.autograd.Function):
    """Identity forward; its backward raises (a backward that fails on every rank)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ArithmeticError("boom")


def _walk(rank: int, stage: int, mics: int, offload: bool, experts: bool = False) -> dict:
    from zeroshard.distributed import device
    from zeroshard.distributed.fake_device import FakeRuntime

    # offload: a device apart from the host (the fake runtime), so the reducer stages
    with device.use(FakeRuntime()) if offload else contextlib.nullcontext():
        return _walk_on(rank, stage, mics, offload, experts)


def _walk_on(rank: int, stage: int, mics: int, offload: bool, experts: bool) -> dict:
    import zeroshard

    torch.manual_seed(0)
    model = MoENet() if experts else Net()
    zc: dict = {"stage": stage, "stage3_param_persistence_threshold": 0, "mics_shard_size": mics}
    if offload:
        zc["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": zc,
        "steps_per_print": 10**6,
    }
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    r = engine.reducer
    seen: set[str] = set()
    r.on_transition = lambda machine, key: seen.add(row_key(machine, key))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    full = not r.sharded

    def loss(**kw):
        return engine(x, **kw).pow(2).mean()

    def boundary(b: bool) -> None:
        engine.set_gradient_accumulation_boundary(b)

    engine.zero_grad()  # EMPTY -> EMPTY
    boundary(True)
    engine.step()  # a step with no backward: zero gradients
    engine.backward(loss())  # reduces; ``extra`` got nothing: its slot is zeroed
    engine.backward(loss(extra=True))  # a second backward after the reduction
    engine.step()
    boundary(False)
    engine.backward(loss())  # local sums
    engine.backward(loss())
    boundary(True)
    engine.backward(loss())  # reduces the window's local sums
    engine.step()
    boundary(False)
    engine.backward(loss())
    boundary(True)
    engine.step()  # right after an unset backward: the step reduces first
    boundary(False)
    engine.backward(loss())
    engine.zero_grad()  # drops the window's local sums
    # the pipeline engine's calls: flush after its backwards, tied gradients before
    r.flush()
    r.flush()
    engine.zero_grad()
    engine.backward(loss())
    r.flush()  # offload: lands the sum held on the device
    r.flush()
    engine.zero_grad()
    if full:
        r.local_grad(0)
        engine.backward(loss())
        r.local_grad(0)
        engine.zero_grad()
    if stage < 3:  # stage 3 reduces fc1's unit at its first arrival (refused by name)
        boundary(True)
        engine.backward(loss(reentrant=True))
        engine.step()
    for b in (False, True):  # a backward that raises on every rank, then a new window
        boundary(b)
        # ``extra`` used: stage 3's graph walk launches no bucket before the raise
        with contextlib.suppress(ArithmeticError):
            engine.backward(_Boom.apply(loss(extra=True)))
        engine.zero_grad()
    boundary(True)
    engine.backward(loss())
    engine.step()

    # orders a tired user makes, each a named error; the reducer goes on afterwards
    errors = {
        "loss.backward()": error_of(lambda: loss().backward()),
        "finish without begin": error_of(r.finish),
    }
    engine.zero_grad()
    r.begin(True)
    errors["begin twice"] = error_of(lambda: r.begin(True))
    r.abandon()
    engine.backward(loss())
    errors["local_grad after the reduction"] = error_of(lambda: r.local_grad(0))
    errors["step inside a backward"] = error_of(lambda: _step_inside(engine, loss))
    engine.zero_grad()
    engine.backward(loss())
    engine.step()
    return {"seen": sorted(seen), "errors": errors}


def _step_inside(engine, loss) -> None:
    """The step's finalize from a gradient hook, while backward runs (before any
    parameter's gradient: nothing is launched)."""
    out = loss(extra=True)
    out.register_hook(lambda g: engine.reducer.finalize())
    engine.backward(out)


CASES = [(0, -1, False), (1, -1, False), (2, -1, False), (3, -1, False), (1, 2, False), (2, -1, True)]  # fmt: skip
# rows only a window held on the device takes (optimizer offload, sharded gradients)
HELD = {"ON_DEVICE", "FINISH_HOLDING", "BACKWARD_HOLDING"}


# stages walked again with expert parallelism (ep 2 x dp 2): the same calls, each bucket
# reduced over the group of its segment's kind
MOE_STAGES = [0, 2, 3]


def _dense(case: tuple) -> str:
    stage, mics, offload = case
    return f"stage={stage} mics={mics} offload={offload}"


def _moe(stage: int) -> str:
    return f"moe stage={stage}"


NAMES = [*(_dense(c) for c in CASES), *(_moe(s) for s in MOE_STAGES)]


def _worker(rank: int, world: int) -> dict:
    return cases.run_named(
        [
            *((_dense(c), functools.partial(_walk, rank, *c)) for c in CASES),
            *(
                (_moe(s), functools.partial(_walk, rank, s, -1, False, experts=True))
                for s in MOE_STAGES
            ),
        ]
    )


@pytest.fixture(scope="module")
def walked():
    return multirank.run(_worker, WORLD, timeout=600)


def _rows() -> set[str]:
    return {row_key(m, k) for m, table in states.MACHINES.items() for k in table}


def test_every_transition_is_taken(walked):
    per_rank = cases.by_rank(walked, *NAMES)
    seen = {k for per in per_rank for case in per.values() for k in case["seen"]}
    missing = sorted(_rows() - seen)
    assert not missing, f"rows no engine sequence reached: {missing}"
    assert seen <= _rows()


def test_each_mode_takes_its_window_rows(walked, subtests):
    """Per mode, the walk takes every window row of that mode (the rows of a window
    held on the device: with offload only, and never without it)."""
    by_name = {_dense(c): c for c in CASES}

    def check(name: str, per_rank: list) -> None:
        stage, mics, offload = by_name[name]
        case = per_rank[0]
        mode = {0: "REPLICATED", 1: "PARTITIONED"}.get(stage, "SHARDED")
        held = {r for r in _rows() if HELD & set(r.split(":")[1].split(","))}
        want = {r for r in _rows() if r.startswith(f"window:{mode},")}
        want = want if offload else want - held
        seen = set(case["seen"])
        assert want <= seen, (stage, mics, offload, sorted(want - seen))
        assert offload or not held & seen, (stage, mics, sorted(held & seen))

    cases.check_each(subtests, walked, check, names=list(by_name))


def test_illegal_orders_are_named_errors(walked, subtests):
    by_name = {_dense(c): c for c in CASES}

    def check(name: str, per_rank: list) -> None:
        stage = by_name[name][0]
        e = per_rank[0]["errors"]
        assert e["loss.backward()"][0] == "UsageError", e
        assert "outside engine.backward()" in e["loss.backward()"][1]
        assert e["finish without begin"][0] == "InternalError", e
        assert "no phase transition from (IDLE) on FINISH" in e["finish without begin"][1]
        assert e["begin twice"][0] == "InternalError", e
        assert "on BEGIN_REDUCING" in e["begin twice"][1]
        tied = e["local_grad after the reduction"]
        assert tied[0] == "InternalError", e
        mode = "SHARDED, ACCUMULATED" if stage >= 2 else "PARTITIONED, REDUCED"
        mode = "REPLICATED, REDUCED" if stage == 0 else mode
        assert f"no window transition from ({mode}) on TIED" in tied[1], (stage, tied)
        inside = e["step inside a backward"]
        assert inside[0] == "InternalError", (stage, inside)
        assert "from (BACKWARD_REDUCING) on FINALIZE" in inside[1], (stage, inside)

    cases.check_each(subtests, walked, check, names=list(by_name))


def test_experts_take_the_moves_of_the_dense_walk(walked):
    """With expert parallelism every rank makes the same calls and moves as without it
    (the kind picks a segment's group, not a state); the same orders are the same named
    errors."""
    for per in cases.by_rank(walked, *NAMES):
        dense = {c[0]: per[_dense(c)] for c in CASES if c[1:] == (-1, False)}
        for stage, moe in ((s, per[_moe(s)]) for s in MOE_STAGES):
            assert moe["seen"] == dense[stage]["seen"], (stage, sorted(set(moe["seen"]) ^ set(dense[stage]["seen"])))  # fmt: skip
            assert moe["errors"] == dense[stage]["errors"], stage


def test_tables_stay_inside_each_mode() -> None:
    """No process: a sharded window never holds local sums, a full one never an
    accumulated shard, and every action is one the reducer runs."""
    from zeroshard.zero.grads.states import WINDOW, Mode, Window

    full = {Window.EMPTY, Window.LOCAL, Window.REDUCED}
    sharded = {Window.EMPTY, Window.ACCUMULATED, Window.ON_DEVICE}
    actions = {states.NONE, states.RESTATE, states.REDUCE, states.ZERO, states.CLEAR}
    actions |= {states.LAND, states.RESCALE}
    for (mode, state, _), (nxt, action) in WINDOW.items():
        allowed = sharded if mode is Mode.SHARDED else full
        assert {state, nxt} <= allowed, (mode, state, nxt)
        assert action in actions
        assert action != states.RESTATE or mode is Mode.PARTITIONED
        assert action != states.RESCALE or mode is Mode.REPLICATED
        # only a window held on the device lands, and it always does before a read
        assert (action == states.LAND) == (
            state is Window.ON_DEVICE
            and nxt is not state
            and _ in (states.Event.FLUSH, states.Event.FINALIZE)
        ), (mode, state, _)
