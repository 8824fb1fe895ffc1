"""Gloo's collectives on one buffer, 2 ranks: reduce-scatter and all-gather against
all-reduce, each also emulated by an all-reduce, and zeroshard's gloo defaults
(``Comm``: reduce-scatter as an all-to-all plus a local sum, all-gather point to point).

    .venv/bin/python benchmarks/bench_gloo_collectives.py
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import _smoke
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

warnings.filterwarnings("ignore", category=FutureWarning)  # *_into_tensor renamed in 2.13

SIZES = (250_000, 6_553_600, 25_000_000)  # fp32 elements: ~1 MiB, 25 MiB, 95 MiB


def _ops(n: int, rank: int, world: int) -> dict:
    from zeroshard.distributed.comm import Comm

    comm = Comm()
    x, out, full, scratch = torch.randn(n), torch.empty(n // world), torch.empty(n), torch.empty(n)
    mine = slice(rank * (n // world), (rank + 1) * (n // world))
    return {
        "all_reduce": lambda: dist.all_reduce(x),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(out, x),
        "rs via ar": lambda: (dist.all_reduce(x), out.copy_(x[mine])),
        "rs send/recv (zeroshard)": lambda: comm.reduce_scatter(
            out, x, via="send_recv", scratch=scratch
        ),
        "rs via a2a": lambda: comm.reduce_scatter(out, x, via="all_to_all", scratch=scratch),
        "all_gather": lambda: dist.all_gather_into_tensor(full, out),
        "all_gather (list)": lambda: dist.all_gather(list(full.chunk(world)), out),
        "ag via ar": lambda: (full.zero_(), full[mine].copy_(out), dist.all_reduce(full)),
        "ag send/recv (zeroshard)": lambda: comm.all_gather(full, out, via="send_recv"),
    }


def _run(rank: int, world: int, tmp: str, sizes: tuple[int, ...] = SIZES) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(tmp + "/s", world), rank=rank, world_size=world)  # fmt: skip
    for i, n in enumerate(sizes):
        ops = _ops(n, rank, world)
        if rank == 0 and i == 0:
            print("| buffer | " + " | ".join(ops) + " |\n" + "|---" * (len(ops) + 1) + "|")
        times: dict[str, list[float]] = {k: [] for k in ops}
        for _ in range(6):  # interleaved; the first round is a warm-up
            for k, op in ops.items():
                dist.barrier()
                t0 = time.perf_counter()
                op()
                times[k].append(time.perf_counter() - t0)
        if rank == 0:
            cells = " | ".join(f"{statistics.median(v[1:]) * 1e3:.1f} ms" for v in times.values())
            print(f"| {n * 4 / 2**20:.2f} MiB | {cells} |", flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _smoke.add_flag(ap)
    args = ap.parse_args()
    sizes = (2_048,) if args.smoke else SIZES  # (the store goes to a temporary directory)
    mp.start_processes(_run, args=(2, tempfile.mkdtemp(), sizes), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
