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

import multirank
import parity
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


def _ranks(rank: int, world: int) -> dict:
    import zeroshard

    out: dict = {"parity": parity.run_cases(rank, world, PARITY)}
    # what the reducer does with the two keys, and the buckets of reduce_bucket_size 0
    for i, case in enumerate(PARITY):
        _, engine = parity.train({**case, "steps": 1}, rank, world)
        trainable = sum(p.requires_grad for p in engine.module.parameters())
        segments = len(engine.flat.layout.segments)
        out[f"case{i}"] = {"predivide": engine.reducer.predivide, "segments": segments}
        out[f"case{i}"]["trainable"] = trainable
    # bucket sizes not given: 25 MiB of gradients (fp32 and bf16), said once on rank 0;
    # given ones are kept
    for name, extra in (
        ("fp32", {}),
        ("bf16", {"bf16": {"enabled": True}}),
        ("given", {"zero_optimization": {"reduce_bucket_size": 1000}}),
    ):
        case = {"stage": 2, "steps": 1, "bucket": None, "extra": extra}
        said = _logged(
            lambda case=case: out.__setitem__("engine", parity.train(case, rank, world)[1])
        )
        out[f"bucket_{name}"] = [
            out.pop("engine").bucket_numel,
            [m for m in said if "25 MiB" in m],
        ]
    # dataloader_drop_last: 10 samples over 2 ranks, micro-batches of 2 -> 2, 2, (1)
    data = torch.utils.data.TensorDataset(torch.arange(10.0).view(10, 1))
    for drop in (False, True):
        model = torch.nn.Linear(1, 1)
        cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "dataloader_drop_last": drop}
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
        _, _, loader, _ = zeroshard.initialize(model=model, training_data=data, config=cfg)
        out[f"drop_last_{drop}"] = [len(b[0]) for b in loader]
    # steps_per_print: Infinity never logs; inert keys are logged at start-up by rank 0
    inert = {"contiguous_gradients": False, "round_robin_gradients": True}
    for every in (float("inf"), 1):
        case = {
            "stage": 2,
            "steps": 2,
            "extra": {"steps_per_print": every, "zero_optimization": inert},
        }
        out[f"log_{every}"] = _logged(lambda case=case: parity.train(case, rank, world))
    return out


def test_config_keys_reach_the_engine() -> None:
    results = multirank.run(_ranks, WORLD, timeout=400)
    parity.assert_parity(PARITY, [r["parity"] for r in results], WORLD)
    for r in results:
        predivides = [r[f"case{i}"]["predivide"] for i in range(len(PARITY))]
        assert predivides == [WORLD, WORLD, 4.0, 4.0, 1.0, 1.0], predivides
        for i in (4, 5):  # reduce_bucket_size 0: a bucket (stage 3: a unit) per parameter
            case = r[f"case{i}"]
            assert case["segments"] >= case["trainable"], case
        assert r["drop_last_False"] == [2, 2, 1] and r["drop_last_True"] == [2, 2]
        assert r["bucket_fp32"][0] == 25 * 2**20 // 4 and r["bucket_bf16"][0] == 25 * 2**20 // 2
        assert r["bucket_given"] == [1000, []]
    rank0, rank1 = results[0], results[1]
    never, every = rank0["log_inf"], rank0["log_1"]
    assert not any(line.startswith("step=") for line in never), never
    assert sum(line.startswith("step=") for line in every) == 2, every  # the check can fail
    inert = [line for line in never if "has no effect here" in line]
    assert inert == [
        "zeroshard: config key zero_optimization.contiguous_gradients has no effect here: "
        "gradients always go into flat, contiguous buffers",
        "zeroshard: config key zero_optimization.round_robin_gradients has no effect here: "
        "each rank moves only its own gradient shard to the CPU",
    ], never
    assert rank1["log_inf"] == [] and rank1["log_1"] == []
    assert len(rank0["bucket_fp32"][1]) >= 1 and rank1["bucket_fp32"][1] == []
