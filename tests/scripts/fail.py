"""Launcher test worker: rank 1 raises while rank 0 blocks in a collective."""

import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise ValueError("boom-rank-1")
dist.barrier()  # never completes: rank 1 is gone
print("rank 0 passed the barrier (unexpected)", flush=True)
