"""accelerate's view of a multi-rank job on CPU-only hosts. No communication.

accelerate (1.x) picks its process-group backend before it initializes DeepSpeed's
communication: with ``LOCAL_RANK`` set and no accelerator device it finds none (only
``cpu=True``, i.e. ``use_cpu`` / ``--cpu``, selects gloo, and that turns DeepSpeed off),
then asks ``deepspeed.comm.init_distributed(dist_backend=None)`` to start the group and
still records ``backend=None``, which it reads as "not distributed": every rank believes
the world has one process (``num_processes == 1``), so the Trainer and
``accelerator.prepare`` give each rank the whole data set. torchrun or our launcher
makes no difference: the environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``) is complete in both cases.

:func:`after_init_distributed` runs after zeroshard's ``init_distributed``, and in
``zeroshard.comm.is_initialized`` (accelerate asks it first, and does not initialize again
when a second ``TrainingArguments`` rebuilds its state), when called from accelerate's
``PartialState`` set-up (the state is being built: it holds no
``num_processes`` yet, and its backend is None): it records the backend that was
actually started, so accelerate counts the processes from ``torch.distributed``.
"""

from __future__ import annotations

import sys

import torch.distributed as dist


def after_init_distributed(requested_backend: str | None) -> bool:
    """Tell accelerate's half-built ``PartialState`` which backend now runs; True if
    it did."""
    state_mod = sys.modules.get("accelerate.state")
    if requested_backend is not None or state_mod is None or not dist.is_initialized():
        return False
    shared = getattr(getattr(state_mod, "PartialState", None), "_shared_state", None)
    if not isinstance(shared, dict) or "num_processes" in shared or shared.get("backend"):
        return False
    if "backend" not in shared:  # not in the middle of PartialState.__init__
        return False
    shared["backend"] = dist.get_backend()
    return True
