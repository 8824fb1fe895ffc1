"""How the engine is assembled from the config (a mixin of
:class:`zeroshard.runtime.engine.Engine`): the ZeRO stage as a :class:`Sharding`, the flat layout (gradient buckets at stages 0-2,
module units at stage 3), the shard and optimizer-state stores, the tensor-parallel
gradient bookkeeping, the scheduler and the data loader.

Communication: :meth:`EngineBuild._parallelize` broadcasts every parameter and buffer
from the first rank of the ``replicas`` group (of the ``stage`` group when tensor
parallelism slices the model next; expert parameters of MoE layers from the first rank
of their ``expert_replicas`` / ``expert_stage`` group: they differ along ``ep``) and
lets expert, tensor and sequence parallelism split the model;
:meth:`EngineBuild._check_agreement` issues the one digest all-gather of
``agreement.py``. Nothing else here communicates.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zeroshard import ArgumentError, NotBuiltError
from zeroshard.config.schema import ConfigError
from zeroshard.fp8 import Fp8Error, Fp8Model, check_fp8_device, convert_to_fp8, preconverted
from zeroshard.moe.apply import bind_layers, convert_hf
from zeroshard.moe.marks import EXPERT_LIST_ATTR, expert_shard, is_expert
from zeroshard.monitor.progress import progress
from zeroshard.offload.states import StateStore
from zeroshard.offload.store import MemoryShard, ShardStore
from zeroshard.parallel.apply import (
    Parallelized,
    gradient_summed_over_tp,
    is_tp_sharded,
    parallelize,
)
from zeroshard.runtime.agreement import check_ranks_agree
from zeroshard.runtime.optim import optimizer_factory
from zeroshard.runtime.schedulers import build_scheduler
from zeroshard.zero.layout.flat import FlatParams
from zeroshard.zero.layout.partition import FlatLayout
from zeroshard.zero.layout.segments import DEFAULT_BUCKET_BYTES, bucket_segments, unit_segments
from zeroshard.zero.optim.memory_store import build_memory_states
from zeroshard.zero.optim.optimizer import TensorParallelGrads
from zeroshard.zero.params.edits import take_edits
from zeroshard.zero.params.init import is_sealed, take_value

if TYPE_CHECKING:
    from zeroshard.distributed.comm import Comm
    from zeroshard.distributed.mesh import Mesh
    from zeroshard.offload.placement import Placement
    from zeroshard.offload.swaps import EngineSwaps
    from zeroshard.runtime.precision import DtypePolicy
    from zeroshard.zero.optim.optimizer import ShardedOptimizer

log = logging.getLogger("zeroshard")

_ALIGN = 16  # chunk sizes are multiples of 16 elements (vector-friendly offsets)
_NVME_ALIGN = 2048  # 4 KiB disk blocks even for 16-bit parameters


@dataclass(frozen=True)
class Sharding:
    """Which model states are split across data-parallel ranks (the ZeRO stage)."""

    optimizer: bool
    gradients: bool
    parameters: bool

    @classmethod
    def for_stage(cls, stage: int) -> Sharding:
        return cls(optimizer=stage >= 1, gradients=stage >= 2, parameters=stage >= 3)


def _kind(p: torch.Tensor) -> int:
    """A parameter's segment kind: 1 for an expert of a MoE layer (sharded and reduced
    over the expert-data-parallel group: with one expert-parallel rank, the usual one),
    else 0."""
    return 1 if expert_shard(p) is not None else 0


def _expert_buffers(module: nn.Module) -> set[int]:
    """Ids of the buffers of DeepSpeed ``Experts`` modules split over several
    expert-parallel ranks (they differ along ``ep`` as their parameters do)."""
    out: set[int] = set()
    for m in module.modules():
        if getattr(m, EXPERT_LIST_ATTR, None) and any(is_expert(p) for p in m.parameters()):
            out.update(id(b) for b in m.buffers())
    return out


def nonfinite_policy(config) -> str:
    """What a step with inf/nan gradients or loss does: "skip", "raise" or "apply"
    (``nonfinite_gradients``; in bf16, DeepSpeed's ``check_grad_overflow`` when given)."""
    check = config.bf16.check_grad_overflow
    if config.bf16.enabled and check is not None:
        if not check:
            return "apply"
        return "skip" if config.nonfinite_gradients == "apply" else config.nonfinite_gradients
    return config.nonfinite_gradients


def cast_floating(obj, dtype: torch.dtype):
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_floating(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: cast_floating(v, dtype) for k, v in obj.items()}
    return obj


def move_module(module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """``module.to(device)`` and floating tensors to ``dtype``, leaving parameters built
    under ``zero.Init`` (they hold no data here) for the flat layout to materialize."""
    with torch.no_grad():
        for m in module.modules():
            for p in m._parameters.values():
                if p is None or is_sealed(p):
                    continue
                target = dtype if p.is_floating_point() else p.dtype
                if p.device != device or p.dtype != target:
                    p.data = p.data.to(device=device, dtype=target)
            for name, b in m._buffers.items():
                if b is not None:
                    target = dtype if b.is_floating_point() else b.dtype
                    m._buffers[name] = b.to(device=device, dtype=target)


class EngineBuild:
    """The engine's construction steps; ``Engine.__init__`` calls them in order."""

    # set by Engine.__init__ before the steps that read them
    module: nn.Module
    _config: Any
    mesh: Mesh
    comm: Comm
    device: torch.device
    policy: DtypePolicy
    placement: Placement
    sharding: Sharding
    flat: FlatParams
    optimizer: ShardedOptimizer | None
    trains: bool
    _swaps: EngineSwaps

    def _check_agreement(self, module: nn.Module, config) -> None:
        """Every rank describes the same model and config (``agreement.py``)."""
        check_ranks_agree(self.comm, module, config)

    def _optimizer_states(self, client: torch.optim.Optimizer | None) -> StateStore:
        """Masters and optimizer states: in swap files (NVMe offload) or in memory."""
        if self.placement.optimizer_nvme:
            if client is not None:
                raise ConfigError(
                    "zero_optimization.offload_optimizer.device: NVMe offload steps the "
                    "config's Adam/AdamW itself; pass no optimizer to initialize() with it"
                )
            return self._swaps.swapped_adam(
                self.flat,
                self.placement.optimizer_nvme,
                take_edits=take_edits,
                progress=partial(
                    progress, desc="writing NVMe swap files", enabled=self.comm.rank == 0
                ),
            )
        cfg = self._config.optimizer
        factory = optimizer_factory(cfg, self.device) if cfg is not None else None
        offload = self._config.zero_optimization.offload_optimizer
        if offload.delayed_update and not isinstance(client, (torch.optim.Optimizer, type(None))):
            raise ConfigError(
                "zero_optimization.offload_optimizer.delayed_update steps a twin of a "
                "torch.optim.Optimizer in a thread; "
                f"{type(client).__name__} is not one"
            )
        states = build_memory_states(
            self.flat,
            self.policy.master,
            self.placement,
            client=client,
            factory=factory,
            copy_masters=offload.delayed_update,
        )
        if offload.delayed_update:
            from zeroshard.offload.delayed import DelayedUpdate

            return DelayedUpdate(states, after=offload.delayed_update_after)
        return states

    def _flatten(self, param_groups: list[dict]) -> tuple[FlatParams, list[int]]:
        """Lay parameters out flat: gradient buckets (stages 0-2) or module units (stage 3)."""
        zc = self._config.zero_optimization
        world = self.mesh.size("zero_shard") if self.sharding.optimizer else 1
        bucket = self._bucket_numel()
        if self.sharding.parameters:
            grouping = unit_segments(
                self.module,
                param_groups,
                int(zc.stage3_param_persistence_threshold),
                bucket,
                int(zc.stage3_model_persistence_threshold),
                alone=self._alone(),
                kind_of=_kind,
            )
        else:
            grouping = bucket_segments(
                self.module, param_groups, bucket, alone=self._alone(), kind_of=_kind
            )
        # with the shard in swap files, chunks start and end on whole disk blocks
        align = _NVME_ALIGN if self.placement.param_nvme else _ALIGN if world > 1 else 1
        # expert segments (kind 1) are split over the expert-data-parallel ranks: the
        # ep adjacent ranks of the ZeRO group share each chunk owner (mesh.py's order)
        ep = self.mesh.size("ep")
        layout = FlatLayout(
            [p.numel() for p in grouping.params],
            world,
            groups=grouping.segments,
            align=align,
            kinds=grouping.kinds,
            strides={1: ep} if world > 1 else None,
        )
        store = self._param_store(layout) if self.sharding.parameters else None
        flat = FlatParams(
            grouping.params,
            grouping.group_of,
            [{k: v for k, v in spec.items() if k != "params"} for spec in param_groups],
            layout,
            self.mesh.coord("zero_shard"),
            device=self.device,
            dtype=self.policy.compute,
            store=store,
            value_of=take_value,
        )
        return flat, grouping.persistent

    def _alone(self) -> frozenset:
        """Ids of parameters laid out in segments of their own (the pipeline engine's
        tied layers); none here."""
        return frozenset()

    def _bucket_numel(self) -> int:
        """Elements per gradient bucket: the smaller of the two bucket sizes given (0: each
        gradient on its own, as DeepSpeed); none given: 25 MiB of gradients, DDP's
        default, so that reductions overlap backward (said once, on rank 0)."""
        zc = self._config.zero_optimization
        given = [int(b) for b in (zc.reduce_bucket_size, zc.allgather_bucket_size) if b is not None]
        if given:
            return max(1, min(given))
        esize = torch.empty((), dtype=self.policy.grad).element_size()
        numel = DEFAULT_BUCKET_BYTES // esize
        if self.comm.rank == 0:
            log.info(
                "zeroshard: zero_optimization.reduce_bucket_size not given: buckets of %d "
                "elements (25 MiB of %s gradients, as DDP's), so reductions overlap backward",
                numel,
                str(self.policy.grad).removeprefix("torch."),
            )
        return numel

    def _param_store(self, layout: FlatLayout) -> ShardStore:
        """Stage 3's shard store: an NVMe swap file, or memory. In memory, where the
        optimizer states live too, the shard is kept in the master dtype: it *is* the
        fp32 master (no second copy, no write-back; gathers cast on the device)."""
        place = self.placement
        if place.param_nvme:
            return self._swaps.param_store(place.param_nvme, layout, self.policy.compute)
        # (without an optimizer there are no masters: the shard is in the working dtype)
        masters_here = self.trains and place.same_place_for_masters()
        dtype = self.policy.master if masters_here else self.policy.compute
        pin = place.pin_memory and place.param_shard.type == "cpu"
        return MemoryShard.empty(layout, dtype, place.param_shard, pin)

    def _tp_grads(self) -> TensorParallelGrads | None:
        """Where the tensor-parallel group's replicated parameters sit in this rank's
        gradient chunks (see :class:`TensorParallelGrads`)."""
        if self.mesh.size("tp") == 1:
            return None
        flat, replicated, partial = self.flat, [], []
        for piece in flat.layout.pieces(flat.rank):
            p = flat.params[piece.param]
            if flat.group_of[piece.param] < 0 or is_tp_sharded(p):
                continue
            lo = piece.shard_lo - flat.layout.segments[piece.segment].shard_start
            where = (piece.segment, lo, lo + piece.numel)
            replicated.append(where)
            if gradient_summed_over_tp(p):
                partial.append(where)
        return TensorParallelGrads(self.mesh.comm("tp"), replicated, partial)

    def _parallelize(self, param_groups: list[dict]) -> list[dict]:
        """Every rank starts from the same model: broadcast from the first rank of each
        replica group (of the whole world, first, when tensor parallelism slices the
        model next; DeepSpeed MoE layers' experts, bound to the ``ep`` group first, from
        the first rank holding the same experts); then expert, tensor and sequence
        parallelism; returns ``param_groups`` holding the parameters that replaced
        sliced ones."""
        split = self._config.tensor_parallel.size > 1  # AutoTP (an mpu's model is split)
        experts_split = self._config.expert_parallel.enabled
        if (split or experts_split) and any(is_sealed(p) for p in self.module.parameters()):
            what = "tensor_parallel.autotp_size" if split else "expert_parallel.enabled"
            raise NotBuiltError(
                f"{what}: a model built under zero.Init with this parallelism is not built "
                "yet; build the model without zero.Init"
            )
        if any(is_sealed(p) and is_expert(p) for p in self.module.parameters()):
            raise NotBuiltError(
                "MoE(ep_size > 1) built under zero.Init is not built yet (zero.Init shards "
                "over the dense data-parallel group; experts differ along ep): build the "
                "model without zero.Init"
            )
        bind_layers(self.module, self.mesh)
        source = self.mesh.comm("stage" if split else "replicas")
        expert_source = self.mesh.comm("expert_stage" if split else "expert_replicas")
        for p in self.module.parameters():
            if not is_sealed(p):  # zero.Init slices are rank 0's values already
                (expert_source if is_expert(p) else source).broadcast(p.data, src=0)
        expert_buffers = _expert_buffers(self.module)
        for b in self.module.buffers():
            (expert_source if id(b) in expert_buffers else source).broadcast(b, src=0)
        names = {id(p): n for n, p in self.module.named_parameters()}
        converted = convert_hf(self.module, self.mesh, self._config)
        if not split and self.mesh.size("sp") == 1:
            self._parallel = Parallelized()
        else:
            self._parallel = parallelize(self.module, self.mesh, self._config)
        if not (converted or split or self.mesh.size("sp") > 1):
            return param_groups
        now = dict(self.module.named_parameters())
        return [{**g, "params": [now[names[id(p)]] for p in g["params"]]} for g in param_groups]

    def _check_fp8_model(self, module: nn.Module) -> None:
        """A model that arrives holding torchao's ``Float8Linear`` layers (accelerate's
        ``mixed_precision="fp8"`` converts before initialize(), which unwraps weights
        wrapped for FSDP2's fp8 all-gather) trains them, in bf16 compute; tensor
        parallelism would replace them with plain shards (refused)."""
        before = preconverted(module)
        if not before:
            return
        origin = f"the model holds torchao Float8Linear layers ({', '.join(before[:3])}{', ...' if len(before) > 3 else ''}), converted to fp8 before initialize() (accelerate's mixed_precision='fp8' does this)"  # fmt: skip
        if not self._config.bf16.enabled:
            raise Fp8Error(f"bf16.enabled: {origin}; fp8 layers compute in bf16: enable bf16")
        check_fp8_device(self.device)
        if self._config.tensor_parallel.size > 1:
            raise Fp8Error(
                f"tensor_parallel.autotp_size: {origin}; tensor parallelism would replace them "
                "with bf16 shards. Give initialize() a model of plain nn.Linear layers and "
                "the config's fp8 section instead (its tensor-parallel layers run fp8)"
            )

    def _convert_fp8(self) -> Fp8Model | None:
        """The ``fp8`` section: fp8 matmuls in the Linear layers (after tensor parallelism,
        before the flat layout); said once, from rank 0."""
        cfg = self._config.fp8
        if not cfg.enabled:
            before = preconverted(self.module)
            if before and self.comm.rank == 0:
                log.warning(
                    "zeroshard: fp8: %d torchao Float8Linear layer(s) converted before "
                    "initialize() run fp8 matmuls (the config has no fp8 section)",
                    len(before),
                )
            return None
        check_fp8_device(self.device)
        fp8 = convert_to_fp8(self.module, cfg)
        if self.comm.rank == 0:
            (log.warning if fp8.kept else log.info)(fp8.summary())
        return fp8

    def _make_scheduler(self, client):
        sc = self._config.scheduler
        if self.optimizer is None:
            if sc is not None or client is not None:
                from zeroshard.config import ConfigError

                raise ConfigError(
                    "scheduler",
                    "a learning-rate scheduler was given (the config's 'scheduler' section "
                    "or lr_scheduler=) but no optimizer; give an optimizer too, or leave "
                    "the scheduler out for inference",
                )
            return None
        if sc is not None:
            if client is not None:
                raise ArgumentError(
                    "initialize: both the config's 'scheduler' section and an lr_scheduler "
                    "argument were given; use one"
                )
            return build_scheduler(sc.type, sc.params, self.optimizer.inner)
        if callable(client) and not hasattr(client, "step"):
            return client(self.optimizer.inner)
        return client

    def _make_loader(self, data, collate_fn):
        if data is None:
            return None
        from torch.utils.data import DataLoader, DistributedSampler

        # ranks that share a tensor, sequence or pipeline group get the same samples
        sampler: DistributedSampler[Any] = DistributedSampler(
            data, num_replicas=self.mesh.size("dp"), rank=self.mesh.coord("dp")
        )
        return DataLoader(
            data,
            batch_size=self._config.train_micro_batch_size_per_gpu,
            sampler=sampler,
            collate_fn=collate_fn,
            drop_last=self._config.dataloader_drop_last,  # as DeepSpeed: the sampler still pads
        )
