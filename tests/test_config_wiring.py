"""Config keys that reach the engine (issue 12's "Why" list), on 2 ranks in one spawn:

* ``prescale_gradients`` and ``gradient_predivide_factor`` with DeepSpeed's meaning
  (prescaling divides by the world size before the reduction; otherwise the factor is
  divided before and world / factor after), at parity with the fp32 reference;
* ``reduce_bucket_size: 0`` (as in Hugging Face's ZeRO-3 test config): each gradient is
  its own bucket, at parity;
* ``dataloader_drop_last``: the engine's loader drops the last incomplete micro-batch;
* ``steps_per_print: Infinity`` never logs progress, and the inert keys a config sets are
  logged once, from rank 0 only.
"""

from __future__ import annotations

import logging
from typing import Any

import cases
import multirank
import parity
import pytest
import torch
from logs import ListHandler

WORLD = 2
PARITY = [
    {"stage": 0, "extra": {"prescale_gradients": True}},
    {"stage": 2, "extra": {"prescale_gradients": True}},
    {"stage": 0, "extra": {"gradient_predivide_factor": 4.0}},
    {"stage": 2, "extra": {"gradient_predivide_factor": 4.0}},
    {"stage": 1, "extra": {"zero_optimization": {"reduce_bucket_size": 0}}},
    {"stage": 3, "extra": {"zero_optimization": {"reduce_bucket_size": 0}}},
]


def _logged(fn):
    """Run ``fn()``; return what it logged to the "zeroshard" logger (INFO and up)."""
    records: list[logging.LogRecord] = []
    handler = ListHandler(records, level=logging.INFO)
    logger = logging.getLogger("zeroshard")
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    try:
        fn()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return [r.getMessage() for r in records]


def _reducer(rank: int, world: int) -> list[dict]:
    """What the reducer does with the two keys, and the buckets of reduce_bucket_size 0."""
    out = []
    for case in PARITY:
        _, engine = parity.train({**case, "steps": 1}, rank, world)
        trainable = sum(p.requires_grad for p in engine.module.parameters())
        segments = len(engine.flat.layout.segments)
        out.append({"predivide": engine.reducer.predivide, "segments": segments})
        out[-1]["trainable"] = trainable
    return out


def _buckets(rank: int, world: int) -> dict:
    """Bucket sizes not given: 25 MiB of gradients (fp32 and bf16), said once on rank 0;
    given ones are kept."""
    out: dict = {}
    for name, extra in (
        ("fp32", {}),
        ("bf16", {"bf16": {"enabled": True}}),
        ("given", {"zero_optimization": {"reduce_bucket_size": 1000}}),
    ):
        case = {"stage": 2, "steps": 1, "bucket": None, "extra": extra}
        said = _logged(
            lambda case=case: out.__setitem__("engine", parity.train(case, rank, world)[1])
        )
        out[name] = [out.pop("engine").bucket_numel, [m for m in said if "25 MiB" in m]]
    return out


def _drop_last() -> dict:
    """10 samples over 2 ranks, micro-batches of 2 -> 2, 2, (1)."""
    import zeroshard

    out = {}
    data = torch.utils.data.TensorDataset(torch.arange(10.0).view(10, 1))
    for drop in (False, True):
        model = torch.nn.Linear(1, 1)
        cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "dataloader_drop_last": drop}
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
        _, _, loader, _ = zeroshard.initialize(model=model, training_data=data, config=cfg)
        out[str(drop)] = [len(b[0]) for b in loader]
    return out


def _logs(rank: int, world: int) -> dict:
    """steps_per_print: Infinity never logs; inert keys are logged at start-up by rank 0."""
    out = {}
    inert = {"contiguous_gradients": False, "round_robin_gradients": True}
    for every in (float("inf"), 1):
        case = {
            "stage": 2,
            "steps": 2,
            "extra": {"steps_per_print": every, "zero_optimization": inert},
        }
        out[str(every)] = _logged(lambda case=case: parity.train(case, rank, world))
    return out


def _ranks(rank: int, world: int) -> dict:
    return cases.run_named(
        [
            *parity.named_cases(rank, world, PARITY),
            ("reducer", lambda: _reducer(rank, world)),
            ("buckets", lambda: _buckets(rank, world)),
            ("dataloader_drop_last", _drop_last),
            ("steps_per_print", lambda: _logs(rank, world)),
        ]
    )


def _check_reducer(per_rank: list) -> None:
    for r in per_rank:
        predivides = [c["predivide"] for c in r]
        assert predivides == [WORLD, WORLD, 4.0, 4.0, 1.0, 1.0], predivides
        for i in (4, 5):  # reduce_bucket_size 0: a bucket (stage 3: a unit) per parameter
            case = r[i]
            assert case["segments"] >= case["trainable"], case


def _check_buckets(per_rank: list) -> None:
    for r in per_rank:
        assert r["fp32"][0] == 25 * 2**20 // 4 and r["bf16"][0] == 25 * 2**20 // 2
        assert r["given"] == [1000, []]
    rank0, rank1 = per_rank
    assert len(rank0["fp32"][1]) >= 1 and rank1["fp32"][1] == []


def _check_drop_last(per_rank: list) -> None:
    for r in per_rank:
        assert r["False"] == [2, 2, 1] and r["True"] == [2, 2]


def _check_logs(per_rank: list) -> None:
    rank0, rank1 = per_rank
    never, every = rank0["inf"], rank0["1"]
    assert not any(line.startswith("step=") for line in never), never
    assert sum(line.startswith("step=") for line in every) == 2, every  # the check can fail
    inert = [line for line in never if "has no effect here" in line]
    assert inert == [
        "zeroshard: config key zero_optimization.contiguous_gradients has no effect here: "
        "gradients always go into flat, contiguous buffers",
        "zeroshard: config key zero_optimization.round_robin_gradients has no effect here: "
        "each rank moves only its own gradient shard to the CPU",
    ], never
    assert rank1["inf"] == [] and rank1["1"] == []


def test_config_keys_reach_the_engine(subtests: pytest.Subtests) -> None:
    results = multirank.run(_ranks, WORLD, timeout=400)
    parity.check_parity(subtests, PARITY, results, WORLD)
    for name, check in (
        ("reducer", _check_reducer),
        ("buckets", _check_buckets),
        ("dataloader_drop_last", _check_drop_last),
        ("steps_per_print", _check_logs),
    ):
        cases.check(subtests, results, name, check)
