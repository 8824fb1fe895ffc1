"""Every monitoring section on, a small GPT at ZeRO stage 3 (tests/test_monitors.py
launches it with `zeroshard run --nproc 2`). The script configures no logging: the step
line has to reach stdout by itself.

Rank 0 writes ``result.json`` in ``--out``: the flops profiler's summary, an independent
``FlopCounterMode`` count of the same step's forwards and backwards, the parameter and
token counts, the ledger's bytes per op and the comms logger's summary.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import zeroshard
from zeroshard.models import GPT, GPTConfig

SEQ, MICRO, GAS = 16, 2, 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--comet", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    zeroshard.init_distributed()
    rank = torch.distributed.get_rank()
    shape = GPTConfig(n_layer=2, n_head=2, d_model=64, seq_len=SEQ)
    torch.manual_seed(0)
    model = GPT(shape)
    out = args.out
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 2,
        "wall_clock_breakdown": True,
        "memory_breakdown": True,
        "dump_state": True,
        "timers": {"throughput": {"enabled": True}},
        "tensorboard": {"enabled": True, "output_path": f"{out}/tb", "job_name": "job"},
        "csv_monitor": {
            "enabled": True,
            "output_path": f"{out}/csv",
            "job_name": "job",
            "all_ranks": True,
        },
        "wandb": {"enabled": True, "project": "zeroshard-test"},
        "comet": {"enabled": args.comet, "online": False, "samples_log_interval": 1},
        "comms_logger": {"enabled": True},
        "flops_profiler": {"enabled": True, "profile_step": 1, "module_depth": 3},
    }
    engine, *_ = zeroshard.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(args.steps * GAS):
        x = torch.randint(0, shape.vocab_size, (MICRO, SEQ), generator=gen)
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
    comm = engine.comm_stats()
    logged = zeroshard.comm.log_summary(return_dict=True)
    profiler = engine.monitor.flops
    assert logged is not None and profiler is not None  # the config enables both
    summary = logged["summary"]
    flops = profiler.summary if rank == 0 else None
    table = profiler.table() if rank == 0 else None
    engine.destroy()  # flushes and closes every writer
    if rank != 0:
        return
    from torch.utils.flop_counter import FlopCounterMode

    reference = GPT(shape)
    with FlopCounterMode(display=False) as counter:
        for _ in range(GAS):
            x = torch.randint(0, shape.vocab_size, (MICRO, SEQ))
            reference(x, x).backward()
    result = {
        "flops": flops,
        "table": table,
        "flop_counter": counter.get_total_flops(),
        "params": sum(p.numel() for p in reference.parameters()),
        "tokens": MICRO * GAS * SEQ,
        "comm": comm,
        "summary": {op: sum(s["bytes"] for s in sizes.values()) for op, sizes in summary.items()},
    }
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
