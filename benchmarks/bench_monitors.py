"""What watching a run costs: every monitor on against every monitor off, one run.

    .venv/bin/python benchmarks/bench_monitors.py --rounds 8 --steps 10

Two ranks (gloo, one thread each), the small reference GPT at ZeRO stage 3, fp32. Each
rank builds two engines over two copies of the model in the same processes: *off*
(``steps_per_print`` null, no monitoring section) and *on* (TensorBoard, CSV, wandb
offline, Comet offline when comet_ml is installed, the comms logger, the flops profiler
at step 1, ``wall_clock_breakdown``, ``memory_breakdown``, ``dump_state``, the
throughput timer and the step line every 10 steps). Rounds alternate which engine goes
first; each round times ``--steps`` optimizer steps of each (forward, backward, step;
rank 0's clock, the ranks move in lockstep). Reported: the median step time of each
over all rounds, the overhead (on / off - 1) from those medians and the median of the
per-round ratios, and the profiled step (the flops profiler's one step, counted in the
median like any other).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def on_config(tmp: str) -> dict:
    comet = importlib.util.find_spec("comet_ml") is not None
    return {
        "steps_per_print": 10,
        "wall_clock_breakdown": True,
        "memory_breakdown": True,
        "dump_state": True,
        "timers": {"throughput": {"enabled": True}},
        "tensorboard": {"enabled": True, "output_path": tmp, "job_name": "tb"},
        "csv_monitor": {"enabled": True, "output_path": tmp, "job_name": "csv"},
        "wandb": {"enabled": True, "project": "bench"},
        "comet": {"enabled": comet, "online": False},
        "comms_logger": {"enabled": True},
        "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": f"{tmp}/flops.txt"},
    }


def rank_main(rounds: int, steps: int, warmup: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    import zeroshard
    from zeroshard.models import GPT, GPTConfig

    torch.set_num_threads(1)
    zeroshard.init_distributed()
    rank = dist.get_rank()
    tmp = tempfile.mkdtemp(prefix="zs-bench-monitors-")
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=tmp)
    os.environ["COMET_OFFLINE_DIRECTORY"] = os.path.join(tmp, "comet")
    shape = GPTConfig.preset("small", seq_len=128)
    base = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3},
        "steps_per_print": None,
    }
    engines = {}
    for name, extra in (("off", {}), ("on", on_config(tmp))):
        torch.manual_seed(0)
        model = GPT(shape)
        engines[name], *_ = zeroshard.initialize(model=model, config={**base, **extra})
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (4, 128), generator=gen)

    def step(engine) -> float:
        t0 = time.perf_counter()
        engine.backward(engine(x, x))
        engine.step()
        return time.perf_counter() - t0

    for engine in engines.values():
        for _ in range(warmup):
            step(engine)
    times: dict[str, list[list[float]]] = {"off": [], "on": []}
    profiled = None
    for r in range(rounds):
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            engine = engines[name]
            timed = []
            for _ in range(steps):
                before = engine.global_steps
                timed.append(step(engine))
                if name == "on" and before == 1:  # the flops profiler's step
                    profiled = timed[-1]
            times[name].append(timed)
    for engine in engines.values():
        engine.destroy()
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"times": times, "profiled": profiled, "warmup": warmup}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per engine first")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from _ranks import run_ranks

    t0 = time.time()
    ranks = run_ranks(__file__, [str(args.rounds), str(args.steps), str(args.warmup)], timeout=3600)
    r0 = ranks[0]
    on = [t for block in r0["times"]["on"] for t in block]
    off = [t for block in r0["times"]["off"] for t in block]
    ratios = [
        statistics.median(a) / statistics.median(b)
        for a, b in zip(r0["times"]["on"], r0["times"]["off"], strict=True)
    ]
    med_on, med_off = statistics.median(on), statistics.median(off)
    import torch

    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    print(f"## {stamp} bench_monitors: 2 cores, torch {torch.__version__}, Python {platform.python_version()}")  # fmt: skip
    print()
    print(f"`.venv/bin/python benchmarks/bench_monitors.py --rounds {args.rounds} --steps {args.steps}`")  # fmt: skip
    print()
    print(f"GPT small, seq 128, micro-batch 4, ZeRO-3, 2 ranks; {args.rounds} interleaved rounds of {args.steps} steps per engine after {args.warmup} warm-up step(s); {time.time() - t0:.0f} s in all.")  # fmt: skip
    print()
    print("| monitors | step (ms), median | min-max (ms) | steps |")
    print("|---|---|---|---|")
    for name, values in (("off", off), ("on (all)", on)):
        print(f"| {name} | {1e3 * statistics.median(values):.1f} | {1e3 * min(values):.1f}-{1e3 * max(values):.1f} | {len(values)} |")  # fmt: skip
    print()
    print(f"overhead: {100 * (med_on / med_off - 1):+.2f}% (medians over all steps); median of per-round ratios {100 * (statistics.median(ratios) - 1):+.2f}% (rounds: {', '.join(f'{100 * (x - 1):+.1f}%' for x in ratios)})")  # fmt: skip
    if r0["profiled"] is not None:
        print(f"the flops profiler's step (in the 'on' steps above): {1e3 * r0['profiled']:.0f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": ranks, "median_on": med_on, "median_off": med_off, "ratios": ratios}, f)  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_rank":
        rank_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        main()
