"""Checkpoints: bitwise resume, resharding across world sizes and stages, atomic saves
under SIGKILL, export to consolidated safetensors, and clear errors on bad input."""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any
from unittest import mock

import cases
import multirank
import parity
import pytest
import torch
from logs import ListHandler
from resume import CPU, RESUME_CASES, ROWS, check_resume
from resume import config as _config
from resume import make as _engine
from resume import resume_phase as _resume_phase
from resume import train as _train


def test_exact_resume(tmp_path, subtests: pytest.Subtests) -> None:
    straight = multirank.run(_resume_phase, 2, "straight", str(tmp_path), timeout=600)
    first = multirank.run(_resume_phase, 2, "first", str(tmp_path), timeout=600)
    resumed = multirank.run(_resume_phase, 2, "second", str(tmp_path), timeout=600)
    check_resume(subtests, RESUME_CASES, straight, first, resumed)


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


_REF: dict = {}


def _job(rank: int, world: int, zero: dict, action: str, where: str) -> dict:
    case = {"stage": zero["stage"], "scheduler": False, "zero": zero}
    engine = _engine(case, world)
    if action == "save":  # first half, then save
        _train(engine, rank, world, range(5))
        engine.save_checkpoint(where)
        return {}
    engine.load_checkpoint(where)
    losses = _train(engine, rank, world, range(5, 10))
    if "ref" not in _REF:
        _REF["ref"] = _reference(case)
    ref_losses, ref_params = _REF["ref"]
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "param_diff": parity.max_param_diff(parity.full_params(engine), ref_params),
    }


def _job_name(zero: dict, action: str, where: str) -> str:
    return f"{action} {os.path.basename(where)} {cases.label(zero)}"


def _reshard(rank: int, world: int, jobs: list) -> dict:
    """Each job: (zero section, "save" or "load", directory). Several per spawn, each a
    named case."""
    return cases.run_named(
        (_job_name(*job), functools.partial(_job, rank, world, *job)) for job in jobs
    )


def test_reshard_across_world_sizes_and_stages(tmp_path, subtests: pytest.Subtests) -> None:
    a, c = str(tmp_path / "w3s3"), str(tmp_path / "w2s2")
    off = str(tmp_path / "w2s2_offload")  # CPU optimizer offload
    pers = str(tmp_path / "w3s3_persist")  # small parameters persistent (not partitioned)
    s1, s2, s3 = {"stage": 1}, {"stage": 2}, {"stage": 3}
    s0 = {"stage": 0}
    offload = {"offload_optimizer": CPU}
    persist = {"stage": 3, "stage3_param_persistence_threshold": 200}
    save_jobs: dict[int, list[tuple[dict, str, str]]] = {
        3: [(s3, "save", a), (persist, "save", pers)],
        2: [(s2, "save", c), ({**s2, **offload}, "save", off)],
    }
    for world, saves in save_jobs.items():  # each save ran on every rank
        results = multirank.run(_reshard, world, saves, timeout=300)
        names = [_job_name(*job) for job in saves]
        cases.check_each(subtests, results, lambda name, per_rank: None, names=names)
    loads: dict[int, list[tuple[dict, str]]] = {
        2: [(s1, a), ({**s2, **offload}, a), (persist, pers)],  # no offload -> offload
        1: [(s0, a), (s2, c), (s0, pers)],
        3: [(s3, c), (s1, off)],  # offload -> no offload
    }
    for world, jobs in loads.items():
        named = {_job_name(z, "load", src): (z, src) for z, src in jobs}
        results = multirank.run(_reshard, world, [(z, "load", src) for z, src in jobs], timeout=300)

        def check(name: str, per_rank: list, world: int = world, named: dict = named) -> None:
            z, src = named[name]
            for res in per_rank:
                assert res["loss_diff"] <= 2e-5 and res["param_diff"] <= 2e-5, (world, z, src, res)

        cases.check_each(subtests, results, check, names=list(named))


# -- atomic saves under SIGKILL ---------------------------------------------------------------
_KILL_COMMON = """
import hashlib, json, os, sys, torch, zeroshard
for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
    os.environ.pop(k, None)
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
cfg = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 2}}
engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)

def digest():
    # parameters and every optimizer state tensor, bitwise
    h = hashlib.sha256()
    for p in engine.module.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    for group in engine.optimizer.inner.param_groups:
        for v in group["params"]:
            for k, t in sorted(engine.optimizer.inner.state.get(v, {}).items()):
                h.update(k.encode() + t.detach().reshape(-1).contiguous().numpy().tobytes())
    return h.hexdigest()
"""

# a fork server: the engine is built once; for each "go" read from stdin a child saves
# in a loop (each checkpoint carrying, in client_state, the digest of what it holds)
# until the test kills it; the server then reaps it and says "dead". World size 1: the
# child never touches the process group it inherits.
SAVE_LOOP = _KILL_COMMON + textwrap.dedent(
    """
    def save(tag):
        engine.save_checkpoint(sys.argv[1], tag=tag,
                               client_state={"digest": digest(), "step": engine.global_steps})

    def child():
        save("t0")
        print(f"ready {os.getpid()}", flush=True)
        i = 1
        while True:
            engine.backward(engine(torch.randn(2, 256)).sum())
            engine.step()
            save(f"t{i % 3}")
            i += 1

    print("server", flush=True)
    for line in sys.stdin:
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                child()
            except BaseException as exc:
                print(f"error {exc!r}", flush=True)
            os._exit(1)
        _, status = os.waitpid(pid, 0)
        print(f"dead {status}", flush=True)
    """
)

# for each directory read from stdin: load what `latest` names and compare it with the
# digest the saver recorded
VERIFY_LOOP = _KILL_COMMON + textwrap.dedent(
    """
    print("ready", flush=True)
    for line in sys.stdin:
        try:
            path, client = engine.load_checkpoint(line.strip())
            ok = client["step"] == engine.global_steps and client["digest"] == digest()
            print(json.dumps({"ok": ok, "path": path, "step": engine.global_steps}), flush=True)
        except Exception as exc:
            print(json.dumps({"ok": False, "error": repr(exc)}), flush=True)
    """
)


def test_sigkill_during_save_never_breaks_latest(tmp_path) -> None:
    """20 saves killed with SIGKILL at random moments; after each, load what `latest`
    names with load_checkpoint and compare it bitwise with what the saver held."""
    save_script, verify_script = tmp_path / "save_loop.py", tmp_path / "verify.py"
    save_script.write_text(SAVE_LOOP)
    verify_script.write_text(VERIFY_LOOP)
    root = tmp_path / "ckpt"
    pipes: dict[str, Any] = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    server = subprocess.Popen(
        [sys.executable, "-W", "ignore", str(save_script), str(root)], **pipes
    )
    verifier = subprocess.Popen([sys.executable, str(verify_script)], **pipes)
    assert server.stdin and server.stdout and verifier.stdin and verifier.stdout
    try:
        assert server.stdout.readline().strip() == "server"
        assert verifier.stdout.readline().strip() == "ready"
        rng = random.Random(0)
        steps = []
        for trial in range(20):
            server.stdin.write("go\n")
            server.stdin.flush()
            word, pid = server.stdout.readline().split()
            assert word == "ready", (trial, word, pid)
            time.sleep(rng.uniform(0.0, 0.4))
            os.kill(int(pid), signal.SIGKILL)
            assert server.stdout.readline().split()[0] == "dead", trial
            verifier.stdin.write(f"{root}\n")
            verifier.stdin.flush()
            result = json.loads(verifier.stdout.readline())
            assert result["ok"], (trial, result)
            steps.append(result["step"])
        assert max(steps) > 0, steps  # kills landed after training had started
    finally:
        for proc in (server, verifier):
            proc.kill()
            proc.wait(timeout=30)


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

    from zeroshard.tools.cli import main as cli

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
    # the shards hold every tensor once, equal to the single-file export (and so to the
    # gathered parameters)
    sharded: dict[str, Any] = {}
    for fname in sorted(set(index["weight_map"].values())):
        part = load_file(str(tmp_path / "sharded" / fname))
        assert not set(part) & set(sharded), fname
        assert all(index["weight_map"][k] == fname for k in part), fname
        sharded.update(part)
    assert sharded.keys() == weights.keys() == index["weight_map"].keys()
    for name, value in weights.items():
        assert torch.equal(sharded[name], value), name
    for name, value in gathered.items():
        assert torch.equal(sharded[name], value), name
    # --dtype bf16: the fp32 export, cast
    out16 = str(tmp_path / "model-bf16.safetensors")
    assert cli(["convert", str(tmp_path / "ckpt"), out16, "--dtype", "bf16"]) == 0
    bf16 = load_file(out16)
    assert bf16.keys() == weights.keys()
    for name, value in weights.items():
        want = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert bf16[name].dtype == want.dtype and torch.equal(bf16[name], want), name
    w16 = load_file(str(tmp_path / "w16" / "model.safetensors"))
    for name, value in gathered.items():
        assert torch.equal(w16[name], value), name


# -- bad input -------------------------------------------------------------------------------
def _gpt_engine(world: int, unused: bool = False, **cfg):
    """An engine on a GPT shaped unlike parity.build_model's (``cfg`` overrides; with
    ``unused``, one more parameter)."""
    import zeroshard
    from zeroshard.models import GPT, GPTConfig

    torch.manual_seed(7)
    model = GPT(GPTConfig(**{"vocab_size": 64, "seq_len": 16, "n_layer": 2, "d_model": 32, **cfg}))
    model.pos_emb.weight.requires_grad_(False)
    if unused:
        model.unused = torch.nn.Parameter(torch.randn(7))
    engine, *_ = zeroshard.initialize(
        model=model,
        model_parameters=parity.param_groups(model),
        config=_config({"stage": 1}, world),
    )
    return engine


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def _pickle_bomb(path: str, marker: str) -> None:
    """A pickle that would create ``marker`` if it were ever unpickled."""
    import pickle

    class Boom:
        def __reduce__(self):
            return (open, (marker, "w"))

    with open(path, "wb") as fh:
        pickle.dump(Boom(), fh)


def _bad_inputs(rank: int, world: int, root: str) -> dict:
    import shutil

    import zeroshard
    from zeroshard.checkpoint.load import CheckpointError
    from zeroshard.checkpoint.safetensors_io import read_header

    case = {"stage": 1}
    engine = _engine(case, world)
    _train(engine, rank, world, range(2))
    good = os.path.join(root, "good")
    engine.save_checkpoint(good, tag="a")
    _train(engine, rank, world, range(2, 3))  # now the engine differs from the checkpoint
    before = parity.full_params(engine)  # snapshot BEFORE any failed load
    errors: dict[str, Any] = {}

    def attempt(key, fn):
        try:
            fn()
            errors[key] = None
        except CheckpointError as exc:
            errors[key] = str(exc)

    attempt("wrong_tag", lambda: engine.load_checkpoint(good, tag="nope"))
    attempt("no_latest", lambda: engine.load_checkpoint(os.path.join(root, "empty")))
    rank_file = "zs_rank00000.safetensors"
    for key in (
        "missing_file",
        "truncated",
        "pickle",
        "bad_manifest",
        "bad_header",
        "renamed_key",
        "pickle_complete",
    ):
        d = os.path.join(root, key)
        shutil.copytree(os.path.join(good, "a"), d)
        f = os.path.join(d, rank_file)
        if key == "missing_file":
            os.remove(f)
        elif key == "truncated":
            with open(f, "r+b") as fh:
                fh.truncate(os.path.getsize(f) - 10)
        elif key == "pickle":  # a DeepSpeed-style directory: pickles, no manifest
            _pickle_bomb(os.path.join(d, "optimizer.pt"), os.path.join(root, "PWNED"))
            os.remove(os.path.join(d, "manifest.json"))
        elif key == "pickle_complete":  # a complete checkpoint with a pickle dropped in
            _pickle_bomb(os.path.join(d, "optimizer.pt"), os.path.join(root, "PWNED"))
            _pickle_bomb(os.path.join(d, "mp_rank_00_model_states.pt"), os.path.join(root, "PWNED"))
            continue  # loaded below, after the untouched-engine check
        elif key == "bad_manifest":
            with open(os.path.join(d, "manifest.json"), "r+b") as fh:
                fh.seek(40)
                fh.write(b"\x00{{{garbage")
        elif key == "bad_header":  # same size, JSON header garbled
            with open(f, "r+b") as fh:
                fh.seek(12)
                fh.write(b"\xff\xfe{{")
        else:  # the last piece's last state renamed (same length): in no header check,
            # a load would write every parameter before finding it missing
            keys = [k for k in read_header(f) if ":" in k and k.split(":")[0] != "rng"]
            keys = [k for k in keys if not k.startswith("whole:")]
            victim = keys[-1].encode()
            with open(f, "r+b") as fh:
                raw = fh.read(1 << 20)  # the header comes first
                at = raw.index(b'"' + victim + b'"') + 1
                fh.seek(at)
                fh.write(b"X" + victim[1:])
            errors["renamed_key_name"] = victim.decode()
        attempt(key, lambda d=d: engine.load_checkpoint(d))
    intact = _same(before, parity.full_params(engine))

    # models that do not fit; each engine snapshotted before its failed load
    results = {}
    for key, eng in (
        ("mismatch", None),  # head not tied: head.weight missing from the checkpoint
        ("unexpected", _gpt_engine(world, bias=False)),  # the checkpoint's biases
        ("shape", _gpt_engine(world, vocab_size=80)),  # tok_emb.weight 64 vs 80 rows
    ):
        if eng is None:
            other = parity.build_model({**case, "tied": False})
            eng, *_ = zeroshard.initialize(
                model=other,
                model_parameters=parity.param_groups(other),
                config=_config(case, world),
            )
        snap = parity.full_params(eng)
        attempt(key, lambda eng=eng: eng.load_checkpoint(good, tag="a"))
        results[key] = _same(snap, parity.full_params(eng))

    pwned_before = os.path.exists(os.path.join(root, "PWNED"))
    attempt(
        "pickle_complete", lambda: engine.load_checkpoint(os.path.join(root, "pickle_complete"))
    )
    loaded = parity.full_params(engine)
    attempt("after", lambda: engine.load_checkpoint(good, tag="a"))
    return {
        "errors": errors,
        "pwned": pwned_before or os.path.exists(os.path.join(root, "PWNED")),
        "intact": intact,
        "others_intact": results,
        "pickle_complete_loaded": _same(loaded, parity.full_params(engine)),
    }


def test_bad_checkpoints_fail_clearly(tmp_path, capsys) -> None:
    from zeroshard.tools.cli import main as cli

    (tmp_path / "empty").mkdir()
    r = multirank.run(_bad_inputs, 1, str(tmp_path), timeout=300)[0]
    e = r["errors"]
    assert "nope" in e["wrong_tag"] and "no such checkpoint" in e["wrong_tag"]
    assert "latest" in e["no_latest"]
    assert "zs_rank00000.safetensors: missing" in e["missing_file"]
    assert "zs_rank00000.safetensors" in e["truncated"] and "truncated" in e["truncated"]
    assert "no manifest.json" in e["pickle"] or "manifest.json: missing" in e["pickle"]
    assert "only as part of a DeepSpeed checkpoint directory" in e["pickle"]
    assert "manifest.json" in e["bad_manifest"] and "corrupt" in e["bad_manifest"]
    assert "zs_rank00000.safetensors" in e["bad_header"] and "header" in e["bad_header"]
    assert "zs_rank00000.safetensors" in e["renamed_key"]
    assert e["renamed_key_name"] in e["renamed_key"]
    assert "head.weight" in e["mismatch"] and "missing from the checkpoint" in e["mismatch"]
    assert "not in the model" in e["unexpected"] and "blocks.0.attn.qkv.bias" in e["unexpected"]
    assert "shape mismatch" in e["shape"] and "tok_emb.weight" in e["shape"]
    # a failed load leaves the engine that attempted it as it was
    assert r["intact"], "a failed load changed the engine's parameters"
    assert all(r["others_intact"].values()), r["others_intact"]
    # a complete checkpoint with stray pickles loads, and no pickle is ever opened
    assert e["pickle_complete"] is None and r["pickle_complete_loaded"]
    assert e["after"] is None
    assert not r["pwned"]
    # `zeroshard convert` never unpickles either, and names the file at fault
    out = str(tmp_path / "exported.safetensors")
    assert cli(["convert", str(tmp_path / "pickle_complete"), out]) == 0
    assert cli(["convert", str(tmp_path / "pickle"), str(tmp_path / "x.safetensors")]) == 2
    assert cli(["convert", str(tmp_path / "bad_header"), str(tmp_path / "y.safetensors")]) == 2
    assert "zs_rank00000.safetensors" in capsys.readouterr().out
    assert cli(["convert", str(tmp_path / "bad_manifest"), str(tmp_path / "z.safetensors")]) == 2
    assert "manifest.json" in capsys.readouterr().out
    assert not (tmp_path / "PWNED").exists()


# -- load options --------------------------------------------------------------------------
def _opt_state(engine) -> tuple[list[float], dict]:
    """(group steps, {state kind: concatenated values}) of this rank's optimizer."""
    from zeroshard.checkpoint.shards import ShardAccess

    access = ShardAccess(engine)
    states = {}
    for key in [k for k in access.kinds() if k not in ("param", "master")]:
        states[key] = torch.cat(
            [
                access.get(key, p.shard_lo, p.shard_lo + p.hi - p.lo)
                for p in access.pieces
                if p.group >= 0
            ]
        )
    return access.group_steps(), states


def _failed_load(engine, root: str) -> tuple[str | None, bool]:
    """Load tag "s" expecting a CheckpointError: (its message or None, whether the
    parameters are as they were)."""
    from zeroshard.checkpoint.load import CheckpointError

    snap = parity.full_params(engine)
    try:
        engine.load_checkpoint(root, tag="s")
        error = None
    except CheckpointError as exc:
        error = str(exc)
    return error, _same(snap, parity.full_params(engine))


def _load_options(rank: int, world: int, root: str) -> dict:
    import logging

    case = {"stage": 1}
    src = _engine(case, world)
    _train(src, rank, world, range(3))
    src.save_checkpoint(root, tag="s")
    saved = parity.full_params(src)
    steps, states = _opt_state(src)
    sched = src.lr_scheduler.state_dict()
    fresh_sched = _engine(case, world).lr_scheduler.state_dict()
    assert sched != fresh_sched
    out: dict[str, Any] = {}

    def check(key, engine, *, opt, sched_loaded, counters):
        st, sv = _opt_state(engine)
        out[key] = {
            "params": _same(saved, parity.full_params(engine)),
            "opt": st == steps and all(torch.equal(sv[k], states[k]) for k in states)
            if opt
            else st == [0.0] * len(st) and all(not v.any() for v in sv.values()),
            "sched": engine.lr_scheduler.state_dict() == (sched if sched_loaded else fresh_sched),
            "counters": engine.global_steps == (3 if counters else 0),
        }

    e = _engine(case, world)
    e.load_checkpoint(root, tag="s")
    check("all", e, opt=True, sched_loaded=True, counters=True)
    e = _engine(case, world)
    e.load_checkpoint(root, tag="s", load_optimizer_states=False)
    check("no_optimizer", e, opt=False, sched_loaded=True, counters=True)
    e = _engine(case, world)
    e.load_checkpoint(root, tag="s", load_lr_scheduler_states=False)
    check("no_scheduler", e, opt=True, sched_loaded=False, counters=True)
    e = _engine(case, world)
    e.load_checkpoint(root, tag="s", load_module_only=True)
    check("module_only", e, opt=False, sched_loaded=False, counters=False)

    # an optimizer that cannot take the saved state: a clear error, nothing written
    sgd = _engine(
        {**case, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}, world
    )
    out["sgd_error"], out["sgd_untouched"] = _failed_load(sgd, root)
    sgd.load_checkpoint(root, tag="s", load_optimizer_states=False)
    out["sgd_params_only"] = _same(saved, parity.full_params(sgd))

    # load_module_strict: a model without biases (the checkpoint's are unexpected) and
    # with one parameter the checkpoint lacks
    e = _gpt_engine(world, bias=False, unused=True)
    snap = parity.full_params(e)
    out["strict_error"], out["strict_untouched"] = _failed_load(e, root)
    records: list[logging.LogRecord] = []
    handler = ListHandler(records)
    logging.getLogger("zeroshard").addHandler(handler)
    try:
        e.load_checkpoint(root, tag="s", load_module_strict=False)
    finally:
        logging.getLogger("zeroshard").removeHandler(handler)
    got = parity.full_params(e)
    out["lenient_warning"] = " ".join(r.getMessage() for r in records)
    out["lenient_loaded"] = all(torch.equal(got[n], saved[n]) for n in got if n != "unused")
    out["lenient_kept_missing"] = torch.equal(got["unused"], snap["unused"])
    return out


def test_load_options(tmp_path) -> None:
    r = multirank.run(_load_options, 2, str(tmp_path), timeout=300)[0]
    for key in ("all", "no_optimizer", "no_scheduler", "module_only"):
        assert all(r[key].values()), (key, r[key])
    err = r["strict_error"]
    assert err and "missing from the checkpoint: ['unused']" in err, err
    assert "not in the model" in err and "blocks.0.attn.qkv.bias" in err, err
    assert r["strict_untouched"]
    assert "exp_avg" in r["sgd_error"] and "SGD" in r["sgd_error"], r["sgd_error"]
    assert r["sgd_untouched"] and r["sgd_params_only"]
    assert "unused" in r["lenient_warning"] and "blocks.0.attn.qkv.bias" in r["lenient_warning"]
    assert r["lenient_loaded"] and r["lenient_kept_missing"]


# -- failed saves -----------------------------------------------------------------------------
def _save_failures(rank: int, world: int, root: str) -> dict:
    import zeroshard.checkpoint.save as save_mod
    from zeroshard.checkpoint.save import CheckpointSaveError

    engine = _engine({"stage": 2}, world)
    _train(engine, rank, world, range(2))
    engine.save_checkpoint(root, tag="a")
    out: dict = {}

    def attempt(key, tag):
        try:
            engine.save_checkpoint(root, tag=tag)
            out[key] = None
        except CheckpointSaveError as exc:
            out[key] = str(exc)
        left = {tag, f".tmp-{tag}", f"{tag}.old"}
        out[key + "_published"] = sorted(
            n for n in os.listdir(root) if n in left or n.startswith(f".tmp-{tag}.")
        )

    # rank 0's manifest cannot be JSON: a param-group value, then a scheduler state
    engine.optimizer.param_groups[0]["custom"] = {1, 2}
    attempt("group", "b")
    del engine.optimizer.param_groups[0]["custom"]
    engine.lr_scheduler.state_dict = lambda: {"last_batch_iteration": torch.tensor(2)}
    attempt("scheduler", "c")
    del engine.lr_scheduler.state_dict
    # an I/O error on rank 0 while publishing; on rank 1 while writing its file
    real_write, real_writer = save_mod.write_text_atomic, save_mod.StreamWriter

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with mock.patch.object(save_mod, "write_text_atomic", disk_full if rank == 0 else real_write):
        attempt("publish_io", "d")
    with mock.patch.object(save_mod, "StreamWriter", disk_full if rank == 1 else real_writer):
        attempt("rank1_io", "e")
    with open(os.path.join(root, "latest")) as fh:
        out["latest_after_failures"] = fh.read()

    # stale leftovers of a save of "f" killed between the two renames of an overwrite
    # (f.old is what `latest` resolves to) and of another killed mid-write (.tmp-f)
    engine.save_checkpoint(root, tag="f")
    engine.comm.barrier()
    if rank == 0:
        os.rename(os.path.join(root, "f"), os.path.join(root, "f.old"))
        os.makedirs(os.path.join(root, ".tmp-f"))
        open(os.path.join(root, ".tmp-f", "junk"), "w").close()
    engine.comm.barrier()
    path, _ = engine.load_checkpoint(root)
    out["resolved_old"] = os.path.basename(path)
    # record the order of renames, directory fsyncs and writes of `latest` (rank 0)
    events: list[tuple[str, ...]] = []
    real_rename, real_fsync = os.rename, save_mod.fsync_dir

    def rename(a, b):
        events.append(("rename", os.path.basename(a), os.path.basename(b)))
        real_rename(a, b)

    def fsync(p):
        events.append(("fsync", os.path.basename(p)))
        real_fsync(p)

    def write(p, text):
        events.append(("write", os.path.basename(p)))
        real_write(p, text)

    with (
        mock.patch.object(save_mod.os, "rename", rename),
        mock.patch.object(save_mod, "fsync_dir", fsync),
        mock.patch.object(save_mod, "write_text_atomic", write),
    ):
        engine.save_checkpoint(root, tag="f")
    out["events"] = events
    out["after_resave"] = sorted(
        n
        for n in os.listdir(root)
        if n in {"f", "f.old", ".tmp-f"} or n.startswith((".tmp-f.", ".trash-f."))
    )
    path, _ = engine.load_checkpoint(root)  # every rank still in step: no collective skipped
    out["final"] = os.path.basename(path)
    return out


def test_failed_save_raises_on_every_rank(tmp_path) -> None:
    """A save failing on one rank (a manifest that is not JSON, an I/O error) raises on
    every rank instead of leaving the others waiting, and publishes nothing; a re-save
    clears a killed save's leftovers and makes the directory durable before `latest`."""
    results = multirank.run(_save_failures, 2, str(tmp_path), timeout=120)
    for rank, r in enumerate(results):
        assert "optimizer param groups" in r["group"] and "custom" in r["group"], r["group"]
        assert "set" in r["group"]
        assert "scheduler" in r["scheduler"] and "Tensor" in r["scheduler"], r["scheduler"]
        assert "rank(s) [0]" in r["publish_io"] and "No space left" in r["publish_io"]
        assert "rank(s) [1]" in r["rank1_io"] and "No space left" in r["rank1_io"]
        for key in ("group", "scheduler", "publish_io", "rank1_io"):
            assert r[key + "_published"] == [], (rank, key, r[key + "_published"])
        assert r["latest_after_failures"] == "a"
        assert r["resolved_old"] == "f.old"
        assert r["after_resave"] == ["f"], r["after_resave"]
        assert r["final"] == "f"
    events = [tuple(e) for e in results[0]["events"]]
    publish = next(i for i, e in enumerate(events) if e[0] == "rename" and e[2] == "f")
    assert events[publish][1].startswith(".tmp-f."), events  # the save's private directory
    latest = events.index(("write", "latest"))
    assert ("fsync", os.path.basename(str(tmp_path))) in events[publish:latest], events


# -- a manifest that lacks a piece -----------------------------------------------------------
GAP_LAYOUTS: dict[str, dict[str, Any]] = {
    "s0": {"stage": 0},
    "s1": {"stage": 1},
    "s2": {"stage": 2},
    "s3": {"stage": 3},
    "s2_offload": {"stage": 2, "zero": {"offload_optimizer": CPU}},
    "s3_offload": {"stage": 3, "zero": {"offload_optimizer": CPU, "offload_param": CPU}},
}


def _victim(m: dict) -> str:
    """A trained, untied, non-square 2-D parameter of the manifest (its first in order)."""
    tied = set(m.get("aliases", {}).values())
    return next(
        n
        for n, e in sorted(m["params"].items())
        if e["group"] >= 0 and len(e["shape"]) == 2 and len(set(e["shape"])) == 2 and n not in tied
    )


def _gap_drop_kind(m: dict) -> list[str]:
    m["kinds"].remove("exp_avg")
    return ["exp_avg", "kinds"]


def _gap_frozen(m: dict) -> list[str]:  # one parameter's optimizer states, all kinds
    name = _victim(m)
    m["params"][name]["group"] = -1
    return [name, "frozen"]


def _gap_drop_param(m: dict) -> list[str]:
    name = _victim(m)
    del m["params"][name]
    return [name, "missing from the manifest"]


def _gap_transpose(m: dict) -> list[str]:
    name = _victim(m)
    m["params"][name]["shape"].reverse()
    return [name, "shape"]


def _gap_extra(m: dict) -> list[str]:
    m["params"]["ghost.weight"] = json.loads(json.dumps(m["params"][_victim(m)]))
    return ["ghost.weight"]


def _gap_numel(m: dict) -> list[str]:
    name = _victim(m)
    m["params"][name]["pieces"][0][2] -= 1
    return [name, "pieces"]


GAP_EDITS = {
    "drop_kind": _gap_drop_kind,
    "frozen": _gap_frozen,
    "drop_param": _gap_drop_param,
    "transpose": _gap_transpose,
    "extra_param": _gap_extra,
    "wrong_numel": _gap_numel,
}


def _attempt_load(engine, where: str) -> str | None:
    from zeroshard.checkpoint.load import CheckpointError

    try:
        engine.load_checkpoint(where)
        return None
    except CheckpointError as exc:
        return str(exc)


def _manifest_gaps(rank: int, world: int, root: str, phase: str) -> dict:
    """phase "save": each layout trains 2 steps and saves; rank 0 writes one edited copy
    per edit (and what its error must name); then every layout loads every copy. phase
    "load" (another world size): fresh engines load the same copies, then the intact one."""
    import shutil

    out: dict = {}
    for key, case in GAP_LAYOUTS.items():
        engine = _engine({**case, "scheduler": False}, world)
        good = os.path.join(root, key, "good")
        if phase == "save":
            _train(engine, rank, world, range(2))
            engine.save_checkpoint(good, tag="t")
            if rank == 0:
                for edit, fn in GAP_EDITS.items():
                    d = os.path.join(root, key, edit)
                    shutil.copytree(os.path.join(good, "t"), d)
                    with open(os.path.join(d, "manifest.json")) as f:
                        m = json.load(f)
                    names = fn(m)
                    with open(os.path.join(d, "manifest.json"), "w") as f:
                        json.dump(m, f)
                    with open(os.path.join(root, key, f"{edit}.names"), "w") as f:
                        json.dump(names, f)
            engine.comm.barrier()
            _train(engine, rank, world, range(2, 3))  # now the engine differs from them
        before = parity.full_params(engine)
        errors = {edit: _attempt_load(engine, os.path.join(root, key, edit)) for edit in GAP_EDITS}
        untouched = _same(before, parity.full_params(engine))
        intact = _attempt_load(engine, good)
        out[key] = {"errors": errors, "untouched": untouched, "intact": intact}
    return out


def _lacking_state(rank: int, world: int, root: str) -> dict:
    """Checkpoints whose manifest agrees with its files but not with the engine: SGD
    without momentum (no state) loaded into AdamW; a parameter frozen when saved and
    trained now (stages 1 and 3); a float buffer loaded into an integer one."""
    out: dict[str, Any] = {}
    sgd = {"type": "SGD", "params": {"lr": 1e-2}}
    src = _engine({"stage": 1, "optimizer": sgd, "scheduler": False}, world)
    _train(src, rank, world, range(2))
    src.save_checkpoint(os.path.join(root, "sgd"), tag="t")
    adam = _engine({"stage": 1, "scheduler": False}, world)
    snap = parity.full_params(adam)
    out["sgd_into_adam"] = _attempt_load(adam, os.path.join(root, "sgd"))
    out["sgd_into_adam_untouched"] = _same(snap, parity.full_params(adam))
    for stage in (1, 3):
        src = _engine({"stage": stage, "scheduler": False}, world)  # pos_emb frozen
        _train(src, rank, world, range(2))
        src.save_checkpoint(os.path.join(root, f"frozen{stage}"), tag="t")
        dst = _engine({"stage": stage, "scheduler": False, "frozen": False}, world)
        snap = parity.full_params(dst)
        out[f"unfrozen_s{stage}"] = _attempt_load(dst, os.path.join(root, f"frozen{stage}"))
        out[f"unfrozen_s{stage}_untouched"] = _same(snap, parity.full_params(dst))
        dst.load_checkpoint(os.path.join(root, f"frozen{stage}"), load_optimizer_states=False)
        out[f"unfrozen_s{stage}_params_only"] = True
    import zeroshard

    for dtype in (torch.float32, torch.long):
        model = parity.build_model({})
        model.register_buffer("counts", torch.arange(4, dtype=dtype))
        engine, *_ = zeroshard.initialize(
            model=model,
            model_parameters=parity.param_groups(model),
            config=_config({"stage": 1, "scheduler": False}, world),
        )
        if dtype == torch.float32:
            engine.save_checkpoint(os.path.join(root, "buffer"), tag="t")
        else:
            out["buffer_dtype"] = _attempt_load(engine, os.path.join(root, "buffer"))
    return out


def test_checkpoints_lacking_a_piece_are_refused(tmp_path, capsys) -> None:
    """Manifest edits that drop an optimizer state kind, one parameter's states, a
    parameter, or give a transposed shape, an extra parameter or a short piece: refused at
    load (same and other world size, stages 0-3, offload) naming the entry, the engine
    untouched, and by `zeroshard convert` (exit 2); the intact checkpoint still loads."""
    from zeroshard.tools.cli import main as cli

    root = str(tmp_path)
    saved = multirank.run(_manifest_gaps, 2, root, "save", timeout=300)
    loaded = multirank.run(_manifest_gaps, 1, root, "load", timeout=300)
    for world, results in ((2, saved), (1, loaded)):
        for rank, r in enumerate(results):
            for key in GAP_LAYOUTS:
                res = r[key]
                assert res["untouched"] and res["intact"] is None, (world, rank, key, res)
                for edit, err in res["errors"].items():
                    names = json.loads((tmp_path / key / f"{edit}.names").read_text())
                    assert err is not None, (world, rank, key, edit, "loaded")
                    assert all(n in err for n in names), (world, key, edit, names, err)
    capsys.readouterr()
    for key in GAP_LAYOUTS:
        for edit in GAP_EDITS:
            out = tmp_path / f"{key}_{edit}.safetensors"
            assert cli(["convert", str(tmp_path / key / edit), str(out)]) == 2, (key, edit)
            text = capsys.readouterr().out
            names = json.loads((tmp_path / key / f"{edit}.names").read_text())
            assert all(n in text for n in names), (key, edit, names, text)
            assert not out.exists()
        assert cli(["convert", str(tmp_path / key / "good"), str(tmp_path / "ok.safetensors")]) == 0
    r = multirank.run(_lacking_state, 2, str(tmp_path / "lacking"), timeout=300)[0]
    err = r["sgd_into_adam"]
    assert err and "exp_avg" in err and "load_optimizer_states=False" in err, err
    assert r["sgd_into_adam_untouched"]
    for stage in (1, 3):
        err = r[f"unfrozen_s{stage}"]
        assert err and "pos_emb.weight" in err and "saved frozen" in err, (stage, err)
        assert r[f"unfrozen_s{stage}_untouched"] and r[f"unfrozen_s{stage}_params_only"]
    err = r["buffer_dtype"]
    assert err and "counts" in err and "dtype" in err, err
