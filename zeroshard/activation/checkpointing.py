"""Activation memory: checkpointing (full and selective), optionally with the kept
tensors offloaded to CPU (the offload itself is :mod:`zeroshard.activation.offload`,
whose :class:`offload_saved_tensors` is re-exported here). No communication.

* :func:`checkpoint` — recompute ``fn`` in backward instead of keeping its activations
  (non-reentrant, RNG state restored, so dropout draws the same mask). Same name and
  call as DeepSpeed's ``deepspeed.checkpointing.checkpoint``; it follows
  :func:`configure`.
* :func:`apply_activation_checkpointing` — wrap the forward of every selected block:
  policy ``"full"`` keeps only the block input; ``"selective"`` keeps the block input
  and the outputs of the 2-D matmuls (``mm``/``addmm``: the linear layers) and
  recomputes the cheap element-wise ops and the attention core (fused attention, or
  QK^T, softmax, dropout and probabilities x V as batched matmuls). ``offload=True``
  additionally moves what is kept — the block input and, with ``selective``, the kept
  matmul outputs — to (pinned) CPU memory during forward and brings it back in
  backward (see :mod:`zeroshard.activation.offload`).
* :func:`apply_activation_offload` — no recomputation: every tensor a selected block
  saves for backward goes to CPU memory (saved-tensor hooks).
* Blocks are selected per block: by type (``Block`` or a tuple of types) or by a
  predicate ``(qualified_name, module) -> bool``, e.g. only the first half of the layers.
* :func:`configure` — DeepSpeed's ``deepspeed.checkpointing.configure``; the engine
  calls it with the config's ``activation_checkpointing`` section when there is one:

  ``cpu_checkpointing`` (``checkpoint_in_cpu``)
      what :func:`checkpoint` keeps (its inputs) is offloaded to CPU as above.
  ``partition_activations``
      accepted, no effect on memory. DeepSpeed splits the checkpointed inputs across
      *model-parallel* ranks, which hold identical copies of them. Under pure data
      parallelism every rank's activations are its own: sharding them over the
      data-parallel ranks would leave each rank holding 1/N of N different inputs —
      the same bytes — plus an all-gather at each recompute. An ``mpu`` with
      model-parallel world size > 1 is refused (not built).
  ``contiguous_memory_optimization``
      accepted, no effect: DeepSpeed copies the partitioned checkpoints into one
      preallocated buffer to avoid CUDA allocator fragmentation (DeepSpeed itself
      requires ``partition_activations`` and ``number_checkpoints`` with it; zeroshard,
      which builds no buffer, does not).
  ``number_checkpoints``
      validated (a whole number >= 1); it only sizes that buffer in DeepSpeed.

  The three are named once at start-up with the config's other inert keys (rank 0); a
  direct :func:`configure` call that sets them logs the same line once per process.
  ``synchronize_checkpoint_boundary``
      the device is synchronized before and after each :func:`checkpoint`.
  ``profile``
      the forward time of each :func:`checkpoint` is logged (logger
      ``zeroshard.checkpointing``, INFO).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from zeroshard import ArgumentError, NotBuiltError, UsageError
from zeroshard.activation import offload as activation_offload  # looked up at each call
from zeroshard.activation.offload import offload_saved_tensors  # re-exported
from zeroshard.distributed.device import runtime

log = logging.getLogger("zeroshard.checkpointing")  # its name before the move (tests, users)

POLICIES = ("full", "selective")

__all__ = [
    "POLICIES",
    "Selector",
    "Settings",
    "apply_activation_checkpointing",
    "apply_activation_offload",
    "checkpoint",
    "configure",
    "is_configured",
    "offload_saved_tensors",
    "reset",
    "settings",
]

# ops whose outputs selective checkpointing keeps: the 2-D matmuls, which is what
# nn.Linear reaches the dispatcher as (costly to redo, sbh-sized). Batched matmuls (bmm,
# baddbmm: the QK^T scores and probabilities x V of an unfused attention core) are
# recomputed with the softmax: keeping them would keep s x s scores per head.
_KEEP = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


# -- selective checkpointing ------------------------------------------------------------
class _KeepMatmuls(TorchDispatchMode):
    """Forward of a selective region: remember each matmul output (offloaded or not)."""

    def __init__(self, store: list, offload: bool) -> None:
        super().__init__()
        self.store, self.offload = store, offload

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _KEEP:
            kept = out.detach()  # an alias: shares the storage and the version counter
            self.store.append(
                (activation_offload.to_host(kept) if self.offload else kept, kept._version)
            )
        return out


class _ReuseMatmuls(TorchDispatchMode):
    """Recompute of a selective region: matmuls return what forward kept (each once, and
    dropped from the store then), everything else runs again."""

    def __init__(self, store: list, offload: bool) -> None:
        super().__init__()
        self.store, self.offload, self.next = store, offload, 0

    def __enter__(self):
        self.next = 0
        self._ahead(0)
        return super().__enter__()

    def _ahead(self, i: int) -> None:
        # the recompute runs in forward order: the next kept outputs are needed next
        if self.offload:
            for entry in self.store[i : i + 2]:
                if entry is not None:
                    activation_offload.prefetch(entry[0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in _KEEP:
            return func(*args, **(kwargs or {}))
        i, self.next = self.next, self.next + 1
        entry = self.store[i] if i < len(self.store) else None
        if entry is None:
            raise UsageError(
                "selective checkpointing: the recomputed region runs a matmul that forward "
                "did not (non-deterministic region?) or is backwarded a second time"
            )
        self.store[i] = None
        self._ahead(i + 1)
        kept, version = entry
        if torch.is_tensor(kept) and kept._version != version:
            raise UsageError(
                "selective checkpointing: a kept matmul output was modified in place after "
                "forward; use policy 'full' for this block"
            )
        return activation_offload.to_device(kept) if self.offload else kept


def _selective_contexts(offload: bool):
    store: list = []
    return _KeepMatmuls(store, offload), _ReuseMatmuls(store, offload)


# -- checkpoint() and configure() --------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    """What :func:`configure` set (DeepSpeed's names in the config section)."""

    cpu_checkpointing: bool = False
    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


_settings = Settings()


def settings() -> Settings:
    """The current :func:`configure` settings."""
    return _settings


def reset() -> None:
    """Back to the defaults (nothing offloaded, no synchronization, no profiling)."""
    global _settings
    _settings = Settings()


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        runtime("cuda").synchronize()


def checkpoint(fn: Callable, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` without keeping its activations; recompute in backward.

    Only the inputs are kept; with ``cpu_checkpointing`` (``configure(checkpoint_in_cpu=
    True)``) they are kept in CPU memory."""
    s = _settings
    if s.synchronize_checkpoint_boundary:
        _synchronize()
    start = time.perf_counter() if s.profile else 0.0
    ctx = offload_saved_tensors() if s.cpu_checkpointing else contextlib.nullcontext()
    with ctx:
        out = _torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
    if s.synchronize_checkpoint_boundary:
        _synchronize()
    if s.profile:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        log.info("checkpoint %s: forward %.3f ms", name, 1e3 * (time.perf_counter() - start))
    return out


def _section(deepspeed_config: Any) -> Mapping[str, Any] | None:
    """The ``activation_checkpointing`` section of a config: a path, a dict, a parsed
    :class:`~zeroshard.config.Config` or the section itself."""
    from zeroshard.config import (
        ActivationCheckpointingConfig,
        Config,
        read_config_file,
        read_section,
    )

    if deepspeed_config is None:
        return None
    if isinstance(deepspeed_config, ActivationCheckpointingConfig):
        section = deepspeed_config
    elif isinstance(deepspeed_config, Config):
        section = deepspeed_config.activation_checkpointing
    else:
        raw = (
            read_config_file(deepspeed_config)
            if isinstance(deepspeed_config, (str, os.PathLike))
            else deepspeed_config
        )
        if not isinstance(raw, Mapping):
            raise TypeError(
                f"deepspeed_config: expected a dict or a path, got {type(raw).__name__}"
            )
        data = raw.get("activation_checkpointing") or {}
        section = read_section(ActivationCheckpointingConfig, data, "activation_checkpointing")
    return {f: getattr(section, f) for f in Settings.__dataclass_fields__}


def _mp_world_size(mpu) -> int:
    for name in ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"):
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    return 1


def _settings_from(deepspeed_config: Any, explicit: Mapping[str, Any]) -> Settings:
    """The section of ``deepspeed_config`` (see :func:`_section`), then the explicit
    values that are not None, each checked."""
    new = Settings(**(_section(deepspeed_config) or {}))
    for key, value in explicit.items():
        if value is None:
            continue
        if key == "number_checkpoints":
            if isinstance(value, bool):
                raise ArgumentError(f"num_checkpoints: expected a whole number, got {value!r}")
            try:
                value = operator.index(value)
            except TypeError:
                raise ArgumentError(
                    f"num_checkpoints: expected a whole number, got {value!r}"
                ) from None
        else:
            value = bool(value)
        new = replace(new, **{key: value})
    if new.number_checkpoints is not None and new.number_checkpoints < 1:
        raise ArgumentError(f"num_checkpoints: must be >= 1, got {new.number_checkpoints}")
    return new


def _check_model_parallel(new: Settings, mpu_) -> None:
    if new.partition_activations and mpu_ is not None and _mp_world_size(mpu_) > 1:
        raise NotBuiltError(
            "partition_activations across model-parallel ranks is not built yet; "
            "with zeroshard's tensor parallelism, tensor_parallel.sequence_parallel "
            "(Megatron-SP) splits activations across the tensor-parallel ranks"
        )


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


_noted: set[str] = set()  # inert settings already logged by this process


def _note_inert(new: Settings) -> None:
    """One warning per inert setting in use (the config schema's reason), from rank 0,
    once per process."""
    from zeroshard.config import schema_table

    prefix = "activation_checkpointing."
    for row in schema_table():
        name = row.path.removeprefix(prefix)
        if not row.path.startswith(prefix) or row.status.kind != "inert" or name in _noted:
            continue
        if getattr(new, name) in (False, None) or _rank() != 0:
            continue
        _noted.add(name)
        log.warning(
            "zeroshard: activation checkpointing setting %s has no effect here: %s",
            name,
            row.status.text,
        )


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
    """DeepSpeed's ``deepspeed.checkpointing.configure``: read the
    ``activation_checkpointing`` section of ``deepspeed_config`` (path, dict or parsed
    config), then let the explicit arguments override it. See the module docstring for
    what each setting does; the ones that change nothing here are logged once (rank 0)."""
    global _settings
    explicit = {
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize,
        "profile": profile,
    }
    new = _settings_from(deepspeed_config, explicit)
    _check_model_parallel(new, mpu_)
    _note_inert(new)
    _settings = new


def configure_from_config(section: Any) -> None:
    """The engine's :func:`configure`: the config's ``activation_checkpointing`` section,
    whose inert keys the engine's start-up lines already name (so nothing is logged)."""
    global _settings
    _settings = _settings_from(section, {})


def is_configured() -> bool:
    return True


# -- applying to blocks -------------------------------------------------------------------
Selector = type | Iterable[type] | Callable[[str, nn.Module], bool]


def _select(model: nn.Module, blocks: Selector) -> list[nn.Module]:
    """The modules ``blocks`` selects, outermost only (a selected module inside a
    selected module is left alone)."""
    if callable(blocks) and not isinstance(blocks, type):
        predicate = blocks
    else:
        types = (blocks,) if isinstance(blocks, type) else tuple(blocks)
        if not all(isinstance(t, type) for t in types):
            raise TypeError("block_types: expected module types or a (name, module) predicate")

        def predicate(_name: str, m: nn.Module) -> bool:
            return isinstance(m, types)

    chosen: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if any(name.startswith(p + ".") or p == "" for p, _ in chosen):
            continue
        if predicate(name, m):
            chosen.append((name, m))
    return [m for _, m in chosen]


def _wrap_forward(module: nn.Module, policy: str | None, offload: bool) -> bool:
    if getattr(module, "_zeroshard_activation", None) is not None:
        return False  # already wrapped
    forward = module.forward

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        ctx = offload_saved_tensors() if offload else contextlib.nullcontext()
        with ctx:
            if policy is None:
                return forward(*args, **kwargs)
            if policy == "full":
                return _torch_checkpoint(
                    forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs
                )
            return _torch_checkpoint(
                forward,
                *args,
                use_reentrant=False,
                context_fn=functools.partial(_selective_contexts, offload),
                **kwargs,
            )

    module.forward = wrapped  # this instance only
    module._zeroshard_activation = (policy, offload)  # type: ignore[assignment]
    return True


def apply_activation_checkpointing(
    model: nn.Module,
    block_types: Selector,
    policy: str = "full",
    *,
    offload: bool = False,
) -> int:
    """Checkpoint every block ``block_types`` selects (types, or a ``(name, module)``
    predicate); returns how many were wrapped. ``offload`` also moves what is kept to
    CPU memory."""
    if policy not in POLICIES:
        raise ArgumentError(f"policy: expected one of {POLICIES}, got {policy!r}")
    return sum(_wrap_forward(m, policy, offload) for m in _select(model, block_types))


def apply_activation_offload(model: nn.Module, block_types: Selector) -> int:
    """Without recomputation, keep every tensor the selected blocks save for backward in
    CPU memory; returns how many blocks were wrapped."""
    return sum(_wrap_forward(m, None, True) for m in _select(model, block_types))
