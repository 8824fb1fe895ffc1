"""Measured pipeline bubbles against the papers' formulas (issue 18's acceptance).

    .venv/bin/python benchmarks/bench_pipeline_bubble.py                 # matmul layers, ~3 min
    .venv/bin/python benchmarks/bench_pipeline_bubble.py --layer sleep   # the control below

``--stages`` ranks (default 4) run zeroshard's pipeline engine on a model of ``2 x stages``
equal layers (two per stage; one per model chunk for ``interleaved_1f1b`` with 2 virtual
stages), ``--microbatches`` micro-batches per ``train_batch``, for each schedule. Every rank
keeps ``engine.pipeline_trace`` of each timed batch; the traces of one batch on all ranks
are joined and ``zeroshard.parallel.pipeline.plot.bubble_fractions`` gives each stage's idle
share of the batch's span (time in sends and receives counts as idle). The table gives the
mean over stages, median over timed batches and rounds, next to
``theoretical_bubble`` (1F1B and GPipe ``(p-1)/(m+p-1)``, interleaved ``(p-1)/(v m+p-1)``,
ZB-H1 with F = B = W), and a timeline PNG per schedule (the last batch) is written to
``--png-dir``.

Layers (``--layer``):

* ``matmul``: ``Linear(d, d, bias=False)`` on ``rows x d`` activations: forward, input
  gradient and weight gradient are one ``rows x d x d`` matmul each (the F = B = W of the
  zero-bubble paper), compute-dominated, no sleeps. Each stage needs its own core: with
  fewer cores than stages, stages time-share and the schedule's idle time is filled by the
  other stages' work, so the measurement says more about the host than the schedule.
* ``sleep``: the same shape of work as ``time.sleep`` (F sleeps in forward, the input
  gradient and the weight gradient each sleep in their own autograd node, so ZB-H1's split
  sees them apart): costs that hold on any number of cores, a control for the schedule and
  the engine's overhead.

Results are appended to ``benchmarks/RESULTS.md`` unless ``--no-record``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import wait_all

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)]


class MatmulLayer(nn.Module):
    def __init__(self, d: int, seed: int, seconds: float = 0.0):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(d, d, bias=False)
        with torch.no_grad():
            self.lin.weight.mul_(0.5)  # keep activations bounded through the stack

    def forward(self, x):
        return self.lin(x)


class _SleepInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.seconds)
        return g, None


class _SleepWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, seconds):
        ctx.seconds, ctx.shape = seconds, w.shape
        return w.new_zeros(())

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.seconds)
        return g.new_zeros(ctx.shape), None


class SleepLayer(nn.Module):
    """F, input gradient and weight gradient each sleep ``seconds``; values pass unchanged."""

    def __init__(self, d: int, seed: int, seconds: float = 0.01):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.seconds = seconds

    def forward(self, x):
        return _SleepInput.apply(x, self.seconds) + _SleepWeight.apply(self.w, self.seconds)


def loss_fn(out, y):
    return torch.nn.functional.mse_loss(out, y)


def worker(spec_path: str, rank: int) -> None:
    import torch.distributed as dist

    import zeroshard
    from zeroshard.parallel.pipeline.engine import PipelineEngine
    from zeroshard.pipe import LayerSpec, PipelineModule

    with open(spec_path) as f:
        spec = json.load(f)
    here, p = os.path.dirname(spec_path), spec["stages"]
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(p), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1"
    )
    dist.init_process_group(
        "gloo", store=dist.FileStore(os.path.join(here, "store"), p), rank=rank, world_size=p
    )
    cls = MatmulLayer if spec["layer"] == "matmul" else SleepLayer
    layers = [LayerSpec(cls, spec["d"], 100 + i, spec["sleep"]) for i in range(2 * p)]
    model = PipelineModule(
        layers=layers,
        num_stages=p,
        loss_fn=loss_fn,
        partition_method="uniform",
        virtual_stages=spec["virtual"],
    )
    config = {
        "train_micro_batch_size_per_gpu": spec["rows"],
        "gradient_accumulation_steps": spec["microbatches"],
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
        "pipeline": {"stages": p, "schedule": spec["schedule"], "virtual_stages": spec["virtual"]},
    }
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    assert isinstance(engine, PipelineEngine)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    traces, times = [], []
    for i in range(spec["warmup"] + spec["steps"]):
        mbs = [
            (
                torch.randn(spec["rows"], spec["d"], generator=g),
                torch.randn(spec["rows"], spec["d"], generator=g),
            )
            for _ in range(spec["microbatches"])
        ]
        dist.barrier()
        t0 = time.perf_counter()
        engine.train_batch(data_iter=iter(mbs))
        dt = time.perf_counter() - t0
        if i >= spec["warmup"]:
            traces.append(list(engine.pipeline_trace))
            times.append(dt)
    with open(os.path.join(here, f"result{rank}.json"), "w") as f:
        json.dump({"traces": traces, "times": times}, f)
    engine.destroy()
    dist.destroy_process_group()


def run_once(spec: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="zs-bubble-") as tmp:
        path = os.path.join(tmp, "spec.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        with contextlib.ExitStack() as stack:
            procs = [
                subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "_worker", path, str(r)],
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
                print(f"{spec['schedule']}: rank {r} exit {p.returncode} after writing its results")
            if not os.path.exists(res):
                with open(os.path.join(tmp, f"log{r}.txt")) as f:
                    tail = f.read().strip().splitlines()[-8:]
                raise RuntimeError(
                    f"{spec['schedule']}: rank {r} exit {p.returncode} (result written: "
                    f"{os.path.exists(res)}):\n" + "\n".join(tail)
                )
            with open(res) as f:
                ranks.append(json.load(f))
    # one joined trace per timed batch
    batches = [[a for rk in ranks for a in rk["traces"][i]] for i in range(spec["steps"])]
    times = [max(ts) for ts in zip(*(rk["times"] for rk in ranks), strict=True)]
    return {"batches": batches, "times": times}


def main(argv=None) -> int:
    sys.path.insert(0, ROOT)  # this checkout's zeroshard, as the workers get it
    from zeroshard.parallel.pipeline.plot import bubble_fractions, plot_timeline, theoretical_bubble

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layer", choices=("matmul", "sleep"), default="matmul")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--d", type=int, default=512, help="layer width")
    ap.add_argument("--rows", type=int, default=256, help="rows per micro-batch")
    ap.add_argument(
        "--sleep",
        type=float,
        default=0.01,
        help="seconds per F / BI / BW and layer (--layer sleep)",
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--schedules", default=",".join(s for s, _ in SCHEDULES))
    ap.add_argument("--png-dir", default=os.path.join(HERE, "pipeline_bubble"))
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CI: 2 stages, 4 micro-batches, interleaved 1F1B, 1 batch; PNGs to a temp dir",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.stages, args.microbatches, args.d, args.rows = 2, 4, 16, 4
        args.rounds, args.steps, args.warmup = 1, 1, 1
        args.schedules, args.no_record = "interleaved_1f1b", True
        args.png_dir = tempfile.mkdtemp(prefix="zs-smoke-bubble-")
    chosen = [(s, v) for s, v in SCHEDULES if s in args.schedules.split(",")]
    p, m = args.stages, args.microbatches
    base = {
        k: getattr(args, k)
        for k in ("layer", "stages", "microbatches", "d", "rows", "sleep", "steps", "warmup")
    }
    os.makedirs(args.png_dir, exist_ok=True)
    results: dict[str, dict] = {s: {"bubbles": [], "per_stage": [], "times": []} for s, _ in chosen}
    start = datetime.datetime.now()
    for rnd in range(args.rounds):
        for sched, v in chosen[rnd % len(chosen) :] + chosen[: rnd % len(chosen)]:
            out = run_once({**base, "schedule": sched, "virtual": v}, args.timeout)
            r = results[sched]
            for trace in out["batches"]:
                fr = bubble_fractions(trace)
                r["bubbles"].append(sum(fr.values()) / len(fr))
                r["per_stage"].append([fr[s] for s in sorted(fr)])
            r["times"] += out["times"]
            r["last"] = out["batches"][-1]
            print(
                f"round {rnd} {sched}: bubble {statistics.median(r['bubbles'][-args.steps :]):.3f}",
                flush=True,
            )
    rows = [
        "| schedule | v | theory | all stages | / theory | stages 1..p-1 | / theory | per stage "
        "| batch (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for sched, v in chosen:
        r = results[sched]
        theory = theoretical_bubble(sched, p, m, v)
        meas = statistics.median(r["bubbles"])
        cols = [statistics.median(col) for col in zip(*r["per_stage"], strict=True)]
        per = " / ".join(f"{c:.3f}" for c in cols)
        rest = statistics.median(sum(st[1:]) / max(1, len(st) - 1) for st in r["per_stage"])
        png = os.path.join(args.png_dir, f"{sched}_{args.layer}.png")
        plot_timeline(
            r["last"],
            png,
            title=f"{sched} (p={p}, m={m}, v={v}, {args.layer} layers): theory {theory:.1%}",
        )
        rows.append(
            f"| {sched} | {v} | {theory:.3f} | {meas:.3f} | {meas / theory:.2f} | **{rest:.3f}** | "
            f"{rest / theory:.2f} | {per} | {statistics.median(r['times']) * 1e3:.0f} |"
        )
    cmd = shlex.join(argv if argv is not None else sys.argv[1:])
    text = (
        f"## {start:%Y-%m-%d %H:%M} bench_pipeline_bubble ({args.layer} layers): {p} stages, {m} micro-batches, "
        f"{os.cpu_count()} cores, torch {torch.__version__}\n\n"
        f"`.venv/bin/python benchmarks/bench_pipeline_bubble.py {cmd}`\n\n"
        f"{2 * p} equal layers ({args.layer}: d {args.d}, {args.rows} rows"
        + (f", {args.sleep * 1e3:.0f} ms per F/BI/BW" if args.layer == "sleep" else "")
        + f"), {args.rounds} rounds x {args.steps} timed batches. Bubble = a stage's idle share of the batch "
        f"span (sends/receives count as idle), median over batches of the mean over stages. Stage 0 has no "
        "input gradient to compute (its input is data), so it does less work than the others and idles more "
        "than the formula for equal stages says; *stages 1..p-1* are the stages of equal work. "
        f"Timelines: `{os.path.relpath(args.png_dir, ROOT)}/"
        f"<schedule>_{args.layer}.png`.\n\n" + "\n".join(rows) + "\n"
    )
    print(text)
    if not args.no_record:
        with open(os.path.join(HERE, "RESULTS.md"), "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        worker(sys.argv[2], int(sys.argv[3]))
    else:
        raise SystemExit(main())
