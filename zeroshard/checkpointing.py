"""Activation memory: checkpointing (full and selective) and offload of saved
activations to CPU. No communication.

* :func:`checkpoint` — recompute ``fn`` in backward instead of keeping its activations
  (non-reentrant, RNG state restored, so dropout draws the same mask). Same name and
  call as DeepSpeed's ``deepspeed.checkpointing.checkpoint``.
* :func:`apply_activation_checkpointing` — wrap the forward of every block of given
  types: policy ``"full"`` keeps only the block input; ``"selective"`` keeps matmul
  outputs and recomputes the cheap element-wise ops and the attention core (softmax).
  ``offload=True`` additionally moves what is kept to CPU memory during forward and
  brings it back in backward (saved-tensor hooks; asynchronous with pinned memory).
* :func:`configure` — DeepSpeed's ``activation_checkpointing`` section.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

POLICIES = ("full", "selective")

# matmul-like ops whose outputs selective checkpointing keeps (they are costly to redo)
_KEEP = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.linear.default,
}

_settings = {"offload": False}


def checkpoint(fn: Callable, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` without keeping its activations; recompute in backward.
    With ``configure(checkpoint_in_cpu=True)`` the kept inputs go to CPU memory."""
    ctx = offload_saved_tensors() if _settings["offload"] else contextlib.nullcontext()
    with ctx:
        return _torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _KEEP else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_selective_policy)


class offload_saved_tensors(torch.autograd.graph.saved_tensors_hooks):
    """Keep tensors saved for backward in (pinned) CPU memory instead of the device."""

    def __init__(self, device: torch.device | None = None) -> None:
        pin = torch.cuda.is_available()

        def pack(t: torch.Tensor):
            if t.device.type == "cpu":
                return t  # already there (CPU training): nothing to move
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            return (t.device, host)

        def unpack(packed):
            if torch.is_tensor(packed):
                return packed
            dev, host = packed
            return host.to(dev, non_blocking=pin)

        super().__init__(pack, unpack)


def _wrap_forward(module: nn.Module, policy: str, offload: bool) -> None:
    forward = module.forward

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        ctx = offload_saved_tensors() if offload else contextlib.nullcontext()
        with ctx:
            if policy == "full":
                return _torch_checkpoint(forward, *args, use_reentrant=False, **kwargs)
            return _torch_checkpoint(
                forward, *args, use_reentrant=False, context_fn=_selective_contexts, **kwargs
            )

    module.forward = wrapped  # this instance only


def apply_activation_checkpointing(
    model: nn.Module,
    block_types: type | Iterable[type],
    policy: str = "full",
    *,
    offload: bool = False,
) -> int:
    """Checkpoint every submodule that is an instance of ``block_types``; returns how many."""
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
    types = (block_types,) if isinstance(block_types, type) else tuple(block_types)
    blocks = [m for m in model.modules() if isinstance(m, types)]
    for m in blocks:
        _wrap_forward(m, policy, offload)
    return len(blocks)


def configure(
    mpu_=None,
    deepspeed_config=None,
    partition_activations=None,
    contiguous_checkpointing=None,
    num_checkpoints=None,
    checkpoint_in_cpu=None,
    synchronize=None,
    profile=None,
) -> None:
    """DeepSpeed's ``checkpointing.configure``: ``checkpoint_in_cpu`` offloads what
    :func:`checkpoint` keeps; partitioning needs model parallelism (not built yet)."""
    if partition_activations:
        raise NotImplementedError(
            "activation_checkpointing.partition_activations is not built yet in zeroshard"
        )
    if checkpoint_in_cpu is not None:
        _settings["offload"] = bool(checkpoint_in_cpu)


def is_configured() -> bool:
    return True
