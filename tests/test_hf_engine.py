"""The engine methods transformers and accelerate call (issue 13), on 2 ranks in one spawn:
accelerate's way of driving accumulation (``set_gradient_accumulation_boundary`` before
each backward, ``step()`` only at the boundary) trains exactly as the plain loop;
``engine.config`` is DeepSpeed's dict; the consolidated 16-bit state dict equals the
gathered parameters; ``compile()``; checkpoint keyword arguments."""

from __future__ import annotations

from typing import Any

import multirank
import parity
import torch


def _accelerate_style(case: dict, rank: int, world: int):
    """parity.train's loop, driven as accelerate's DeepSpeedEngineWrapper drives it."""
    import zeroshard

    model = parity.build_model(case)
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=parity.param_groups(model), config=parity.ds_config(case)
    )
    micro, gas = case["micro"], case["gas"]
    for step in range(case["steps"]):
        x, y = parity.batch(step, micro * gas * world)
        for m in range(gas):
            lo = (m * world + rank) * micro
            sync = m == gas - 1
            engine.set_gradient_accumulation_boundary(is_boundary=sync)
            engine.backward(engine(x[lo : lo + micro], y[lo : lo + micro]))
            if sync:
                engine.step()
    return engine


def _exclude_frozen(rank: int, world: int, tmp: str) -> dict:
    """save_checkpoint(exclude_frozen_parameters=True) leaves the frozen parameters out;
    load_checkpoint(load_module_strict=False) restores the rest, strict refuses."""
    import json
    import os

    from zeroshard.checkpoint.format import CheckpointError

    out: dict[str, Any] = {}
    for stage in (2, 3):
        case = {"stage": stage, "micro": 2, "steps": 2, "frozen": True}
        _, trained = parity.train(case, rank, world)
        frozen = sorted(n for n, p in trained.module.named_parameters() if not p.requires_grad)
        path = os.path.join(tmp, f"ex{stage}")
        trained.save_checkpoint(path, exclude_frozen_parameters=True)
        want = parity.full_params(trained)
        trained.destroy()
        with open(os.path.join(path, "global_step2", "manifest.json")) as f:
            manifest = json.load(f)
        saved = set(manifest["params"]) | set(manifest["whole"])
        _, fresh = parity.train({**case, "steps": 0}, rank, world)
        try:
            fresh.load_checkpoint(path)
            out[f"strict{stage}"] = "loaded"
        except CheckpointError as e:
            out[f"strict{stage}"] = str(e)
        fresh.load_checkpoint(path, load_module_strict=False)
        out[f"exclude{stage}"] = [
            bool(frozen),
            sorted(saved & set(frozen)),
            parity.max_param_diff(want, parity.full_params(fresh)),
            fresh.global_steps,
        ]
        fresh.destroy()
    return out


def _checks(rank: int, world: int, tmp: str) -> dict:
    import zeroshard

    comm = zeroshard.comm  # deepspeed.comm's module-level names, counted in comm.LEDGER
    comm.LEDGER.reset()
    t = torch.full((4,), float(rank + 1))
    comm.all_reduce(t)
    b = torch.full((2,), float(rank))
    comm.broadcast(b, src=1)
    parts = [torch.zeros(2) for _ in range(world)]
    comm.all_gather(parts, torch.full((2,), float(rank)))
    comm.barrier()
    out = {
        "comm": [t.tolist(), b.tolist(), [p.tolist() for p in parts]],
        "who": [comm.get_rank(), comm.get_world_size(), comm.is_initialized()],
        "ledger": sorted(comm.LEDGER.snapshot()),
    }
    for stage in (2, 3):
        case = {"stage": stage, "micro": 2, "gas": 4, "steps": 2, "frozen": False, "clip": 1.0}
        _, plain = parity.train(case, rank, world)
        want = parity.full_params(plain)
        plain.destroy()
        driven = _accelerate_style(case, rank, world)
        got = parity.full_params(driven)
        out[f"boundary{stage}"] = parity.max_param_diff(want, got)
        out[f"steps{stage}"] = driven.global_steps
        cfg = driven.config
        out[f"config{stage}"] = [
            isinstance(cfg, dict),
            cfg["zero_optimization"]["stage"],
            driven.parsed_config.zero_optimization.stage,
        ]
        state = driven._zero3_consolidated_16bit_state_dict()
        if rank == 0:
            out[f"consolidated{stage}"] = max(
                (state[n].float() - t).abs().max().item() for n, t in got.items()
            )
            out[f"keys{stage}"] = sorted(state) == sorted(driven.module.state_dict())
        else:
            out[f"consolidated{stage}"] = len(state)
        out[f"gather_on_save{stage}"] = driven.zero_gather_16bit_weights_on_model_save()
        out[f"norm{stage}"] = driven.get_global_grad_norm() is not None
        out[f"overflow{stage}"] = driven.optimizer.overflow
        x, y = parity.batch(0, 2)
        driven.compile(backend="eager")  # every stage (issue 32; tests/test_compile.py)
        out[f"compiled{stage}"] = [driven.is_compiled, bool(torch.isfinite(driven(x, y)))]
        driven.destroy()
    out.update(_exclude_frozen(rank, world, tmp))
    return out


def test_engine_methods_for_hugging_face(tmp_path) -> None:
    for rank, r in enumerate(multirank.run(_checks, 2, str(tmp_path), timeout=300)):
        assert r["comm"] == [[3.0] * 4, [1.0, 1.0], [[0.0, 0.0], [1.0, 1.0]]]
        assert r["who"] == [rank, 2, True]
        assert r["ledger"] == ["all_gather", "all_reduce", "broadcast"]
        for stage in (2, 3):
            assert r[f"boundary{stage}"] <= 1e-6, (stage, r)
            assert r[f"steps{stage}"] == 2
            assert r[f"config{stage}"] == [True, stage, stage]
            if rank == 0:
                assert r[f"consolidated{stage}"] == 0.0 and r[f"keys{stage}"]
            else:
                assert r[f"consolidated{stage}"] == 0  # other ranks get an empty dict
            assert r[f"gather_on_save{stage}"] is False  # the key's default
            assert r[f"norm{stage}"] and r[f"overflow{stage}"] is False
        assert r["compiled2"] == r["compiled3"] == [True, True]
        for stage in (2, 3):
            assert r[f"exclude{stage}"] == [True, [], 0.0, 2], r
            assert "missing from the checkpoint" in r[f"strict{stage}"]
