"""Host bytes of ZeRO-3 with parameters and optimizer offloaded to CPU memory, on the GPU
code path run on the CPU (``ZEROSHARD_STAGE_ON_CPU=1``): how many fp32 copies of each
shard the host keeps.

One rank, a GPT of ``--preset`` trained two steps (fp32 AdamW; ``--dtype bf16`` for
mixed precision). Prints one Markdown row: ``memory_stats()`` bytes per shard element
by kind, and peak RSS above the resident set before the model was built. Run it with
``PYTHONPATH`` pointing at an older checkout to get that checkout's row in the same
session.

    .venv/bin/python benchmarks/bench_host_copy.py --preset 100M --label after
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("ZEROSHARD_ACCELERATOR", "cpu")
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
os.environ["ZEROSHARD_STAGE_ON_CPU"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="100M")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--label", default="")
    parser.add_argument("--smoke", action="store_true", help="CI: the tiny GPT in bf16")
    args = parser.parse_args()
    if args.smoke:  # (prints its row only: nothing is written anywhere)
        args.preset, args.dtype, args.label = "tiny", "bf16", "smoke"

    import rss
    import torch

    from zeroshard.models import GPTConfig

    torch.set_num_threads(1)
    cfg = GPTConfig.preset(args.preset, seq_len=args.seq)
    cpu = {"device": "cpu", "pin_memory": True}
    zc = {
        "stage": 3,
        "offload_optimizer": cpu,
        "offload_param": cpu,
        "stage3_param_persistence_threshold": 0,
    }
    extra = {"bf16": {"enabled": True}} if args.dtype == "bf16" else None
    engine, delta = rss.train_gpt(cfg, zc, partitioned=True, extra=extra)
    shard = engine.flat.layout.shard_numel
    m = engine.memory_stats()
    per = {k: m[k] / shard for k in ("params", "grads", "optimizer_states")}
    total = sum(per.values())
    print(
        f"| {args.label} | {args.preset} ({shard / 1e6:.1f}M) | {args.dtype} | "
        f"{per['params']:.2f} | {per['grads']:.2f} | {per['optimizer_states']:.2f} | "
        f"{total:.2f} | {m['params'] + m['grads'] + m['optimizer_states']:,} | {delta:.0f} |"
    )


if __name__ == "__main__":
    main()
