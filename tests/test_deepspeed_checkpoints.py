"""Loading DeepSpeed's own checkpoints (a user switching from DeepSpeed has them).

The fixtures in ``tests/data/deepspeed/`` were made by DeepSpeed 0.19.8 on 2 ranks (CPU,
gloo) with ``make_checkpoints.py``: ``tests/deepspeed_case.py``'s model trained 3 steps
and saved at ZeRO-0/1/2/3 (fp32; bf16 at stages 1-3, stage 1 being DeepSpeed's
``BF16_Optimizer``), then trained 3 more steps by DeepSpeed. ``reference.json`` holds
what DeepSpeed's own API said the training state was at the save (fp32 master and Adam
moments per parameter) and its continuation (losses, final fp32 parameters).

zeroshard builds the model from another seed, loads the checkpoint at 1 and 2 ranks,
into the same and another stage, and must hold exactly DeepSpeed's state, then continue
within ``TOL`` of DeepSpeed's continuation (fp32). The live test (marked slow; needs
``.venv-bench`` with deepspeed) makes fresh checkpoints with the real DeepSpeed first.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import zipfile

import cases
import deepspeed_case as case
import multirank
import pytest
import torch

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "deepspeed")
BENCH_PYTHON = os.path.join(os.path.dirname(FIXTURES), "..", "..", ".venv-bench", "bin", "python")
TOL = 2e-5  # the bound on the continuation's losses and parameters (fp32)

# (checkpoint, zeroshard's stage) per world size: every DeepSpeed stage into its own
# stage and another one
PLAN = {
    1: [
        ("zero1_fp32", 1), ("zero2_fp32", 2), ("zero2_fp32", 3), ("zero3_fp32", 3),
        ("zero3_fp32", 1), ("zero2_elastic", 1), ("zero1_bf16", 2), ("zero2_bf16", 2),
        ("zero3_bf16", 3),
    ],
    2: [
        ("zero1_fp32", 3), ("zero2_fp32", 2), ("zero2_fp32", 1), ("zero3_fp32", 3),
        ("zero3_fp32", 2), ("zero2_elastic", 3), ("zero1_bf16", 1), ("zero2_bf16", 3),
        ("zero3_bf16", 2),
    ],
}  # fmt: skip


def _pieces(engine) -> list:
    """This rank's pieces of every trained parameter: (name, first element, {kind:
    values}) for the fp32 master and the Adam moments."""
    from zeroshard.checkpoint.format import parameter_names
    from zeroshard.checkpoint.shards import ShardAccess

    access = ShardAccess(engine)
    names = parameter_names(engine)
    master = "master" if access.has_master() else "param"
    out = []
    for p in access.pieces:
        if p.group < 0:
            continue
        a, b = p.shard_lo, p.shard_lo + p.hi - p.lo
        kinds = {"master": master, "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
        out.append(
            [
                names[p.param],
                p.lo,
                {k: access.get(v, a, b).float().tolist() for k, v in kinds.items()},
            ]
        )
    return out


def _assemble(per_rank: list[list]) -> dict[str, dict[str, torch.Tensor]]:
    """Whole tensors per parameter and kind from every rank's pieces (each element once)."""
    found: dict[str, dict[str, dict[int, list]]] = {}
    for pieces in per_rank:
        for name, lo, kinds in pieces:
            for kind, values in kinds.items():
                found.setdefault(name, {}).setdefault(kind, {})[lo] = values
    out: dict = {}
    for name, kinds in found.items():
        for kind, parts in kinds.items():
            flat: list = []
            for lo in sorted(parts):
                assert lo == len(flat), (name, kind, sorted(parts))
                flat += parts[lo]
            out.setdefault(name, {})[kind] = torch.tensor(flat)
    return out


def _job_name(name: str, stage: int) -> str:
    return f"{name} -> stage {stage}"


def _continue(rank: int, world: int, root: str, jobs: list) -> dict:
    return cases.run_named(
        (_job_name(*job), functools.partial(_continue_one, rank, world, root, *job)) for job in jobs
    )


def _continue_one(rank: int, world: int, root: str, name: str, stage: int) -> dict:
    import zeroshard

    rows = slice(rank * case.ROWS // world, (rank + 1) * case.ROWS // world)
    _, dtype, _, _ = case.CASES[name]
    model = case.build_model(seed=99)  # another init: everything must come from the file
    engine, *_ = zeroshard.initialize(
        model=model,
        model_parameters=case.param_groups(model),
        config=case.config(stage, world, dtype),
    )
    path, client = engine.load_checkpoint(os.path.join(root, name))
    from zeroshard.checkpoint.shards import ShardAccess
    from zeroshard.zero import GatheredParameters

    module = engine.module
    assert isinstance(module, case.TinyLM)
    with GatheredParameters([module.pos]):
        pos = module.pos.detach().float().reshape(-1).tolist()
    loaded = {
        "path": path,
        "client": client,
        "pieces": _pieces(engine),
        "steps": ShardAccess(engine).group_steps(),
        "lr": engine.get_lr(),
        "counters": [engine.global_steps, engine.global_samples, engine.skipped_steps],
        "sched": engine.lr_scheduler.state_dict(),
        "temperature": float(module.temperature),
        "pos": pos,
    }
    losses = []
    for step in range(case.SAVE_AT, case.SAVE_AT + case.MORE):
        idx, tgt = case.batch(step, rows)
        loss = engine(idx, tgt)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        torch.distributed.all_reduce(mean)
        losses.append(float(mean) / world)
    out = {"loaded": loaded, "losses": losses, "final": _pieces(engine)}
    engine.destroy()
    return out


def _check(
    subtests: pytest.Subtests, results: list, world: int, plan: list, reference: dict, report: dict
) -> None:
    """Each job of ``plan`` under its own subtest."""
    for name, stage in plan:
        cases.check(
            subtests,
            results,
            _job_name(name, stage),
            functools.partial(_check_job, world, name, stage, reference, report),
        )


def _check_job(world: int, name: str, stage: int, reference: dict, report: dict, ranks: list):
    initial_pos = case.build_model().pos.reshape(-1)
    ref = reference[name]
    got = _assemble([r["loaded"]["pieces"] for r in ranks])
    what = f"{name} -> {world} rank(s), stage {stage}"
    # the training state DeepSpeed saved, held exactly (every kind of every parameter)
    assert set(got) == set(ref["saved"]), what
    for pname, kinds in ref["saved"].items():
        for kind, values in kinds.items():
            assert torch.equal(got[pname][kind], case.values(values)), (what, pname, kind)
    loaded = ranks[0]["loaded"]
    assert loaded["path"].endswith(os.path.join(name, "global_step3")), what
    assert loaded["client"] == {}, what
    assert loaded["counters"] == [case.SAVE_AT, case.SAVE_AT * case.ROWS, 0], what
    assert max(r["loaded"]["steps"][0] for r in ranks) == case.SAVE_AT, what
    assert loaded["lr"] == pytest.approx(ref["lr_at_save"], rel=1e-12), what
    assert loaded["sched"]["last_batch_iteration"] == case.SAVE_AT - 1, what
    temp = torch.tensor(
        case.TEMPERATURE, dtype=torch.bfloat16 if ref["dtype"] == "bf16" else torch.float32
    )
    assert loaded["temperature"] == float(temp), what
    pos = initial_pos.to(torch.bfloat16).float() if ref["dtype"] == "bf16" else initial_pos
    assert torch.equal(torch.tensor(loaded["pos"]), pos), what  # frozen: as saved
    # then training continues as DeepSpeed's did
    final = _assemble([r["final"] for r in ranks])
    loss_diff = max(abs(a - b) for a, b in zip(ranks[0]["losses"], ref["losses"], strict=True))
    param_diff = max(
        (final[n]["master"] - case.values(v)).abs().max().item() for n, v in ref["params"].items()
    )
    moved = max(
        (case.values(ref["params"][n]) - case.values(v["master"])).abs().max().item()
        for n, v in ref["saved"].items()
    )
    report[what] = (loss_diff, param_diff)
    if ref["dtype"] == "bf16" and world == 2:  # the same bf16 arithmetic per rank
        assert ranks[0]["losses"][0] == ref["losses"][0], what
    if ref["dtype"] == "fp32":
        assert loss_diff <= TOL and param_diff <= TOL, (what, loss_diff, param_diff)
        assert moved > 1000 * TOL, (what, moved)  # a lost step could not pass


def _reference(root: str) -> dict:
    with open(os.path.join(root, "reference.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("world", [1, 2])
def test_deepspeed_checkpoints_load_and_continue(world: int, subtests: pytest.Subtests) -> None:
    reference = _reference(FIXTURES)
    plan = PLAN[world]
    results = multirank.run(_continue, world, FIXTURES, plan, timeout=600)
    report: dict = {}
    _check(subtests, results, world, plan, reference, report)
    for what, (loss, param) in report.items():
        print(f"{what}: max |loss - DeepSpeed's| {loss:.2g}, max |param - DeepSpeed's| {param:.2g}")


# -- bad input -------------------------------------------------------------------------


def _copy(root: str, name: str, src: str = "zero2_fp32") -> str:
    dst = os.path.join(root, name)
    shutil.copytree(os.path.join(FIXTURES, src), dst)
    return os.path.join(dst, "global_step3")


def _flip_tensor_bytes(path: str, value: float) -> None:
    """Overwrite the first element of the largest tensor stored in torch zip ``path``
    (stored uncompressed) with ``value``, leaving the archive's CRC-32 as it was."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
        f.seek(info.header_offset + 30 + name_len + extra_len)
        f.write(torch.tensor([value], dtype=torch.float32).numpy().tobytes())


def _resave(obj, path: str) -> None:
    """``torch.save`` over ``path``, whose tensors ``obj`` may still map (a new file
    replaces the old: writing into a mapped file would fault)."""
    torch.save(obj, path + ".new")
    os.replace(path + ".new", path)


def _spoil(root: str) -> None:
    """Copies of a fixture under ``root``, each spoiled one way (named by its folder)."""
    optim1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    d = _copy(root, "truncated")
    with open(os.path.join(d, optim1), "r+b") as f:
        f.truncate(500)
    d = _copy(root, "bitflip")
    _flip_tensor_bytes(os.path.join(d, optim1), 0.5)
    d = _copy(root, "nan")
    _flip_tensor_bytes(os.path.join(d, optim1), float("nan"))
    d = _copy(root, "missing")
    os.remove(os.path.join(d, optim1))
    d = _copy(root, "stray")
    shutil.copy(
        os.path.join(d, optim1), os.path.join(d, "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    )
    from argparse import Namespace

    from zeroshard.checkpoint.ds_pickle import load_pt

    d = _copy(root, "global")
    sd = load_pt(os.path.join(d, "mp_rank_00_model_states.pt"))
    sd["args"] = Namespace(lr=1)  # client_state a user passed, holding a non-data object
    _resave(sd, os.path.join(d, "mp_rank_00_model_states.pt"))
    d = _copy(root, "bomb")
    marker = os.path.join(root, "PWNED")

    class Boom:
        def __reduce__(self):
            return (open, (marker, "w"))

    torch.save({"module": Boom()}, os.path.join(d, "mp_rank_00_model_states.pt"))
    for key, junk in (
        ("pipeline", "layer_01-model_states.pt"),
        ("tensor_parallel", "mp_rank_01_model_states.pt"),
        ("moe", "expp_rank_0_mp_rank_00_optim_states.pt"),
        ("universal", "zero"),
    ):
        d = _copy(root, key)
        if junk == "zero":
            os.makedirs(os.path.join(d, junk))
        else:
            shutil.copy(os.path.join(d, "mp_rank_00_model_states.pt"), os.path.join(d, junk))


def _bad(rank: int, world: int, root: str) -> dict:
    import zeroshard
    from zeroshard.checkpoint.load import CheckpointError

    errors: dict = {}

    def engine(**kw):
        model = case.build_model(seed=99) if not kw.get("model") else kw["model"]
        cfg = case.config(kw.get("stage", 2), world)
        if kw.get("opt"):
            cfg["optimizer"] = kw["opt"]
        eng, *_ = zeroshard.initialize(
            model=model, model_parameters=case.param_groups(model), config=cfg
        )
        return eng

    def attempt(key: str, directory: str, eng=None, **kw) -> None:
        eng = eng or engine()
        before = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
        try:
            eng.load_checkpoint(directory, **kw)
            errors[key] = None
        except CheckpointError as exc:
            errors[key] = str(exc)
        errors[key + ":intact"] = all(
            torch.equal(before[n], p) for n, p in eng.module.named_parameters()
        )

    _spoil(root) if rank == 0 else None
    torch.distributed.barrier()
    tag = lambda key: os.path.join(root, key)  # noqa: E731
    for key in ("truncated", "bitflip", "missing", "stray", "global", "bomb"):
        attempt(key, tag(key))
    attempt("bitflip_noverify", tag("bitflip"), verify=False)
    attempt("nan", tag("nan"), verify=False)
    errors["pwned"] = os.path.exists(os.path.join(root, "PWNED"))
    for key in ("pipeline", "tensor_parallel", "moe", "universal"):
        attempt(key, tag(key))
    # a model that is not the one saved; an optimizer that cannot take Adam's state
    other = case.build_model(seed=99)
    other.fc1 = torch.nn.Linear(case.DIM, case.HIDDEN + 1)
    other.norm = torch.nn.LayerNorm(case.HIDDEN + 1)
    other.fc2 = torch.nn.Linear(case.HIDDEN + 1, case.DIM)
    attempt("mismatch", os.path.join(FIXTURES, "zero2_fp32"), engine(model=other))
    sgd = engine(opt={"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}})
    attempt("sgd", os.path.join(FIXTURES, "zero3_fp32"), sgd)
    attempt("sgd_weights", os.path.join(FIXTURES, "zero3_fp32"), sgd, load_optimizer_states=False)
    # no ZeRO: the weights load, the optimizer state (a torch state_dict) is refused
    attempt("zero0", os.path.join(FIXTURES, "zero0_fp32"))
    eng = engine(stage=3)
    attempt("zero0_module", os.path.join(FIXTURES, "zero0_fp32"), eng, load_module_only=True)
    from zeroshard.zero import GatheredParameters

    with GatheredParameters(list(eng.module.parameters())):
        errors["zero0_params"] = {
            n: p.detach().reshape(-1).tolist() for n, p in eng.module.named_parameters()
        }
    return errors


def test_bad_deepspeed_checkpoints_fail_clearly(tmp_path) -> None:
    e = multirank.run(_bad, 2, str(tmp_path), timeout=600)[0]
    optim1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    for key in ("truncated", "missing", "stray", "global", "bomb", "pipeline", "mismatch", "sgd"):
        assert e[key] is not None and e[f"{key}:intact"], (key, e[key])
    assert f"truncated/global_step3/{optim1}" in e["truncated"]
    assert "corrupt or truncated" in e["truncated"]
    assert f"bitflip/global_step3/{optim1}" in e["bitflip"] and "CRC-32" in e["bitflip"]
    assert e["bitflip_noverify"] is None  # a finite value: only the checksum catches it
    assert f"nan/global_step3/{optim1}" in e["nan"] and "non-finite" in e["nan"]
    assert e["nan:intact"] and e["bitflip:intact"]
    assert f"missing/global_step3/{optim1}: missing" in e["missing"]
    assert "zero_pp_rank_2_mp_rank_00_optim_states.pt" in e["stray"]
    assert "global/global_step3/mp_rank_00_model_states.pt" in e["global"]
    assert "argparse.Namespace" in e["global"] and "refused" in e["global"]
    assert "bomb/global_step3/mp_rank_00_model_states.pt" in e["bomb"] and not e["pwned"]
    assert "layer_01-model_states.pt" in e["pipeline"] and "pipeline-parallel" in e["pipeline"]
    assert "mp_rank_01_model_states.pt" in e["tensor_parallel"]
    assert "tensor/model-parallel" in e["tensor_parallel"]
    assert "expp_rank_0" in e["moe"] and "mixture-of-experts" in e["moe"]
    assert "universal" in e["universal"] and "zero" in e["universal"]
    assert "fc1.weight [10, 6] vs model [11, 6]" in e["mismatch"]
    assert "exp_avg" in e["sgd"] and "SGD" in e["sgd"]
    assert e["sgd_weights"] is None
    assert "0 optimizer param groups saved" in e["zero0"] and e["zero0:intact"]
    assert e["zero0_module"] is None
    saved = _reference(FIXTURES)["zero0_fp32"]["saved"]
    for name, kinds in saved.items():
        assert e["zero0_params"][name] == case.values(kinds["master"]).tolist(), name


@contextlib.contextmanager
def _deepspeed_classes():
    """Empty classes under DeepSpeed's qualified names, so that ``torch.save`` pickles
    objects by those names as DeepSpeed's own files do (the modules exist only inside
    the block; DeepSpeed is not imported). Yields ``(classes by name, convert)``:
    ``convert(obj)`` turns ``load_pt``'s stand-ins in ``obj`` back into such objects."""
    import types

    from zeroshard.checkpoint import ds_pickle

    added: list[str] = []
    made: dict = {}
    for qualified, stand_in in ds_pickle.STAND_INS.items():
        module, _, name = qualified.rpartition(".")
        parts = module.split(".")
        for i in range(len(parts)):
            mod_name = ".".join(parts[: i + 1])
            if mod_name not in sys.modules:
                sys.modules[mod_name] = types.ModuleType(mod_name)
                added.append(mod_name)
        base = int if stand_in is ds_pickle.ZeroStage else object
        cls = type(name, (base,), {"__module__": module, "__qualname__": name})
        setattr(sys.modules[module], name, cls)
        made[qualified] = cls

    def convert(x):
        if isinstance(x, ds_pickle.ZeroStage):
            return made["deepspeed.runtime.zero.config.ZeroStageEnum"](int(x))
        if isinstance(x, (ds_pickle.LossScalerState, ds_pickle.FragmentAddress)):
            if isinstance(x, ds_pickle.FragmentAddress):
                name = "deepspeed.utils.tensor_fragment.fragment_address"
            else:
                kind = "DynamicLossScaler" if x.fields().get("dynamic") else "LossScaler"
                name = f"deepspeed.runtime.fp16.loss_scaler.{kind}"
            out = made[name]()
            out.__dict__.update(x.fields())
            return out
        if isinstance(x, torch.Size):
            return x
        if isinstance(x, dict):
            return type(x)((k, convert(v)) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return type(x)(convert(v) for v in x)
        return x

    try:
        yield made, convert
    finally:
        for mod_name in added:
            del sys.modules[mod_name]


def _dynamic_scale(rank: int, world: int, root: str) -> dict:
    """DeepSpeed's fp16 runs pickle a DynamicLossScaler (fp16 DeepSpeed does not run on
    this CPU): the fixture's scaler replaced by one, the scale state must reach an fp16
    engine."""
    import zeroshard
    from zeroshard.checkpoint.ds_pickle import load_pt

    d = _copy(root, "fp16")
    fields = {
        "cur_scale": 1024.0, "cur_iter": 3, "last_overflow_iter": 1, "scale_factor": 2.0,
        "scale_window": 1000, "min_scale": 1.0, "delayed_shift": 2, "cur_hysteresis": 1,
        "consecutive_hysteresis": False, "raise_error_at_min_scale": True,
        "dtype": torch.float16, "dynamic": True,
    }  # fmt: skip
    with _deepspeed_classes() as (classes, convert):
        for r in range(2):
            path = os.path.join(d, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
            sd = convert(load_pt(path))
            scaler = classes["deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"]()
            scaler.__dict__.update(fields)
            sd["optimizer_state_dict"]["loss_scaler"] = scaler
            _resave(sd, path)
    cfg = case.config(2, world)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 4}
    model = case.build_model(seed=99)
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=case.param_groups(model), config=cfg
    )
    before = engine.loss_scaler.state_dict()
    engine.load_checkpoint(os.path.dirname(d))
    return {"before": before, "after": engine.loss_scaler.state_dict()}


def test_dynamic_loss_scale_restored(tmp_path) -> None:
    r = multirank.run(_dynamic_scale, 1, str(tmp_path), timeout=300)[0]
    assert r["before"]["scale"] == 16.0
    assert r["after"] == {
        "scale": 1024.0, "cur_hysteresis": 1, "iteration": 3, "last_overflow_iter": 1
    }  # fmt: skip


def test_convert_from_deepspeed(tmp_path) -> None:
    from safetensors.torch import load_file

    from zeroshard.tools.cli import main as cli

    reference = _reference(FIXTURES)
    for name in ("zero1_bf16", "zero2_fp32", "zero3_fp32", "zero0_fp32"):
        out = str(tmp_path / f"{name}.safetensors")
        assert cli(["convert", "--from-deepspeed", os.path.join(FIXTURES, name), out]) == 0
        got = load_file(out)
        for pname, kinds in reference[name]["saved"].items():  # the fp32 masters
            assert torch.equal(got[pname].reshape(-1), case.values(kinds["master"])), (name, pname)
        assert torch.equal(got["head.weight"], got["emb.weight"])  # the tied name too
        assert set(got) == {n for n, _ in case.build_model().state_dict().items()}
    # the flag insists on DeepSpeed; a zeroshard directory is not one
    ours = tmp_path / "ours"
    ours.mkdir()
    assert cli(["convert", "--from-deepspeed", str(ours), str(tmp_path / "x.safetensors")]) == 2


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(BENCH_PYTHON), reason="needs .venv-bench with deepspeed")
def test_live_deepspeed_checkpoints(tmp_path, subtests: pytest.Subtests) -> None:
    """Fresh checkpoints from the real DeepSpeed (``.venv-bench``), loaded at 1 and 2
    ranks: the same checks as the fixtures get."""
    names = ["zero2_fp32", "zero3_fp32"]
    script = os.path.join(FIXTURES, "make_checkpoints.py")
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    subprocess.run([BENCH_PYTHON, script, str(tmp_path), *names], check=True, env=env, timeout=1200)
    reference = _reference(str(tmp_path))
    assert all(reference[n]["deepspeed"] for n in names)
    for world in (1, 2):
        plan = [job for job in PLAN[world] if job[0] in names]
        results = multirank.run(_continue, world, str(tmp_path), plan, timeout=600)
        _check(subtests, results, world, plan, reference, {})


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
