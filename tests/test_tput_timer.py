"""``engine.tput_timer``: DeepSpeed's throughput timer, with its attributes and their
meaning (DeepSpeed's unit test_zero_context::test_throughput_calculation reads them), and
``engine.optimizer.optimizer`` (its test_zero::TestZeroAdamOptimizerStepCount reads it)."""

from __future__ import annotations

import multirank
import torch

from zeroshard.monitor.timers import ThroughputTimer


def test_counts_and_times_as_deepspeed() -> None:
    t = ThroughputTimer(synchronized=False, batch_size=6, device=torch.device("cpu"))
    assert (t.initialized, t.started, t.start_step, t.start_time) == (False, False, 2, 0)
    t.stop()  # before any start: nothing
    assert (t.initialized, t.micro_step_count, t.total_elapsed_time) == (False, 0, 0)
    t.start()
    assert t.initialized and t.started and t.start_time == 0  # not timed before start_step
    t.stop()
    assert (t.started, t.micro_step_count, t.global_step_count) == (False, 1, 0)
    gas = 3
    while t.global_step_count < t.start_step:  # the first start_step steps are not timed
        t.start()
        t.stop(global_step=(t.micro_step_count + 1) % gas == 0)
    assert t.total_elapsed_time == 0 and t.avg_samples_per_sec() == float("-inf")
    while t.global_step_count == t.start_step:
        t.start()
        before_step, before_total = t.step_elapsed_time, t.total_elapsed_time
        boundary = (t.micro_step_count + 1) % gas == 0
        t.stop(global_step=boundary)
        duration = t.end_time - t.start_time
        assert t.start_time > 0 and duration >= 0
        assert t.total_elapsed_time == before_total + duration
        assert t.step_elapsed_time == (0 if boundary else before_step + duration)
    assert t.micro_step_count == 9 and t.global_step_count == 3
    assert t.avg_samples_per_sec() == 6 / t.total_elapsed_time
    assert t.line().startswith("epoch=0/micro_step=9/global_step=3, RunningAvgSamplesPerSec=")
    t.update_epoch_count()
    assert (t.epoch_count, t.micro_step_count) == (1, 0)
    assert ThroughputTimer(synchronized=True, batch_size=None, device=t.device).batch_size == 1


def _engine_timer(rank: int, world: int) -> dict:
    """With the default config (no ``timers`` section): the timer counts, as DeepSpeed's."""
    import zeroshard

    model = torch.nn.Linear(4, 4)
    cfg = {
        "train_micro_batch_size_per_gpu": 7,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    }
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    t = engine.tput_timer
    out = {"batch": t.batch_size, "fresh": [t.initialized, t.micro_step_count]}
    for _ in range(8):
        engine.backward(engine(torch.randn(7, 4)).pow(2).mean())
        engine.step()
    out["after"] = [t.micro_step_count, t.global_step_count, t.total_elapsed_time > 0]
    # DeepSpeed's engine.optimizer.optimizer: the wrapped torch optimizer, stepped each step
    opt = engine.optimizer
    assert opt is not None
    inner = opt.optimizer
    out["inner"] = inner is opt.inner and isinstance(inner, torch.optim.Adam)
    out["steps"] = [int(inner.state[p]["step"]) for g in inner.param_groups for p in g["params"]]
    return out


def test_engine_tput_timer_runs_with_the_engine() -> None:
    r = multirank.run(_engine_timer, 1, timeout=300)[0]
    assert r["batch"] == 14 and r["fresh"] == [False, 0], r
    assert r["after"] == [8, 4, True], r  # steps 3 and 4 were timed
    assert r["inner"] and r["steps"] and set(r["steps"]) == {4}, r
