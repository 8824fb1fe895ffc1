"""A config giving only gradient_accumulation_steps (seed 001's method B as printed):
with the user feeding the batches, the micro-batch size comes from the first batch
(issue 13, part 6); where it cannot be known, the error names the key. The seed's script
itself runs in test_examples.py."""

from __future__ import annotations

import logging

import multirank
import pytest
import torch
from logs import ListHandler

from zeroshard.config import ConfigError, load_config
from zeroshard.runtime.first_batch import rows_of

GAS_ONLY = {
    "train_batch_size": 0,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
}
KEY = "train_micro_batch_size_per_gpu"


def test_rows_of_the_first_tensor_with_a_batch_dimension() -> None:
    x = torch.zeros(5, 3)
    assert rows_of((x,), {}) == 5
    assert rows_of((), {"input_ids": torch.zeros(4, 7, dtype=torch.long)}) == 4
    assert rows_of((torch.tensor(2.0), [{"a": x}]), {}) == 5  # a scalar has no rows
    assert rows_of((3, "text"), {"flag": True}) is None


def test_config_leaves_it_to_the_first_batch_only_when_asked() -> None:
    cfg = load_config(GAS_ONLY, dp_world_size=2, micro_batch_from_data=True)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (None, None)
    assert cfg.gradient_accumulation_steps == 2
    with pytest.raises(ConfigError, match=f"^{KEY}: only gradient_accumulation_steps"):
        load_config(GAS_ONLY, dp_world_size=2)
    # given batch keys are resolved as always; nothing at all given stays an error
    cfg = load_config({**GAS_ONLY, KEY: 4}, dp_world_size=2, micro_batch_from_data=True)
    assert cfg.train_batch_size == 16
    with pytest.raises(ConfigError, match="no batch size given"):
        load_config({"train_batch_size": 0}, micro_batch_from_data=True)


class _Counted(torch.nn.Module):
    """A forward that takes no tensor: nothing to take the batch size from."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, n: int) -> torch.Tensor:
        return self.w.sum() * n


def _ranks(rank: int, world: int) -> dict:
    import zeroshard

    out: dict = {}
    records: list[str] = []
    handler = ListHandler(records, messages=True)
    logging.getLogger("zeroshard").addHandler(handler)

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ref = torch.nn.Linear(4, 2)
    ref.load_state_dict(model.state_dict())
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=GAS_ONLY)  # fmt: skip
    out["before"] = [engine.train_micro_batch_size_per_gpu(), engine.train_batch_size()]
    try:
        engine.step()
        out["step_first"] = "no error"
    except ConfigError as exc:
        out["step_first"] = str(exc)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(4):  # 2 optimizer steps; this rank's 3 rows of 6 per micro-step
        x = torch.randn(3 * world, 4, generator=torch.Generator().manual_seed(step))
        loss = model(x[3 * rank : 3 * rank + 3]).square().mean()  # the raw module, as the seed
        engine.backward(loss)
        engine.step()
        (ref(x).square().mean() / 2).backward()
        if step % 2 == 1:
            ref_opt.step()
            ref_opt.zero_grad()
    out["after"] = [engine.train_micro_batch_size_per_gpu(), engine.train_batch_size()]
    out["samples"] = engine.global_samples
    out["diff"] = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters(), strict=True))  # fmt: skip
    out["lines"] = [m for m in records if "first batch" in m]
    engine.destroy()

    # cannot be known: training_data given, a first batch with no tensor, uneven ranks
    errors = []
    data = torch.utils.data.TensorDataset(torch.zeros(8, 4))
    try:
        zeroshard.initialize(
            model=torch.nn.Linear(4, 2), config=GAS_ONLY, training_data=data,
            model_parameters=None,
        )  # fmt: skip
    except ConfigError as exc:
        errors.append(str(exc))
    counted = _Counted()
    engine, *_ = zeroshard.initialize(model=counted, model_parameters=counted.parameters(), config=GAS_ONLY)  # fmt: skip
    try:
        engine(2)
    except ConfigError as exc:
        errors.append(str(exc))
    engine.destroy()
    lin = torch.nn.Linear(4, 2)
    engine, *_ = zeroshard.initialize(model=lin, model_parameters=lin.parameters(), config=GAS_ONLY)  # fmt: skip
    try:
        engine(torch.zeros(2 + rank, 4))
    except ConfigError as exc:
        errors.append(str(exc))
    engine.destroy()
    out["errors"] = errors
    logging.getLogger("zeroshard").removeHandler(handler)
    return out


@pytest.fixture(scope="module")
def results():
    return multirank.run(_ranks, 2, timeout=180)


def test_micro_batch_taken_from_the_first_batch(results) -> None:
    for rank, r in enumerate(results):
        assert r["before"] == [None, None]
        assert r["after"] == [3, 12]  # 3 rows x 2 accumulation steps x 2 ranks
        assert r["samples"] == 24
        assert r["diff"] <= 2e-5, r["diff"]
        assert len(r["lines"]) == (1 if rank == 0 else 0), r["lines"]
    assert "taken from the first batch: 3" in results[0]["lines"][0]


def test_where_it_cannot_be_known_the_error_names_the_key(results) -> None:
    for r in results:
        assert r["step_first"].startswith(f"{KEY}: ") and "no batch" in r["step_first"]
        assert len(r["errors"]) == 3, r["errors"]
        data, no_tensor, uneven = r["errors"]
        assert data.startswith(f"{KEY}: only gradient_accumulation_steps")
        assert no_tensor.startswith(f"{KEY}: ") and "no tensor" in no_tensor
        assert uneven.startswith(f"{KEY}: ") and "2 to 3 rows" in uneven
