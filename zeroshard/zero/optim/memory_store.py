"""Optimizer state in memory: fp32 master chunks and a torch optimizer stepping them.
No communication.

This is the memory store of the optimizer-state store protocol
(:class:`~zeroshard.offload.states.StateStore`): ``kinds``, ``read(kind, a, b)`` /
``write(kind, a, values)`` at shard positions, ``buffers()``, ``disk_bytes()``, plus
``step(grads, factor)``. Its NVMe counterpart is
:class:`~zeroshard.offload.swapped_adam.SwappedAdam`; the sharded optimizer and
checkpoints use either through the protocol.

Masters: when the parameter store already holds this rank's chunks in fp32 in the same
place (fp32 training without offload; CPU-only offload; stage 3 with parameters and
optimizer both offloaded to the host, where the shard *is* the master) the masters are
views of it: no copy and no write-back. Otherwise (bf16/fp16 parameters, or masters in
host memory apart from device parameters) they are an fp32 copy of this rank's chunks
and the updated values are written back into the parameter store after each step.

Twin-Flow (``offload_optimizer.ratio`` below 1, ZeRO-Offload++): the leading segments'
masters and states are in device memory, the others in host memory, all stepped by the
one torch optimizer (its param groups are the schedulers' and checkpoints' as ever):
segment by segment, the device's first, so the device runs its share of the step while
the host steps the rest.

Gradient scaling (fp16 unscale times the clip factor) is handed to torch's fused
kernels as ``grad_scale``, so it costs no pass of its own over the gradients.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import Any, ClassVar

import torch

from zeroshard import ArgumentError, InternalError
from zeroshard.distributed.device import runtime
from zeroshard.offload.placement import Placement
from zeroshard.offload.states import StepGrads
from zeroshard.zero.layout.flat import FlatParams
from zeroshard.zero.optim.views import fold_scale, group_views, held_pieces
from zeroshard.zero.params.edits import take_edits

_EAGER_STATE = (torch.optim.Adam, torch.optim.AdamW)
# optimizers whose update of an element depends only on that element's state
_ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


class MemoryStates:
    """This rank's masters and optimizer states, in device or host memory."""

    def __init__(
        self,
        flat: FlatParams,
        inner: torch.optim.Optimizer,
        masters: list[torch.Tensor],
        *,
        separate: bool,
        pipelined: bool,
        master_dtype: torch.dtype,
        uploads: bool = False,
        device_segments: int = 0,
    ) -> None:
        self.flat, self.inner, self.masters = flat, inner, masters
        # the segments this store holds: the first len(masters) (Twin-Flow with NVMe:
        # the device's; the swap files hold the others), each group's pieces in them
        self.pieces = held_pieces(flat, len(masters))
        #: Twin-Flow: the leading segments whose masters and states are on the device
        #: (the others in host memory); 0 without a split
        self.device_segments = device_segments
        #: shard positions below this are on the device
        self.device_numel = sum(seg.chunk for seg in flat.layout.segments[:device_segments])
        #: whether the masters are a copy (written back into the parameters each step)
        self.separate = separate
        #: step segment by segment, each write-back overlapping the next step
        self.pipelined = pipelined
        self._master_kind = separate or master_dtype != flat.dtype
        self.rt = runtime(flat.device)
        # masters in host memory written into parameters in device memory (``uploads``):
        # the event after the last non-blocking copies; the next step waits on it
        # before it rewrites the masters
        self._uploads = separate and bool(masters) and uploads
        self._uploaded: Any = None  # the device's event (distributed/device.py)
        self._by_segment: list[list[list[torch.Tensor]]] | None = None
        # (group, shard_lo, shard_hi, master view, parameter) of every optimizer tensor
        self._views: list[tuple[int, int, int, torch.Tensor, int]] = []
        for g, group in enumerate(inner.param_groups):
            for (s, lo, hi, pi), view in zip(self.pieces[g], group["params"], strict=False):
                start = flat.layout.segments[s].shard_start
                self._views.append((g, start + lo, start + hi, view, pi))

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def init_state(self, zero_grads: list[torch.Tensor]) -> None:
        """Create Adam's moment buffers now, so memory is reserved and reported up front
        (a step at lr 0 on ``zero_grads``, the reducer's still-zero gradient chunks)."""
        if type(self.inner) not in _EAGER_STATE:
            return
        saved = [(g["lr"], g.get("weight_decay", 0.0)) for g in self.inner.param_groups]
        for g in self.inner.param_groups:
            g["lr"], g["weight_decay"] = 0.0, 0.0
        self._attach_grads(zero_grads)
        self.inner.step()
        for g, (lr, wd) in zip(self.inner.param_groups, saved, strict=True):
            g["lr"], g["weight_decay"] = lr, wd
            for m in g["params"]:
                m.grad = None
                self.inner.state[m]["step"].zero_()

    # -- the step -----------------------------------------------------------------------
    def _attach_grads(
        self, chunks: list[torch.Tensor], optimizer: torch.optim.Optimizer | None = None
    ) -> list[torch.Tensor]:
        """Point every master view's ``.grad`` (in ``optimizer``'s param groups, default
        this store's) at the reduced gradient (fp32)."""
        if self.device_segments:  # Twin-Flow: each chunk where its master is
            chunks = [
                c if (c.dtype, c.device) == (m.dtype, m.device) else c.to(m.device, m.dtype)
                for c, m in zip(chunks, self.masters, strict=False)
            ]
        elif self.masters and (chunks[0].dtype, chunks[0].device) != (
            self.masters[0].dtype,
            self.masters[0].device,
        ):
            where = self.masters[0].device
            chunks = [c.to(device=where, dtype=self.masters[0].dtype) for c in chunks]
        grads = []
        for gi, group in enumerate((optimizer or self.inner).param_groups):
            for m, g in zip(group["params"], group_views(chunks, self.pieces[gi]), strict=True):
                m.grad = g
                grads.append(g)
        return grads

    def prepare_step(
        self,
        optimizer: torch.optim.Optimizer,
        chunks: list[torch.Tensor],
        factor: float,
        unused: AbstractSet[int] = frozenset(),
    ) -> bool:
        """Give ``optimizer``'s masters their gradients from ``chunks``, none to the
        parameters in ``unused`` (no gradient on any rank: torch then skips them, no moment
        update, no weight decay), scaled by ``factor`` (folded into a fused kernel where it
        can be: then True, and the caller deletes ``optimizer.grad_scale`` after the step)."""
        grads = self._attach_grads(chunks, optimizer)
        if unused:
            for *_, view, pi in self._views:
                if pi in unused:
                    view.grad = None
            grads = [v.grad for *_, v, _ in self._views if v.grad is not None]
        folded = factor != 1.0 and bool(grads) and fold_scale(optimizer, grads[0].device, factor)
        if factor != 1.0 and grads and not folded:
            torch._foreach_mul_(grads, factor)
        return folded

    def write_masters(self) -> None:
        """Write the (separate) masters into the parameter store; on a device, remember
        the event after their non-blocking uploads (the next step waits on it)."""
        for s, master in enumerate(self.masters):
            self.flat.store.write_chunk(s, master)
        self._record_uploads()

    def _record_uploads(self) -> None:
        if self._uploads:  # the device reads the pinned masters after step() returns
            rt = self.rt
            self._uploaded = rt.record(rt.current_stream(self.flat.device))

    @staticmethod
    def clear_grads(optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            for m in group["params"]:
                m.grad = None

    def take_upload_event(self) -> Any:
        """The event after the last non-blocking uploads of the masters (None if none
        is pending); the caller waits on it before rewriting the masters."""
        event, self._uploaded = self._uploaded, None
        return event

    def step(self, grads: StepGrads, factor: float, unused: AbstractSet[int] = frozenset()) -> None:
        """Step on ``grads.chunks`` (the reduced gradient chunks) scaled by ``factor``;
        write back if separate. Parameters in ``unused`` are skipped (:meth:`prepare_step`)."""
        if self._uploaded is not None:  # never in practice: backward synced long ago
            self.rt.sync_event(self._uploaded)
            self._uploaded = None
        folded = self.prepare_step(self.inner, list(grads.chunks), factor, unused)
        try:
            if self.pipelined:
                self._step_and_write_back_by_segment(1.0 / factor if folded else None)
                self._record_uploads()
            else:
                self.inner.step()
                if self.separate:
                    self.write_masters()
        finally:
            if folded:
                del self.inner.grad_scale  # type: ignore[attr-defined]  # torch's fused step reads it by getattr
        self.clear_grads(self.inner)

    def _step_and_write_back_by_segment(self, inv_scale: float | None = None) -> None:
        """Offload to a separate host: step one segment's masters, then start its
        non-blocking copy back into the device parameters, so the copy of segment k runs
        while the host steps segment k+1 (elementwise optimizers only: a segment's
        update does not depend on the others)."""
        groups = self.inner.param_groups
        every = [g["params"] for g in groups]
        if self._by_segment is None:  # per segment, per group: its master views (once)
            spans = self.pieces
            self._by_segment = [
                [
                    [m for m, (seg, *_) in zip(params, sp, strict=False) if seg == s]
                    for params, sp in zip(every, spans, strict=True)
                ]
                for s in range(len(self.masters))
            ]
        # Twin-Flow: the device's segments come first, so their steps and write-backs
        # are queued on the device (asynchronously) before the host steps its own; each
        # memory gets the fused kernel's grad_scale (``inv_scale``, folded by the caller)
        # in a tensor of its own, the host's made from the float: a copy of the device's
        # would make the host wait for every step queued there
        scale = getattr(self.inner, "grad_scale", None)
        scales = {}
        if scale is not None and inv_scale is not None and self.device_segments:
            scales[scale.device] = scale
        try:
            for s, per_group in enumerate(self._by_segment):
                for g, params in zip(groups, per_group, strict=True):
                    g["params"] = params
                if scales:
                    where = self.masters[s].device
                    if where not in scales:
                        scales[where] = torch.tensor(inv_scale, dtype=torch.float32, device=where)
                    self.inner.grad_scale = scales[where]  # type: ignore[attr-defined]  # read by getattr
                self.inner.step()
                self.flat.store.write_chunk(s, self.masters[s])
        finally:
            for g, params in zip(groups, every, strict=True):
                g["params"] = params

    def refresh(self, segments: list[int]) -> None:
        """Parameters of ``segments`` were changed from outside: the masters take the
        changed values (``zero/params/edits.py``: unchanged elements keep their fp32 bits)."""
        if self.separate:
            for s in segments:
                take_edits(self.masters[s], self.flat.store.chunk(s))

    # -- the store protocol ----------------------------------------------------------------
    @property
    def kinds(self) -> list[str]:
        """``master`` (when it differs from the parameters) and the elementwise states."""
        keys: set[str] = set()
        for _, _, _, view, _ in self._views:
            for k, v in self.inner.state.get(view, {}).items():
                if torch.is_tensor(v) and v.numel() == view.numel() and v.dim() > 0:
                    keys.add(k)
        return (["master"] if self._master_kind else []) + sorted(keys)

    def _view_at(self, a: int) -> tuple[int, torch.Tensor]:
        for _, lo, hi, view, _ in self._views:
            if lo <= a < hi:
                return lo, view
        raise KeyError(f"shard position {a} is in no optimizer tensor")

    def _master_at(self, a: int) -> tuple[int, torch.Tensor]:
        for seg in self.flat.layout.segments:
            if seg.shard_start <= a < seg.shard_start + seg.chunk:
                return seg.shard_start, self.masters[seg.index]
        raise KeyError(f"shard position {a} is in no segment")

    def read(self, kind: str, a: int, b: int) -> torch.Tensor:
        if kind == "master":
            lo, master = self._master_at(a)
            return master[a - lo : b - lo]
        lo, view = self._view_at(a)
        return self.inner.state[view][kind][a - lo : b - lo]

    def write(self, kind: str, a: int, values: torch.Tensor) -> None:
        b = a + values.numel()
        if kind == "master":
            lo, master = self._master_at(a)
            master[a - lo : b - lo].copy_(values)
            return
        lo, view = self._view_at(a)
        state = self.inner.state.setdefault(view, {})
        if kind not in state:
            state[kind] = torch.zeros_like(view)
        state[kind][a - lo : b - lo].copy_(values)

    def group_steps(self) -> list[float]:
        """Per group, the most steps any of its tensors took (a parameter left without
        gradients for a while took fewer: checkpoints keep the group's count)."""
        steps = [0.0] * len(self.inner.param_groups)
        for gi, _, _, view, _ in self._views:
            step = self.inner.state.get(view, {}).get("step")
            if step is not None:
                steps[gi] = max(steps[gi], float(step))
        return steps

    def set_group_steps(self, steps: list[float]) -> None:
        for gi, _, _, view, _ in self._views:
            st = self.inner.state.setdefault(view, {})
            old = st.get("step")
            if torch.is_tensor(old):
                old.fill_(steps[gi])
            elif steps[gi] or old is not None:
                st["step"] = torch.tensor(float(steps[gi]))

    def buffers(self) -> list[torch.Tensor]:
        """Master copies (when separate) plus every tensor in the inner optimizer's state."""
        out = list(self.masters) if self.separate else []
        for st in self.inner.state.values():
            out += [v for v in st.values() if torch.is_tensor(v)]
        return out

    def disk_bytes(self) -> int:
        return 0

    def buffers_by_place(self) -> dict[str, list[torch.Tensor]]:
        """:meth:`buffers` by where they live: ``device`` (Twin-Flow's share kept on the
        device) and ``host`` (the offloaded rest, or everything without a split)."""
        place = {"device": [], "host": []}  # type: dict[str, list[torch.Tensor]]
        if self.separate:
            for seg, master in zip(self.flat.layout.segments, self.masters, strict=False):
                place["device" if seg.index < self.device_segments else "host"].append(master)
        for _, lo, _, view, _ in self._views:
            where = "device" if lo < self.device_numel else "host"
            place[where] += [
                v for v in self.inner.state.get(view, {}).values() if torch.is_tensor(v)
            ]
        return place


def build_memory_states(
    flat: FlatParams,
    master_dtype: torch.dtype,
    placement: Placement,
    *,
    client: torch.optim.Optimizer | None = None,
    factory=None,
    copy_masters: bool = False,
    device_only: bool = False,
) -> MemoryStates:
    """Make this rank's master chunks (one per segment) and the torch optimizer that
    steps them, one param group per ``flat`` group holding that group's master views.
    ``master_dtype``: the masters' dtype (the dtype policy's, fp32).

    ``client``: a user's optimizer instance, re-pointed at the masters in place (so an
    lr scheduler already bound to it keeps working). ``factory(param_groups)``: builds
    a new one. ``copy_masters``: masters apart from the parameters even where they could
    be views of them (the delayed update steps them while the parameters are in use).
    ``device_only``: Twin-Flow with NVMe: only the device's segments (the swap files
    hold the others' states: ``offload/twin.py``)."""
    store = flat.store
    twin = placement.device_segments(flat.layout)
    views = (
        not twin
        and not copy_masters
        and flat.chunks is not None
        and (store.dtype == master_dtype and placement.same_place_for_masters())
    )
    if views and flat.chunks is not None:
        masters = [c.detach() for c in flat.chunks]
    else:
        # Twin-Flow: the leading ``twin`` segments' masters on the device (``cut``
        # elements), the rest where the optimizer is placed
        cut = sum(seg.chunk for seg in flat.layout.segments[:twin])
        here = torch.empty(cut, dtype=master_dtype, device=placement.device)
        rest = 0 if device_only else flat.layout.shard_numel - cut
        buf = placement.empty(rest, master_dtype, placement.optimizer)
        masters = [
            here[s.shard_start : s.shard_start + s.chunk]
            if s.index < twin
            else buf[s.shard_start - cut : s.shard_start - cut + s.chunk]
            for s in flat.layout.segments
            if s.index < twin or not device_only
        ]
        for s, master in enumerate(masters):
            master.copy_(store.chunk(s))
    pieces = held_pieces(flat, len(masters))
    groups = [
        {**hyper, "params": group_views(masters, pieces[gi])}
        for gi, hyper in enumerate(flat.hyperparams)
    ]
    if client is None:
        inner = factory(groups)
    else:
        if len(client.param_groups) != len(groups):
            raise ArgumentError("internal: param group count changed")
        for cg, g in zip(client.param_groups, groups, strict=True):
            cg["params"] = g["params"]
        client.state.clear()
        inner = client
    pipelined = (
        not views
        and type(inner) in _ELEMENTWISE
        and placement.optimizer_on_host
        and len(masters) > 1
    )
    return MemoryStates(
        flat,
        inner,
        masters,
        separate=not views,
        pipelined=pipelined,
        master_dtype=master_dtype,
        # host masters into a parameter store in device memory (not the host shard of
        # stage 3's offload_param, which they are written into on the host)
        uploads=placement.optimizer_on_host and not placement.param_on_host,
        device_segments=twin,
    )


class NoStates:
    """The state store of an engine built without an optimizer (inference / evaluation):
    no masters, no optimizer states; checkpoints hold the parameters only."""

    kinds: ClassVar[list[str]] = []
    masters = None
    separate = False

    def read(self, kind: str, a: int, b: int) -> torch.Tensor:
        raise KeyError(f"no optimizer state {kind!r}: this engine has no optimizer")

    def write(self, kind: str, a: int, values: torch.Tensor) -> None:
        raise KeyError(f"no optimizer state {kind!r}: this engine has no optimizer")

    def group_steps(self) -> list[float]:
        return []

    def set_group_steps(self, steps: list[float]) -> None:
        if steps:
            raise InternalError("step counts for an engine without an optimizer")

    def buffers(self) -> list[torch.Tensor]:
        return []

    def disk_bytes(self) -> int:
        return 0


NO_STATES = NoStates()
