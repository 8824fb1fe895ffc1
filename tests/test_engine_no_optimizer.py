"""An engine without an optimizer (``initialize`` given no ``optimizer=`` and a config
without an ``optimizer`` section), for inference and evaluation at every ZeRO stage, as
DeepSpeed builds one (accelerate's ``prepare(model)`` for ZeRO-3 inference).

Two ranks, stages 0-3 in one spawn: the returned optimizer and scheduler are None; the
forward equals the plain model's in bf16 bit for bit (stage 3 gathering the partitioned
parameters); stage 3 keeps a bf16 shard and no gradient or optimizer bytes; backward and
step raise naming the missing optimizer; a training engine's checkpoint loads into it
and its own checkpoints round-trip; GatheredParameters edits stick; save_16bit_model
writes the weights; a scheduler without an optimizer is refused by name.
"""

from __future__ import annotations

import os

import pytest
import torch
from multirank import run
from torch import nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def _config(stage: int, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **extra,
    }


def _cases(rank: int, world: int, root: str) -> dict:
    import zeroshard
    from zeroshard.config import ConfigError
    from zeroshard.zero import GatheredParameters

    out: dict[str, object] = {}
    torch.manual_seed(123)
    x = torch.randn(2, 8)  # the same on both ranks
    for stage in (0, 1, 2, 3):
        r: dict = {}
        ref = _model().to(torch.bfloat16)
        engine, opt, _, sched = zeroshard.initialize(model=_model(), config=_config(stage))
        r["none"] = opt is None and sched is None and engine.optimizer is None
        engine.eval()
        with torch.no_grad():
            y = engine(x)
            r["forward"] = torch.equal(y, ref(x.bfloat16()))
        engine.train()
        y = engine(x)
        loss = y.float().sum()
        for call in (lambda: engine.backward(loss), engine.step):  # noqa: B023  (called here)
            try:
                call()
                r.setdefault("refused", []).append(False)
            except RuntimeError as exc:
                r.setdefault("refused", []).append("has no optimizer" in str(exc))
        r["lr"] = engine.get_lr() == [] and engine.get_global_grad_norm() is None
        stats = engine.memory_stats()
        r["bytes"] = [stats["params"], stats["grads"], stats["optimizer_states"]]
        if stage == 3:
            r["shard_dtype"] = str(engine.flat.store.dtype)

        # a training engine's checkpoint loads into it (its optimizer states are skipped)
        trainer, *_ = zeroshard.initialize(
            model=_model(),
            config=_config(stage, optimizer={"type": "AdamW", "params": {"lr": 0.1}}),
        )
        loss = trainer(torch.randn(2, 8)).float().pow(2).mean()
        trainer.backward(loss)
        trainer.step()
        trained = os.path.join(root, f"trained{stage}")
        trainer.save_checkpoint(trained)
        engine.load_checkpoint(trained)
        with torch.no_grad():
            r["loads_training"] = torch.equal(engine(x), trainer(x))
        trainer.destroy()

        # its own checkpoint round-trips, after an edit through GatheredParameters
        first = engine.module.get_parameter("0.weight")
        with GatheredParameters([first], modifier_rank=0), torch.no_grad():
            first.mul_(0.5)
        with torch.no_grad():
            edited = engine(x)
        own = os.path.join(root, f"own{stage}")
        engine.save_checkpoint(own)
        engine.save_16bit_model(own, "weights.safetensors")
        again, *_ = zeroshard.initialize(model=_model(), config=_config(stage))
        again.load_checkpoint(own)
        with torch.no_grad():
            r["round_trip"] = torch.equal(again(x), edited) and not torch.equal(edited, y)
        if rank == 0:
            from safetensors.torch import load_file

            saved = load_file(os.path.join(own, "weights.safetensors"))
            with GatheredParameters(list(again.module.parameters())):
                r["16bit"] = all(
                    torch.equal(saved[n], p.detach()) for n, p in again.module.named_parameters()
                )
        else:
            with GatheredParameters(list(again.module.parameters())):
                pass
        again.destroy()
        engine.destroy()
        out[str(stage)] = r
    try:
        zeroshard.initialize(model=_model(), config=_config(2, scheduler={"type": "WarmupLR"}))
        out["scheduler_refused"] = ""
    except ConfigError as exc:
        out["scheduler_refused"] = str(exc)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run(_cases, 2, str(tmp_path_factory.mktemp("noopt")))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_inference_engine_at_every_stage(results, stage: int) -> None:
    for rank, res in enumerate(results):
        r = res[str(stage)]
        assert r["none"] and r["forward"] and r["lr"], (rank, r)
        assert r["refused"] == [True, True], r
        assert r["loads_training"] and r["round_trip"], r
        params, grads, states = r["bytes"]
        assert grads == 0 and states == 0, r["bytes"]
        if stage == 3:  # a bf16 shard: half the 2-byte model per rank (padded to 16)
            total = 8 * 32 + 32 + 32 * 4 + 4
            assert r["shard_dtype"] == "torch.bfloat16"
            assert total * 2 // 2 <= params <= total * 2 // 2 + 2 * 16 * 4, params
    assert results[0][str(stage)]["16bit"]


def test_scheduler_without_optimizer_is_refused(results) -> None:
    assert "scheduler" in results[0]["scheduler_refused"]
    assert "no optimizer" in results[0]["scheduler_refused"]
