"""What the accelerator host offers zeroshard: torch/CUDA versions, and which gloo
collectives accept CUDA tensors (ranks that share one GPU must use gloo, since NCCL
refuses two ranks on one device).

    python benchmarks/cuda_env.py
    python benchmarks/cuda_env.py --smoke   # CI, no GPU: the same probe on CPU tensors
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _probe(rank: int, world: int, store: str, device: str = "cuda") -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    dev = torch.device(device, 0) if device == "cuda" else torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    x = torch.ones(8, device=dev)
    ops = {
        "all_reduce": lambda: dist.all_reduce(x.clone()),
        "broadcast": lambda: dist.broadcast(x.clone(), 0),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
            torch.empty(8 * world, device=dev), x
        ),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            torch.empty(8 // world, device=dev), x
        ),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty_like(x), x),
        "all_gather (list)": lambda: dist.all_gather(
            [torch.empty_like(x) for _ in range(world)], x
        ),
        "reduce_scatter (list)": lambda: dist.reduce_scatter(
            torch.empty(4, device=dev), [torch.ones(4, device=dev) for _ in range(world)]
        ),
    }
    for name, fn in ops.items():
        try:
            fn()
            sync()
            res = "yes"
        except Exception as exc:  # report, don't stop: this is a survey
            res = f"no ({type(exc).__name__}: {str(exc).splitlines()[0][:100]})"
        if rank == 0:
            print(f"  gloo {name} on {dev.type.upper()} tensors: {res}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CI: probe CPU tensors without a GPU")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cores {os.cpu_count()}")
    if not torch.cuda.is_available():
        print("no CUDA device")
        if args.smoke:  # the probe's code, on the CPU (the store in a temporary directory)
            with tempfile.TemporaryDirectory() as tmp:
                store = os.path.join(tmp, "s")
                mp.start_processes(_probe, args=(2, store, "cpu"), nprocs=2, start_method="spawn")
        return
    p = torch.cuda.get_device_properties(0)
    print(f"{torch.cuda.device_count()} x {p.name}, {p.total_memory / 2**30:.0f} GiB")
    print(f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_probe, args=(2, os.path.join(tmp, "s")), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
