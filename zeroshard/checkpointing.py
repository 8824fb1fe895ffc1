"""Activation memory: checkpointing (full and selective) and offload of saved
activations to CPU. No communication.

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
  backward (see *Offload* below).
* :func:`apply_activation_offload` — no recomputation: every tensor a selected block
  saves for backward goes to CPU memory (saved-tensor hooks).
* Blocks are selected per block: by type (``Block`` or a tuple of types) or by a
  predicate ``(qualified_name, module) -> bool``, e.g. only the first half of the layers.
* :func:`configure` — DeepSpeed's ``deepspeed.checkpointing.configure``; the engine
  calls it with the config's ``activation_checkpointing`` section when there is one:

  ``cpu_checkpointing`` (``checkpoint_in_cpu``)
      what :func:`checkpoint` keeps (its inputs) is offloaded to CPU as above.
  ``partition_activations``
      accepted, no effect on memory (a warning is logged). DeepSpeed splits the
      checkpointed inputs across *model-parallel* ranks, which hold identical copies of
      them. zeroshard has only data parallelism, where every rank's activations are its
      own: sharding them over the data-parallel ranks would leave each rank holding
      1/N of N different inputs — the same bytes — plus an all-gather at each
      recompute. An ``mpu`` with model-parallel world size > 1 is refused.
  ``contiguous_memory_optimization``
      accepted, no effect: DeepSpeed copies the partitioned checkpoints into one
      preallocated buffer to avoid CUDA allocator fragmentation; it requires
      ``partition_activations`` and ``number_checkpoints`` (checked, as DeepSpeed does).
  ``number_checkpoints``
      validated (a whole number >= 1); it only sizes that buffer in DeepSpeed.
  ``synchronize_checkpoint_boundary``
      the device is synchronized before and after each :func:`checkpoint`.
  ``profile``
      the forward time of each :func:`checkpoint` is logged (logger
      ``zeroshard.checkpointing``, INFO).

Offload (``offload=True``, :func:`apply_activation_offload`, ``cpu_checkpointing``):

* CPU-only runs (tensors on the CPU): nothing is copied, saved tensors stay as they are.
* On CUDA (any device whose torch module has ``Stream`` and ``Event``) the copies run on
  one side stream per device (created on first use), not on the compute (current)
  stream, so they overlap with compute. Forward: the side stream waits for the compute
  stream (the tensor is ready), copies into pinned host memory and records an event;
  the compute stream never waits for it. The source tensor stays referenced until that
  event is seen complete — polled at each pack and unpack, waited for when more than
  1 GiB of sources is held, and at the end of each backward — and is
  ``record_stream``-ed on the side stream (a storage freed under it, as ZeRO-3 does with
  parameters, is not reused before the copy is done), so the caching allocator cannot
  hand its memory out while the copy reads it. Backward: the copy back runs on
  the side stream and records an event; the compute stream waits on that event
  (``wait_event``: no host synchronization) before using the result, which is
  ``record_stream``-ed on the compute stream.
* Prefetch: when backward first unpacks a tensor of a block, the copies back of every
  tensor of the block packed before it start, so they overlap this block's backward;
  within the first block unpacked, the few tensors packed just before each one; the
  selective recompute asks for the next kept matmul outputs ahead. A tensor whose copy to
  host is not seen complete yet when backward needs it is used as is (no copy back).
* Other devices (``mps``): blocking copies on the current stream.
* A saved tensor modified in place while its copy to host may still be reading it is
  refused at unpack (autograd refuses a modified saved tensor without offload too).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import operator
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

log = logging.getLogger(__name__)

POLICIES = ("full", "selective")

# ops whose outputs selective checkpointing keeps: the 2-D matmuls, which is what
# nn.Linear reaches the dispatcher as (costly to redo, sbh-sized). Batched matmuls (bmm,
# baddbmm: the QK^T scores and probabilities x V of an unfused attention core) are
# recomputed with the softmax: keeping them would keep s x s scores per head.
_KEEP = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


# -- offload ------------------------------------------------------------------------------
class _StreamMover:
    """The copies an offload does, on one side stream per device (created on first use),
    so that they overlap with compute on the current stream. A device whose torch module
    has no ``Stream``/``Event`` (e.g. ``mps``) gets blocking copies on the current stream.

    Events are this device's ``Event``; ``None`` stands for a copy already complete."""

    def __init__(self) -> None:
        self._side: dict[torch.device, Any] = {}

    def moves(self, t: torch.Tensor) -> bool:
        return t.device.type not in ("cpu", "meta")  # CPU training: nothing to move

    @staticmethod
    def _api(device: torch.device) -> Any:
        mod = getattr(torch, device.type, None)
        return mod if hasattr(mod, "Stream") and hasattr(mod, "Event") else None

    def _stream(self, api: Any, device: torch.device) -> Any:
        side = self._side.get(device)
        if side is None:
            side = self._side[device] = api.Stream(device=device)
        return side

    def to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        pin = t.device.type == "cuda"  # pinned: the copy is a true async DMA
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin)
        api = self._api(t.device)
        if api is None:
            host.copy_(t)
            return host, None
        side = self._stream(api, t.device)
        side.wait_stream(api.current_stream(t.device))  # t is written on the compute stream
        with api.stream(side):
            host.copy_(t, non_blocking=pin)
        # besides the reference the queue keeps: a storage freed under us (ZeRO-3 resizes
        # parameter storage to 0 after a block) must not be reused before the copy is done
        t.record_stream(side)
        event = api.Event()
        event.record(side)
        return host, event

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        api = self._api(device)
        if api is None:
            return host.to(device), None
        side = self._stream(api, device)
        with api.stream(side):  # allocated from the side stream's pool, filled there
            dev = host.to(device, non_blocking=host.is_pinned())
        event = api.Event()
        event.record(side)
        return dev, event

    def use(self, dev: torch.Tensor, event: Any) -> None:
        """Hand a :meth:`to_device` result to the compute stream."""
        if event is None:
            return
        compute = self._api(dev.device).current_stream(dev.device)
        compute.wait_event(event)
        # freed later on the compute stream: the allocator must not give the block back to
        # the side stream before the compute stream is done with it
        dev.record_stream(compute)

    def done(self, event: Any) -> bool:
        return event is None or event.query()

    def wait(self, event: Any) -> None:
        if event is not None:
            event.synchronize()


class _Group:
    """The entries packed in one offload region (one block's forward), in pack order."""

    __slots__ = ("__weakref__", "entries", "prev", "started")

    def __init__(self, prev: _Group | None) -> None:
        self.entries: list[weakref.ref[_Offloaded]] = []  # weak: the graph owns them
        self.prev = weakref.ref(prev) if prev is not None else None
        self.started = False  # backward has unpacked one of them


class _Offloaded:
    """What packing a device tensor returns: its host copy, plus the source tensor until
    the copy is seen complete, and the tensor to unpack once it is on its way back."""

    __slots__ = (
        *("__weakref__", "d2h", "dev", "device", "from_src", "group", "h2d", "host"),
        *("nbytes", "prev", "src", "stale", "unpacked", "version"),
    )

    def __init__(
        self, t: torch.Tensor, host: torch.Tensor, d2h: Any, prev: Any, group: _Group
    ) -> None:
        self.device, self.host, self.d2h, self.prev = t.device, host, d2h, prev
        self.group = group
        self.src: torch.Tensor | None = t  # kept alive: the side stream still reads it
        self.version = t._version
        self.nbytes = t.numel() * t.element_size()
        self.dev: torch.Tensor | None = None  # what the next unpack returns
        self.h2d: Any = None  # the event of dev's copy back (None: nothing to wait for)
        self.from_src = False  # dev is the source itself, not a copy
        self.stale = False
        self.unpacked = False


class _OffloadQueue:
    """Bookkeeping of offloaded saved activations; the copies themselves are the mover's.

    * pack: start the device-to-host copy, keep the source until the copy is seen
      complete (polled at every pack and unpack; a pack blocks on the oldest copies while
      more than ``max_inflight_bytes`` of sources are held), link it to the entry packed
      just before and to its group, the region (block) being packed: links to earlier
      entries and groups are weak, so a freed graph's entries die with it.
    * unpack: start the host-to-device copy unless a prefetch did and hand the result
      to the compute stream. Prefetch, since backward runs roughly in reverse pack
      order: the first unpack of a group starts the copies of the whole group packed
      before it (the previous block: its copies overlap this block's backward), and the
      first unpack of each entry those of the ``prefetch`` entries packed just before it
      (within the group unpacked first). An entry whose source is still held (copy to
      host not seen complete) gets the source back: no copy back.
    * at the end of each backward that unpacked, the copies still running are waited for
      and their sources released, so nothing outlives the backward.
    * a source modified in place before its copy was seen complete may have been copied
      half-modified: its unpack raises (without offload autograd would raise too)."""

    def __init__(self, mover: Any, prefetch: int = 4, max_inflight_bytes: int = 1 << 30) -> None:
        self.mover, self.prefetch_depth = mover, prefetch
        self.max_inflight_bytes = max_inflight_bytes
        self.pending: collections.deque[_Offloaded] = collections.deque()
        self.inflight_bytes = 0
        self._last: Any = None  # weakref to the entry packed last
        self._group: _Group | None = None  # the group being packed
        self._new_group = True
        self._drain_task = -1  # the backward (graph task) a drain is queued for
        self._lock = threading.RLock()  # pack: forward thread; unpack: autograd's threads

    def pack(self, t: torch.Tensor) -> Any:
        if not self.mover.moves(t):
            return t
        with self._lock:
            self._reap()
            if self._new_group or self._group is None:
                self._group, self._new_group = _Group(self._group), False
            host, event = self.mover.to_host(t)
            entry = _Offloaded(t, host, event, self._last, self._group)
            self._last = weakref.ref(entry)
            self._group.entries.append(self._last)
            self.pending.append(entry)
            self.inflight_bytes += entry.nbytes
            while self.inflight_bytes > self.max_inflight_bytes and self.pending:
                self.mover.wait(self.pending[0].d2h)
                self._release(self.pending.popleft())
            return entry

    def unpack(self, packed: Any) -> torch.Tensor:
        if torch.is_tensor(packed):
            return packed
        e: _Offloaded = packed
        with self._lock:
            self._reap()
            self._queue_drain()
            self._start(e)
            if e.stale or (e.from_src and e.dev._version != e.version):
                raise RuntimeError(
                    "activation offload: a saved tensor was modified in place while it was "
                    "being copied to host memory (autograd would refuse it without offload)"
                )
            out, event = e.dev, e.h2d
            e.dev, e.h2d, e.from_src = None, None, False  # a second backward fetches again
            if not e.unpacked:
                e.unpacked = True
                self._prefetch_before(e)
            if not e.group.started:
                e.group.started = True
                previous = e.group.prev() if e.group.prev is not None else None
                for ref in previous.entries if previous is not None else ():
                    if (entry := ref()) is not None and not entry.unpacked:
                        self._start(entry)
        if event is not None:
            self.mover.use(out, event)
        return out

    def prefetch(self, packed: Any) -> None:
        """Start bringing ``packed`` back now (it will be unpacked soon)."""
        if isinstance(packed, _Offloaded):
            with self._lock:
                self._start(packed)

    def begin_group(self) -> None:
        """What is packed from now on belongs to a new group (block)."""
        with self._lock:
            self._new_group = True

    def reap(self) -> None:
        """Release the sources whose copies to host are complete (non-blocking)."""
        with self._lock:
            self._reap()

    def drain(self) -> None:
        """Wait for every copy to host still running, release every source."""
        with self._lock:
            while self.pending:
                self.mover.wait(self.pending[0].d2h)
                self._release(self.pending.popleft())

    # -- under the lock ----------------------------------------------------------------
    def _release(self, e: _Offloaded) -> None:
        if e.src is not None and e.src._version != e.version:
            e.stale = True  # modified while (or after) the copy read it: refuse at unpack
        e.src = None
        self.inflight_bytes -= e.nbytes

    def _reap(self) -> None:
        # the copies of a side stream finish in order: stop at the first still running
        while self.pending and self.mover.done(self.pending[0].d2h):
            self._release(self.pending.popleft())

    def _start(self, e: _Offloaded) -> None:
        """Get ``e``'s tensor on its way back to the device (once)."""
        if e.dev is not None or e.stale:
            return
        if e.src is not None:  # still on the device: keep it instead of copying back
            e.dev, e.h2d, e.from_src = e.src, None, True
        else:
            e.dev, e.h2d = self.mover.to_device(e.host, e.device)

    def _prefetch_before(self, e: _Offloaded) -> None:
        ref = e.prev
        for _ in range(self.prefetch_depth):
            prev = ref() if ref is not None else None
            if prev is None:
                return
            if not prev.unpacked:
                self._start(prev)
            ref = prev.prev

    def _queue_drain(self) -> None:
        task = torch._C._current_graph_task_id()  # -1: not in a backward
        if task == -1 or task == self._drain_task or not self.pending:
            return
        torch.autograd.Variable._execution_engine.queue_callback(self.drain)
        self._drain_task = task


_QUEUE = _OffloadQueue(_StreamMover())


def _to_host(t: torch.Tensor) -> Any:
    """Pack: a device tensor becomes an :class:`_Offloaded` whose copy to (pinned) host
    memory is under way; a CPU tensor stays as it is (CPU training: nothing to move)."""
    return _QUEUE.pack(t)


def _to_device(packed: Any) -> torch.Tensor:
    """Unpack what :func:`_to_host` packed."""
    return _QUEUE.unpack(packed)


def _prefetch(packed: Any) -> None:
    _QUEUE.prefetch(packed)


class offload_saved_tensors(torch.autograd.graph.saved_tensors_hooks):
    """Keep tensors saved for backward in (pinned) CPU memory instead of the device; the
    copies run on a side stream (see the module docstring)."""

    def __init__(self, queue: _OffloadQueue | None = None) -> None:
        if queue is None:  # looked up at each call, so the module's functions can be wrapped
            super().__init__(lambda t: _to_host(t), lambda packed: _to_device(packed))
        else:
            super().__init__(queue.pack, queue.unpack)
        self._queue = queue

    def __enter__(self) -> None:
        (self._queue or _QUEUE).begin_group()  # a block boundary
        super().__enter__()

    def __exit__(self, *args: object) -> None:
        super().__exit__(*args)
        (self._queue or _QUEUE).reap()  # a block boundary: let finished copies go


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
            self.store.append((_to_host(kept) if self.offload else kept, kept._version))
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
                    _prefetch(entry[0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in _KEEP:
            return func(*args, **(kwargs or {}))
        i, self.next = self.next, self.next + 1
        entry = self.store[i] if i < len(self.store) else None
        if entry is None:
            raise RuntimeError(
                "selective checkpointing: the recomputed region runs a matmul that forward "
                "did not (non-deterministic region?) or is backwarded a second time"
            )
        self.store[i] = None
        self._ahead(i + 1)
        kept, version = entry
        if torch.is_tensor(kept) and kept._version != version:
            raise RuntimeError(
                "selective checkpointing: a kept matmul output was modified in place after "
                "forward; use policy 'full' for this block"
            )
        return _to_device(kept) if self.offload else kept


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
        torch.cuda.synchronize()


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
    from zeroshard.config import ActivationCheckpointingConfig, Config, read_config_file

    if deepspeed_config is None:
        return None
    if isinstance(deepspeed_config, ActivationCheckpointingConfig):
        section = deepspeed_config
    elif isinstance(deepspeed_config, Config):
        section = deepspeed_config.activation_checkpointing
    else:
        from zeroshard._config_parse import _parse_activation_checkpointing

        raw = (
            read_config_file(deepspeed_config)
            if isinstance(deepspeed_config, (str, os.PathLike))
            else deepspeed_config
        )
        if not isinstance(raw, Mapping):
            raise TypeError(
                f"deepspeed_config: expected a dict or a path, got {type(raw).__name__}"
            )
        section = _parse_activation_checkpointing(raw.get("activation_checkpointing"))
    return {f: getattr(section, f) for f in Settings.__dataclass_fields__}


def _mp_world_size(mpu) -> int:
    for name in ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"):
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    return 1


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
    what each setting does."""
    global _settings
    new = Settings(**(_section(deepspeed_config) or {}))
    explicit = {
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize,
        "profile": profile,
    }
    for key, value in explicit.items():
        if value is None:
            continue
        if key == "number_checkpoints":
            if isinstance(value, bool):
                raise ValueError(f"num_checkpoints: expected a whole number, got {value!r}")
            try:
                value = operator.index(value)
            except TypeError:
                raise ValueError(
                    f"num_checkpoints: expected a whole number, got {value!r}"
                ) from None
        else:
            value = bool(value)
        new = replace(new, **{key: value})
    if new.number_checkpoints is not None and new.number_checkpoints < 1:
        raise ValueError(f"num_checkpoints: must be >= 1, got {new.number_checkpoints}")
    if new.contiguous_memory_optimization and not new.partition_activations:
        raise ValueError("contiguous_checkpointing needs partition_activations (as in DeepSpeed)")
    if new.contiguous_memory_optimization and new.number_checkpoints is None:
        raise ValueError("contiguous_checkpointing needs num_checkpoints (as in DeepSpeed)")
    if new.partition_activations:
        if mpu_ is not None and _mp_world_size(mpu_) > 1:
            raise NotImplementedError(
                "partition_activations across model-parallel ranks needs tensor "
                "parallelism, which zeroshard does not build"
            )
        log.warning(
            "zeroshard: activation_checkpointing.partition_activations has no effect: "
            "without model parallelism no rank holds a copy of another's activations, "
            "so partitioning them would not reduce any rank's memory"
        )
    _settings = new


def is_configured() -> bool:
    return True


# -- applying to blocks -------------------------------------------------------------------
Selector = type | Iterable[type] | Callable[[str, nn.Module], bool]


def _select(model: nn.Module, blocks: Selector) -> list[nn.Module]:
    """The modules ``blocks`` selects, outermost only (a selected module inside a
    selected module is left alone)."""
    if isinstance(blocks, type):
        blocks = (blocks,)
    if callable(blocks) and not isinstance(blocks, type):
        predicate = blocks
    else:
        types = tuple(blocks)
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
    module._zeroshard_activation = (policy, offload)
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
        raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
    return sum(_wrap_forward(m, policy, offload) for m in _select(model, block_types))


def apply_activation_offload(model: nn.Module, block_types: Selector) -> int:
    """Without recomputation, keep every tensor the selected blocks save for backward in
    CPU memory; returns how many blocks were wrapped."""
    return sum(_wrap_forward(m, None, True) for m in _select(model, block_types))
