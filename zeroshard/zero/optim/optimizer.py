"""The sharded optimizer: global-norm clipping, overflow checks and the step of this
rank's optimizer-state store.

Communication at the step, per accumulation boundary:

* one all-reduce of a single fp32 scalar (the squared gradient norm) over the ZeRO
  shard group when gradients are sharded and clipping or fp16 overflow detection needs
  the global norm (8 bytes). With expert parallelism the shards of expert segments
  (over the expert-data-parallel ranks, each ``ep`` coordinate holding its own experts)
  and of dense ones together partition the whole gradient, so the same all-reduce
  counts each parameter once;
* one all-reduce (max) of a byte per trainable parameter, plus one, over the gradient
  group (and the TP group): which parameters got a gradient on some rank in the window
  (the others are not stepped), and whether some rank saw an inf/nan gradient or loss
  (then no rank steps);
* with tensor parallelism: the squared norm all-reduced over the TP group too, and one
  all-reduce over it of the gradients of replicated parameters that are partial sums;
* with pipeline stages: the squared norm all-reduced over the pipeline axis too, and
  one byte (some stage saw inf/nan) all-reduced over it (:class:`PipelineGrads`);
and nothing else: re-assembling whole parameters from the updated chunks is the job of
``zero/params/gatherer.py``.

Where the fp32 masters and the optimizer states live (device or host memory:
``zero/optim/memory_store.py``; NVMe files: ``offload/swapped_adam.py``) is the store's business:
both answer one protocol (``step``, ``read``/``write`` of a kind of state, ``buffers``).
"""

from __future__ import annotations

import math

import torch

from zeroshard import NonFiniteError, UsageError
from zeroshard.distributed.comm import Comm
from zeroshard.runtime.precision import DtypePolicy, LossScaler
from zeroshard.zero.grads.reducer import GradReducer
from zeroshard.zero.layout.flat import FlatParams


def _sum_of_squares(c: torch.Tensor) -> torch.Tensor:
    """fp32 sum of squares of one gradient chunk. An fp32 chunk in CPU memory (the
    offloaded shard) goes through BLAS ``dot``, which uses every core: torch's CPU norm
    reduction ran on one (measured, torch 2.11 on a 16-core host: 38 ms per 100M
    elements at any thread count, ``dot`` 7 ms; it was 0.42 s of a 1B model's 0.75 s
    offloaded step)."""
    if c.device.type == "cpu" and c.dtype == torch.float32:
        return torch.dot(c, c)
    return torch.linalg.vector_norm(c, dtype=torch.float32).square()


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
        total = sum((_sum_of_squares(c) for c in chunks), torch.zeros(()))
        if self.comm.rank != 0:  # replicated parameters: counted by TP rank 0
            for s, lo, hi in self.replicated:
                total = total - _sum_of_squares(chunks[s][lo:hi]).to(total.device)
        return total

    def sum_partial(self, chunks: list[torch.Tensor], device: torch.device) -> None:
        if not self.partial:
            return
        flat = torch.cat([chunks[s][lo:hi] for s, lo, hi in self.partial]).to(device)
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
            total = total + _sum_of_squares(chunks[s][lo:hi]).to(total.device)
        return total

    def any_stage(self, bad: bool, device: torch.device) -> bool:
        flag = torch.tensor([bad], dtype=torch.uint8, device=device)
        self.comm.all_reduce(flag, op="max")
        return bool(flag.item())


class ShardedOptimizer:
    """Unscale, check overflow, clip by global norm, then step the state store.

    ``states`` is a :class:`~zeroshard.zero.optim.memory_store.MemoryStates` or a
    :class:`~zeroshard.offload.swapped_adam.SwappedAdam`; its ``param_groups`` are
    exposed so schedulers and users can change ``lr``.
    """

    def __init__(
        self,
        flat: FlatParams,
        reducer: GradReducer,
        states,
        comm: Comm,
        *,
        policy: DtypePolicy,
        scaler: LossScaler,
        clip: float = 0.0,
        nonfinite: str = "skip",
        tp: TensorParallelGrads | None = None,
    ) -> None:
        self.flat, self.reducer, self.states = flat, reducer, states
        self.comm, self.policy, self.scaler = comm, policy, scaler
        self.tp = tp
        self.pipeline: PipelineGrads | None = None  # set by the pipeline engine
        self.clip = clip
        # fp16 always checks (an overflow lowers the loss scale); else the config's policy
        self.nonfinite = "skip" if scaler.dynamic else nonfinite
        self.global_grad_norm: float | None = None
        self.overflow = False
        states.init_state(reducer.grad_chunks)

    @property
    def inner(self):
        """The torch optimizer (or NVMe Adam) holding the param groups: what schedulers
        take."""
        return self.states.inner

    @property
    def param_groups(self) -> list[dict]:
        return self.states.param_groups

    @property
    def state(self):
        return self.states.state

    def _replicated_over(self) -> Comm | None:
        """Stage 0 (no tensor or pipeline parallelism): the group over which every rank
        holds the same all-reduced gradient, so that each rank sums the squares of its
        1/N share only (N times fewer bytes read; the flags' all-reduce combines the
        finiteness, an all-reduce the norm). None otherwise."""
        comm = self.reducer.comm
        if self.flat.partitioned or self.tp is not None or self.pipeline is not None:
            return None
        return comm if comm.world_size > 1 else None

    def _local_sum_of_squares(self) -> torch.Tensor:
        """This rank's part of the squared global norm (tensor-parallel replicas of a
        parameter counted once), on the device, fp32."""
        chunks = self.reducer.grad_chunks
        replicated = self._replicated_over()
        if replicated is not None and self._experts_unsharded:
            chunks = self._shares()
        elif replicated is not None:  # this rank's share of the whole gradient
            total, n, r = self.flat.layout.shard_numel, replicated.world_size, replicated.rank
            chunks = self.reducer.grad_pieces(total * r // n, total * (r + 1) // n)
        elif self._experts_unsharded:  # each segment counted by the first rank holding it
            chunks = [
                c if self.reducer.comm_of(i).rank == 0 else c[:0] for i, c in enumerate(chunks)
            ]
        if self.tp is not None:
            local = self.tp.local_sum_of_squares(chunks)
        elif chunks:
            local = torch.stack([_sum_of_squares(c) for c in chunks]).sum()
        else:
            local = torch.zeros((), dtype=torch.float32)
        if self.pipeline is not None and self.pipeline.excluded:
            local = local - self.pipeline.excluded_sum_of_squares(chunks).to(local.device)
        return local.reshape(1).to(device=self.flat.device, dtype=torch.float32)

    @property
    def _experts_unsharded(self) -> bool:
        """Stage 0 with expert parallelism: every replica holds the whole dense gradient,
        but only its own experts'."""
        return not self.flat.partitioned and self.reducer.expert_comm is not self.reducer.comm

    def _shares(self) -> list[torch.Tensor]:
        """Stage 0 with expert parallelism: this rank's share of each segment's whole
        gradient among the ranks holding the same one (every replica for dense
        segments, the expert-data-parallel ones for experts), so that summing over every
        replica counts each element once."""
        out = []
        for seg in self.flat.layout.segments:
            chunk = self.reducer.grad_chunks[seg.index]
            comm = self.reducer.comm_of(seg.index)
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
        elif self._experts_unsharded:  # each replica counted its part once
            self.reducer.comm.all_reduce(local)
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

    def apply_step(self, loss_finite: bool = True) -> bool:
        """One optimizer step on the reduced gradients; False if skipped: inf/nan in the
        gradients or the loss on some rank (fp16: an overflow, which also lowers the
        loss scale), unless the policy is "apply" ("raise": an error on every rank)."""
        self.reducer.ensure_defined()
        if self.tp is not None:
            self.tp.sum_partial(self.reducer.grad_chunks, self.flat.device)
        local = self._local_sum_of_squares() if self.clip > 0 or self.nonfinite != "apply" else None
        bad = self.nonfinite != "apply" and not (
            loss_finite and local is not None and bool(torch.isfinite(local))
        )
        if self.pipeline is not None and self.nonfinite != "apply":
            bad = self.pipeline.any_stage(bad, self.flat.device)  # an overflow anywhere
        # one all-reduce for both: which parameters got gradients, and whether any rank
        # saw a non-finite value
        unused, self.overflow = self.reducer.unused_everywhere(bad, extra=self.tp)
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
        self.states.step(self.reducer, factor, unused)
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
        self.reducer.zero_grad()
