"""``zero_optimization.overlap_param_gather`` (stages 1-2): the all-gathers of updated
parameters are left in flight at the end of ``step()`` and each module's forward waits
for its own segments; every other engine call waits for all. Parity with the single-process
reference is in test_parity; this checks the mechanism is really in use, that the
parameters end up equal to the blocking path's, and the refusals."""

from __future__ import annotations

import functools
from typing import Any

import cases
import multirank
import pytest
import torch


def _stage(rank: int, stage: int) -> dict:
    """Training with and without overlap_param_gather at ``stage``: the gathers left in
    flight, none after the wait, and the final parameters' difference."""
    import zeroshard
    from zeroshard.models import GPT, GPTConfig
    from zeroshard.zero.params.whole import WholeParams

    out: dict[str, Any] = {}
    finals = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32))
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {
                "stage": stage,
                "reduce_bucket_size": 3000,
                "overlap_param_gather": overlap,
            },
        }
        engine, *_ = zeroshard.initialize(model=model, config=cfg)
        g = torch.Generator().manual_seed(rank)
        in_flight = []
        for _ in range(3):
            ids = torch.randint(0, 64, (2, 17), generator=g)
            engine.backward(engine(ids[:, :-1], ids[:, 1:]))
            engine.step()
            assert isinstance(engine.params, WholeParams)
            in_flight.append(len(engine.params._pending))
        if overlap:
            out["in_flight"] = in_flight
            engine.wait_param_gather()
            assert isinstance(engine.params, WholeParams)
            out["after_wait"] = len(engine.params._pending)
        finals[overlap] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        engine.destroy()
    out["diff"] = (finals[True] - finals[False]).abs().max().item()
    return out


def _run(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return cases.run_named((f"stage{s}", functools.partial(_stage, rank, s)) for s in (1, 2))


def _check(stage: str, per_rank: list) -> None:
    for r in per_rank:
        assert min(r["in_flight"]) > 1, r  # several segments left in flight
        assert r["after_wait"] == 0, r
        assert r["diff"] == 0.0, r  # bitwise the blocking path's parameters


def test_gathers_stay_in_flight_and_land_the_same(subtests: pytest.Subtests) -> None:
    results = multirank.run(_run, 2, timeout=300)
    cases.check_each(subtests, results, _check, names=["stage1", "stage2"])


@pytest.mark.parametrize("stage", [0, 3])
def test_refused_where_there_is_nothing_to_overlap(stage):
    from zeroshard.config import ConfigError, load_config

    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage, "overlap_param_gather": True},
    }
    with pytest.raises(ConfigError, match="overlap_param_gather"):
        load_config(cfg, world_size=1)
