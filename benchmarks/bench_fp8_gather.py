"""The fp8 all-gather of ZeRO-3 weights (``fp8.enable_fsdp_float8_all_gather``) against
the bf16 all-gather, on 2 gloo ranks on the CPU: all-gather bytes per step from the
ledger, the amax all-reduces it adds, step time, and the losses (which must be equal:
the same fp8 matmul on the same fp8 weight, tests/test_fp8_gather.py).

Model: zeroshard's GPT without biases (so both runs lay out the same units), fp8
tensorwise, bf16 compute, stage 3 with ``stage3_param_persistence_threshold`` 0 (every
weight gathered, in both runs) and the default prefetch and reuse distance (at this size
a unit stays gathered from its forward through its backward: one gather a step); the same
batches in both runs, rounds interleaved (A B A B ...), the step time the slowest rank's,
median over the timed steps, then over rounds. The CPU runs fp8 matmuls slowly and gloo
moves bytes through memory, so the step times say what the cast and the smaller gather
cost here, not what a GPU gains (``make gpu-check``'s fp8 section has a stage-3 row with
the fp8 all-gather, not yet measured on a GPU).

    .venv/bin/python benchmarks/bench_fp8_gather.py [--rounds 3] [--record]
    .venv/bin/python benchmarks/bench_fp8_gather.py --smoke
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

SYSTEMS = ("bf16 all-gather", "fp8 all-gather")
HEADER = (
    "| gather | step (s), median [min-max] | x bf16 gather | all-gather bytes/step | calls "
    "| all-reduce bytes/step | calls | loss first -> last | losses equal |"
)


def _rank(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist

    import zeroshard
    from zeroshard.models import GPT, GPTConfig

    args = _parser().parse_args(argv[:-1])
    out = argv[-1]
    torch.set_num_threads(1)
    zeroshard.init_distributed()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq, n_layer=args.layers, n_head=4, d_model=args.hidden, bias=False)  # fmt: skip
    model = GPT(cfg)
    fp8_elements = sum(
        m.weight.numel()
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n != "head"  # head: tied to the embedding
    )
    config = {
        "train_micro_batch_size_per_gpu": args.micro,
        "bf16": {"enabled": True},
        "fp8": {"enabled": True, "enable_fsdp_float8_all_gather": args.system == SYSTEMS[1]},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
        "steps_per_print": 10**9,
    }
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)  # fmt: skip
    rank = dist.get_rank()
    losses, times = [], []
    for s in range(args.warmup + args.steps):
        if s == args.warmup:
            engine.reset_comm_stats()
        g = torch.Generator().manual_seed(1000 * s + rank)
        x = torch.randint(0, 256, (args.micro, args.seq + 1), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
        times.append(time.perf_counter() - t0)
    stats = engine.comm_stats()
    per_step = {
        op: {k: stats.get(op, {}).get(k, 0) / args.steps for k in ("calls", "bytes")}
        for op in ("all_gather", "all_reduce")
    }
    engine.destroy()
    result = {
        "times": times[args.warmup :],
        "losses": losses,
        "per_step": per_step,
        "fp8_elements": fp8_elements,
        "params": sum(p.numel() for p in model.parameters()),
    }
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)


def _parser() -> argparse.ArgumentParser:
    import _smoke

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system", default=SYSTEMS[0], choices=SYSTEMS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--record", action="store_true", help="append to benchmarks/RESULTS.md")
    _smoke.add_flag(p)
    return p


def main() -> None:
    import _record
    from _ranks import run_ranks

    args = _parser().parse_args()
    if importlib.util.find_spec("torchao") is None:  # the optional extra zeroshard[fp8]
        print("bench_fp8_gather: torchao is not installed (pip install 'zeroshard[fp8]'): no fp8 run")  # fmt: skip
        sys.exit(0 if args.smoke else 1)
    if args.smoke:
        args.rounds, args.layers, args.hidden, args.seq, args.micro = 1, 1, 32, 16, 1
        args.warmup, args.steps, args.record = 1, 1, False
    base = [
        f"--layers={args.layers}", f"--hidden={args.hidden}", f"--seq={args.seq}",
        f"--micro={args.micro}", f"--warmup={args.warmup}", f"--steps={args.steps}",
    ]  # fmt: skip
    per_round: dict[str, list] = {s: [] for s in SYSTEMS}
    for _ in range(args.rounds):
        for system in SYSTEMS:  # interleaved: A B A B ...
            ranks = run_ranks(__file__, [f"--system={system}", *base], nproc=2, env={"OMP_NUM_THREADS": "1"})  # fmt: skip
            slowest = [max(t) for t in zip(*(r["times"] for r in ranks), strict=True)]
            per_round[system].append({"step": statistics.median(slowest), "ranks": ranks})
    first = per_round[SYSTEMS[0]][-1]["ranks"][0]
    lines = [
        f"GPT {args.layers} x {args.hidden} (no biases, {first['params'] / 1e6:.2f} M parameters, "
        f"{first['fp8_elements'] / 1e6:.2f} M of them in fp8 Linear weights; the head is tied "
        f"to the embedding and gathers in bf16), seq {args.seq}, micro-batch {args.micro}, fp8 "
        f"tensorwise, ZeRO-3 (persistence threshold 0), 2 ranks (gloo, 1 thread each), "
        f"{args.rounds} rounds x {args.steps} timed steps; bytes per step and rank (ledger).",
        "",
        HEADER,
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ref = per_round[SYSTEMS[0]]
    for system, rounds in per_round.items():
        steps = [r["step"] for r in rounds]
        ratio = statistics.median(r["step"] / b["step"] for r, b in zip(rounds, ref, strict=True))
        r0 = rounds[-1]["ranks"][0]
        ag, ar = r0["per_step"]["all_gather"], r0["per_step"]["all_reduce"]
        equal = all(
            a["ranks"][k]["losses"] == b["ranks"][k]["losses"]
            for a, b in zip(rounds, ref, strict=True)
            for k in range(2)
        )
        lines.append(
            f"| {system} | {statistics.median(steps):.3f} [{min(steps):.3f}-{max(steps):.3f}] | "
            f"{ratio:.2f} | {ag['bytes'] / 2**20:.3f} MiB | {ag['calls']:.0f} | "
            f"{ar['bytes']:,.0f} B | {ar['calls']:.0f} | "
            f"{r0['losses'][0]:.5f} -> {r0['losses'][-1]:.5f} | {'yes' if equal else 'NO'} |"
        )
    b16 = ref[-1]["ranks"][0]["per_step"]["all_gather"]["bytes"]
    f8 = per_round[SYSTEMS[1]][-1]["ranks"][0]["per_step"]["all_gather"]["bytes"]
    lines += ["", f"All-gather bytes: fp8 / bf16 = {f8 / b16:.3f} ({(b16 - f8) / 2**20:.3f} MiB a step saved; the fp8 weights' bytes halve, the embedding's and the norms' stay bf16)."]  # fmt: skip
    body = "\n".join(lines)
    print(body)
    if args.record:
        cmd = f".venv/bin/python benchmarks/bench_fp8_gather.py --rounds {args.rounds}"
        _record.append_section(os.path.join(HERE, "RESULTS.md"), "fp8 all-gather at ZeRO-3 (bench_fp8_gather.py)", cmd, body)  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_rank":
        _rank(sys.argv[2:])
    else:
        main()
