"""Nested ``zero.Init`` contexts (DeepSpeed's unit test ``test_zero_dynamic_class``: a
module class declared inside one Init and built inside a second). Each parameter is
sealed once, by the first context that sees it; before the fix the second read the
first's freed storage and the process died with a segmentation fault. Two ranks: the
model built nested equals the one built under a single Init, and trains."""

from __future__ import annotations

import torch
from multirank import run


def _case(rank: int, world: int) -> dict:
    import zeroshard
    from zeroshard.zero import GatheredParameters

    config = {"train_batch_size": 2, "zero_optimization": {"stage": 3}}
    torch.manual_seed(0)
    with zeroshard.zero.Init(config_dict_or_path=config):

        class Net(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc = torch.nn.Linear(4, 4)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.fc(x)

        with zeroshard.zero.Init(config_dict_or_path=config):
            nested = Net()
    torch.manual_seed(0)
    with zeroshard.zero.Init(config_dict_or_path=config):
        single = Net()
    with GatheredParameters([nested.fc.weight, single.fc.weight]):
        same = torch.equal(nested.fc.weight, single.fc.weight)
    engine, *_ = zeroshard.initialize(
        model=nested, config={**config, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    )
    loss = engine(torch.ones(1, 4)).sum()
    engine.backward(loss)
    engine.step()
    return {"same": same, "loss": float(loss)}


def test_nested_init_seals_each_parameter_once() -> None:
    results = run(_case, 2)
    assert all(r["same"] for r in results), results
    assert results[0]["loss"] == results[1]["loss"]
