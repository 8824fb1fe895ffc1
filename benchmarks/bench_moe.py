"""Mixture-of-experts on the CPU: grouped expert compute against the loop over experts,
and a training step of a Mixtral-shaped model with expert parallelism against dense data
parallelism.

1. **Expert compute** (one process): the rows of a Mixtral-shaped experts module (top-2
   of ``--experts`` experts, random routing) through ``ExpertParallelExperts`` forward and
   backward, by each way of ``zeroshard/moe/grouped.py``: ``grouped_mm`` (one
   ``torch._grouped_mm`` per projection), ``bmm`` (padded batched matmul) and ``loop``
   (one matmul per expert); and DeepSpeed's ``MoE`` experts (an ``nn.Sequential``
   expert) through ``torch.func.vmap`` against one call per expert. Tokens per
   CPU-second of the calling thread (torch runs on that one thread), median of
   ``--repeats``: on a shared machine CPU time is steadier than wall time, which is
   printed too.
2. **Training step** (2 ranks, gloo, 1 thread each): a transformers Mixtral, ZeRO 1,
   the same global batch: ``dense`` (every rank holds every expert; data parallel over 2)
   against ``ep2`` (``expert_parallel.autoep_size`` 2: each rank holds half the experts,
   tokens exchanged by all-to-all). Median step time (slowest rank, wall clock), the
   ranks' CPU seconds per step (``time.process_time``: gloo's threads included), expert
   bytes per rank (``memory_stats()``), and the ledger's bytes per step by axis and op.

    .venv/bin/python benchmarks/bench_moe.py --rounds 3 [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from _smoke import add_flag


def _mixtral(args):
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
        max_position_embeddings=args.seq, num_local_experts=args.experts,
        num_experts_per_tok=2, output_router_logits=True, use_cache=False,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return transformers.MixtralForCausalLM(cfg)


def _compute(args) -> list[tuple[str, tuple[float, float]]]:
    """Tokens per second of each expert-compute way (forward + backward)."""
    import torch
    from torch import nn

    from zeroshard.moe.grouped import WAYS
    from zeroshard.moe.hf import ExpertParallelExperts
    from zeroshard.moe.layer import Experts

    torch.set_num_threads(args.threads)
    stock = _mixtral(args).model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, generator=g, requires_grad=True)
    scores = torch.rand(args.tokens, args.experts, generator=g)
    weights, index = torch.topk(scores.softmax(-1), 2, dim=-1)

    def timed(fn) -> tuple[float, float]:
        """Tokens per wall second and per CPU second of this thread (first call: warm-up)."""
        walls, cpus = [], []
        for _ in range(args.repeats + 1):
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            walls.append(time.perf_counter() - t0)
            cpus.append(time.thread_time() - c0)
        return args.tokens / statistics.median(walls[1:]), args.tokens / statistics.median(cpus[1:])

    out = []
    for way in WAYS:
        experts = ExpertParallelExperts(stock, None, way)

        def run(experts=experts) -> None:
            y = experts(x, index, weights)
            y.square().sum().backward()

        out.append((f"Mixtral experts, {way}", timed(run)))
    mlp = nn.Sequential(
        nn.Linear(args.hidden, args.intermediate),
        nn.SiLU(),
        nn.Linear(args.intermediate, args.hidden),
    )
    ds = Experts(mlp, args.experts)
    counts = torch.bincount(index[:, 0], minlength=args.experts).tolist()
    # a leaf of its own: each timed call runs forward and backward from it afresh
    rows = x.detach()[torch.argsort(index[:, 0], stable=True)].requires_grad_()
    for grouped in (True, False):
        ds.grouped = grouped

        def run_ds() -> None:
            ds.rows(rows, counts).square().sum().backward()

        out.append(
            (f"MoE(expert=Sequential) experts, {'vmap' if grouped else 'loop'}", timed(run_ds))
        )
    return out


def _rank(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist

    import zeroshard

    args = _parser().parse_args(argv[:-1])
    out = argv[-1]
    torch.set_num_threads(1)
    zeroshard.init_distributed()
    model = _mixtral(args)
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }
    if args.mode == "ep2":
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": 2}
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    rank = dist.get_rank()
    times, cpus, losses = [], [], []
    for s in range(args.warmup + args.steps):
        if s == args.warmup:
            engine.reset_comm_stats()
        g = torch.Generator().manual_seed(1000 * s + rank)
        ids = torch.randint(0, 1024, (args.micro, args.seq), generator=g)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        losses.append(loss.item())
    stats = engine.memory_stats()
    experts = stats.get("experts") or {
        "params": sum(
            p.numel() * 4 for n, p in engine.module.named_parameters() if ".experts." in n
        )
    }
    ledger = {
        f"{axis}:{op}": s["bytes"] / args.steps
        for axis, ops in engine.comm_stats(by_axis=True).items()
        for op, s in ops.items()
        if s["bytes"]
    }
    result = {
        "times": times[args.warmup :],
        "cpus": cpus[args.warmup :],
        "losses": losses,
        "expert_param_bytes": experts["params"],
        "params": stats["params"],
        "ledger": ledger,
    }
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="ep2", choices=("dense", "ep2"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=4096, help="rows of the expert-compute part")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--record", action="store_true", help="append the tables to RESULTS.md")
    add_flag(p)
    return p


def main() -> None:
    from _ranks import run_ranks, run_ranks_each

    args = _parser().parse_args()
    if args.smoke:
        args.rounds, args.layers, args.hidden, args.intermediate = 1, 1, 32, 64
        args.experts, args.seq, args.micro, args.warmup, args.steps = 4, 16, 1, 1, 1
        args.tokens, args.repeats, args.record = 64, 1, False
    lines = [
        f"Expert compute: {args.experts} experts, hidden {args.hidden}, intermediate "
        f"{args.intermediate}, top-2 of random routing, {args.tokens} tokens, fp32, forward + "
        f"backward, {args.threads} thread(s), median of {args.repeats}",
        "",
        "| experts module, way | tokens/CPU-s | x loop | tokens/s (wall) | x loop (wall) |",
        "|---|---|---|---|---|",
    ]
    rows = _compute(args)
    loops = {name.split(",")[0]: r for name, r in rows if name.endswith("loop")}
    for name, (wall, cpu) in rows:
        lw, lc = loops[name.split(",")[0]]
        lines.append(f"| {name} | {cpu:,.0f} | {cpu / lc:.2f} | {wall:,.0f} | {wall / lw:.2f} |")
    base = [
        f"--layers={args.layers}", f"--hidden={args.hidden}", f"--intermediate={args.intermediate}",
        f"--experts={args.experts}", f"--seq={args.seq}", f"--micro={args.micro}",
        f"--warmup={args.warmup}", f"--steps={args.steps}",
    ]  # fmt: skip
    per_round: dict[str, list] = {"dense": [], "ep2": []}

    def launch(modes: list[str]) -> list[list[dict]]:
        """Each mode's ranks: a fresh launch per mode, or (--smoke) one launch for all."""
        if args.smoke:
            return run_ranks_each(__file__, [[f"--mode={m}", *base] for m in modes])
        return [run_ranks(__file__, [f"--mode={m}", *base], nproc=2) for m in modes]

    for _ in range(args.rounds):
        for mode, ranks in zip(per_round, launch(list(per_round)), strict=True):  # interleaved
            slowest = [max(t) for t in zip(*(r["times"] for r in ranks), strict=True)]
            cpu = statistics.median(c for r in ranks for c in r["cpus"])
            per_round[mode].append({"step": statistics.median(slowest), "cpu": cpu, "ranks": ranks})
    lines += [
        "",
        f"Training step: Mixtral {args.layers} layers x hidden {args.hidden}, {args.experts} "
        f"experts (intermediate {args.intermediate}, top-2), seq {args.seq}, micro-batch "
        f"{args.micro} per rank, fp32, ZeRO 1, 2 ranks (gloo, 1 thread each), {args.rounds} "
        f"rounds x {args.steps} timed steps",
        "",
        "| layout | step (s, wall), median [min-max] | x dense | CPU s/step/rank | x dense "
        "(CPU) | expert param bytes/rank | param bytes/rank | ledger bytes/step (rank 0) | "
        "loss first -> last |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    dense = statistics.median(r["step"] for r in per_round["dense"])
    dense_cpu = statistics.median(r["cpu"] for r in per_round["dense"])
    for mode, rounds in per_round.items():
        steps = [r["step"] for r in rounds]
        cpu = statistics.median(r["cpu"] for r in rounds)
        r0 = rounds[-1]["ranks"][0]
        ledger = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sorted(r0["ledger"].items()))
        lines.append(
            f"| {mode} | {statistics.median(steps):.3f} [{min(steps):.3f}-{max(steps):.3f}] | "
            f"{statistics.median(steps) / dense:.2f} | {cpu:.3f} | {cpu / dense_cpu:.2f} | "
            f"{r0['expert_param_bytes'] / 2**20:.2f} MiB | "
            f"{r0['params'] / 2**20:.2f} MiB | {ledger} | "
            f"{r0['losses'][0]:.4f} -> {r0['losses'][-1]:.4f} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.record:
        from _record import append_section

        here = os.path.dirname(os.path.abspath(__file__))
        command = "benchmarks/bench_moe.py " + " ".join(sys.argv[1:])
        append_section(os.path.join(here, "RESULTS.md"), "bench_moe (issue 34)", command, text)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_rank":
        _rank(sys.argv[2:])
    else:
        main()
