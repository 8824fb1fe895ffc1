"""Launcher test worker: all_reduce over gloo, print rank/world, pass through argv."""

import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
expected = world * (world + 1) / 2
assert t.item() == expected, (t.item(), expected)
line = (
    f"OK rank={rank} world={world} local_rank={os.environ['LOCAL_RANK']} "
    f"sum={t.item():g} omp={os.environ.get('OMP_NUM_THREADS')} argv={sys.argv[1:]}\n"
)
sys.stdout.write(line)  # one write, so lines of different ranks do not interleave
sys.stdout.flush()
dist.destroy_process_group()
