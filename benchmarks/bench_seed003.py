"""seeds/003's comparison, measured: its FSDP example (``model = FSDP(model)``, torch's
FullyShardedDataParallel around the whole GPT-2, AdamW lr 5e-5) against its ZeRO-1,
ZeRO-2 (+ CPU optimizer offload) and ZeRO-3 examples run by zeroshard
(``examples/seeds/seed003_zero.py``'s configs), on the same GPT-2 (124M, built from
``GPT2Config()``: no download), the seed's input shape (1 x 128 tokens,
``labels=inputs``), 2 ranks (gloo, 1 thread each), fp32.

    .venv/bin/python benchmarks/bench_seed003.py --rounds 3 --steps 4

Every run is a fresh pair of processes (``zeroshard run --nproc 2``); rounds rotate the
order. Columns: median step time (slowest rank) over rounds [min-max], peak RSS per
rank, and the loss at the first and last step (same init and data for every system).
Appended to ``benchmarks/RESULTS.md`` unless ``--no-record``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shlex
import statistics
import sys
import time
from typing import Any

import torch
from _ranks import RanksFailed, run_ranks, run_ranks_each

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = ["fsdp (seed)", "zeroshard-s1", "zeroshard-s2+cpu", "zeroshard-s3"]
MiB = 2**20
TINY_ENV = "ZS_SEED003_TINY"


def rank_main(system: str, steps: int, n_layer: int, out: str) -> None:
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    # --smoke: a GPT-2 of width 64 and vocabulary 256 (the default's embedding alone is 38M)
    tiny: dict[str, Any] = (
        {"vocab_size": 256, "n_embd": 64, "n_head": 2} if os.environ.get(TINY_ENV) else {}
    )
    config = GPT2Config(n_layer=n_layer, **tiny)
    model: torch.nn.Module = GPT2LMHeadModel(config)
    if system.startswith("fsdp"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        model = FSDP(model, device_id=torch.device("cpu"))  # the seed's one line (CPU here)
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)

        def train_step(inputs):
            optimizer.zero_grad()
            loss = model(inputs, labels=inputs).loss
            loss.backward()
            optimizer.step()
            return loss
    else:
        import zeroshard as deepspeed

        stage = int(system[len("zeroshard-s")])
        cfg: dict[str, Any] = {
            "train_batch_size": 2,  # the seed's 8 is 4 micro-batches of 1 per rank on 2 ranks
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 5e-5}},
        }
        if system.endswith("+cpu"):
            cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        engine, *_ = deepspeed.initialize(model=model, config=cfg)
        rank, world = engine.global_rank, engine.world_size

        def train_step(inputs):
            loss = engine(inputs, labels=inputs).loss
            engine.backward(loss)
            engine.step()
            return loss

    times, losses = [], []
    for step in range(steps + 1):  # step 0 is warm-up
        g = torch.Generator().manual_seed(step * world + rank)
        inputs = torch.randint(0, config.vocab_size, (1, 128), generator=g)
        t0 = time.perf_counter()
        loss = train_step(inputs)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    res = {
        "step": statistics.median(times[1:]),
        "losses": [losses[0], losses[-1]],
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)


def _env(args) -> dict[str, str]:
    return {"OMP_NUM_THREADS": "1", TINY_ENV: "1" if args.smoke else ""}


def _summary(ranks: list[dict]) -> dict:
    return {
        "step": max(r["step"] for r in ranks),
        "rss": [r["rss"] for r in ranks],
        "losses": ranks[0]["losses"],
    }


def run_system(system: str, args) -> dict | None:
    try:
        ranks = run_ranks(
            __file__,
            [system, str(args.steps), str(args.n_layer)],
            env=_env(args),
            prefix="zs-seed003-",
        )
    except RanksFailed as exc:
        print(f"{system}: failed\n{exc.output[-2000:]}", file=sys.stderr)
        return None
    return _summary(ranks)


def smoke_systems(systems: list[str], args) -> dict[str, dict]:
    """--smoke: every system in ONE launch (the code paths, not a measurement: the peak
    RSS of a later system includes the earlier ones'); a failure fails the run."""
    argvs = [[s, str(args.steps), str(args.n_layer)] for s in systems]
    each = run_ranks_each(__file__, argvs, env=_env(args))
    return {s: _summary(ranks) for s, ranks in zip(systems, each, strict=True)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_rank":
        rank_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--n-layer", type=int, default=12, help="GPT-2 layers (the seed's gpt2: 12)")
    p.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    p.add_argument("--no-record", action="store_true")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CI: 1 narrow GPT-2 layer, 2 steps, FSDP and ZeRO-2+CPU",
    )
    args = p.parse_args()
    systems = SYSTEMS
    if args.smoke:
        args.rounds, args.steps, args.n_layer, args.no_record = 1, 2, 1, True
        systems = ["fsdp (seed)", "zeroshard-s2+cpu"]
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    if args.smoke:
        for s, got in smoke_systems(systems, args).items():
            runs[s].append(got)
            print(f"round 0 {s}: {got['step']:.3f} s, rss {got['rss']}", flush=True)
    for r in range(0 if args.smoke else args.rounds):
        order = systems[r % len(systems) :] + systems[: r % len(systems)]
        for s in order:
            res = run_system(s, args)
            if res:
                runs[s].append(res)
                print(f"round {r} {s}: {res['step']:.3f} s, rss {res['rss']}", flush=True)
    rows = [
        "| system | step (s), median [min-max] | peak RSS r0/r1 (MiB) | loss first -> last |",
        "|---|---|---|---|",
    ]
    for s in systems:
        if not runs[s]:
            rows.append(f"| {s} | failed | | |")
            continue
        steps = [x["step"] for x in runs[s]]
        rss = [statistics.median(x["rss"][i] for x in runs[s]) / MiB for i in range(2)]
        lo, hi = runs[s][0]["losses"]
        rows.append(
            f"| {s} | {statistics.median(steps):.3f} [{min(steps):.3f}-{max(steps):.3f}] | "
            f"{rss[0]:.0f} / {rss[1]:.0f} | {lo:.4f} -> {hi:.4f} |"
        )
    body = (
        f"GPT-2 ({args.n_layer} layers), input 1 x 128 per rank, 2 ranks, fp32, AdamW lr 5e-5, "
        f"{args.rounds} rounds x {args.steps} timed steps\n\n" + "\n".join(rows)
    )
    print(body)
    if not args.no_record:
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        command = ".venv/bin/python benchmarks/bench_seed003.py " + shlex.join(sys.argv[1:])
        with open(args.results, "a") as f:
            f.write(
                f"\n## {stamp} bench_seed003: seeds/003's FSDP example vs its ZeRO examples, "
                f"torch {torch.__version__}\n\n`{command}`\n\n{body}\n"
            )


if __name__ == "__main__":
    main()
