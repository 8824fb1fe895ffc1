"""Train the reference GPT byte-level on the Python standard library's source code.

    zeroshard run --nproc 2 examples/train_gpt.py --deepspeed_config examples/ds_config_demo.json

A DeepSpeed-style loop: ``initialize``, then ``engine(batch)``, ``engine.backward``,
``engine.step``. Rank 0 shows a progress bar and prints loss, tokens/s, each rank's
memory_stats and the communication bytes per step; metrics go to ``--metrics`` as JSON
lines.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.models import GPT, GPTConfig


def stdlib_bytes(limit: int) -> torch.Tensor:
    """Up to ``limit`` bytes of .py source from the standard library (on every machine)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="GPT preset (tiny, small, 25M, 100M, ...)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--metrics", default="runs/demo/metrics.jsonl")
    zeroshard.add_config_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))

    zeroshard.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(args.model, seq_len=args.seq))
    n_params = sum(p.numel() for p in model.parameters())
    engine, _, _, _ = zeroshard.initialize(
        args=args, model=model, model_parameters=model.parameters()
    )
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()

    data = stdlib_bytes(4_000_000)
    split = int(0.95 * len(data))
    gen = torch.Generator().manual_seed(1000 + rank)

    def sample(source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(source) - args.seq - 1, (micro,), generator=gen)
        rows = torch.stack([source[i : i + args.seq + 1] for i in idx])
        return rows[:, :-1].to(engine.device), rows[:, 1:].to(engine.device)

    metrics = None
    if rank == 0:
        Path(args.metrics).parent.mkdir(parents=True, exist_ok=True)
        metrics = open(args.metrics, "w")  # noqa: SIM115  (closed after the summary)
        print(
            f"GPT {args.model}: {n_params / 1e6:.2f}M params, seq {args.seq}, micro {micro} x gas {gas} "
            f"x {world} ranks, ZeRO stage {engine.zero_optimization_stage()}",
            flush=True,
        )

    tokens_per_step = micro * gas * world * args.seq
    t_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        engine.reset_comm_stats()
        t0 = time.perf_counter()
        total = 0.0
        for _ in range(gas):
            x, y = sample(data[:split])
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        dt = time.perf_counter() - t0
        comm = engine.comm_stats()
        record = {
            "step": step,
            "loss": total / gas,
            "step_seconds": dt,
            "tokens_per_s": tokens_per_step / dt,
            "lr": engine.get_lr()[0],
            "comm_bytes": sum(v["bytes"] for v in comm.values()),
        }
        if metrics is not None:
            metrics.write(json.dumps(record) + "\n")
            if not sys.stdout.isatty() and step % max(1, args.steps // 10) and step != args.steps:
                continue  # not a terminal: print ten progress lines, not one per step
            done = int(30 * step / args.steps)
            sys.stdout.write("\r" if sys.stdout.isatty() else "\n")
            sys.stdout.write(
                f"[{'#' * done}{'.' * (30 - done)}] step {step}/{args.steps} "
                f"loss {record['loss']:.3f} {record['tokens_per_s']:.0f} tok/s"
            )
            sys.stdout.flush()
    elapsed = time.perf_counter() - t_start

    with torch.no_grad():
        engine.eval()
        x, y = sample(data[split:])
        val = engine(x, y)
        dist.all_reduce(val)
        val = val.item() / world
        engine.train()
    mem = engine.memory_stats()
    mems = [None] * world
    dist.all_gather_object(mems, mem)
    if rank == 0:
        print()
        print(
            f"trained {args.steps} steps in {elapsed:.1f} s: "
            f"{args.steps * tokens_per_step / elapsed:.0f} tokens/s, final loss {record['loss']:.3f}, "
            f"held-out loss {val:.3f} (uniform bytes: {torch.log(torch.tensor(256.0)):.3f})"
        )
        print(
            "communication per step (rank 0): "
            + ", ".join(
                f"{op} {v['calls']} calls {v['bytes'] / 1e6:.2f} MB" for op, v in comm.items()
            )
        )
        for r, m in enumerate(mems):
            print(
                f"rank {r} memory: params {m['params'] / 1e6:.2f} MB, grads {m['grads'] / 1e6:.2f} MB, "
                f"optimizer states {m['optimizer_states'] / 1e6:.2f} MB, by location "
                + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in m["by_location"].items())
            )
        metrics.write(
            json.dumps({"summary": True, "elapsed_s": elapsed, "val_loss": val, "memory": mems})
            + "\n"
        )
        metrics.close()
        print(f"metrics: {args.metrics}")


if __name__ == "__main__":
    main()
