"""Process-group setup from the launcher's environment. Issues no collectives.

``init_distributed`` reads torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT; OMPI_* from mpirun as a fallback) and initializes
``torch.distributed`` with NCCL when CUDA is present and gloo otherwise. Without a
launcher it makes a one-rank group backed by a file store (no port is opened), so
scripts that call ``torch.distributed.get_rank()`` work unchanged.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import tempfile

import torch
import torch.distributed as dist

from zeroshard import ArgumentError, UsageError
from zeroshard.distributed.device import claim_device, runtime
from zeroshard.distributed.env import ACCELERATOR_ENV

_MPI_ENV = {
    "RANK": "OMPI_COMM_WORLD_RANK",
    "WORLD_SIZE": "OMPI_COMM_WORLD_SIZE",
    "LOCAL_RANK": "OMPI_COMM_WORLD_LOCAL_RANK",
}


def _shutdown() -> None:
    """At exit, tear the process group down while Python is still whole: gloo's worker
    threads may hold the last reference to a tensor whose release needs the GIL, and
    must be joined before the interpreter finalizes (else: "terminate called without an
    active exception")."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()  # engines in reference cycles drop their tensors now
        dist.destroy_process_group()


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))


def use_cuda() -> bool:
    """Whether ranks compute on CUDA devices: yes when CUDA is present, unless
    ``ZEROSHARD_ACCELERATOR`` (or DeepSpeed's ``DS_ACCELERATOR``) says ``cpu``."""
    name = next((v for v in (ACCELERATOR_ENV, "DS_ACCELERATOR") if os.environ.get(v)), None)
    if name is None:
        return torch.cuda.is_available()
    want = os.environ[name].strip().lower()
    if want not in ("cpu", "cuda"):
        raise ArgumentError(f"{name}={os.environ[name]!r}: zeroshard supports 'cpu' and 'cuda'")
    if want == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"{name}=cuda, but torch.cuda.is_available() is False")
    return want == "cuda"


def default_device() -> torch.device:
    """This rank's accelerator (``cuda:LOCAL_RANK``) if there is one, else the CPU."""
    if use_cuda():
        return torch.device("cuda", local_rank() % runtime("cuda").device_count())
    return torch.device("cpu")


def default_backend() -> str:
    return "nccl" if use_cuda() else "gloo"


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config=None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Initialize ``torch.distributed`` once (DeepSpeed's signature; extra args accepted).

    No-op if already initialized. Raises if the environment is half set up (e.g.
    WORLD_SIZE without RANK), naming the missing variable.
    """
    if dist.is_initialized() or dist_init_required is False:
        return
    backend = dist_backend or default_backend()
    timeout = timeout or datetime.timedelta(minutes=30)
    if auto_mpi_discovery and "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" in os.environ:
        for ours, theirs in _MPI_ENV.items():
            os.environ.setdefault(ours, os.environ[theirs])
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    if rank >= 0:
        os.environ["RANK"] = str(rank)
    if world_size > 0:
        os.environ["WORLD_SIZE"] = str(world_size)
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if backend == "nccl":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        count = runtime("cuda").device_count()
        if local_world > count:
            raise UsageError(
                f"init_distributed: LOCAL_WORLD_SIZE={local_world} ranks on this node but "
                f"{count} visible GPU(s); NCCL cannot put two ranks on "
                "one GPU (set ZEROSHARD_ACCELERATOR=cpu for CPU ranks with gloo)"
            )
        claim_device("cuda", local_rank())
    if init_method is not None or env_world > 1 or "MASTER_ADDR" in os.environ:
        missing = [k for k in ("RANK", "WORLD_SIZE") if k not in os.environ]
        if missing and init_method is None:
            raise UsageError(
                f"init_distributed: environment variable(s) {', '.join(missing)} not set; "
                "start the script with `zeroshard run --nproc N script.py` (or torchrun)"
            )
        # rank / world_size given: passed on (a file:// or tcp:// rendezvous needs them)
        dist.init_process_group(
            backend,
            init_method=init_method or "env://",
            timeout=timeout,
            rank=rank if rank >= 0 else -1,  # torch's "not given" is -1 too
            world_size=world_size if world_size > 0 else -1,
        )
        atexit.register(_shutdown)
        return
    # One rank, no launcher: a private file store, no network port.
    path = os.path.join(tempfile.mkdtemp(prefix="zeroshard-"), "store")
    dist.init_process_group(
        backend, store=dist.FileStore(path, 1), rank=0, world_size=1, timeout=timeout
    )
    atexit.register(_shutdown)
