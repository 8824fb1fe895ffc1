"""Make the DeepSpeed checkpoint fixtures and DeepSpeed's own continuation from them.

Runs with DeepSpeed, never in the test suite's venv (``make ds-fixtures``, or)::

    DS_ACCELERATOR=cpu .venv-bench/bin/python tests/data/deepspeed/make_checkpoints.py OUT [CASE...]

For each case of ``tests/deepspeed_case.CASES`` (default: all), on 2 ranks (gloo, CPU):
build the model, train ``SAVE_AT`` steps, ``save_checkpoint(OUT/CASE)``, record what
DeepSpeed's own API says the training state is (``safe_get_full_fp32_param`` and
``safe_get_full_optimizer_state``, per parameter), then train ``MORE`` steps on the same
data, recording the global mean loss of each and the fp32 parameters at the end.
``OUT/reference.json`` gets one entry per case. Only the checkpoint files DeepSpeed
writes are kept (its copied ``zero_to_fp32.py`` scripts are removed: code, not data).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import sys
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import deepspeed_case as case
import torch
import torch.multiprocessing as mp

WORLD = 2


def _values(t: torch.Tensor) -> str:
    """A tensor's fp32 values, exactly and compactly: base64 of their little-endian bytes
    (``deepspeed_case.values`` reads them back)."""
    data = t.detach().float().reshape(-1).contiguous().numpy().astype("<f4").tobytes()
    return base64.b64encode(data).decode("ascii")


def _state(engine, model) -> dict:
    """Every trained parameter's fp32 master and Adam moments, as DeepSpeed's API
    assembles them (a collective at stage 3: every rank calls it in the same order)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2 link the moments
        opt._hp_optimizer_states_linked = False  # once, before the first step made them
        opt._lazy_init_hp_params_optimizer_state()
    out: dict = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        master = safe_get_full_fp32_param(p)
        if master is None:  # no ZeRO (stage 0, fp32): the parameter is the master
            state = engine.optimizer.state[p]
            out[name] = {k: _values(v) for k, v in (("master", p), *state.items()) if k != "step"}
            continue
        out[name] = {
            "master": _values(master),
            "exp_avg": _values(safe_get_full_optimizer_state(p, "exp_avg")),
            "exp_avg_sq": _values(safe_get_full_optimizer_state(p, "exp_avg_sq")),
        }
    return out


def _rank(rank: int, name: str, out: str, store: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_SIZE=str(WORLD)
    )
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD)
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the group above
    import time

    t0 = time.monotonic()
    stage, dtype, accum, zero = case.CASES[name]
    model = case.build_model()
    with torch.no_grad():
        model.temperature.fill_(case.TEMPERATURE)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=case.param_groups(model),
        config=case.config(stage, WORLD, dtype, accum, zero),
    )
    print(f"rank {rank}: initialize done at {time.monotonic() - t0:.1f} s", flush=True)
    rows = slice(rank * case.ROWS // WORLD, (rank + 1) * case.ROWS // WORLD)

    def train(step: int) -> float:
        idx, tgt = case.batch(step, rows)
        loss = engine(idx, tgt)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        return float(mean) / WORLD

    before = [train(s) for s in range(case.SAVE_AT)]
    engine.save_checkpoint(os.path.join(out, name))
    saved = _state(engine, model)
    lrs = [g["lr"] for g in engine.optimizer.param_groups]
    losses = [train(s) for s in range(case.SAVE_AT, case.SAVE_AT + case.MORE)]
    after = _state(engine, model)
    print(f"rank {rank}: training done at {time.monotonic() - t0:.1f} s", flush=True)
    if rank == 0:
        result = {
            "stage": stage,
            "dtype": dtype,
            "world": WORLD,
            "deepspeed": deepspeed.__version__,
            "losses_before_save": before,
            "saved": saved,
            "lr_at_save": lrs,
            "losses": losses,
            "params": {n: v["master"] for n, v in after.items()},
        }
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    out = os.path.abspath(argv[0])
    names = argv[1:] or list(case.CASES)
    os.makedirs(out, exist_ok=True)
    for name in names:
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(
                _rank, args=(name, out, os.path.join(tmp, "store")), nprocs=WORLD,
                start_method="spawn",
            )  # fmt: skip
        for root, _, files in os.walk(os.path.join(out, name)):
            for fname in files:
                if fname.endswith(".py"):  # DeepSpeed copies its recovery scripts in
                    os.remove(os.path.join(root, fname))
    path = os.path.join(out, "reference.json")
    reference = {}
    if os.path.exists(path):
        with open(path) as fh:
            reference = json.load(fh)
    for name in names:
        part = os.path.join(out, f"{name}.json")
        with open(part) as fh:
            reference[name] = json.load(fh)
        os.remove(part)
    with open(path, "w") as fh:
        json.dump(reference, fh, sort_keys=True, separators=(",", ":"))
        fh.write("\n")
    print(f"wrote {', '.join(names)} and reference.json under {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
