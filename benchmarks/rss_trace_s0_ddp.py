"""Per-phase RSS of ZeRO stage 0 and DDP on 2 ranks (GPT 100M, seq 32, 25 MiB buckets):
where the peak-RSS gap of bench_train's state-bound shape comes from.

    .venv/bin/python benchmarks/rss_trace_s0_ddp.py                  # glibc defaults
    MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python benchmarks/rss_trace_s0_ddp.py

Prints rank 0's (phase, current RSS MiB, peak RSS MiB) for each system.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import multirank

BUCKET = 6_553_600  # elements: 25 MiB of fp32, DDP's bucket_cap_mb=25


def _rss() -> tuple[int, int]:
    """(current, peak) RSS of this process in MiB."""
    with open("/proc/self/status") as f:
        now = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    return now // 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def _trace(rank: int, world: int, system: str, preset: str = "100M", steps: int = 4) -> list:
    from zeroshard.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset, seq_len=32))
    out = [("built", *_rss())]
    if system == "zeroshard-s0":
        import zeroshard

        cfg = {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {
                "stage": 0,
                "reduce_bucket_size": BUCKET,
                "allgather_bucket_size": BUCKET,
            },
        }
        engine, *_ = zeroshard.initialize(
            model=model, model_parameters=model.parameters(), config=cfg
        )
        forward: Callable[..., Any] = engine
        backward: Callable[[torch.Tensor], Any] = engine.backward
        step: Callable[[], Any] = engine.step
    else:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=25)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, fused=True)

        def ddp_step() -> None:
            opt.step()
            opt.zero_grad()

        forward, backward, step = ddp, lambda loss: loss.backward(), ddp_step
    out.append(("init", *_rss()))
    x = torch.randint(0, 256, (1, 33))
    for i in range(steps):
        backward(forward(x[:, :-1], x[:, 1:]))
        out.append((f"backward {i}", *_rss()))
        step()
        out.append((f"step {i}", *_rss()))
    return out


if __name__ == "__main__":
    smoke = "--smoke" in sys.argv[1:]  # CI: GPT tiny, one step each
    for system in ("zeroshard-s0", "ddp"):
        print(system, multirank.run(_trace, 2, system, *(("tiny", 1) if smoke else ()))[0])
