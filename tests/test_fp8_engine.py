"""fp8 through ``initialize`` on 2 gloo ranks: every composition of the issue, one spawn.

* Data parallelism, ZeRO stages 0-3, CPU offload, gradient accumulation, clipping,
  activation checkpointing, each recipe: the engine ends where a single-process
  reference ends (fp32 masters, a bf16 copy of them converted by torchao, each rank's
  micro-batches run separately, so every activation's fp8 scale is the one its rank
  takes: data parallelism scales each rank's own tokens, as FSDP2 with torchao does),
  within bf16 round-off of the gradients; and that reference is ~10x or more farther
  from the bf16 run without fp8 (fp8 really ran, and a lost step cannot pass).
* Tensor parallelism (AutoTP, with and without Megatron sequence parallelism): scales are
  global, the unsplit tensor's. The column/row layers' fp8 matmuls in fp32 reproduce the
  unsplit torchao layer to float round-off on inputs whose shards have amaxes 30x apart
  (per-shard scales are 10^3 x farther off); the engine matches the unsplit fp8 model.
* Ulysses sequence parallelism splits tokens: with ``rowwise_with_gw_hp`` (per-token
  scales, bf16 weight gradient) it reproduces the unsplit fp8 model to round-off.
* Checkpoints hold the high-precision weights: saved with fp8 on they load with fp8
  off and on (another stage, another recipe), and the reverse.
* Pipeline parallelism (two stages, 1F1B, ZeRO-1 and ZeRO-3): each stage's Linear layers
  run fp8, the head too, a pipeline layer that is itself an nn.Linear (every Float8Linear
  runs once per micro-batch); the run matches the whole model run micro-batch by
  micro-batch to round-off.
* A model converted by torchao before initialize() (accelerate's fp8) with AutoTP is
  refused by name (AutoTP would slice its fp8 layers into bf16 shards).
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

import cases
import multirank
import parity
import pytest
import torch

# every case here runs torchao's Float8Linear (or compares with it)
pytest.importorskip(
    "torchao", reason="torchao is not installed (optional: pip install 'zeroshard[fp8]')"
)

STEPS = 3
RECIPE = {"recipe_name": "tensorwise"}


def _ds_config(case: dict) -> dict:
    cfg = parity.ds_config({**case, "dtype": "bf16"})
    # gradients summed in fp32 (as the reference does): bf16 sums differ in round-off,
    # which Adam turns into whole steps for gradients that nearly cancel across ranks
    cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if case.get("fp8", True):
        cfg["fp8"] = {"enabled": True, "recipe_name": case.get("recipe", "tensorwise")}
    if case.get("offload"):
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if case["stage"] == 3:
            cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    if case.get("tp"):
        cfg["tensor_parallel"] = {"autotp_size": 2, "sequence_parallel": case.get("msp", False)}
    if case.get("sp"):
        cfg["sequence_parallel_size"] = 2
    return cfg


def _checkpointed(model: Any) -> None:
    """Activation checkpointing of every block (zeroshard.checkpointing.checkpoint)."""
    from zeroshard import checkpointing

    for block in model.blocks:
        block.forward = functools.partial(checkpointing.checkpoint, block.forward)


def _fp8_copy(
    model: torch.nn.Module, recipe: str, dtype: torch.dtype = torch.bfloat16
) -> torch.nn.Module:
    import dataclasses

    from zeroshard.fp8 import torchao_float8

    f8 = torchao_float8()
    cfg = dataclasses.replace(f8.Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True)
    work = copy.deepcopy(model).to(dtype)
    return f8.convert_to_float8_training(work, config=cfg)


def reference(case: dict, dp: int, fp8: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """fp32 masters (AdamW, the parity harness's groups; the bf16-rounded initial
    values, as the engine casts the model first), a bf16 copy (fp8 by torchao)
    for forward and backward; each of the ``dp`` ranks' micro-batches separately, their
    gradients summed in fp32 and averaged, clipped by the global norm."""
    master = parity.build_model(case)
    with torch.no_grad():  # the engine's masters start from the bf16 model it was given
        for p in master.parameters():
            p.copy_(p.to(torch.bfloat16))
    lr = case.get("lr", parity.LR)
    groups = [g for g in parity.param_groups(master, lr=lr) if any(p.requires_grad for p in g["params"])]  # fmt: skip
    _, opt_class, opt_kwargs = parity.OPTS[case.get("opt", "AdamW")]
    opt = opt_class(groups, lr=lr, **opt_kwargs)
    work = _fp8_copy(master, case.get("recipe", "tensorwise")) if fp8 else copy.deepcopy(master).to(torch.bfloat16)  # fmt: skip
    named = dict(master.named_parameters())
    micro, gas = case.get("micro", 2), case.get("gas", 1)
    losses = []
    for step in range(STEPS):
        x, y = parity.batch(step, micro * gas * dp)
        with torch.no_grad():
            for n, p in work.named_parameters():
                p.copy_(named[n])
        total = 0.0
        for lo in range(0, micro * gas * dp, micro):
            loss = work(x[lo : lo + micro], y[lo : lo + micro])
            (loss / (gas * dp)).backward()  # bf16 grads of one micro-batch, summed below
            for n, p in work.named_parameters():
                if p.grad is not None:
                    q = named[n]
                    q.grad = p.grad.float() if q.grad is None else q.grad + p.grad.float()
            work.zero_grad()
            total += loss.item()
        losses.append(total / (gas * dp))
        if case.get("clip", 0.0) > 0:
            torch.nn.utils.clip_grad_norm_([p for p in master.parameters() if p.requires_grad], case["clip"])  # fmt: skip
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in master.named_parameters()}


def _train(case: dict, rank: int, world: int):
    import zeroshard
    from zeroshard.offload.staging import STAGE_ON_CPU_ENV

    model = parity.build_model(case)
    if case.get("ac"):
        _checkpointed(model)
    groups = parity.param_groups(model, lr=case.get("lr", parity.LR))
    os.environ[STAGE_ON_CPU_ENV] = "1" if case.get("staged") else "0"
    engine, *_ = zeroshard.initialize(model=model, model_parameters=groups, config=_ds_config(case))  # fmt: skip
    os.environ.pop(STAGE_ON_CPU_ENV)
    dp, dp_rank = engine.mesh.size("dp"), engine.mesh.coord("dp")
    micro, gas = case.get("micro", 2), case.get("gas", 1)
    losses = []
    for step in range(STEPS):
        x, y = parity.batch(step, micro * gas * dp)
        total = 0.0
        for m in range(gas):
            lo = (m * dp + dp_rank) * micro
            loss = engine(x[lo : lo + micro], y[lo : lo + micro])
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / gas)
    return engine, losses, dp


def _masters(engine, path: str) -> dict[str, torch.Tensor]:
    """The fp32 masters, whole: saved in a checkpoint and read back (every rank)."""
    from zeroshard.checkpoint.export import open_checkpoint

    engine.save_checkpoint(path, tag="m")
    entries, fetch, _ = open_checkpoint(os.path.join(path, "m"))
    return {name: fetch(name).float() for name, _, _ in entries}


def _engine_case(case: dict, rank: int, world: int, root: str) -> dict:
    engine, losses, dp = _train(case, rank, world)
    kinds = sorted({type(m).__name__ for m in engine.module.modules() if "Linear" in type(m).__name__})  # fmt: skip
    fp8_layers = sum(
        type(m).__name__ == "Float8Linear" or getattr(m, "linear_fn", None) is not None
        for m in engine.module.modules()
    )
    got = _masters(engine, os.path.join(root, f"case{case['i']}"))
    ref_losses, ref = reference(case, dp, fp8=True)
    _, plain = reference(case, dp, fp8=False)
    init = {n: t.bfloat16().float() for n, t in parity.initial_params(case).items()}
    engine.destroy()
    trained = [n for n, p in parity.build_model(case).named_parameters() if p.requires_grad]
    ref = {n: ref[n] for n in trained}
    diff = max((got[n] - ref[n]).abs().max().item() for n in ref)
    baseline = None
    if case.get("tp") or case.get("sp"):  # the same layout without fp8, against its reference
        plain_engine, _, _ = _train({**case, "fp8": False}, rank, world)
        plain_got = _masters(plain_engine, os.path.join(root, f"case{case['i']}-bf16"))
        plain_engine.destroy()
        baseline = max((plain_got[n] - plain[n]).abs().max().item() for n in ref)
    return {
        "kinds": kinds,
        "fp8_layers": fp8_layers,
        "losses": losses,
        "ref_losses": ref_losses,
        "param_diff": diff,
        "baseline": baseline,
        "fp8_vs_bf16": max((ref[n] - plain[n]).abs().max().item() for n in ref),
        "movement": max((ref[n] - init[n]).abs().max().item() for n in ref),
    }


def _tp_layers(rank: int, world: int, recipe: str, msp: bool) -> dict:
    """A column- and a row-parallel fp8 layer, each on its own input and output gradient
    (fp32), against the unsplit torchao layer: outputs and gradients relative to the
    largest element. Rank 0's output features of the column layer and rank 1's input
    features of the row layer are 30x the others, so per-shard amaxes differ from the
    whole tensor's."""
    from zeroshard.distributed.comm import Comm
    from zeroshard.fp8 import RECIPES, Split, fp8_linear
    from zeroshard.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear
    from zeroshard.parallel.tensor.slices import assemble, tp_slice_of

    comm = Comm(torch.distributed.group.WORLD)
    torch.manual_seed(0)
    up, down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
    x_up, x_down = torch.randn(2, 8, 32), torch.randn(2, 8, 64)
    g_up, g_down = torch.randn(2, 8, 64), torch.randn(2, 8, 32)
    with torch.no_grad():
        up.weight[:32] *= 30
        down.weight[:, 32:] *= 30
        x_down[..., 32:] *= 30
    r = RECIPES[recipe]
    col = ColumnParallelLinear.from_linear(up, comm, sequence_parallel=msp)
    row = RowParallelLinear.from_linear(down, comm, sequence_parallel=msp)
    col.linear_fn = functools.partial(fp8_linear, recipe=r, split=Split(comm, "out"))
    row.linear_fn = functools.partial(fp8_linear, recipe=r, split=Split(comm, "in"))
    out = {}
    for name, whole, layer, x, g in (("col", up, col, x_up, g_up), ("row", down, row, x_down, g_down)):  # fmt: skip
        ref = _fp8_copy(torch.nn.Sequential(whole), recipe, torch.float32)[0]  # type: ignore[index]
        ref_x = x.clone().requires_grad_()
        ref_y = ref(ref_x)
        ref_y.backward(g)
        seq = slice(4 * rank, 4 * rank + 4)  # this rank's half of the sequence (msp)
        if name == "col":  # input replicated (or its sequence half); output features split
            mine = (x[:, seq] if msp else x).clone().requires_grad_()
            y = layer(mine)
            y.backward(g.chunk(2, dim=-1)[rank])
            y = torch.cat(comm.all_gather_object(y.detach()), -1)
            assert mine.grad is not None
            gx = torch.cat(comm.all_gather_object(mine.grad), 1) if msp else mine.grad
        else:  # input features split; output replicated (or its sequence half)
            mine = x.chunk(2, dim=-1)[rank].clone().requires_grad_()
            y = layer(mine)
            y.backward(g[:, seq] if msp else g)
            y = torch.cat(comm.all_gather_object(y.detach()), 1) if msp else y.detach()
            assert mine.grad is not None
            gx = torch.cat(comm.all_gather_object(mine.grad), -1)
        split = tp_slice_of(layer.weight)
        assert layer.weight.grad is not None and split is not None
        gw = assemble(comm.all_gather_object(layer.weight.grad), split)
        pairs = {"y": (y, ref_y.detach()), "grad_x": (gx, ref_x.grad), "grad_w": (gw, ref.weight.grad)}  # fmt: skip
        for k, (a, b) in pairs.items():
            out[f"{name}_{k}"] = ((a - b).abs().max() / b.abs().max()).item()
    return out


def _checkpoint_case(rank: int, world: int, root: str) -> dict:
    """fp8 on -> off and on (rowwise, stage 3); fp8 off -> on: the weights load as saved."""
    out = {}
    plan: list[tuple[str, dict, list[dict]]] = [
        ("on", {"stage": 2}, [{"stage": 3, "fp8": False}, {"stage": 1, "recipe": "rowwise"}]),
        ("off", {"stage": 1, "fp8": False}, [{"stage": 3}]),
    ]
    for name, saver, loaders in plan:
        engine, _, _ = _train(saver, rank, world)
        engine.save_checkpoint(os.path.join(root, name), tag="t")
        saved = _masters(engine, os.path.join(root, name))
        engine.destroy()
        for i, loader in enumerate(loaders):
            import zeroshard

            model = parity.build_model(loader)
            groups = parity.param_groups(model)
            engine, *_ = zeroshard.initialize(model=model, model_parameters=groups, config=_ds_config(loader))  # fmt: skip
            engine.load_checkpoint(os.path.join(root, name), tag="t")
            got = _masters(engine, os.path.join(root, f"{name}-{i}"))
            x, y = parity.batch(99, 4)
            engine.backward(engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
            engine.step()  # trains on after the load
            fp8_layers = sum(type(m).__name__ == "Float8Linear" for m in engine.module.modules())
            engine.destroy()
            out[f"{name}->{i}"] = {
                "diff": max((got[k] - saved[k]).abs().max().item() for k in saved),
                "fp8_layers": fp8_layers,
                "expect_fp8": loader.get("fp8", True),
            }
    return out


def _preconverted_tp(rank: int, world: int) -> str:
    """A model converted by torchao before initialize() (accelerate's fp8) with AutoTP:
    AutoTP would slice its fp8 layers into bf16 shards; refused by name."""
    import zeroshard
    from zeroshard.fp8 import Fp8Error

    model = _fp8_copy(parity.build_model({}), "tensorwise", torch.float32)
    cfg = _ds_config({"stage": 1, "tp": True, "fp8": False})
    try:
        zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    except Fp8Error as err:
        return str(err)
    return "accepted"


def _count_float8_calls(module: torch.nn.Module) -> tuple[dict[str, int], list]:
    """A forward counter on every torchao Float8Linear of ``module`` (by name)."""
    calls: dict[str, int] = {}
    hooks = []
    for name, m in module.named_modules():
        if type(m).__name__ == "Float8Linear":
            calls[name] = 0

            def count(_m, _args, name: str = name) -> None:
                calls[name] += 1

            hooks.append(m.register_forward_pre_hook(count))
    return calls, hooks


def _pipeline(rank: int, world: int, root: str, zero: int) -> dict:
    """Two pipeline stages (1F1B, 4 micro-batches of 6-7 tokens: padded in the fp8
    weight-gradient gemm) with fp8 at ZeRO stage ``zero``, against the whole model run
    micro-batch by micro-batch by torchao (bf16-rounded fp32 masters, AdamW, fp32
    gradient sums). The head is a pipeline layer that is itself an nn.Linear: the
    pipeline must run the Float8Linear that replaced it (every Float8Linear of each
    stage runs once per micro-batch, in the engine and in the reference)."""
    import pipeline_cases as pc

    import zeroshard
    from zeroshard.pipe import PipelineModule

    case = {"stages": 2, "gas": 4, "zero": zero, "dtype": "bf16", "tied": False}
    cfg = pc.config(case)
    cfg["fp8"] = {"enabled": True}
    cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    torch.manual_seed(0)
    engine, *_ = zeroshard.initialize(model=pc.build(case, 2), config=cfg)
    pipe = engine.module
    assert isinstance(pipe, PipelineModule)
    lo, hi = pipe.chunk_ranges[0]
    layer_kinds = {i: type(pipe.layer(i)).__name__ for i in range(lo, hi)}
    calls, hooks = _count_float8_calls(engine.module)
    batches = [iter([pc.batch(s, i) for i in range(4)]) for s in range(3)]
    losses = [float(engine.train_batch(b)) for b in batches]  # type: ignore[operator]
    for h in hooks:
        h.remove()
    got = _masters(engine, os.path.join(root, f"pipeline{zero}"))
    engine.destroy()
    torch.manual_seed(0)
    master = pc.build(case, 1, 0)
    with torch.no_grad():
        for p in master.parameters():
            p.copy_(p.to(torch.bfloat16))
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2, weight_decay=0.1)
    work = _fp8_copy(master, "tensorwise")
    ref_calls, _ = _count_float8_calls(work)
    named = dict(master.named_parameters())
    ref_losses = []
    for step in range(3):
        with torch.no_grad():
            for n, p in work.named_parameters():
                p.copy_(named[n])
        total = 0.0
        for i in range(4):
            ids, labels = pc.batch(step, i)
            loss = pc.loss_fn(work(ids), labels) / 4
            loss.backward()
            for n, p in work.named_parameters():
                q = named[n]
                assert p.grad is not None
                q.grad = p.grad.float() if q.grad is None else q.grad + p.grad.float()
            work.zero_grad()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        ref_losses.append(total)
    mine = [n for n in got if n in named]
    return {
        "fp8_layers": len(calls),
        "layer_kinds": layer_kinds,
        "calls": calls,
        "ref_calls": ref_calls,
        "names": len(mine),
        "param_diff": max((got[n] - named[n]).abs().max().item() for n in mine),
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
    }


def _run_case(rank: int, world: int, case: dict, root: str) -> Any:
    if case.get("kind") == "preconverted_tp":
        return _preconverted_tp(rank, world)
    if case.get("kind") == "pipeline":
        return _pipeline(rank, world, root, case["zero"])
    if case.get("kind") == "tp_layers":
        return _tp_layers(rank, world, case["recipe"], case.get("msp", False))
    if case.get("kind") == "checkpoint":
        return _checkpoint_case(rank, world, root)
    return _engine_case(case, rank, world, root)


def _name(case: dict) -> str:
    return cases.label({k: v for k, v in case.items() if k != "i"})


def _worker(rank: int, world: int, case_list: list[dict], root: str) -> dict:
    return cases.run_named(
        (_name(c), functools.partial(_run_case, rank, world, c, root)) for c in case_list
    )


DP_CASES: list[dict[str, Any]] = [
    {"stage": 0},
    {"stage": 1, "clip": 0.05},
    {"stage": 2, "gas": 2, "clip": 0.05},
    {"stage": 3, "gas": 2, "clip": 0.05},
    {"stage": 2, "offload": True, "staged": True},
    {"stage": 3, "offload": True, "clip": 0.05},
    {"stage": 0, "ac": True},
    {"stage": 3, "ac": True, "gas": 2},
    {"stage": 2, "recipe": "rowwise", "clip": 0.05},
    {"stage": 3, "recipe": "rowwise_with_gw_hp"},
]
# the row-parallel sums (and Ulysses' attention) round differently in bf16 than the unsplit
# model's: SGD keeps such round-off a round-off (Adam's first steps are sign(gradient))
_SGD = {"opt": "SGD", "lr": 0.02}
TP_CASES: list[dict[str, Any]] = [
    {"stage": 1, "tp": True, **_SGD},
    {"stage": 3, "tp": True, "msp": True, "recipe": "rowwise", **_SGD},
    {"stage": 2, "sp": True, "recipe": "rowwise_with_gw_hp", **_SGD},
]
LAYER_CASES: list[dict[str, Any]] = [
    {"kind": "tp_layers", "recipe": r, "msp": msp}
    for r in ("tensorwise", "rowwise", "rowwise_with_gw_hp")
    for msp in (False, True)
]


def _pipeline_failures(case: dict, per_rank: list[dict]) -> list[str]:
    """Each stage's layers that were built as nn.Linear are Float8Linear when called,
    every Float8Linear ran once per micro-batch (3 steps x 4) in the engine and in the
    reference (whose head is a pipeline layer too), and the run matches the reference
    as the data-parallel cases do."""
    worst = {k: max(r[k] for r in per_rank) for k in ("param_diff", "loss_diff")}
    ran = [r["calls"] for r in per_rank] + [per_rank[0]["ref_calls"]]
    ok = (
        all(r["fp8_layers"] > 0 for r in per_rank)
        and all(kind != "Linear" for r in per_rank for kind in r["layer_kinds"].values())
        and any("Float8Linear" in r["layer_kinds"].values() for r in per_rank)
        and all(n == 12 for calls in ran for n in calls.values())
        and worst["param_diff"] <= 1e-6
        and worst["loss_diff"] <= 1e-5
    )
    return [] if ok else [f"pipeline zero {case['zero']}: {per_rank}"]


def _check(case: dict, results: list) -> None:
    """One case's results (rank 0's, or every rank's where they differ)."""
    failures = []
    r = results[0]
    if case.get("kind") == "tp_layers":
        # global scales: the same fp8 values as the unsplit layer; only the row
        # layer's sum splits in two, rounded in fp32 (tensorwise) or, where torchao's
        # rowwise kernel returns bf16, in bf16 (2^-8 each part, and their sum)
        tol = 1e-5 if case["recipe"] == "tensorwise" else 2 * 2.0**-8
        bad = {k: v for k, v in r.items() if v > tol}
        if bad:
            failures.append(f"{case}: {bad} (tolerance {tol:.2g})")
    elif case.get("kind") == "preconverted_tp":
        if not r.startswith("tensor_parallel.autotp_size: the model holds torchao Float8Linear"):
            failures.append(f"a model converted before initialize() with AutoTP: {r}")
    elif case.get("kind") == "pipeline":
        failures += _pipeline_failures(case, results)
    elif case.get("kind") == "checkpoint":
        for name, v in r.items():
            fp8_ok = (v["fp8_layers"] > 0) == v["expect_fp8"]
            if v["diff"] != 0.0 or not fp8_ok:
                failures.append(f"checkpoint {name}: {v}")
    else:
        per_rank = [res["losses"] for res in results]  # each rank's own batches
        losses = [sum(step) / len(step) for step in zip(*per_rank, strict=True)]
        loss_diff = max(abs(a - b) for a, b in zip(losses, r["ref_losses"], strict=True))
        param_diff = max(res["param_diff"] for res in results)
        if case.get("tp") or case.get("sp"):
            # fp8 magnifies the layout's bf16 round-off (a nudged value rounds to
            # another fp8 number), so the run is compared with the unsplit fp8 run
            # in units of the layout's own bf16 drift and of fp8's effect
            ok = (
                r["fp8_layers"] > 0
                and loss_diff <= 2e-3
                and param_diff <= 10 * r["baseline"]
                and param_diff < r["fp8_vs_bf16"]
                and r["movement"] >= 10 * param_diff
            )
        else:  # exact but for the order of fp32 sums
            ok = (
                r["fp8_layers"] > 0
                and loss_diff <= 1e-5
                and param_diff <= 1e-6
                and r["fp8_vs_bf16"] >= 1000 * param_diff
                and r["movement"] >= 1000 * param_diff
            )
        if not ok:
            failures.append(
                f"{case}: loss {loss_diff:.3g} param {param_diff:.3g} fp8-vs-bf16 "
                f"{r['fp8_vs_bf16']:.3g} movement {r['movement']:.3g} {r['kinds']}"
            )
    assert not failures, "\n".join(failures)


def test_fp8_composes(tmp_path, subtests: pytest.Subtests) -> None:
    case_list: list[dict[str, Any]] = [
        *DP_CASES,
        *TP_CASES,
        *LAYER_CASES,
        {"kind": "checkpoint"},
        {"kind": "pipeline", "zero": 1},
        {"kind": "pipeline", "zero": 3},
        {"kind": "preconverted_tp"},
    ]
    by_name = {_name(c): {**c, "i": i} for i, c in enumerate(case_list)}
    results = multirank.run(_worker, 2, list(by_name.values()), str(tmp_path), timeout=900)
    check = lambda name, per_rank: _check(by_name[name], per_rank)  # noqa: E731
    cases.check_each(subtests, results, check, names=list(by_name))
