"""Engine behaviour on 2 and 3 ranks: the communication ledger, memory_stats, fp16
overflow at every stage, and (on 2 ranks) the DeepSpeed-style accessors. One spawn per
world size runs every check."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import cases
import multirank
import parity
import pytest
import torch

BIG = 10**9  # one bucket: padding is negligible against the tolerance
# A small reduce bucket (the model has about 28k parameters), no smaller than its largest
# parameter (4096), so that every gradient staging buffer is at most one bucket.
SMALL = 5000
ALIGN = 16  # zeroshard.runtime.build._ALIGN: chunks are multiples of 16 elements


def _psi(engine) -> int:
    return sum(p.numel() for p in engine.module.parameters() if p.requires_grad)


def _one_step(case: dict, rank: int, world: int):
    _, engine = parity.train({**case, "steps": 1}, rank, world)
    engine.reset_comm_stats()
    x, y = parity.batch(99, case.get("micro", 2) * world)
    lo = rank * case.get("micro", 2)
    engine.backward(engine(x[lo : lo + 2], y[lo : lo + 2]))
    engine.step()
    return engine, engine.comm_stats()


def _ledger_and_memory(rank: int, world: int) -> dict:
    out = {}
    for stage in (0, 1, 2):
        engine, stats = _one_step({"stage": stage, "bucket": BIG, "frozen": False}, rank, world)
        out[f"ledger{stage}"] = {
            "stats": stats,
            "psi": _psi(engine),
            "flags": parity.flag_bytes(engine),
        }
        out[f"memory{stage}"] = engine.memory_stats()
    # stage 2 with reduce_scatter left to the engine: on gloo an all-to-all per bucket
    case = {
        "stage": 2,
        "bucket": BIG,
        "frozen": False,
        "extra": {"zero_optimization": {"reduce_scatter": None}},
    }
    engine, stats = _one_step(case, rank, world)
    out["ledger2_gloo"] = {"stats": stats, "psi": _psi(engine), "flags": parity.flag_bytes(engine)}
    # a small bucket at stage 0: still exactly 2 x 4 Psi, in several all-reduces
    engine, stats = _one_step({"stage": 0, "bucket": 3000}, rank, world)
    out["ledger0_buckets"] = {
        "stats": stats,
        "psi": _psi(engine),
        "flags": parity.flag_bytes(engine),
    }
    # stage 2 with a small bucket: the gradient shard plus a staging pool of few buckets
    engine, _ = _one_step({"stage": 2, "bucket": SMALL, "frozen": False}, rank, world)
    trainable = [p for p in engine.module.parameters() if p.requires_grad]
    out["memory2_small"] = engine.memory_stats()
    out["small"] = {
        "psi": _psi(engine),
        "count": len(trainable),
        "largest": max(p.numel() for p in trainable),
    }
    return out


def _fp16_overflow(rank: int, world: int) -> dict:
    return {str(stage): _fp16_overflow_at(stage, rank, world) for stage in (0, 1, 2, 3)}


def _fp16_overflow_at(stage: int, rank: int, world: int) -> dict:
    # stage 3: partition every parameter (the tiny model is below the default threshold)
    z3 = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    case = {"stage": stage, "dtype": "fp16", "steps": 1, "extra": z3 if stage == 3 else {}}
    _, engine = parity.train(case, rank, world)
    before = parity.full_params(engine)
    scale = engine.cur_scale
    x, y = parity.batch(7, 2 * world)
    loss = engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
    if rank == 1:
        loss = loss * float("inf")  # only one rank overflows
    engine.backward(loss)
    engine.step()
    after = parity.full_params(engine)
    unchanged = all(torch.equal(before[n], p) for n, p in after.items())
    result = {
        "unchanged": unchanged,
        "scale_before": scale,
        "scale_after": engine.cur_scale,
        "skipped": engine.skipped_steps,
        "applied": engine.was_step_applied(),
        "global_steps": engine.global_steps,
    }
    # the next clean step applies
    loss = engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
    engine.backward(loss)
    engine.step()
    result["applied_next"] = engine.was_step_applied()
    after = parity.full_params(engine)
    result["finite_next"] = all(torch.isfinite(p).all().item() for p in after.values())
    result["changed_next"] = parity.max_param_diff(after, before) > 0
    return result


def _accessors(rank: int, world: int) -> dict:
    case = {"stage": 2, "gas": 2, "micro": 1}
    _, engine = parity.train({**case, "steps": 2}, rank, world)
    return {
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "boundary": engine.is_gradient_accumulation_boundary(),
        "train_batch_size": engine.train_batch_size(),
        "lr": engine.get_lr(),
        "device": str(engine.device),
        "world": engine.world_size,
    }


def _api(rank: int, world: int, cfg_path: str) -> dict:
    """DeepSpeed-script plumbing: argparse flags, args-based config, training_data."""
    import argparse

    import zeroshard

    out = {}
    for flags in (["--deepspeed", "--deepspeed_config", cfg_path], ["--deepspeed", cfg_path]):
        parser = zeroshard.add_config_arguments(argparse.ArgumentParser())
        args = parser.parse_args(flags)
        model = torch.nn.Linear(4, 2)
        data = torch.utils.data.TensorDataset(torch.arange(40.0).view(10, 4))
        engine, _opt, loader, sched = zeroshard.initialize(
            args=args, model=model, model_parameters=model.parameters(), training_data=data
        )
        rows = [b[0][:, 0].tolist() for b in loader]
        out["hf" if len(flags) == 2 else "ds"] = {
            "rows": rows,
            "micro": engine.train_micro_batch_size_per_gpu(),
            "sched": type(sched).__name__,
            "lr": engine.get_lr(),
        }
    return out


def _all(rank: int, world: int, cfg_path: str) -> dict:
    named = [
        ("ledger and memory", lambda: _ledger_and_memory(rank, world)),
        ("fp16 overflow", lambda: _fp16_overflow(rank, world)),
    ]
    if world == 2:  # the config file and the expected batch layout are for 2 ranks
        named += [
            ("accessors", lambda: _accessors(rank, world)),
            ("api", lambda: _api(rank, world, cfg_path)),
        ]
    return cases.run_named(named)


CONFIG_WITH_COMMENTS = """{
  // DeepSpeed reads configs with comments; so do we
  "train_batch_size": 4,
  "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
  "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}, /* log warmup */
  "zero_optimization": {"stage": 1}
}"""


@pytest.mark.parametrize("world", [2, 3])
def test_engine_ranks(tmp_path, world: int, subtests: pytest.Subtests) -> None:
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(CONFIG_WITH_COMMENTS)
    results = multirank.run(_all, world, str(cfg), timeout=300)

    def ledger_and_memory(per_rank: list) -> None:
        for lm in per_rank:
            _check_ledger_and_memory(lm, world)

    def fp16_overflow(per_rank: list) -> None:
        for per_stage in per_rank:
            _check_fp16_overflow(per_stage)

    cases.check(subtests, results, "ledger and memory", ledger_and_memory)
    cases.check(subtests, results, "fp16 overflow", fp16_overflow)
    if world == 2:
        cases.check(subtests, results, "api", _check_api)
        cases.check(subtests, results, "accessors", _check_accessors)


def _check_ledger_and_memory(lm: dict, world: int) -> None:
    # Stage 0: an all-reduce of every gradient, exactly 2 x 4 Psi bytes, plus the
    # used-parameter flags (a byte per parameter), nothing else.
    for key in ("ledger0", "ledger0_buckets"):
        stats, psi = lm[key]["stats"], lm[key]["psi"]
        assert set(stats) == {"all_reduce"}, stats
        assert stats["all_reduce"]["bytes"] == 2 * 4 * psi + lm[key]["flags"]
    assert lm["ledger0_buckets"]["stats"]["all_reduce"]["calls"] > 2
    # Stages 1 and 2: reduce-scatter + all-gather of the whole model, 2 x 4 Psi (+-2%).
    for stage in (1, 2):
        led = lm[f"ledger{stage}"]
        stats, psi = led["stats"], led["psi"]
        assert set(stats) == {"reduce_scatter", "all_gather", "all_reduce"}, stats
        assert stats["all_reduce"]["bytes"] == led["flags"], stats
        moved = stats["reduce_scatter"]["bytes"] + stats["all_gather"]["bytes"]
        assert abs(moved - 8 * psi) <= 0.02 * 8 * psi, (stage, moved, 8 * psi)
    # Stage 2 on gloo by default: the gradients all-reduced (2 x 4 Psi, as DDP), the
    # updated parameters all-gathered (4 Psi)
    led = lm["ledger2_gloo"]
    stats, psi = led["stats"], led["psi"]
    assert set(stats) == {"reduce_scatter", "all_reduce", "all_gather"}, stats
    assert stats["all_reduce"]["bytes"] == led["flags"], stats  # only the flags
    assert abs(stats["reduce_scatter"]["bytes"] - 4 * psi) <= 0.02 * 4 * psi, stats
    assert abs(stats["all_gather"]["bytes"] - 4 * psi) <= 0.02 * 4 * psi, stats
    # memory: fp32 Adam -> 8 Psi / N optimizer bytes from stage 1; grads 4 Psi / N at stage 2.
    psi = lm["ledger0"]["psi"]
    pad = 2 * 16 * 4 * 3  # one segment, alignment padding, a few step scalars
    m0, m1, m2 = lm["memory0"], lm["memory1"], lm["memory2"]
    assert m0["optimizer_states"] >= 8 * psi
    assert m1["optimizer_states"] <= 8 * psi / world + pad
    assert m2["optimizer_states"] <= 8 * psi / world + pad
    assert m0["grads"] == 4 * psi and m1["grads"] >= 4 * psi
    bucket = 4 * (psi + world * ALIGN)  # the staging bucket (the whole model here)
    assert m2["grads"] <= 4 * psi / world + bucket + pad
    assert m2["params"] >= 4 * psi  # stage 2 keeps whole parameters
    # Stage 2, small bucket: the owned gradient shard plus the staging pool. Per
    # zero/grads/buckets.py a staging buffer is one segment (at most one bucket here, as no
    # parameter is larger than SMALL) and the pool holds at most two: the bucket being
    # filled and the one whose reduce-scatter is in flight (overlap_comm). Padding: each
    # segment and staging buffer is rounded up to N x ALIGN elements (at most ALIGN per
    # rank per segment, a segment per parameter at most).
    small, ms = lm["small"], lm["memory2_small"]
    assert small["largest"] <= SMALL
    psi = small["psi"]
    seg_pad = 4 * ALIGN * (small["count"] + 2 * world)
    assert ms["grads"] <= 4 * psi / world + 2 * 4 * SMALL + seg_pad, (ms["grads"], psi)
    assert ms["grads"] < 4 * psi, (ms["grads"], psi)  # really sharded
    for m in (m0, m1, m2, ms):
        assert sum(m["by_location"].values()) == m["params"] + m["grads"] + m["optimizer_states"]
        assert set(m["by_location"]) == {"cpu"}


def _check_fp16_overflow(per_stage: dict) -> None:
    # fp16: an inf on one rank skips the step everywhere, leaves every parameter as it was
    # and halves the scale; the next clean step applies.
    assert set(per_stage) == {"0", "1", "2", "3"}
    for stage, f in per_stage.items():
        assert f["unchanged"] and not f["applied"] and f["skipped"] == 1, (stage, f)
        assert f["scale_after"] == f["scale_before"] / 2, (stage, f)
        assert f["applied_next"] and f["finite_next"] and f["changed_next"], (stage, f)
        assert f["global_steps"] == 2, (stage, f)


def _check_api(per_rank: list[dict]) -> None:
    # training_data: each rank gets its own micro-batches of 2 (train 4 = 2 x 1 x 2 ranks)
    seen = []
    for r in per_rank:
        for api in r.values():
            assert api["micro"] == 2 and api["sched"] == "WarmupLR"
            assert api["lr"] == [0.0]  # WarmupLR starts at warmup_min_lr, as DeepSpeed does
            assert all(len(b) <= 2 for b in api["rows"])
        seen.append(sorted(x for b in r["ds"]["rows"] for x in b))
    assert sorted(seen[0] + seen[1]) == [4.0 * i for i in range(10)]


def _check_accessors(per_rank: list[dict]) -> None:
    for a in per_rank:
        assert a["global_steps"] == 2 and a["micro_steps"] == 4 and not a["boundary"]
        assert a["train_batch_size"] == 1 * 2 * 2 and a["world"] == 2 and a["device"] == "cpu"
        assert math.isclose(a["lr"][0], parity.LR) and math.isclose(a["lr"][1], parity.LR_NODECAY)


def test_single_process_without_launcher() -> None:
    """World size 1, no launcher environment: initialize() sets everything up itself."""
    code = textwrap.dedent(
        """
        import os, torch, zeroshard
        for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
            os.environ.pop(k, None)
        model = torch.nn.Linear(8, 8)
        cfg = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
               "zero_optimization": {"stage": 2}}
        engine, opt, loader, sched = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        w0 = model.weight.detach().clone()
        loss = engine(torch.randn(4, 8)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        assert not torch.equal(w0, model.weight), "no update"
        assert torch.distributed.get_world_size() == 1
        print("OK", engine.global_steps, engine.train_micro_batch_size_per_gpu())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "OK 1 4" in out.stdout


def test_backward_returns_the_loss_scaled_by_accumulation() -> None:
    """engine.backward(loss) returns what DeepSpeed's returns: ``loss / gas`` in fp32 when
    more than one micro-step accumulates (DeepSpeed's unit test_multi_output_model checks
    it), the loss itself at gas 1 or with ``scale_wrt_gas=False``."""
    code = textwrap.dedent(
        """
        import os, torch, zeroshard
        for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
            os.environ.pop(k, None)
        model = torch.nn.Linear(8, 8).to(torch.bfloat16)
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
               "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}, "bf16": {"enabled": True}}
        engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        loss = engine(torch.randn(2, 8, dtype=torch.bfloat16)).float().pow(2).mean().to(torch.bfloat16)
        out = engine.backward(loss)
        assert out.dtype == torch.float32 and not out.requires_grad, out
        assert torch.equal(out, loss.detach().float() / 3), (out, loss)
        loss = engine(torch.randn(2, 8, dtype=torch.bfloat16)).float().pow(2).mean()
        assert engine.backward(loss, scale_wrt_gas=False) is loss
        print("OK")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "OK" in out.stdout


def _scale_edge_cases(rank: int, world: int) -> dict:
    """The clip/unscale factor handed to torch's fused kernel as grad_scale, at its
    edges: an infinite gradient norm (factor 0: applied as a multiply, as torch's
    clip_grad_norm_ does, giving NaN, not a crash), and a param group that is not fused
    (it cannot take grad_scale: the factor is applied by a separate multiply). The first
    runs with ``nonfinite_gradients: "apply"``, where such a step is taken (by default it
    is skipped: test_nonfinite.py)."""
    import zeroshard

    out = {}
    case = {"stage": 2, "clip": 1.0, "steps": 1, "extra": {"nonfinite_gradients": "apply"}}
    _, engine = parity.train(case, rank, world)
    x, y = parity.batch(7, 2)
    engine.backward(engine(x, y))
    engine.reducer.grad_chunks[0][0] = float("inf")
    engine.step()  # must not raise
    out["inf_norm"] = engine.get_global_grad_norm()
    out["nan_params"] = any(p.isnan().any().item() for p in engine.module.parameters())

    model = parity.build_model(case)
    decay, nodecay = (g["params"] for g in parity.param_groups(model, with_hyper=False))
    client = torch.optim.AdamW(
        [{"params": decay, "fused": False}, {"params": nodecay}], lr=1e-3, fused=True
    )
    cfg = parity.ds_config({"stage": 2, "clip": 0.05, "client": True})
    engine, *_ = zeroshard.initialize(model=model, optimizer=client, config=cfg)
    assert engine.optimizer is not None
    out["mixed_fused"] = [g.get("fused") for g in engine.optimizer.inner.param_groups]
    x, y = parity.batch(0, 2)
    engine.backward(engine(x, y))
    engine.step()  # must not raise: the non-fused group refuses grad_scale
    out["mixed_norm"] = engine.get_global_grad_norm()
    return out


def test_fused_grad_scale_edge_cases() -> None:
    r = multirank.run(_scale_edge_cases, 1, timeout=300)[0]
    assert r["inf_norm"] == math.inf and r["nan_params"], r
    assert r["mixed_fused"] == [False, True], r
    assert r["mixed_norm"] > 0.05, r  # clipping was active: the factor was applied


def test_nccl_with_more_local_ranks_than_gpus_is_a_clear_error(monkeypatch) -> None:
    import torch.distributed as dist

    from zeroshard.distributed.process_group import init_distributed

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(torch.cuda.device_count() + 1))
    with pytest.raises(RuntimeError, match=r"LOCAL_WORLD_SIZE=.* NCCL cannot put two ranks"):
        init_distributed(dist_backend="nccl")
    assert not dist.is_initialized()
