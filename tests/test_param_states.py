"""The stage-3 gatherer's transition tables (zeroshard/zero/params/states.py), walked by
real engines on 2 gloo ranks (one spawn). Four engines run the orders a user makes:

* plain: prefetching, persistent parameters, a forward that skips a module (its
  prefetched unit goes unused), GatheredParameters with and without modifier_rank and
  the re-gather that sees the edit, the whole model checkpointed (its forward re-run
  inside backward), the root called inside its own forward, a forward that raises and
  then an earlier loss's backward, teardown;
* reuse under a cap: units kept from forward to backward (DeepSpeed's default reuse
  distance), kept units evicted under ``stage3_max_live_parameters``, a forward without
  a backward and then a step (kept units released);
* prefetch under a cap, in a mispredicted order: a prefetched unit evicted;
* parameters in an NVMe swap file with one pool buffer, in a mispredicted order: a
  prefetch lands because the on-demand gather needs its buffer, and is claimed later.

Every move is recorded; the test asserts that every row of both tables was taken (a
row no sequence reaches is dead, or the walk is missing a case), that the live count
and the users stay consistent with the states at each probe, that values survive the
edits, and that illegal orders end in InternalError naming the state and the event.
Removing a row from a table makes the walk raise InternalError at that row (mutation
check; ``ZS_DROP_ROW=machine:STATE,EVENT`` drops one, to see it fail).
"""

from __future__ import annotations

import contextlib
import functools
import os

import cases
import multirank
import pytest
import torch
from state_walks import error_of, row_key
from torch import nn
from torch.utils.checkpoint import checkpoint

from zeroshard.zero.params import states

WORLD = 2


class Boom(Exception):
    """Raised inside a forward on every rank."""


class Net(nn.Module):
    """Units: the weights of emb (32 elements), a, b and c (64 each); the biases, head
    and scale are persistent (at most 20 elements each)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)
        self.scale = nn.Parameter(torch.ones(2))

    def forward(self, x, *, swap=False, skip=False, nested=False, boom=False):
        h = self.emb(x)
        for m in (self.b, self.a) if swap else (self.a, self.b):
            h = torch.tanh(m(h))
        if boom:
            raise Boom
        if not skip:
            h = torch.tanh(self.c(h))
        out = self.head(h) * self.scale
        return out + self(x) if nested else out


def _engine(rank: int, tmp: str, **zero):
    import zeroshard

    torch.manual_seed(0)
    model = Net()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 20,
            "stage3_prefetch_bucket_size": 10**6,
            "stage3_max_reuse_distance": 0,
            **zero,
        },
        "steps_per_print": 10**6,
    }
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine, model, engine.params


def _consistent(g) -> bool:
    """The live count is the states' (non-persistent units in a live state), and no unit
    has a user between engine calls unless a GatheredParameters block holds it."""
    u = g.units
    live = sum(u.numel[s] for s, st in enumerate(u.state) if st in states.LIVE)
    held = {s for s, st in enumerate(u.state) if st is states.UnitState.GATHERED}
    return live == u.live_numel and all(n == 0 or s in held for s, n in enumerate(u.users))


def _x(rank: int, step: int) -> torch.Tensor:
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def _plain(rank: int, tmp: str) -> dict:
    from zeroshard.zero import GatheredParameters
    from zeroshard.zero.params.states import Event

    engine, model, g = _engine(rank, tmp)
    out: dict = {"consistent": []}

    def train(step: int, **kw) -> None:
        engine.backward(engine(_x(rank, step), **kw).pow(2).mean())
        engine.step()
        out["consistent"].append(_consistent(g))

    train(0)  # records the orders, checks agreement
    train(1)  # prefetches along them
    train(2, skip=True)  # c prefetched, never asked for: released when the forward ends
    w = model.a.weight
    with GatheredParameters([w]):
        out["whole_inside"] = tuple(w.shape) == (8, 8) and w.untyped_storage().nbytes() > 0
        held = g.units.state.index(states.UnitState.GATHERED)  # the one unit held here
        out["evict_needed"] = error_of(lambda: g.units.move(held, Event.EVICT))
    out["released_after"] = w.untyped_storage().nbytes() == 0
    with GatheredParameters([w], modifier_rank=0), torch.no_grad():
        w.fill_(float(rank + 1))  # every rank writes; rank 0's values are kept
    train(3)  # the edited unit gathered again (then stepped by SGD)
    with GatheredParameters([w]):
        out["edit_seen"] = w.detach().clone().tolist()
    persistent = next(iter(g.persistent))
    out["fetch_persistent"] = error_of(lambda: g.units.move(persistent, Event.FETCH))
    out["end_without_begin"] = error_of(g.end_backward)
    g.begin_backward()
    out["begin_twice"] = error_of(g.begin_backward)
    g.end_backward()
    # the whole model checkpointed: its forward re-runs inside backward
    x = _x(rank, 4).requires_grad_()
    engine.backward(checkpoint(engine.module, x, use_reentrant=True).pow(2).mean())
    engine.step()
    train(5, nested=True)  # the root called inside its own forward
    loss = engine(_x(rank, 6)).pow(2).mean()
    with contextlib.suppress(Boom):
        engine(_x(rank, 7), boom=True)  # raises on every rank before its end
    engine.backward(loss)  # an earlier loss's backward after the raise
    engine.step()
    train(8)
    out["consistent"].append(_consistent(g))
    engine.destroy()
    out["detached"] = sorted({st.name for st in g.units.state})
    return out


def _reuse_capped(rank: int, tmp: str) -> dict:
    engine, _, g = _engine(
        rank,
        tmp,
        stage3_prefetch_bucket_size=0,
        stage3_max_reuse_distance=10**9,
        stage3_max_live_parameters=130,  # emb and a kept, then emb goes for b
    )
    consistent, peaks = [], []
    for step in range(3):
        g.reset_stats()
        engine.backward(engine(_x(rank, step)).pow(2).mean())
        peaks.append(g.stats()["peak_live_numel"])
        engine.step()
        consistent.append(_consistent(g))
    engine(_x(rank, 9)).pow(2).mean()  # a forward without a backward keeps its units
    kept = len(g.kept_units())
    engine.step()  # the shards change: kept units are released
    consistent.append(_consistent(g) and not g.kept_units())
    engine.destroy()
    return {"consistent": consistent, "peaks": peaks, "kept_before_step": kept}


def _mispredicted(rank: int, tmp: str, **zero) -> dict:
    engine, _, g = _engine(rank, tmp, **zero)
    consistent = []
    for step in range(4):  # recorded a, b; then asked for b, a
        engine.backward(engine(_x(rank, step), swap=step % 2 == 1).pow(2).mean())
        engine.step()
        consistent.append(_consistent(g))
    engine.destroy()
    return {"consistent": consistent}


def _worker(rank: int, world: int, tmp: str) -> dict:
    drop = os.environ.get("ZS_DROP_ROW")  # the mutation check by hand: one row less
    if drop:
        machine = drop.split(":")[0]
        table = states.MACHINES[machine]
        del table[next(k for k in table if row_key(machine, k) == drop)]
    seen: set[str] = set()
    step = states.step

    def recorded(machine: str, key: tuple):  # every move of every engine, start-up included
        out = step(machine, key)
        seen.add(row_key(machine, key))
        return out

    states.step = recorded  # this rank's process only
    engines = {
        "plain": lambda: _plain(rank, tmp),
        "reuse": lambda: _reuse_capped(rank, tmp),
        # emb + a fit under the cap, a + b do not: the prefetched a goes for b
        "spec": lambda: _mispredicted(rank, tmp, stage3_max_live_parameters=100),
        "nvme": lambda: _mispredicted(
            rank, tmp, offload_param={"device": "nvme", "nvme_path": tmp, "buffer_count": 1}
        ),
    }

    def walk(engine) -> dict:
        seen.clear()
        return {**engine(), "seen": sorted(seen)}

    try:
        return cases.run_named(
            (name, functools.partial(walk, engine)) for name, engine in engines.items()
        )
    finally:
        states.step = step


NAMES = ("plain", "reuse", "spec", "nvme")


@pytest.fixture(scope="module")
def walked(tmp_path_factory):
    return multirank.run(_worker, WORLD, str(tmp_path_factory.mktemp("swap")), timeout=600)


def _rows() -> set[str]:
    return {row_key(m, k) for m, table in states.MACHINES.items() for k in table}


def test_every_transition_is_taken(walked):
    per_rank = cases.by_rank(walked, *NAMES)
    seen = {k for r in per_rank for case in r.values() for k in case["seen"]}
    missing = sorted(_rows() - seen)
    assert not missing, f"rows no engine sequence reached: {missing}"
    assert seen <= _rows()


def test_each_engine_takes_what_it_is_for(walked, subtests):
    """The rows each engine was built to reach, reached there (a change of the model or
    config that silently stops reaching them fails here, naming the engine)."""
    want = {
        "plain": {"unit:PREFETCHED,RELEASE", "unit:PERSISTENT,DETACH", "phase:IDLE,FORWARD_END"},
        "reuse": {"unit:GATHERED,KEEP", "unit:KEPT,REUSE", "unit:KEPT,EVICT", "unit:KEPT,RELEASE"},
        "spec": {"unit:PREFETCHED,EVICT"},
        "nvme": {"unit:PREFETCHED,CLAIM"},
    }
    want["plain"] |= {"phase:FORWARD,BACKWARD_START", "phase:BACKWARD,FORWARD_END"}

    def check(name: str, per_rank: list) -> None:
        for walk in per_rank:
            assert want[name] <= set(walk["seen"]), (name, sorted(want[name] - set(walk["seen"])))

    cases.check_each(subtests, walked, check, names=NAMES)


def test_states_agree_with_the_counts(walked, subtests):
    def check(name: str, per_rank: list) -> None:
        for case in per_rank:
            assert all(case["consistent"]), (name, case["consistent"])

    cases.check_each(subtests, walked, check, names=NAMES)
    reuse = cases.values(walked, "reuse")[0]
    assert all(p <= 130 for p in reuse["peaks"]), reuse["peaks"]
    assert reuse["kept_before_step"] > 0


def test_values_and_teardown(walked):
    plain = cases.values(walked, "plain")
    for p in plain:
        assert p["whole_inside"] and p["released_after"]
        # rank 0's edit reached every rank's shard; one SGD step moved it since
        assert p["edit_seen"] == plain[0]["edit_seen"]
        assert all(abs(v - 1.0) < 0.5 for row in p["edit_seen"] for v in row), p["edit_seen"]
        assert p["detached"] == ["DETACHED"]


def test_illegal_orders_are_named_errors(walked):
    for e in cases.values(walked, "plain"):
        for case, text in [
            ("evict_needed", "no unit transition from (GATHERED) on EVICT"),
            ("fetch_persistent", "no unit transition from (PERSISTENT) on FETCH"),
            ("end_without_begin", "no phase transition from (IDLE) on BACKWARD_END"),
            ("begin_twice", "no phase transition from (BACKWARD) on BACKWARD_START"),
        ]:
            assert e[case][0] == "InternalError", (case, e[case])
            assert text in e[case][1], (case, e[case])


def test_tables_keep_their_promises() -> None:
    """No process: an all-gather in flight only lands or is claimed; only kept and
    speculative units are evicted; teardown is final; every state is reachable from
    NEW; the phase changes only on the root's hooks and begin/end_backward."""
    from zeroshard.zero.params.states import IN_FLIGHT, PHASE, UNIT, Event, UnitState

    for (state, event), nxt in UNIT.items():
        if state in IN_FLIGHT:
            assert event in (Event.LAND, Event.CLAIM), (state, event)
        if event is Event.EVICT:
            assert state in (UnitState.KEPT, UnitState.PREFETCHED), state
        assert state is not UnitState.DETACHED
        if event in (Event.RELEASE, Event.EVICT):
            assert nxt is UnitState.RELEASED
    reach, frontier = {UnitState.NEW}, [UnitState.NEW]
    while frontier:
        here = frontier.pop()
        for (state, _), nxt in UNIT.items():
            if state is here and nxt not in reach:
                reach.add(nxt)
                frontier.append(nxt)
    assert reach == set(UnitState)
    phase_events = {Event.FORWARD_START, Event.FORWARD_END}
    phase_events |= {Event.BACKWARD_START, Event.BACKWARD_END}
    assert {e for _, e in PHASE} == phase_events
    assert not {e for _, e in UNIT} & phase_events
