"""``zeroshard.init_distributed(init_method="file://...", rank=, world_size=)``: the
rendezvous DeepSpeed's unit-test harness uses (``deepspeed.init_distributed`` with a
file:// init method and the rank and world size as arguments). Two processes, spawned
with nothing in the environment, join one gloo group and all-reduce."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.multiprocessing as mp


def _rank(rank: int, world: int, init_file: str, out: str) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        os.environ.pop(key, None)
    os.environ["ZEROSHARD_ACCELERATOR"] = "cpu"
    import torch.distributed as dist

    import zeroshard

    zeroshard.init_distributed(
        dist_backend="gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
    )
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    with open(os.path.join(out, f"{rank}.txt"), "w") as f:
        f.write(f"{dist.get_rank()} {dist.get_world_size()} {t.item()}")
    dist.destroy_process_group()


def test_file_rendezvous_with_rank_and_world_size() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.start_processes(_rank, args=(2, init_file, tmp), nprocs=2, start_method="spawn")
        got = []
        for r in range(2):
            with open(os.path.join(tmp, f"{r}.txt")) as f:
                got.append(f.read())
        got.sort()
    assert got == ["0 2 3.0", "1 2 3.0"]
