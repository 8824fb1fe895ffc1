"""Checkpoints: bitwise resume, resharding across world sizes and stages, atomic saves
under SIGKILL, export to consolidated safetensors, and clear errors on bad input."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import multirank
import parity
import pytest
import torch

ROWS = 6  # global batch: divisible by 1, 2 and 3 ranks
CPU = {"device": "cpu"}


def _config(case: dict, world: int) -> dict:
    cfg = {
        "train_batch_size": ROWS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": case["stage"],
            "reduce_bucket_size": 3000,
            "allgather_bucket_size": 3000,
            "stage3_param_persistence_threshold": 0,
            **case.get("zero", {}),
        },
        "steps_per_print": 10**6,
    }
    if case.get("scheduler", True):
        cfg["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-3},
        }
    if case.get("dtype") == "fp16":
        cfg["fp16"] = {
            "enabled": True,
            "initial_scale_power": 6,
            "loss_scale_window": 3,
            "hysteresis": 1,
        }
    if case.get("dtype") == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _engine(case: dict, world: int):
    import zeroshard

    model = parity.build_model(case)
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=parity.param_groups(model), config=_config(case, world)
    )
    return engine


def _train(engine, rank: int, world: int, steps: range) -> list[float]:
    micro = ROWS // world
    losses = []
    for step in steps:
        x, y = parity.batch(step, ROWS)
        loss = engine(x[rank * micro : (rank + 1) * micro], y[rank * micro : (rank + 1) * micro])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    return losses


RESUME_CASES = [
    {"stage": 0},
    {"stage": 1},
    {"stage": 2},
    {"stage": 3},
    {"stage": 2, "zero": {"offload_optimizer": CPU}},
    {"stage": 3, "zero": {"offload_optimizer": CPU, "offload_param": CPU}},
    {"stage": 1, "dtype": "fp16"},
    {"stage": 3, "dtype": "bf16"},
]


def _resume_phase(rank: int, world: int, phase: str, root: str) -> list:
    out = []
    for i, case in enumerate(RESUME_CASES):
        ckpt = os.path.join(root, f"case{i}")
        engine = _engine(case, world)
        if phase == "straight":
            losses = _train(engine, rank, world, range(10))[5:]
        elif phase == "first":
            _train(engine, rank, world, range(5))
            engine.save_checkpoint(ckpt, client_state={"epoch": 3})
            out.append(None)
            continue
        else:
            _, client = engine.load_checkpoint(ckpt)
            assert client == {"epoch": 3} and engine.global_steps == 5
            losses = _train(engine, rank, world, range(5, 10))
        params = parity.full_params(engine)
        out.append(
            {
                "losses": losses,
                "params": {k: v.flatten().tolist() for k, v in params.items()},
                "scale": engine.cur_scale,
                "lr": engine.get_lr(),
            }
        )
    return out


def test_exact_resume(tmp_path) -> None:
    straight = multirank.run(_resume_phase, 2, "straight", str(tmp_path), timeout=600)
    multirank.run(_resume_phase, 2, "first", str(tmp_path), timeout=600)
    resumed = multirank.run(_resume_phase, 2, "second", str(tmp_path), timeout=600)
    for i, case in enumerate(RESUME_CASES):
        a, b = straight[0][i], resumed[0][i]
        assert a["losses"] == b["losses"], (case, a["losses"], b["losses"])  # bitwise
        assert a["params"] == b["params"], case
        assert a["scale"] == b["scale"] and a["lr"] == b["lr"], case


# -- resharding ---------------------------------------------------------------------------
def _reference(case: dict) -> tuple[list[float], dict]:
    """Single-process fp32 AdamW, 10 steps on the whole batch, with clipping."""
    model = parity.build_model(case)
    opt = torch.optim.AdamW(
        [
            {
                "params": [p for p in model.parameters() if p.dim() >= 2 and p.requires_grad],
                "weight_decay": 0.1,
            },
            {
                "params": [p for p in model.parameters() if p.dim() < 2],
                "weight_decay": 0.0,
                "lr": parity.LR_NODECAY,
            },
        ],
        lr=1e-3,
    )
    losses = []
    for step in range(10):
        x, y = parity.batch(step, ROWS)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses[5:], {n: p.detach() for n, p in model.named_parameters()}


def _reshard(rank: int, world: int, stage: int, src: str, dst: str | None) -> dict:
    case = {"stage": stage, "scheduler": False}
    engine = _engine(case, world)
    if dst is not None:  # first half, then save
        _train(engine, rank, world, range(5))
        engine.save_checkpoint(dst)
        return {}
    engine.load_checkpoint(src)
    losses = _train(engine, rank, world, range(5, 10))
    ref_losses, ref_params = _reference(case)
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "param_diff": parity.max_param_diff(parity.full_params(engine), ref_params),
    }


def test_reshard_across_world_sizes_and_stages(tmp_path) -> None:
    a, c = str(tmp_path / "w3s3"), str(tmp_path / "w2s2")
    multirank.run(_reshard, 3, 3, None, a, timeout=300)  # save at 3 ranks, stage 3
    multirank.run(_reshard, 2, 2, None, c, timeout=300)  # save at 2 ranks, stage 2
    for world, stage, src in ((2, 1, a), (1, 0, a), (3, 3, c), (1, 2, c)):
        for r in multirank.run(_reshard, world, stage, src, None, timeout=300):
            assert r["loss_diff"] <= 2e-5 and r["param_diff"] <= 2e-5, (world, stage, src, r)


# -- atomic saves under SIGKILL ---------------------------------------------------------------
SAVE_LOOP = textwrap.dedent(
    """
    import os, sys, torch, zeroshard
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    cfg = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2}}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    engine.save_checkpoint(sys.argv[1], tag="t0")
    print("ready", flush=True)
    i = 1
    while True:
        engine.backward(engine(torch.randn(2, 256)).sum())
        engine.step()
        engine.save_checkpoint(sys.argv[1], tag=f"t{i % 3}")
        i += 1
    """
)


def test_sigkill_during_save_never_breaks_latest(tmp_path) -> None:
    from zeroshard.checkpoint.load import read_manifest, resolve_tag

    script = tmp_path / "save_loop.py"
    script.write_text(SAVE_LOOP)
    root = tmp_path / "ckpt"
    rng = random.Random(0)
    for trial in range(20):
        proc = subprocess.Popen(
            [sys.executable, str(script), str(root)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline().strip() == "ready", f"trial {trial}: the saver did not start"
        time.sleep(rng.uniform(0.0, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        tag = resolve_tag(str(root), None)
        read_manifest(str(root / tag))  # every file present, complete and of the recorded size


# -- export ---------------------------------------------------------------------------------
def _export(rank: int, world: int, root: str) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    import zeroshard

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(cfg)
    engine, *_ = zeroshard.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={
            "train_batch_size": 2 * world,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        },
    )
    ids = torch.randint(0, 64, (2, 8))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(os.path.join(root, "ckpt"))
    engine.save_16bit_model(os.path.join(root, "w16"))
    from zeroshard.zero import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
    if rank == 0:
        from safetensors.torch import save_file

        save_file(values, os.path.join(root, "gathered.safetensors"))
    return {}


def test_export_round_trip(tmp_path) -> None:
    pytest.importorskip("transformers")
    from safetensors.torch import load_file
    from transformers import GPT2Config, GPT2LMHeadModel

    from zeroshard.cli import main as cli

    multirank.run(_export, 2, str(tmp_path), timeout=300)
    out = str(tmp_path / "model.safetensors")
    assert cli(["convert", str(tmp_path / "ckpt"), out]) == 0
    weights = load_file(out)
    gathered = load_file(str(tmp_path / "gathered.safetensors"))
    for name, value in gathered.items():
        assert torch.equal(weights[name], value), name
    # loads into a transformers GPT-2 with its own names (tied lm_head included)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    fresh = GPT2LMHeadModel(cfg)
    missing, unexpected = fresh.load_state_dict(weights, strict=False)
    assert not unexpected and not [m for m in missing if not m.endswith("attn.bias")], (
        missing,
        unexpected,
    )
    assert torch.equal(fresh.lm_head.weight, gathered["transformer.wte.weight"])
    # sharded export with an index
    assert (
        cli(
            [
                "convert",
                str(tmp_path / "ckpt"),
                str(tmp_path / "sharded"),
                "--max-shard-size",
                "40KB",
            ]
        )
        == 0
    )
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    w16 = load_file(str(tmp_path / "w16" / "model.safetensors"))
    for name, value in gathered.items():
        assert torch.equal(w16[name], value), name


# -- bad input -------------------------------------------------------------------------------
def _bad_inputs(rank: int, world: int, root: str) -> dict:
    import shutil

    import zeroshard
    from zeroshard.checkpoint.load import CheckpointError

    case = {"stage": 1}
    engine = _engine(case, world)
    _train(engine, rank, world, range(2))
    good = os.path.join(root, "good")
    engine.save_checkpoint(good, tag="a")
    errors = {}

    def attempt(key, fn):
        try:
            fn()
            errors[key] = None
        except CheckpointError as exc:
            errors[key] = str(exc)

    attempt("wrong_tag", lambda: engine.load_checkpoint(good, tag="nope"))
    attempt("no_latest", lambda: engine.load_checkpoint(os.path.join(root, "empty")))
    for key, damage in (
        ("missing_file", "missing"),
        ("truncated", "truncate"),
        ("pickle", "pickle"),
    ):
        d = os.path.join(root, key)
        shutil.copytree(os.path.join(good, "a"), d)
        f = os.path.join(d, "zs_rank00000.safetensors")
        if damage == "missing":
            os.remove(f)
        elif damage == "truncate":
            with open(f, "r+b") as fh:
                fh.truncate(os.path.getsize(f) - 10)
        else:  # a pickle that would create a file if it were ever unpickled

            class Boom:
                def __reduce__(self):
                    return (open, (os.path.join(root, "PWNED"), "w"))

            import pickle

            with open(os.path.join(d, "optimizer.pt"), "wb") as fh:
                pickle.dump(Boom(), fh)
            os.remove(os.path.join(d, "manifest.json"))
        attempt(key, lambda d=d: engine.load_checkpoint(d))
    # a model that does not fit: different width
    other = parity.build_model({**case, "tied": False})
    eng2, *_ = zeroshard.initialize(
        model=other, model_parameters=other.parameters(), config=_config(case, world)
    )
    attempt("mismatch", lambda: eng2.load_checkpoint(good, tag="a"))
    before = parity.full_params(engine)
    attempt("after", lambda: engine.load_checkpoint(good, tag="a"))
    return {
        "errors": errors,
        "pwned": os.path.exists(os.path.join(root, "PWNED")),
        "intact": all(torch.equal(before[n], v) for n, v in parity.full_params(engine).items()),
    }


def test_bad_checkpoints_fail_clearly(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    r = multirank.run(_bad_inputs, 1, str(tmp_path), timeout=300)[0]
    e = r["errors"]
    assert "nope" in e["wrong_tag"] and "no such checkpoint" in e["wrong_tag"]
    assert "latest" in e["no_latest"]
    assert "zs_rank00000.safetensors: missing" in e["missing_file"]
    assert "zs_rank00000.safetensors" in e["truncated"] and "truncated" in e["truncated"]
    assert "no manifest.json" in e["pickle"] and "never loaded" in e["pickle"]
    assert "head.weight" in e["mismatch"] and "missing from the checkpoint" in e["mismatch"]
    assert e["after"] is None and r["intact"]
    assert not r["pwned"]
