"""ZeRO-Inference: generate with weights kept in CPU memory or NVMe files, streamed to the
compute device one layer at a time, with the next layers read ahead while this one runs.

A model is cut into *units* (``stream_units.py``): each layer of its outermost layer
lists (the decoder blocks; an encoder-decoder's two stacks), and every other module
that owns parameters (the embeddings, the final norm, the head). The weights of every unit live in a *source*:

* ``nvme``: one file in a private swap directory under ``nvme_path``
  (``offload/nvme.py``: aligned ``O_DIRECT`` I/O on a thread pool, so the page cache
  does not fill RAM either), each unit's tensors contiguous;
* ``cpu``: CPU memory (pinned on CUDA). On a CPU-only host the compute device *is* CPU
  memory, so nothing moves: parameters stay where they are and no hook is installed.

The module keeps placeholder parameters (right shape, dtype and device, one element of
storage). A forward pre-hook on each unit waits for its read, points the parameters at
a buffer of a pool of ``buffer_count`` (uploading it first when the compute device is a
GPU), and starts reading the units predicted to come next (the unit that followed this
one last time, initially registration order, which wraps from the head to the
embeddings for the next token; units read ahead on a guess the forward proved wrong
give their buffers back) while buffers are free; the forward hook puts the
placeholders back and returns the buffer. Memory is thus ``buffer_count`` times the
largest unit, whatever the model's size: a model larger than RAM generates, each token
reading every weight once (DeepSpeed's ZeRO-Inference: it pays off with large batches,
whose compute hides the reads).

A parameter shared by two units (tied embedding and head) is stored once and read by
each. A quantized layer (``quantize.py``'s ``QuantLinear``) streams the tensors its
kernel reads (int8 weights and scales, int4 packed weights and scales) the same way. A
parameter must be read inside its unit's forward (as ``nn.Module`` layers do).

No communication.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zeroshard import UsageError
from zeroshard.distributed.device import runtime
from zeroshard.inference.config import InferenceError
from zeroshard.inference.stream_store import (  # noqa: F401  (StreamConfig, stream_config: re-exported)
    MemorySource,
    StreamConfig,
    SwapSource,
    stream_config,
)
from zeroshard.inference.stream_units import (
    Slot,
    Unit,
    kernel_tensors,
    placeholder,
    plan_units,
    reads,
    with_values,
)
from zeroshard.offload.nvme import ALIGN, SwapSpace, aligned_empty, round_up


@dataclass
class _Loaded:
    buf: torch.Tensor  # host buffer (from the pool)
    future: Future | None
    users: int = 0
    compute: torch.Tensor | None = None  # the device copy, when computing off the host
    uploaded: object = None  # the device's event recorded after the upload from ``buf``


@dataclass
class StreamStats:
    units_read: int = 0
    bytes_read: int = 0
    prefetched: int = 0  # reads already started when their unit's forward began
    on_demand: int = 0  # reads started only when their unit's forward began
    waited_s: float = 0.0  # time forwards spent waiting for reads


class StreamedWeights:
    """The hooks and buffers that stream a model's weights (see the module docstring).
    Build it with :func:`stream_weights`; :meth:`remove` puts whole weights back."""

    def __init__(self, model, units, source, config: StreamConfig, device, upload: bool):
        self.model, self.units, self.source, self.config = model, units, source, config
        self.device, self.upload = torch.device(device), upload
        self.rt = runtime(self.device)
        self.stats = StreamStats()
        self._bufsize = max((u.nbytes for u in units), default=ALIGN)
        # free host buffers, each with the event its last upload must reach before it is
        # written again (None on the host)
        self._pool: list[tuple[torch.Tensor, object]] = []
        self._allocated = 0
        self._loaded: dict[int, _Loaded] = {}
        self._next = {i: (i + 1) % len(units) for i in range(len(units))}
        self._last: int | None = None
        self._io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="zeroshard-stream")
        self._lock = threading.Lock()
        self._hooks: list[RemovableHandle] = []
        for i, u in enumerate(units):
            self._hooks.append(u.module.register_forward_pre_hook(self._pre_hook(i)))
            self._hooks.append(u.module.register_forward_hook(self._post_hook(i)))
        # first of the model's pre-forward hooks: a forward that raised left its units
        # in use; a new top-level forward takes their buffers back
        self._hooks.append(model.register_forward_pre_hook(self._recover, prepend=True))

    def _recover(self, module, args) -> None:
        for i, ld in list(self._loaded.items()):
            if ld.users:
                ld.users = 1
                self.release(i)

    # -- buffers ------------------------------------------------------------------------
    def _take_buffer(self, evict_for: int | None) -> torch.Tensor | None:
        """A free host buffer; when all are out and ``evict_for`` is given, one holding
        a unit read ahead but not in use (a wrong guess) is taken back."""
        if self._pool:
            buf, uploaded = self._pool.pop()
            self.rt.sync_event(uploaded)  # a non-blocking upload may still read it
            return buf
        if self._allocated < self.config.buffer_count:
            self._allocated += 1
            if not (self.config.pin_memory and self.rt.pin):
                return aligned_empty(self._bufsize)
            raw = self.rt.host_empty(self._bufsize + ALIGN, torch.uint8)
            skip = (-raw.data_ptr()) % ALIGN  # O_DIRECT reads need aligned addresses
            return raw[skip : skip + self._bufsize]
        if evict_for is None:
            return None
        for j, ld in list(self._loaded.items()):
            if ld.users == 0 and j != evict_for:
                if ld.future is not None:
                    ld.future.result()
                del self._loaded[j]
                return ld.buf
        return None

    def _start(self, i: int, demand: bool) -> bool:
        if i in self._loaded:
            return True
        buf = self._take_buffer(i if demand else None)
        if buf is None:
            return False
        unit = self.units[i]
        self._loaded[i] = _Loaded(buf=buf, future=self._io.submit(self._read, unit, buf))
        return True

    def _read(self, unit: Unit, buf: torch.Tensor) -> None:
        for src, at, n in unit.runs:
            self.source.read(src, buf[at : at + n])
        with self._lock:
            self.stats.units_read += 1
            self.stats.bytes_read += unit.nbytes

    # -- hooks --------------------------------------------------------------------------
    def _pre_hook(self, i: int):
        def hook(module, args):
            self.acquire(i)

        return hook

    def _post_hook(self, i: int):
        def hook(module, args, output):
            self.release(i)

        return hook

    def acquire(self, i: int) -> None:
        """Make unit ``i``'s weights resident (its forward is starting)."""
        if self._last is not None and self._last != i:
            self._next[self._last] = i  # learn the order the forward really takes
        self._last = i
        ld = self._loaded.get(i)
        if ld is None:
            self.stats.on_demand += 1
            if not self._start(i, demand=True):
                raise UsageError(
                    f"zero.offload_param.buffer_count: all {self.config.buffer_count} "
                    f"buffers hold units in use when {self.units[i].name} starts (units "
                    "nested deeper than the pool); raise buffer_count"
                )
            ld = self._loaded[i]
        elif ld.users == 0 and ld.future is not None:
            self.stats.prefetched += 1
        if ld.future is not None:
            t0 = time.perf_counter()
            ld.future.result()
            self.stats.waited_s += time.perf_counter() - t0
            ld.future = None
            if self.upload:  # on the current stream: the unit's forward is ordered after
                n, rt = self.units[i].nbytes, self.rt
                ld.compute = torch.empty(n, dtype=torch.uint8, device=self.device)
                rt.copy(ld.compute, ld.buf[:n], non_blocking=True)
                ld.uploaded = rt.record(rt.current_stream(self.device))
        ld.users += 1
        data = ld.compute if ld.compute is not None else ld.buf
        for s in self.units[i].slots:
            s.point(data[s.at : s.at + s.nbytes].view(s.dtype).view(s.shape))
        self._prefetch(i)

    def _prefetch(self, i: int) -> None:
        """Read ahead the units predicted to follow ``i``; units read ahead earlier that
        the prediction no longer names (a guess the forward proved wrong) give their
        buffers back first."""
        chain, j = [], i
        for _ in range(self.config.buffer_count - 1):
            j = self._next[j]
            if j == i or j in chain:
                break
            chain.append(j)
        for k, ld in list(self._loaded.items()):
            if ld.users == 0 and k not in chain:
                if ld.future is not None:
                    ld.future.result()
                del self._loaded[k]
                self._pool.append((ld.buf, ld.uploaded))
        for j in chain:
            if not self._start(j, demand=False):
                break

    def release(self, i: int) -> None:
        """Unit ``i``'s forward is done: placeholders back, its buffer to the pool."""
        ld = self._loaded[i]
        ld.users -= 1
        if ld.users:
            return
        data = ld.compute if ld.compute is not None else ld.buf
        lo, hi = data.data_ptr(), data.data_ptr() + data.numel()
        for s in self.units[i].slots:
            if lo <= s.current().data_ptr() < hi:  # a tied parameter may be another unit's now
                s.point(placeholder(s.shape, s.dtype, self.device))
        del self._loaded[i]
        self._pool.append((ld.buf, ld.uploaded))

    # -- teardown -----------------------------------------------------------------------
    def remove(self) -> None:
        """Remove the hooks and give every parameter its whole weights back in memory on
        the compute device (then close the swap files)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for ld in self._loaded.values():
            if ld.future is not None:
                ld.future.result()
        self._loaded.clear()
        done: set[int] = set()  # offsets: a tied parameter is read back once
        for u in self.units:
            for s in u.slots:
                if s.offset in done:
                    continue
                done.add(s.offset)
                raw = aligned_empty(round_up(s.nbytes))
                self.source.read(s.offset, raw)
                s.point(raw[: s.nbytes].view(s.dtype).view(s.shape).clone().to(self.device))
        self._io.shutdown(wait=True)
        self.source.close()

    def resident_bytes(self) -> int:
        """Bytes of unit buffers allocated now (host side)."""
        return self._allocated * self._bufsize


InitFn = Callable[[str, nn.Module], None]


def stream_weights(
    model: nn.Module,
    config: StreamConfig,
    *,
    device: torch.device | str | None = None,
    init: InitFn | None = None,
    tag: str = "rank0",
    force_upload: bool = False,
) -> StreamedWeights | None:
    """Move ``model``'s parameters to ``config``'s storage and stream them back per unit.

    ``model`` may hold real weights (they are copied out unit by unit and dropped) or be
    built on the ``meta`` device, in which case ``init(unit_name, unit_module)`` fills
    each unit after it is materialized on the CPU, one unit at a time, so the whole
    model never exists in memory. ``device`` is the compute device (default: where the
    parameters are, CPU for meta). Returns None when there is nothing to stream (CPU
    storage feeding CPU compute: the parameters stay in place).
    """
    params = list(model.parameters())
    if not params:
        return None
    on_meta = any(p.is_meta for p in params)
    if on_meta and init is None:
        raise InferenceError(
            "stream_weights: the model is on the meta device; pass init(unit_name, module) "
            "to fill each unit, or build it with real weights"
        )
    if on_meta and any(b.is_meta for b in model.buffers()):
        name = next(n for n, b in model.named_buffers() if b.is_meta)
        raise InferenceError(
            f"stream_weights: buffer {name} is on the meta device; only parameters are "
            "streamed, so buffers must be real: build the model with parameters only on "
            "meta (accelerate's init_empty_weights() does that)"
        )
    if device is None:
        device = "cpu" if on_meta else params[0].device
    device = torch.device(device)
    upload = runtime(device).apart or force_upload
    if config.device == "cpu" and not upload and not on_meta:
        return None  # the weights already sit in the compute device's memory
    units = [Unit(name, m) for name, m in plan_units(model)]
    # every distinct parameter, kept alive here so ids stay unique while we lay out
    olds: dict[int, nn.Parameter] = {}
    for u in units:
        for param in u.module.parameters():
            olds.setdefault(id(param), param)
    missing = [n for n, p in model.named_parameters() if id(p) not in olds]
    if missing:  # plan_units covers every parameter; a guard for future changes
        raise AssertionError(f"parameters outside every unit: {missing}")
    new_of = {
        k: nn.Parameter(placeholder(p.shape, p.dtype, device), requires_grad=False)
        for k, p in olds.items()
    }
    # lay out unit by unit (each unit's tensors contiguous in the source): its parameters
    # not placed by an earlier unit, then its quantized layers' kernel tensors
    where: dict[int, int] = {}  # id(old parameter) -> offset
    values: dict[int, torch.Tensor] = {}  # offset -> the values (live models)
    total = 0
    for u in units:
        for m in u.module.modules():
            for p in m._parameters.values():
                if p is None or any(s.param is new_of[id(p)] for s in u.slots):
                    continue
                if id(p) not in where:
                    where[id(p)] = total
                    values[total] = p
                    total += round_up(p.numel() * p.element_size())
                u.slots.append(Slot(where[id(p)], tuple(p.shape), p.dtype, param=new_of[id(p)]))
            for attr, t in kernel_tensors(m):
                if on_meta:
                    raise InferenceError(f"stream_weights: {u.name} holds quantized layers on meta")
                u.slots.append(Slot(total, tuple(t.shape), t.dtype, owner=m, attr=attr))
                values[total] = t
                total += round_up(t.numel() * t.element_size())
    for m in model.modules():  # every holder, ties included, gets the placeholder
        for attr, p in list(m._parameters.items()):
            if p is not None and id(p) in new_of:
                m._parameters[attr] = new_of[id(p)]
    if config.device == "nvme":
        assert config.nvme_path is not None  # StreamConfig refuses nvme without it
        space = SwapSpace(os.fspath(config.nvme_path), f"infer-{tag}")
        source: SwapSource | MemorySource = SwapSource(space, total)
    else:
        source = MemorySource(total, pin=config.pin_memory and runtime(device).pin)
    written: set[int] = set()
    for u in units:
        mine = {s.offset: values[s.offset] for s in u.slots}
        if on_meta:  # materialize this unit only, let init fill it, write it, drop it
            assert init is not None  # on meta without init was refused above
            mine = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in mine.items()}
            by_param = {id(s.param): mine[s.offset] for s in u.slots}
            with_values(u.module, by_param, lambda mod=u.module, n=u.name, f=init: f(n, mod))
        at = 0
        for s in u.slots:
            v = mine[s.offset]
            s.nbytes, s.at = v.numel() * v.element_size(), at
            at += round_up(s.nbytes)
            if s.offset not in written:
                source.write(s.offset, v)
                written.add(s.offset)
            if s.param is None:  # the module's own tensor: dropped now
                s.point(placeholder(s.shape, s.dtype, device))
        u.nbytes = max(at, ALIGN)
        u.runs = reads(u.slots)
        del mine
    olds.clear()
    values.clear()
    return StreamedWeights(model, units, source, config, device, upload)
