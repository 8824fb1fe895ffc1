"""The sharded optimizer: an inner torch optimizer stepping this rank's fp32 master chunks.

Communication at the step, per accumulation boundary:

* one all-reduce of a single fp32 scalar (the squared gradient norm) when gradients are
  sharded and clipping or fp16 overflow detection needs the global norm (8 bytes);
and nothing else: re-assembling whole parameters from the updated chunks is the job of
``zero/parameters.py``.

Master weights: with fp32 training the master chunks *are* the parameter storage (views,
no copy); in bf16/fp16 training, or when the optimizer is offloaded, they are an fp32
copy of this rank's chunks only (on the offload device), and the updated values are
copied back into the parameters after the step.

Gradient scaling (fp16 unscale times the clip factor) is handed to torch's fused kernels
as ``grad_scale``, so it costs no pass of its own over the gradients.
"""

from __future__ import annotations

import math

import torch

from zeroshard.comm import Comm
from zeroshard.offload.placement import Placement
from zeroshard.offload.staging import stage_on_cpu
from zeroshard.offload.swapped_adam import SwappedAdam
from zeroshard.precision import DtypePolicy, LossScaler
from zeroshard.zero.flat import FlatParams
from zeroshard.zero.gradients import GradReducer

_EAGER_STATE = (torch.optim.Adam, torch.optim.AdamW)
# optimizers whose update of an element depends only on that element's state
_ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def _sum_of_squares(c: torch.Tensor) -> torch.Tensor:
    """fp32 sum of squares of one gradient chunk. An fp32 chunk in CPU memory (the
    offloaded shard) goes through BLAS ``dot``, which uses every core: torch's CPU norm
    reduction ran on one (measured, torch 2.11 on a 16-core host: 38 ms per 100M
    elements at any thread count, ``dot`` 7 ms; it was 0.42 s of a 1B model's 0.75 s
    offloaded step)."""
    if c.device.type == "cpu" and c.dtype == torch.float32:
        return torch.dot(c, c)
    return torch.linalg.vector_norm(c, dtype=torch.float32).square()


class ShardedOptimizer:
    """Unscale, check overflow, clip by global norm, step, write back, re-gather.

    ``inner`` is a torch optimizer whose param groups hold this rank's master views
    (built by :func:`build_inner_optimizer`); its ``param_groups`` are exposed so
    schedulers and users can change ``lr``.
    """

    def __init__(
        self,
        flat: FlatParams,
        reducer: GradReducer,
        inner: torch.optim.Optimizer,
        masters: list[torch.Tensor],
        comm: Comm,
        *,
        policy: DtypePolicy,
        scaler: LossScaler,
        clip: float = 0.0,
        check_overflow: bool = False,
    ) -> None:
        self.flat, self.reducer, self.inner, self.masters = flat, reducer, inner, masters
        storage = flat.storage()
        self.separate_masters = not masters or (
            storage is None
            or masters[0].untyped_storage().data_ptr() != storage.untyped_storage().data_ptr()
        )
        self.comm, self.policy, self.scaler = comm, policy, scaler
        self.clip, self.check_overflow = clip, check_overflow
        self.global_grad_norm: float | None = None
        self.overflow = False
        host = masters[0].device if masters else flat.device
        self._pipelined = (
            self.separate_masters
            and bool(masters)
            and type(inner) in _ELEMENTWISE
            and (host != flat.device or stage_on_cpu())
            and len(masters) > 1
        )
        self._by_segment: list[list[list[torch.Tensor]]] | None = None
        # offload to a GPU: the event after the last non-blocking copies of the masters
        # to the device; the next step waits on it before it rewrites the masters
        self._uploads = self.separate_masters and bool(masters) and host != flat.device
        self._uploaded = None
        self._init_state()

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def _init_state(self) -> None:
        """Create Adam's moment buffers now, so memory is reserved and reported up front."""
        if type(self.inner) not in _EAGER_STATE:
            return
        saved = [(g["lr"], g.get("weight_decay", 0.0)) for g in self.inner.param_groups]
        for g in self.inner.param_groups:
            g["lr"], g["weight_decay"] = 0.0, 0.0
        self._attach_grads()  # still all zeros: no update, and no extra buffer
        self.inner.step()
        for g, (lr, wd) in zip(self.inner.param_groups, saved, strict=True):
            g["lr"], g["weight_decay"] = lr, wd
            for m in g["params"]:
                m.grad = None
                self.inner.state[m]["step"].zero_()

    # -- the step -------------------------------------------------------------------
    def _attach_grads(self) -> list[torch.Tensor]:
        """Point every master view's ``.grad`` at the reduced gradient (fp32)."""
        chunks = self.reducer.grad_chunks
        if self.masters and (chunks[0].dtype, chunks[0].device) != (
            self.masters[0].dtype,
            self.masters[0].device,
        ):
            where = self.masters[0].device
            chunks = [c.to(device=where, dtype=self.policy.master) for c in chunks]
        grads = []
        for gi, group in enumerate(self.inner.param_groups):
            for m, g in zip(group["params"], self.flat.group_views(chunks, gi), strict=True):
                m.grad = g
                grads.append(g)
        return grads

    def _global_norm(self) -> float:
        """L2 norm of the whole (averaged) gradient: local chunks, summed over shards."""
        chunks = self.reducer.grad_chunks
        if chunks:
            local = torch.stack([_sum_of_squares(c) for c in chunks]).sum()
            local = local.reshape(1).to(self.flat.device)
        else:
            local = torch.zeros(1, dtype=torch.float32, device=self.flat.device)
        if self.flat.sharded:  # the shards of the ZeRO group partition the gradient
            self.comm.all_reduce(local)
        return math.sqrt(float(local))

    def step(self) -> bool:
        """One optimizer step on the reduced gradients; False if skipped (fp16 overflow)."""
        self.reducer.ensure_defined()
        inv_scale = 1.0 / self.scaler.scale
        self.overflow = False
        if self.clip > 0 or self.check_overflow:
            self.global_grad_norm = self._global_norm() * inv_scale
            self.overflow = self.check_overflow and not math.isfinite(self.global_grad_norm)
        if self.overflow:
            self.scaler.update(overflow=True)
            return False
        factor = inv_scale
        if self.clip > 0:
            factor *= min(1.0, self.clip / (self.global_grad_norm + 1e-6))
        if isinstance(self.inner, SwappedAdam):  # masters live in swap files
            self.inner.swapped_step(self.reducer.grad_shard, factor, self.flat.write_range)
        else:
            if self._uploaded is not None:  # never in practice: backward synced long ago
                self._uploaded.synchronize()
                self._uploaded = None
            grads = self._attach_grads()
            folded = factor != 1.0 and bool(grads) and self._fold_scale(grads[0].device, factor)
            if factor != 1.0 and grads and not folded:
                torch._foreach_mul_(grads, factor)
            try:
                if self._pipelined:
                    self._step_and_write_back_by_segment()
                else:
                    self.inner.step()
                    self._write_back()
            finally:
                if folded:
                    del self.inner.grad_scale
            self._record_uploads()
            for group in self.inner.param_groups:
                for m in group["params"]:
                    m.grad = None
        self.scaler.update(overflow=False)
        return True

    def _record_uploads(self) -> None:
        """With separate host masters on an accelerator, mark the end of their copies to
        the device (they read the pinned masters after ``step`` returns)."""
        if self._uploads:
            dev = self.flat.device
            self._uploaded = getattr(torch, dev.type).current_stream(dev).record_event()

    def _fold_scale(self, device: torch.device, factor: float) -> bool:
        """Let torch's fused kernel scale the gradients (unscale and clip) inside its one
        pass over memory, as AMP's GradScaler does, instead of a separate multiply that
        reads and writes every gradient once more. Fused Adam/AdamW/SGD only."""
        if type(self.inner) not in _ELEMENTWISE:
            return False
        if not all(g.get("fused") for g in self.inner.param_groups):
            return False  # a non-fused group refuses grad_scale
        # the kernel divides by grad_scale (within an ulp of multiplying by factor); a
        # zero factor (an infinite norm) or one whose inverse overflows fp32 is applied
        # as a plain multiply, as before
        if not factor > 0.0 or 1.0 / factor > torch.finfo(torch.float32).max:
            return False
        self.inner.grad_scale = torch.tensor(1.0 / factor, dtype=torch.float32, device=device)
        return True

    def _step_and_write_back_by_segment(self) -> None:
        """Offload to a separate host: step one segment's masters, then start its
        non-blocking copy back into the device parameters, so the copy of segment k runs
        while the host steps segment k+1 (elementwise optimizers only: a segment's
        update does not depend on the others)."""
        groups = self.inner.param_groups
        every = [g["params"] for g in groups]
        if self._by_segment is None:  # per segment, per group: its master views (once)
            spans = [self.flat._spans[gi] for gi in range(len(groups))]
            self._by_segment = [
                [
                    [m for m, (seg, _, _) in zip(params, sp, strict=False) if seg == s]
                    for params, sp in zip(every, spans, strict=True)
                ]
                for s in range(len(self.masters))
            ]
        try:
            for s, per_group in enumerate(self._by_segment):
                for g, params in zip(groups, per_group, strict=True):
                    g["params"] = params
                self.inner.step()
                self.flat.write_chunk(s, self.masters[s])
        finally:
            for g, params in zip(groups, every, strict=True):
                g["params"] = params

    def _write_back(self) -> None:
        """Cast the updated fp32 master chunks into this rank's parameter chunks."""
        if self.separate_masters:
            for s, master in enumerate(self.masters):
                self.flat.write_chunk(s, master)

    def refresh_masters(self, segments: list[int]) -> None:
        """Parameters of ``segments`` were changed from outside: copy them into the masters."""
        if isinstance(self.inner, SwappedAdam):
            for s in segments:
                start = self.flat.layout.segments[s].shard_start
                self.inner.write_state("master", start, self.flat.read_chunk(s).float())
        elif self.separate_masters:
            for s in segments:
                self.masters[s].copy_(self.flat.read_chunk(s))

    # -- accounting -----------------------------------------------------------------
    def buffers(self) -> list[torch.Tensor]:
        """Master copies (when separate) plus every tensor in the inner optimizer's state
        (with NVMe offload: the swap buffer sets)."""
        if isinstance(self.inner, SwappedAdam):
            return self.inner.buffers()
        out = list(self.masters) if self.separate_masters else []
        for st in self.inner.state.values():
            out += [v for v in st.values() if torch.is_tensor(v)]
        return out

    def nvme_bytes(self) -> int:
        return self.inner.nvme_bytes() if isinstance(self.inner, SwappedAdam) else 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are owned by the engine's reducer; cleared after each step."""
        self.reducer.zero_grad()


def build_inner_optimizer(
    flat: FlatParams,
    policy: DtypePolicy,
    placement: Placement,
    *,
    client: torch.optim.Optimizer | None = None,
    factory=None,
    swapped=None,
) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    """Make this rank's master chunks (one per segment) and the torch optimizer that
    steps them, one param group per ``flat`` group holding that group's master views.

    ``client``: a user's optimizer instance, re-pointed at the masters in place (so an
    lr scheduler already bound to it keeps working). ``factory(param_groups)``: builds
    a new one. ``swapped()``: builds a :class:`SwappedAdam` (NVMe), which keeps its
    masters in files, so no master chunks are returned.
    """
    if swapped is not None:
        if client is not None:
            raise ValueError(
                "zero_optimization.offload_optimizer.device: NVMe offload steps the config's "
                "Adam/AdamW itself; pass no optimizer to initialize() with it"
            )
        return swapped(), []
    # parameter shards in swap files (offload_param nvme) have no memory to alias
    offloaded = placement.offload_optimizer and placement.host_is_separate
    if policy.separate_master or offloaded or flat.chunks is None:
        buf = placement.empty(flat.layout.shard_numel, policy.master, placement.optimizer)
        masters = [buf[s.shard_start : s.shard_start + s.chunk] for s in flat.layout.segments]
        for s, master in enumerate(masters):
            master.copy_(flat.read_chunk(s))
    else:
        masters = [c.detach() for c in flat.chunks]
    groups = [
        {**hyper, "params": flat.group_views(masters, gi)}
        for gi, hyper in enumerate(flat.hyperparams)
    ]
    if client is None:
        return factory(groups), masters
    if len(client.param_groups) != len(groups):
        raise ValueError("internal: param group count changed")
    for cg, g in zip(client.param_groups, groups, strict=True):
        cg["params"] = g["params"]
    client.state.clear()
    return client, masters
