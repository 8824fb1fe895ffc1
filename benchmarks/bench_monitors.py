"""What watching a run costs: every monitor on against every monitor off, one run.

    .venv/bin/python benchmarks/bench_monitors.py --rounds 8 --steps 10

Two ranks (gloo, one thread each), the small reference GPT at ZeRO stage 3, fp32. Each
rank builds two engines over two copies of the model in the same processes: *off*
(``steps_per_print`` null, no monitoring section) and *on* (TensorBoard, CSV, wandb
offline, Comet offline when comet_ml is installed, the comms logger, the flops profiler
at step 1, ``wall_clock_breakdown``, ``memory_breakdown``, ``dump_state``, the
throughput timer and the step line every 10 steps). The engines take turns step by
step (off, on, off, on, ...; each round starts with the other one), so both see the
same load from the rest of the machine; each step (forward, backward, step) is timed on
rank 0 by the wall clock, the main thread's CPU clock and the process's (all its
threads: the writers' threads too; the ranks move in lockstep; wandb's service runs in
a process of its own). Reported: the median step time of each, the overhead from the medians and
the median over pairs of neighbouring steps of on / off, for both clocks, and the
profiled step (the flops profiler's one step, counted in the medians like any other).
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
SEQ, MICRO = 128, 8


def on_config(tmp: str, services: bool = True) -> dict:
    """Every section on; ``services`` false leaves out wandb and Comet (third-party
    processes and threads that share the host's cores)."""
    comet = services and importlib.util.find_spec("comet_ml") is not None
    return {
        "steps_per_print": 10,
        "wall_clock_breakdown": True,
        "memory_breakdown": True,
        "dump_state": True,
        "timers": {"throughput": {"enabled": True}},
        "tensorboard": {"enabled": True, "output_path": tmp, "job_name": "tb"},
        "csv_monitor": {"enabled": True, "output_path": tmp, "job_name": "csv"},
        "wandb": {"enabled": services, "project": "bench"},
        "comet": {"enabled": comet, "online": False},
        "comms_logger": {"enabled": True},
        "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": f"{tmp}/flops.txt"},
    }


def rank_main(rounds: int, steps: int, warmup: int, services: bool, out: str) -> None:
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
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3},
        "steps_per_print": None,
    }
    engines = {}
    for name, extra in (("off", {}), ("on", on_config(tmp, services))):
        torch.manual_seed(0)
        model = GPT(shape)
        engines[name], *_ = zeroshard.initialize(model=model, config={**base, **extra})
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (MICRO, SEQ), generator=gen)

    def step(engine) -> tuple[float, float, float]:
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        engine.backward(engine(x, x))
        engine.step()
        now = time.perf_counter(), time.thread_time(), time.process_time()
        return now[0] - t0, now[1] - c0, now[2] - p0

    for engine in engines.values():
        for _ in range(warmup):
            step(engine)
    times: dict[str, list[tuple[float, float, float]]] = {"off": [], "on": []}
    profiled = None
    for r in range(rounds):
        for _ in range(steps):
            for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
                engine = engines[name]
                before = engine.global_steps
                times[name].append(step(engine))
                if name == "on" and before == 1:  # the flops profiler's step
                    profiled = times[name][-1][0]
    for engine in engines.values():
        engine.destroy()
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"times": times, "profiled": profiled, "warmup": warmup}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10, help="step pairs per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per engine first")
    parser.add_argument("--no-services", action="store_true", help="'on' without wandb and Comet")
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="CI: 1 round of 2 step pairs")
    args = parser.parse_args()
    from _ranks import run_ranks

    if args.smoke:  # monitors write under a temporary directory either way
        args.rounds, args.steps, args.warmup, args.no_services = 1, 2, 1, True
        print("smoke: wandb and Comet skipped: their imports cost more than the run", flush=True)

    t0 = time.time()
    services = "0" if args.no_services else "1"
    ranks = run_ranks(__file__, [str(args.rounds), str(args.steps), str(args.warmup), services], timeout=3600)  # fmt: skip
    r0 = ranks[0]
    import torch

    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    print(f"## {stamp} bench_monitors: 2 cores, torch {torch.__version__}, Python {platform.python_version()}")  # fmt: skip
    print()
    flag = " --no-services" if args.no_services else ""
    print(f"`.venv/bin/python benchmarks/bench_monitors.py --rounds {args.rounds} --steps {args.steps}{flag}`")  # fmt: skip
    print()
    print(f"GPT small, seq {SEQ}, micro-batch {MICRO}, ZeRO-3, fp32, 2 ranks (1 thread each); {args.rounds} rounds of {args.steps} step pairs (off/on alternating) after {args.warmup} warm-up step(s) per engine; {time.time() - t0:.0f} s in all.")  # fmt: skip
    print()
    print("| clock (rank 0) | off: median step (ms) | on: median step (ms) | overhead, medians | overhead, median of pairs | on - off (ms) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    summary = {}
    for i, clock in enumerate(("wall", "CPU (main thread)", "CPU (process, all threads)")):
        off = [t[i] for t in r0["times"]["off"]]
        on = [t[i] for t in r0["times"]["on"]]
        pairs = statistics.median(a / b for a, b in zip(on, off, strict=True))
        m_on, m_off = statistics.median(on), statistics.median(off)
        summary[clock] = {"off": m_off, "on": m_on, "pairs": pairs}
        print(f"| {clock} | {1e3 * m_off:.1f} | {1e3 * m_on:.1f} | {100 * (m_on / m_off - 1):+.2f}% | {100 * (pairs - 1):+.2f}% | {1e3 * (m_on - m_off):+.2f} |")  # fmt: skip
    if r0["profiled"] is not None:
        print()
        print(f"The flops profiler's step (one of the 'on' steps above): {1e3 * r0['profiled']:.0f} ms wall.")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": ranks, "summary": summary}, f)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_rank":
        rank_main(
            int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1", sys.argv[6]
        )
    else:
        main()
