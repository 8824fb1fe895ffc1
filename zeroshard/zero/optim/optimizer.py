"""The sharded optimizer: global-norm clipping, overflow checks and the step of this
rank's optimizer-state store.

Communication at the step, per accumulation boundary:

* one all-reduce of a single fp32 scalar (the squared gradient norm) over the ZeRO
  shard group when gradients are sharded and clipping or fp16 overflow detection needs
  the global norm (8 bytes). With expert parallelism the shards of expert segments
  (over the expert-data-parallel ranks, each ``ep`` coordinate holding its own experts)
  and of dense ones together partition the whole gradient, so the same all-reduce
  counts each parameter once (at stage 0, where every replica holds whole gradients,
  each rank sums its share of each segment among the ranks holding it, and the scalar is
  all-reduced over the gradient group);
* one all-reduce (max) of a byte per trainable parameter, plus one, over the gradient
  group (and the TP group): which parameters got a gradient on some rank in the window
  (the others are not stepped), and whether some rank saw an inf/nan gradient or loss
  (then no rank steps). With expert parallelism the expert parameters' bytes are a
  second all-reduce, over the expert-data-parallel group (the ranks holding the same
  experts): each parameter is flagged in one of the two;
* with tensor parallelism: the squared norm all-reduced over the TP group too, and one
  all-reduce over it of the gradients of replicated parameters that are partial sums;
* with pipeline stages: the squared norm all-reduced over the pipeline axis too, and
  one byte (some stage saw inf/nan) all-reduced over it (:class:`PipelineGrads`);
and nothing else: re-assembling whole parameters from the updated chunks is the job of
``zero/params/gatherer.py``.

Where the fp32 masters and the optimizer states live (device or host memory:
``zero/optim/memory_store.py``; NVMe files: ``offload/swapped_adam.py``) is the store's business:
both answer one protocol (:class:`~zeroshard.offload.states.StateStore`: ``step``,
``read``/``write`` of a kind of state, ``buffers``). The fp16 loss scale comes in as a
:class:`Scaler` (``runtime/precision.LossScaler`` satisfies it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from zeroshard import NonFiniteError, UsageError
from zeroshard.distributed.comm import Comm
from zeroshard.offload.states import StateStore
from zeroshard.zero.grads.buckets import chunk_sum_of_squares
from zeroshard.zero.grads.result import ReducedGrads
from zeroshard.zero.layout.flat import FlatParams


class Scaler(Protocol):
    """The loss scale the gradients carry (fp16; 1 otherwise), told of each step."""

    @property
    def scale(self) -> float: ...

    @property
    def dynamic(self) -> bool:
        """Whether overflows change the scale (then every step checks for them)."""

    def update(self, overflow: bool) -> None:
        """One step was attempted (skipped when ``overflow``)."""


class TensorParallelGrads:
    """Where, in this rank's gradient chunks, the tensor-parallel group's replicated
    parameters sit (the same places on every rank of the group: their layouts agree).

    ``replicated``: ``(segment, lo, hi)`` of parameters every TP rank holds whole;
    counted in the global norm on TP rank 0 only. ``partial``: those of them whose
    gradients are partial sums (Megatron-SP norms, biases of replicated regions); summed
    over the TP group before the norm and the step: one all-reduce of their total size.
    """

    def __init__(self, comm: Comm, replicated, partial) -> None:
        self.comm, self.replicated, self.partial = comm, list(replicated), list(partial)

    def local_sum_of_squares(self, chunks: list[torch.Tensor]) -> torch.Tensor:
        total = sum((chunk_sum_of_squares(c) for c in chunks), torch.zeros(()))
        if self.comm.rank != 0:  # replicated parameters: counted by TP rank 0
            for s, lo, hi in self.replicated:
                total = total - chunk_sum_of_squares(chunks[s][lo:hi]).to(total.device)
        return total

    def sum_partial(self, chunks: list[torch.Tensor], device: torch.device) -> None:
        if not self.partial:
            return
        # (Twin-Flow: the chunks of the device's share and of the host's are apart)
        flat = torch.cat([chunks[s][lo:hi].to(device) for s, lo, hi in self.partial])
        self.comm.all_reduce(flat)
        offset = 0
        for s, lo, hi in self.partial:
            chunks[s][lo:hi].copy_(flat[offset : offset + hi - lo])
            offset += hi - lo


class PipelineGrads:
    """The global norm and the non-finite check span every pipeline stage.

    ``comm``: the pipeline axis. ``excluded``: ``(segment, lo, hi)`` of this rank's
    gradient chunks left out of its part of the norm (a tied parameter, whose summed
    gradient every stage holding it has, is counted on the first one only). Adds one
    all-reduce of a byte (any stage non-finite) and, when the norm is needed, one of an
    fp32 scalar over the pipeline axis at each step.
    """

    def __init__(self, comm: Comm, excluded) -> None:
        self.comm, self.excluded = comm, list(excluded)

    def excluded_sum_of_squares(self, chunks: list[torch.Tensor]) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32)
        for s, lo, hi in self.excluded:
            total = total + chunk_sum_of_squares(chunks[s][lo:hi]).to(total.device)
        return total

    def any_stage(self, bad: bool, device: torch.device) -> bool:
        flag = torch.tensor([bad], dtype=torch.uint8, device=device)
        self.comm.all_reduce(flag, op="max")
        return bool(flag.item())


def _stack(squares: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The per-chunk squares as one tensor; where they are on two devices (Twin-Flow: the
    share of the shard on the device, the rest on the host), on ``device``."""
    if len({t.device for t in squares}) > 1:
        squares = [t.to(device) for t in squares]
    return torch.stack(squares)


def unused_and_bad(
    grads: ReducedGrads,
    bad: bool = False,
    extra: Comm | None = None,
    experts: Comm | None = None,
) -> tuple[set[int], bool]:
    """Trainable parameters that got no gradient on any rank in this accumulation
    window, and whether ``bad`` holds on any rank: one all-reduce (max) of a byte per
    trainable parameter, plus one, over every group the gradients were averaged over
    (and over ``extra``, the tensor-parallel group, when given). Torch skips a parameter
    whose ``grad`` is None; a parameter used on some ranks only is stepped, its gradient
    averaged with zeros, as DDP does.

    ``experts``: with expert parallelism, the group expert parameters (segments of kind
    1, which differ along the ``ep`` axis) were reduced over, the ranks holding the same
    experts. Their bytes are a second all-reduce over it (with the hybrid replicas,
    ``grads.groups[1:]``, and ``extra``): a rank of another ``ep`` coordinate holds other
    experts at the same index. None: every parameter in the first."""
    flat = grads.flat
    layout = flat.layout
    trainable = [pi for pi in range(len(flat.params)) if flat.group_of[pi] >= 0]
    expert = [
        pi
        for pi in trainable
        if experts is not None and layout.segments[layout.param_segment[pi]].kind
    ]
    apart = set(expert)
    dense = [pi for pi in trainable if pi not in apart]
    filled = grads.arrived
    flags = torch.tensor([*(pi in filled for pi in dense), bad], dtype=torch.uint8)
    flags = flags.to(flat.device)
    for comm in (*grads.groups, extra):
        if comm is not None:
            comm.all_reduce(flags, op="max")
    *used, any_bad = flags.tolist()
    unused = {pi for pi, u in zip(dense, used, strict=True) if not u}
    if expert:
        mine = torch.tensor([pi in filled for pi in expert], dtype=torch.uint8)
        mine = mine.to(flat.device)
        for comm in (experts, *grads.groups[1:], extra):
            if comm is not None:
                comm.all_reduce(mine, op="max")
        unused |= {pi for pi, u in zip(expert, mine.tolist(), strict=True) if not u}
    return unused, bool(any_bad)


class ShardedOptimizer:
    """Unscale, check overflow, clip by global norm, then step the state store.

    ``states`` is a :class:`~zeroshard.offload.states.StateStore` (memory, NVMe, or the
    delayed update over memory); its ``param_groups`` are
    exposed so schedulers and users can change ``lr``. It steps on the gradients it is
    handed (:meth:`apply_step`); ``grad_comm`` is the group they are reduced over
    (``expert_grad_comm`` the one expert parameters' are, with expert parallelism),
    ``zero_grads`` the still-zero gradient chunks the states are initialized on, and
    ``clear_grads`` what :meth:`zero_grad` calls (the engine's reducer starts a window).
    """

    def __init__(
        self,
        flat: FlatParams,
        states: StateStore,
        comm: Comm,
        *,
        grad_comm: Comm,
        zero_grads: Sequence[torch.Tensor],
        clear_grads: Callable[[], None],
        scaler: Scaler,
        clip: float = 0.0,
        nonfinite: str = "skip",
        tp: TensorParallelGrads | None = None,
        expert_grad_comm: Comm | None = None,
    ) -> None:
        self.flat, self.states = flat, states
        self.comm, self.scaler = comm, scaler
        self.grad_comm, self._clear_grads = grad_comm, clear_grads
        self.expert_grad_comm = expert_grad_comm
        self.tp = tp
        self.pipeline: PipelineGrads | None = None  # set by the pipeline engine
        self.clip = clip
        # fp16 always checks (an overflow lowers the loss scale); else the config's policy
        self.nonfinite = "skip" if scaler.dynamic else nonfinite
        self.global_grad_norm: float | None = None
        self.overflow = False
        states.init_state(list(zero_grads))

    @property
    def inner(self) -> Any:
        """The torch optimizer (or NVMe Adam) holding the param groups: what schedulers
        take."""
        return self.states.inner

    @property
    def optimizer(self):
        """DeepSpeed's name for the wrapped optimizer (``engine.optimizer.optimizer``):
        :attr:`inner`, whose parameters are this rank's fp32 master chunks."""
        return self.inner

    @property
    def param_groups(self) -> list[dict]:
        return self.states.param_groups

    @property
    def state(self) -> Any:
        return self.states.state

    @property
    def fp32_partitioned_groups_flat(self) -> list[torch.Tensor]:
        """DeepSpeed's name for its ZeRO-3 sub-groups' fp32 master partitions: this rank's
        fp32 master chunks, one per segment of the flat layout (zeroshard's sub-groups),
        at every stage. (Masters in NVMe swap files are not in memory: AttributeError.)"""
        masters = getattr(self.states, "masters", None)
        if masters is None:
            raise AttributeError(
                "fp32_partitioned_groups_flat: the fp32 masters are in NVMe swap files "
                "(offload_optimizer.device nvme), not in memory"
            )
        return list(masters)

    def _replicated_over(self) -> Comm | None:
        """Stage 0 (no tensor or pipeline parallelism): the group over which every rank
        holds the same all-reduced gradient, so that each rank sums the squares of its
        1/N share only (N times fewer bytes read; the flags' all-reduce combines the
        finiteness, an all-reduce the norm). None otherwise."""
        comm = self.grad_comm
        if self.flat.partitioned or self.tp is not None or self.pipeline is not None:
            return None
        return comm if comm.world_size > 1 else None

    def _local_sum_of_squares(self, grads: ReducedGrads) -> torch.Tensor:
        """This rank's part of the squared global norm (tensor-parallel replicas of a
        parameter counted once), on the device, fp32."""
        chunks = list(grads.chunks)
        replicated = self._replicated_over()
        split = self._experts_apart
        # offload: the squares the host took as each chunk landed, during backward
        landed = grads.landed_squares() if replicated is None and not split else None
        if replicated is not None and split:
            chunks = self._shares(grads)
        elif replicated is not None:  # this rank's share of the whole gradient
            total, n, r = self.flat.layout.shard_numel, replicated.world_size, replicated.rank
            chunks = grads.pieces(total * r // n, total * (r + 1) // n)
        elif split:  # each segment counted by the first rank holding it
            chunks = [c if self._reduced_over(i).rank == 0 else c[:0] for i, c in enumerate(chunks)]
        if self.tp is not None:
            local = self.tp.local_sum_of_squares(chunks)
        elif landed:
            local = _stack(landed, self.flat.device).sum()
        elif chunks:
            local = _stack([chunk_sum_of_squares(c) for c in chunks], self.flat.device).sum()
        else:
            local = torch.zeros((), dtype=torch.float32)
        if self.pipeline is not None and self.pipeline.excluded:
            local = local - self.pipeline.excluded_sum_of_squares(chunks).to(local.device)
        return local.reshape(1).to(device=self.flat.device, dtype=torch.float32)

    def _reduced_over(self, segment: int) -> Comm:
        """The group segment ``segment``'s gradients were reduced over (by its kind)."""
        if self.expert_grad_comm is not None and self.flat.layout.segments[segment].kind:
            return self.expert_grad_comm
        return self.grad_comm

    @property
    def _experts_apart(self) -> bool:
        """Stage 0 with expert parallelism: every replica holds the whole dense gradient,
        but only its own experts'."""
        return not self.flat.partitioned and self.expert_grad_comm is not None

    def _shares(self, grads: ReducedGrads) -> list[torch.Tensor]:
        """Stage 0 with expert parallelism: this rank's share of each segment's whole
        gradient among the ranks holding the same one (every replica for dense
        segments, the expert-data-parallel ones for experts), so that summing over every
        replica counts each element once."""
        out = []
        for seg in self.flat.layout.segments:
            chunk = grads.chunks[seg.index]
            comm = self._reduced_over(seg.index)
            n, r, size = comm.world_size, comm.rank, chunk.numel()
            out.append(chunk[size * r // n : size * (r + 1) // n])
        return out

    def _global_norm(self, local: torch.Tensor) -> float:
        """L2 norm of the whole (averaged) gradient: local parts summed over shards
        (and over tensor-parallel ranks)."""
        if self.flat.partitioned:  # the shards of the ZeRO group partition the gradient
            self.comm.all_reduce(local)
        elif (replicated := self._replicated_over()) is not None:  # shares of one gradient
            replicated.all_reduce(local)
        elif self._experts_apart:  # each replica counted its part once
            self.grad_comm.all_reduce(local)
        if self.tp is not None:
            self.tp.comm.all_reduce(local)
        if self.pipeline is not None:  # every stage's parameters
            self.pipeline.comm.all_reduce(local)
        return math.sqrt(float(local))

    def step(self, closure=None) -> None:
        """Refused: the engine steps (at accumulation boundaries, after reducing)."""
        raise UsageError(
            "optimizer.step() on a zeroshard optimizer: call engine.step() after "
            "engine.backward(loss); it steps at accumulation boundaries, once gradients "
            "are reduced across ranks"
        )

    def apply_step(self, grads: ReducedGrads, loss_finite: bool = True) -> bool:
        """One optimizer step on the reduced gradients ``grads`` (the reducer's
        ``finalize()``); False if skipped: inf/nan in the gradients or the loss on some
        rank (fp16: an overflow, which also lowers the loss scale), unless the policy is
        "apply" ("raise": an error on every rank)."""
        if self.tp is not None:
            self.tp.sum_partial(list(grads.chunks), self.flat.device)
        needs_norm = self.clip > 0 or self.nonfinite != "apply"
        local = self._local_sum_of_squares(grads) if needs_norm else None
        bad = self.nonfinite != "apply" and not (
            loss_finite and local is not None and bool(torch.isfinite(local))
        )
        if self.pipeline is not None and self.nonfinite != "apply":
            bad = self.pipeline.any_stage(bad, self.flat.device)  # an overflow anywhere
        # one all-reduce for both: which parameters got gradients, and whether any rank
        # saw a non-finite value
        tp = self.tp.comm if self.tp is not None else None
        unused, self.overflow = unused_and_bad(grads, bad, extra=tp, experts=self.expert_grad_comm)
        self.global_grad_norm = None
        if self.overflow:
            self.scaler.update(overflow=True)
            if self.nonfinite == "raise":
                raise NonFiniteError(
                    "non-finite gradients or loss (inf/nan) on some rank; no step was "
                    'applied (nonfinite_gradients: "raise"; "skip" skips such steps)'
                )
            return False
        inv_scale = 1.0 / self.scaler.scale
        factor = inv_scale
        if self.clip > 0:
            assert local is not None  # computed above when clipping
            norm = self.global_grad_norm = self._global_norm(local) * inv_scale
            factor *= min(1.0, self.clip / (norm + 1e-6))
        self.states.step(grads, factor, unused)
        self.scaler.update(overflow=False)
        return True

    def refresh_masters(self, segments: list[int]) -> None:
        """Parameters of ``segments`` were changed from outside: copy them into the masters."""
        self.states.refresh(segments)

    # -- accounting -----------------------------------------------------------------
    def buffers(self) -> list[torch.Tensor]:
        """Masters (when separate) and optimizer states held in memory."""
        return self.states.buffers()

    def nvme_bytes(self) -> int:
        return self.states.disk_bytes()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are owned by the engine's reducer; cleared after each step."""
        self._clear_grads()
