"""The delayed parameter update (``offload_optimizer.delayed_update``) against the exact
offloaded step and against no offload, on this machine's CPUs:

    .venv/bin/python benchmarks/bench_delayed_update.py [--preset 25M --seq 128 --stage 2]

2 ranks (``zeroshard run``, gloo), an fp32 GPT preset (vocab 256), AdamW, accumulation
1, micro-batch ``--micro``. Layouts: ``none`` (everything on the device), ``cpu``
(``offload_optimizer: cpu``, exact), ``cpu+dpu`` (the same with ``delayed_update``,
``delayed_update_after: 0`` so every timed step is delayed). With ``--staged`` (the
default) offload runs the GPU code path on the CPU (``ZEROSHARD_STAGE_ON_CPU=1``:
separate masters, staged gradient moves, write-back), as the issue asks when no GPU is
there. Each layout is a fresh set of ranks; layouts alternate over ``--rounds`` (``--smoke``:
one launch runs both, `_ranks.run_ranks_each`).

Per step, rank 0's wall time of forward + backward + ``step()`` ("iteration"), of
``step()`` alone, and of the host optimizer's part of ``step()`` (``cpu``: the exact
CPU AdamW step with its write-back; ``cpu+dpu``: the wait for the background step at
the boundary plus its write-back; ``none``: the step on the device); the table gives medians over the steps after ``--warmup`` and over
rounds. On a CPU the "device" compute and the background optimizer share the same
cores, so the overlap DPU buys on a GPU (where the CPU is otherwise idle during
forward/backward) shows here only as far as cores are free: with 2 ranks on 2 cores,
one torch thread each, the Adam thread competes with compute.

Results are printed and appended to ``benchmarks/RESULTS.md`` unless ``--no-record``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

import _smoke
import torch
from _ranks import run_ranks, run_ranks_each
from _record import append_section

HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUTS = ("none", "cpu", "cpu+dpu")


def rank_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--micro", type=int, required=True)
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--layout", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    import zeroshard
    from zeroshard.models import GPT, GPTConfig

    torch.set_num_threads(a.threads)
    zc = {"stage": a.stage}
    if a.layout != "none":
        zc["offload_optimizer"] = {"device": "cpu"}
    if a.layout == "cpu+dpu":
        zc["offload_optimizer"] |= {"delayed_update": True, "delayed_update_after": 0}
    cfg = {
        "train_micro_batch_size_per_gpu": a.micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "zero_optimization": zc,
    }
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(a.preset, vocab_size=256, seq_len=a.seq))
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rank, world = engine.global_rank, engine.world_size
    iters, steps, losses, host = [], [], [], []
    # the host part inside step(): the exact optimizer step (cpu), or the wait for the
    # background one plus its write-back (cpu+dpu)
    inner: list[float] = []
    assert engine.optimizer is not None
    store = engine.optimizer.states
    name = "wait" if a.layout == "cpu+dpu" else "step"
    timed = getattr(store, name)

    def timing(*args, **kwargs):
        t0 = time.perf_counter()
        out = timed(*args, **kwargs)
        inner.append(time.perf_counter() - t0)
        return out

    setattr(store, name, timing)
    for step in range(a.steps):
        g = torch.Generator().manual_seed(step * world + rank)
        ids = torch.randint(0, 256, (a.micro, a.seq + 1), generator=g)
        t0 = time.perf_counter()
        loss = engine(ids[:, :-1], ids[:, 1:])
        engine.backward(loss)
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        iters.append(t2 - t0)
        steps.append(t2 - t1)
        losses.append(float(loss))
        host.append(sum(inner))  # (the store's own waits inside step() are no-ops)
        inner.clear()
    engine.wait_param_gather()  # the last delayed step lands (not timed)
    with open(f"{a.out}.{rank}", "w") as f:
        json.dump({"iter_s": iters, "step_s": steps, "host_s": host, "losses": losses}, f)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_rank":
        rank_main(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="25M")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--no-staged", dest="staged", action="store_false")
    p.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    p.add_argument("--no-record", action="store_true")
    _smoke.add_flag(p)
    args = p.parse_args()
    if args.smoke:  # the delayed layout against no offload: one 2-rank launch
        args.preset, args.seq, args.micro, args.steps, args.warmup = "tiny", 16, 1, 2, 1
        args.rounds, args.layouts, args.no_record = 1, "none,cpu+dpu", True
    layouts = args.layouts.split(",")
    env = {"ZEROSHARD_STAGE_ON_CPU": "1" if args.staged else "0"}
    got: dict[str, dict[str, list[float]]] = {
        k: {"iter_s": [], "step_s": [], "host_s": []} for k in layouts
    }

    def argv(layout: str) -> list[str]:
        out = [f"--{k}={getattr(args, k)}" for k in ("preset", "seq", "micro", "stage")]
        return [*out, f"--layout={layout}", f"--steps={args.steps}", f"--threads={args.threads}", "--out"]  # fmt: skip

    script = os.path.abspath(__file__)
    for _ in range(args.rounds):
        if args.smoke:  # the code paths, not a measurement: both layouts in one launch
            launched = run_ranks_each(script, [argv(k) for k in layouts], nproc=2, env=env)
        else:  # a fresh launch per layout
            launched = [run_ranks(script, argv(k), nproc=2, env=env) for k in layouts]
        for layout, ranks in zip(layouts, launched, strict=True):
            r0 = ranks[0]
            for key in ("iter_s", "step_s", "host_s"):
                got[layout][key] += r0[key][args.warmup :]
    base = statistics.median(got[layouts[0]]["iter_s"])
    rows = [
        f"| {k} | {statistics.median(v['iter_s']) * 1e3:.0f} | "
        f"{statistics.median(v['step_s']) * 1e3:.0f} | "
        f"{statistics.median(v['host_s']) * 1e3:.0f} | "
        f"{statistics.median(v['iter_s']) / base:.2f}x |"
        for k, v in got.items()
    ]
    n = len(got[layouts[0]]["iter_s"])
    body = "\n".join(
        [
            f"GPT {args.preset}, seq {args.seq}, micro-batch {args.micro}, stage {args.stage}, "
            f"2 ranks x {args.threads} torch thread(s), fp32 AdamW, clip 1.0, "
            f"{'GPU code path on CPU (ZEROSHARD_STAGE_ON_CPU=1)' if args.staged else 'CPU path'}; "
            f"rank 0 medians over {n} steps per layout ({args.rounds} rounds).",
            "",
            f"| layout | iteration ms | step() ms | of it: host optimizer ms | iteration / {layouts[0]} |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    print(body)
    if not args.no_record:
        command = ".venv/bin/python benchmarks/bench_delayed_update.py " + shlex.join(sys.argv[1:])
        append_section(args.results, "bench_delayed_update", command, body)


if __name__ == "__main__":
    main()
