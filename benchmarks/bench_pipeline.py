"""Pipeline-parallel training step: zeroshard's pipeline engine (gpipe, 1f1b, zb_h1) against
``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B``)
and DeepSpeed's ``PipelineModule`` engine, on the same model, in the same run.

    .venv/bin/python benchmarks/bench_pipeline.py --rounds 5                  # ~5 min on 2 cores
    .venv/bin/python benchmarks/bench_pipeline.py --rounds 1 --steps 2 --layers 2 --no-record

The model is the reference GPT's parts as a flat layer list -- token+position embedding,
``--layers`` pre-LN blocks, final norm + untied head -- built layer by layer with a seed per
layer, so every system builds only its own stage's layers and all of them start from the
same weights (the first loss of every system is in the table: equal losses, same model and
data). The list is cut into ``--stages`` equal halves (DeepSpeed ``partition_method
"uniform"``; the same indices for torch and zeroshard). fp32, AdamW (torch's, fused; lr
3e-4), ``--microbatches`` micro-batches of ``--micro-batch`` sequences per step, one
pipeline (no data parallelism), gloo, one thread per rank.

Every run is a fresh set of processes (``_worker``), DeepSpeed's in ``--ds-python``
(default ``.venv-bench``: ``make .venv-bench/.installed-stamp``) with ``DS_ACCELERATOR=cpu``.
Rounds interleave the systems, rotating the order; after ``--warmup`` batches (the first
carries one-off costs: shape exchange, allocator growth), a run's step time is the median over its
timed steps of the slowest rank's ``train_batch`` (forward, backward, optimizer step); the
table gives the median over rounds and the fastest round. *CPU per step* is the process CPU time of
one ``train_batch`` (the busier rank, median over steps and rounds): the work each system does,
which other jobs on a shared host disturb much less than the wall time. Memory: each rank's peak RSS (``ru_maxrss``) and that
peak minus the RSS before the model was built (the run's own growth: weights, gradients,
optimizer state, activations in flight, communication buffers).

Results go to stdout and are appended to ``benchmarks/RESULTS.md`` (unless ``--no-record``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import wait_all

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SYSTEMS = [
    "zeroshard-gpipe",
    "zeroshard-1f1b",
    "zeroshard-zb_h1",
    "torch-gpipe",
    "torch-1f1b",
    "deepspeed",
]
LR = 3e-4


# -- the model, one seeded layer at a time -------------------------------------------------
def _cfg(spec):
    from zeroshard.models import GPTConfig

    return GPTConfig(
        vocab_size=spec["vocab"],
        seq_len=spec["seq"],
        n_layer=spec["layers"],
        n_head=spec["heads"],
        d_model=spec["d_model"],
        tie_embeddings=False,
    )


class Embed(nn.Module):
    def __init__(self, spec: dict, seed: int):
        super().__init__()
        cfg = _cfg(spec)
        torch.manual_seed(seed)
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx):
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class SeededBlock(nn.Module):
    def __init__(self, spec: dict, seed: int):
        super().__init__()
        from zeroshard.models import Block

        torch.manual_seed(seed)
        self.block = Block(_cfg(spec))

    def forward(self, x):
        return self.block(x)


class Head(nn.Module):
    def __init__(self, spec: dict, seed: int):
        super().__init__()
        cfg = _cfg(spec)
        torch.manual_seed(seed)
        self.norm = nn.LayerNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x):
        return self.out(self.norm(x))


def layer_specs(spec) -> list[tuple[type, dict, int]]:
    n = spec["layers"]
    return (
        [(Embed, spec, 1000)]
        + [(SeededBlock, spec, 1001 + i) for i in range(n)]
        + [(Head, spec, 2000)]
    )


def stage_range(spec, stage: int) -> tuple[int, int]:
    n, p = spec["layers"] + 2, spec["stages"]
    bounds = [round(i * n / p) for i in range(p + 1)]
    return bounds[stage], bounds[stage + 1]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def micro_batches(spec, step: int):
    g = torch.Generator().manual_seed(10_000 + step)
    shape = (spec["microbatches"], spec["micro_batch"], spec["seq"] + 1)
    data = torch.randint(0, spec["vocab"], shape, generator=g)
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


# -- the systems: build(spec, rank) -> step(list of (x, y)) -> loss or None ----------------
class NotAvailable(Exception):
    pass


def torch_system(spec, rank: int):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    lo, hi = stage_range(spec, rank)
    mod = nn.Sequential(*(cls(s, seed) for cls, s, seed in layer_specs(spec)[lo:hi]))
    stage = PipelineStage(mod, rank, spec["stages"], torch.device("cpu"))
    kind = ScheduleGPipe if spec["system"] == "torch-gpipe" else Schedule1F1B
    sched = kind(stage, n_microbatches=spec["microbatches"], loss_fn=loss_fn)
    opt = torch.optim.AdamW(mod.parameters(), lr=LR, fused=True)
    first, last = rank == 0, rank == spec["stages"] - 1

    def step(mbs):
        x = torch.cat([m[0] for m in mbs])
        y = torch.cat([m[1] for m in mbs])
        losses: list = []
        if first:
            sched.step(x)
        elif last:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return torch.stack(losses).mean().item() if losses else None

    return step, f"{kind.__name__} + PipelineStage"


def _ds_config(spec, schedule: str | None = None) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": spec["micro_batch"],
        "gradient_accumulation_steps": spec["microbatches"],
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True, "fused": True}},
        "steps_per_print": 10**9,
    }
    if schedule:
        cfg["optimizer"]["params"] = {"lr": LR}
        cfg["pipeline"] = {"stages": spec["stages"], "schedule": schedule}
    return cfg


def deepspeed_system(spec, rank: int):
    try:
        import deepspeed
        from deepspeed.pipe import LayerSpec, PipelineModule
    except ImportError as e:
        raise NotAvailable(f"deepspeed not installed ({e})") from e
    deepspeed.init_distributed(dist_backend="gloo")
    layers = [LayerSpec(cls, s, seed) for cls, s, seed in layer_specs(spec)]
    model = PipelineModule(
        layers=layers, num_stages=spec["stages"], loss_fn=loss_fn, partition_method="uniform"
    )
    assert (model._local_start, model._local_stop) == stage_range(spec, rank)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=_ds_config(spec)
    )

    def step(mbs):
        loss = engine.train_batch(data_iter=iter(mbs))
        return loss.item() if rank == spec["stages"] - 1 else None

    return step, f"DeepSpeed {deepspeed.__version__} PipelineEngine (TrainSchedule), ZeRO 0"


def zeroshard_system(spec, rank: int):
    import zeroshard
    from zeroshard.parallel.pipeline.engine import PipelineEngine

    try:
        from zeroshard.pipe import LayerSpec, PipelineModule
    except ImportError as e:
        raise NotAvailable(f"zeroshard.pipe not built yet ({e})") from e
    layers = [LayerSpec(cls, s, seed) for cls, s, seed in layer_specs(spec)]
    model = PipelineModule(
        layers=layers, num_stages=spec["stages"], loss_fn=loss_fn, partition_method="uniform"
    )
    schedule = spec["system"].split("-", 1)[1]
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=_ds_config(spec, schedule)
    )
    assert isinstance(engine, PipelineEngine)

    def step(mbs):
        loss = engine.train_batch(data_iter=iter(mbs))
        return float(loss) if rank == spec["stages"] - 1 else None

    step.close = engine.destroy  # type: ignore[attr-defined]  # a function attribute the runner calls
    return step, f"zeroshard pipeline engine, schedule {schedule}"


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def worker(spec_path: str, rank: int) -> None:
    import torch.distributed as dist

    with open(spec_path) as f:
        spec = json.load(f)
    here, world = os.path.dirname(spec_path), spec["stages"]
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1"
    )
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(os.path.join(here, "store"), world),
        rank=rank,
        world_size=world,
    )
    base = _rss_kib()
    build = {"torch": torch_system, "deepspeed": deepspeed_system, "zeroshard": zeroshard_system}
    try:
        step, note = build[spec["system"].split("-")[0]](spec, rank)
    except NotAvailable as e:
        out: dict[str, Any] = {"status": "not available", "reason": str(e)}
    else:
        torch.set_num_threads(1)
        times, cpu, losses = [], [], []
        for i in range(spec["warmup"] + spec["steps"]):
            mbs = micro_batches(spec, i)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = step(mbs)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            losses.append(loss)
            if i >= spec["warmup"]:
                times.append(dt)
                cpu.append(dc)
        out = {"status": "ok", "note": note, "times": times, "cpu": cpu, "losses": losses}
    out["rss_base_kib"] = base
    out["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open(os.path.join(here, f"result{rank}.json"), "w") as f:
        json.dump(out, f)
    if out["status"] == "ok" and hasattr(step, "close"):
        step.close()
    dist.destroy_process_group()


# -- the driver ---------------------------------------------------------------------------
def run_once(spec: dict, python: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="zs-benchpp-") as tmp:
        path = os.path.join(tmp, "spec.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        env = {
            **os.environ,
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        with contextlib.ExitStack() as stack:
            procs = [
                subprocess.Popen(
                    [python, os.path.abspath(__file__), "_worker", path, str(r)],
                    stdout=stack.enter_context(open(os.path.join(tmp, f"log{r}.txt"), "w")),
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=ROOT,
                )
                for r in range(spec["stages"])
            ]
            wait_all(procs, timeout)  # kills the others on a failed rank or the timeout
        ranks = []
        for r, p in enumerate(procs):
            res = os.path.join(tmp, f"result{r}.json")
            if p.returncode != 0 and os.path.exists(res):  # died after its results: say so
                print(f"{spec['system']}: rank {r} exit {p.returncode} after writing its results")
            if not os.path.exists(res):
                with open(os.path.join(tmp, f"log{r}.txt")) as f:
                    tail = f.read().strip().splitlines()[-6:]
                return {
                    "status": "error",
                    "reason": f"rank {r} exit {p.returncode}: " + " | ".join(tail),
                }
            with open(res) as f:
                ranks.append(json.load(f))
        if ranks[0]["status"] != "ok":
            return ranks[0]
        slowest = [max(ts) for ts in zip(*(r["times"] for r in ranks), strict=True)]
        first_loss = next(x for x in ranks[-1]["losses"] if x is not None)
        return {
            "status": "ok",
            "note": ranks[0]["note"],
            "step_s": statistics.median(slowest),
            "cpu_s": statistics.median(
                max(cs) for cs in zip(*(r["cpu"] for r in ranks), strict=True)
            ),
            "peak_mib": [r["maxrss_kib"] / 1024 for r in ranks],
            "growth_mib": [(r["maxrss_kib"] - r["rss_base_kib"]) / 1024 for r in ranks],
            "first_loss": first_loss,
        }


def summarize(runs: dict[str, list[dict]]) -> str:
    rows = [
        "| system | step (ms), median of rounds | fastest round | CPU per step (ms) | peak RSS per rank (MiB) "
        "| growth per rank (MiB) | first loss | setup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, rs in runs.items():
        ok = [r for r in rs if r["status"] == "ok"]
        if not ok:
            rows.append(
                f"| {name} | {rs[0]['status']}: {rs[0].get('reason', '')[:160]} | | | | | | |"
            )
            continue
        med = statistics.median(r["step_s"] for r in ok) * 1e3
        cpu = statistics.median(r["cpu_s"] for r in ok) * 1e3
        per = " ".join(f"{r['step_s'] * 1e3:.0f}" for r in ok)
        peak = " / ".join(
            f"{statistics.median(r['peak_mib'][i] for r in ok):.0f}"
            for i in range(len(ok[0]["peak_mib"]))
        )
        grow = " / ".join(
            f"{statistics.median(r['growth_mib'][i] for r in ok):.0f}"
            for i in range(len(ok[0]["growth_mib"]))
        )
        rows.append(
            f"| {name} | **{med:.0f}** ({per}) | {min(r['step_s'] for r in ok) * 1e3:.0f} | {cpu:.0f} | {peak} "
            f"| {grow} | {ok[0]['first_loss']:.4f} "
            f"| {ok[0]['note']} |"
        )
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--ds-python", default=os.path.join(ROOT, ".venv-bench", "bin", "python"))
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CI: a 2-block GPT, 2 micro-batches, zeroshard zb_h1 and torch 1f1b, 1 step",
    )
    args = ap.parse_args(argv)
    if args.smoke:  # (DeepSpeed's engine needs .venv-bench: left out)
        args.systems, args.rounds, args.steps, args.warmup = "zeroshard-zb_h1,torch-1f1b", 1, 1, 1
        args.microbatches, args.micro_batch, args.seq, args.layers = 2, 1, 16, 2
        args.d_model, args.heads, args.vocab, args.no_record = 32, 2, 64, True
        print("smoke: deepspeed skipped: it runs from .venv-bench, which CI does not build")
    systems = args.systems.split(",")
    if args.layers + 2 < args.stages:
        ap.error("--layers + 2 must be at least --stages")
    base = {
        k: getattr(args, k)
        for k in (
            "steps",
            "warmup",
            "stages",
            "microbatches",
            "micro_batch",
            "seq",
            "layers",
            "d_model",
            "heads",
            "vocab",
        )
    }
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    start = datetime.datetime.now()
    for rnd in range(args.rounds):
        for name in systems[rnd % len(systems) :] + systems[: rnd % len(systems)]:
            py = args.ds_python if name == "deepspeed" else sys.executable
            if name == "deepspeed" and not os.path.exists(py):
                res: dict[str, Any] = {
                    "status": "not available",
                    "reason": f"no {py} (make .venv-bench/.installed-stamp)",
                }
            else:
                res = run_once({**base, "system": name}, py, args.timeout)
            runs[name].append(res)
            brief = (
                f"{res['step_s'] * 1e3:.0f} ms"
                if res["status"] == "ok"
                else res.get("reason", "")[:300]
            )
            print(f"round {rnd} {name}: {res['status']} {brief}", flush=True)
    table = summarize(runs)
    n = args.layers * (12 * args.d_model**2 + 13 * args.d_model) + 2 * args.vocab * args.d_model
    head = (
        f"## {start:%Y-%m-%d %H:%M} bench_pipeline: {args.stages} stages, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, Python {platform.python_version()}\n\n"
        f"`.venv/bin/python benchmarks/bench_pipeline.py {shlex.join(argv or sys.argv[1:])}`\n\n"
        f"GPT {args.layers} blocks x d{args.d_model} (~{n / 1e6:.1f}M parameters), seq {args.seq}, "
        f"{args.microbatches} micro-batches of {args.micro_batch}, fp32, AdamW, one rank per stage (gloo, "
        f"1 thread). Step = one train_batch; slowest rank, median over {args.steps} steps, then over rounds "
        f"(each round's value in parentheses). Growth = peak RSS - RSS before the model was built.\n"
    )
    text = head + "\n" + table + "\n"
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    if not args.no_record:
        with open(os.path.join(HERE, "RESULTS.md"), "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        worker(sys.argv[2], int(sys.argv[3]))
    else:
        raise SystemExit(main())
