"""Train the reference GPT byte-level on the Python standard library's source code.

    zeroshard run --nproc 2 examples/train_gpt.py --deepspeed_config examples/ds_config_demo.json
    zeroshard --num_gpus 2 examples/train_gpt.py --deepspeed examples/ds_config_demo.json
    zeroshard plot runs/demo

A DeepSpeed-style loop: ``initialize``, then ``engine(batch)``, ``engine.backward``,
``engine.step``. The library does the watching: rank 0 prints a step line every
``steps_per_print`` steps, the config's ``csv_monitor`` writes DeepSpeed's CSV files and
``metrics.jsonl`` into ``runs/demo`` (``--run-dir`` moves them; a rerun first moves the
earlier run's files to ``runs/demo/previous/``), and
``engine.monitor.print_summary`` ends the run with throughput, communication and each
rank's memory. The script adds only the held-out loss.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
from pathlib import Path

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.config import read_config_file
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
    default_model = os.environ.get("ZEROSHARD_EXAMPLE_MODEL", "small")  # the doc-tests: tiny
    parser.add_argument("--model", default=default_model, help="GPT preset (tiny, small, 25M, 100M, ...; default: $ZEROSHARD_EXAMPLE_MODEL or small)")  # fmt: skip
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--run-dir", default=None, help="where csv_monitor writes (default: the config's)")  # fmt: skip
    # DeepSpeed-style launchers (`zeroshard --num_gpus 2 ...`, `deepspeed ...`) pass it
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    zeroshard.add_config_arguments(parser)  # --deepspeed_config PATH, or --deepspeed PATH
    args = parser.parse_args()
    config_path = args.deepspeed_config or (args.deepspeed if isinstance(args.deepspeed, str) else None)  # fmt: skip
    if config_path is None:
        parser.error("give the config: --deepspeed_config PATH (or --deepspeed PATH)")
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))

    config = read_config_file(config_path)  # JSON with DeepSpeed's comments allowed
    if args.run_dir is not None:
        path = Path(args.run_dir)
        config["csv_monitor"] = {"enabled": True, "output_path": str(path.parent), "job_name": path.name}  # fmt: skip
    zeroshard.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(args.model, seq_len=args.seq))
    n_params = sum(p.numel() for p in model.parameters())  # whole, before any sharding
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)  # fmt: skip
    micro = engine.train_micro_batch_size_per_gpu()
    if rank == 0:
        print(
            f"GPT {args.model}: {n_params / 1e6:.2f}M params, seq {args.seq}, micro {micro} x "
            f"gas {engine.gradient_accumulation_steps()} x {world} ranks, ZeRO stage "
            f"{engine.zero_optimization_stage()}",
            flush=True,
        )

    data = stdlib_bytes(4_000_000)
    split = int(0.95 * len(data))
    gen = torch.Generator().manual_seed(1000 + rank)

    def sample(source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(source) - args.seq - 1, (micro,), generator=gen)
        rows = torch.stack([source[i : i + args.seq + 1] for i in idx])
        return rows[:, :-1].to(engine.device), rows[:, 1:].to(engine.device)

    for _ in range(args.steps * engine.gradient_accumulation_steps()):
        x, y = sample(data[:split])
        engine.backward(engine(x, y))
        engine.step()

    with torch.no_grad():
        engine.eval()
        x, y = sample(data[split:])
        val = engine(x, y)
        dist.all_reduce(val)
        engine.train()
    engine.monitor.print_summary()
    if rank == 0:
        uniform = torch.log(torch.tensor(256.0))
        print(f"held-out loss {val.item() / world:.3f} (uniform bytes: {uniform:.3f})")
    engine.destroy()  # flushes the metrics and CSV files


if __name__ == "__main__":
    main()
