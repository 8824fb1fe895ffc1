"""How an engine's parts are built from the config: :class:`EngineBuilder` makes the
ZeRO stage's strategy objects and returns them as :class:`EngineParts`, which the
engine holds (``runtime/engine.py``). The ZeRO stage is a :class:`Sharding`; the flat
layout has gradient buckets at stages 0-2 and module units at stage 3; the shard and
optimizer-state stores follow the placement (``offload/``); the tensor-parallel
gradient bookkeeping, the scheduler.

Communication: :meth:`EngineBuilder.build` runs ``prepare.parallelize_model`` (its
broadcasts), and the flat layout takes each parameter's value through
``zero/params/init.take_value`` (a parameter built under ``zero.Init`` is all-gathered
once, on every rank); nothing else here communicates.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from zeroshard.config.schema import ConfigError
from zeroshard.distributed.mesh import Mesh
from zeroshard.fp8 import Fp8Model
from zeroshard.moe.apply import check_composition
from zeroshard.moe.marks import expert_shard
from zeroshard.monitor.progress import progress
from zeroshard.offload.delayed import DelayedUpdate
from zeroshard.offload.placement import Placement
from zeroshard.offload.states import StateStore
from zeroshard.offload.store import MemoryShard, ShardStore
from zeroshard.offload.swaps import EngineSwaps
from zeroshard.offload.twin import TwinStates
from zeroshard.parallel.apply import Parallelized, gradient_summed_over_tp, is_tp_sharded
from zeroshard.runtime.optim import nonfinite_policy, optimizer_factory
from zeroshard.runtime.precision import DtypePolicy, LossScaler
from zeroshard.runtime.prepare import convert_fp8, parallelize_model, plan_fp8_gather
from zeroshard.zero.grads.reducer import GradReducer
from zeroshard.zero.layout.flat import FlatParams
from zeroshard.zero.layout.partition import FlatLayout
from zeroshard.zero.layout.segments import DEFAULT_BUCKET_BYTES, bucket_segments, unit_segments
from zeroshard.zero.optim.memory_store import build_memory_states
from zeroshard.zero.optim.optimizer import ShardedOptimizer, TensorParallelGrads
from zeroshard.zero.params.edits import take_edits
from zeroshard.zero.params.gatherer import ParamGatherer
from zeroshard.zero.params.init import take_value
from zeroshard.zero.params.leaves import find_leaves
from zeroshard.zero.params.manager import ParamManager
from zeroshard.zero.params.whole import WholeParams

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


@dataclass(kw_only=True)
class EngineParts:
    """What :meth:`EngineBuilder.build` makes; the engine holds each part."""

    #: what tensor and sequence parallelism installed (removed at ``destroy()``)
    parallel: Parallelized
    #: the fp8 conversion of the ``fp8`` section (undone at ``destroy()``), or None
    fp8: Fp8Model | None
    #: the NVMe swap directories, files and pools (closed at ``destroy()``)
    swaps: EngineSwaps
    flat: FlatParams
    #: whole parameters (stages 0-2) or gathered per unit (stage 3): one Protocol
    params: ParamManager
    reducer: GradReducer
    loss_scaler: LossScaler
    #: None: an engine without an optimizer (inference)
    optimizer: ShardedOptimizer | None
    #: ``offload_optimizer.delayed_update``: the store stepping one step late, else None
    delayed: DelayedUpdate | None
    #: ``(name, parameter)`` of the parameters frozen now (not laid out): unfreezing one
    #: later needs a new ``initialize()``
    frozen: list[tuple[str, nn.Parameter]]
    #: elements per gradient bucket (stage 3: the cap of a unit of small modules)
    bucket_numel: int


class EngineBuilder:
    """Builds an engine's parts for ``module`` from the config, on ``mesh``: the dtype
    policy, placement and sharding, with the config's composition checked, when made;
    the parts at :meth:`build`."""

    def __init__(
        self,
        module: nn.Module,
        config,
        mesh: Mesh,
        *,
        device: torch.device,
        trains: bool,
    ) -> None:
        self.module, self.config, self.mesh, self.device = module, config, mesh, device
        self.trains = trains
        self.rank = mesh.comm("world").rank
        self.policy = DtypePolicy.from_config(config)
        self.placement = Placement.from_config(config.zero_optimization, device)
        self.sharding = Sharding.for_stage(config.zero_optimization.stage)
        if mesh.size("zero_replicate") > 1 and not self.sharding.optimizer:
            raise ConfigError(
                "zero_optimization.mics_shard_size: hybrid sharding needs ZeRO stage 1, 2 or 3 "
                "(stage 0 shards nothing)"
            )
        # what ZeRO shards over, and the groups its collectives run in (expert
        # parameters: over the expert-data-parallel ranks, with expert parallelism)
        check_composition(mesh.size("ep"), config)

    # -- the parts -------------------------------------------------------------------
    def build(
        self,
        param_groups: list[dict],
        *,
        client_optimizer: torch.optim.Optimizer | None,
        alone: frozenset = frozenset(),
    ) -> EngineParts:
        """Parallelize the model, lay its parameters out, and make the parameter
        manager, the gradient reducer and (when training) the sharded optimizer.
        ``alone``: ids of parameters laid out in segments of their own (the pipeline
        engine's tied layers). When a step raises (a config the optimizer refuses, ...),
        the hooks, conversions and swap files of the parts made so far are removed."""
        undo: list[Callable[[], None]] = []
        try:
            return self._build(param_groups, client_optimizer, alone, undo)
        except BaseException:
            for step in reversed(undo):
                step()
            raise

    def _build(
        self,
        param_groups: list[dict],
        client_optimizer: torch.optim.Optimizer | None,
        alone: frozenset,
        undo: list[Callable[[], None]],
    ) -> EngineParts:
        config, mesh, sharding = self.config, self.mesh, self.sharding
        param_groups, parallel = parallelize_model(self.module, mesh, config, param_groups)
        undo.append(parallel.remove)
        fp8 = convert_fp8(self.module, config, self.device, self.rank)
        if fp8 is not None:
            undo.append(fp8.undo)
        # stage 3: fp8 Linear weights gathered in fp8, each alone in its unit (fp8/gather.py)
        fp8_gather = plan_fp8_gather(self.module, fp8, config, self.rank)
        if fp8_gather is not None and fp8 is not None:
            alone = alone | fp8_gather.weight_ids
            fp8.also_undo(fp8_gather.undo)  # destroy() undoes fp8 (layers from before too)
        swaps = EngineSwaps(config, self.rank)
        undo.append(swaps.close)
        bucket = self._bucket_numel()
        flat, persistent = self._flatten(param_groups, swaps, bucket, alone)
        shard_comm, replicas = mesh.comm("zero_shard"), mesh.comm("replicas")
        experts = mesh.size("ep") > 1
        expert_shard_comm = mesh.comm("expert_shard") if experts else None
        expert_replicas = mesh.comm("expert_replicas") if experts else None
        reduce_comm = shard_comm if flat.partitioned else replicas
        expert_reduce = expert_shard_comm if flat.partitioned else expert_replicas
        if sharding.parameters and flat.partitioned:
            # gradients are reduced in a group of their own: in backward the gathers and
            # the reductions each keep one order on every rank, but how they interleave
            # differs when a parameter gets a gradient on some ranks only (a leaf module)
            reduce_comm = mesh.twin("zero_shard")
            expert_reduce = mesh.twin("expert_shard") if experts else None
        zc = config.zero_optimization
        params: ParamManager
        on_bucket_ready = None
        if sharding.parameters:
            codecs = None
            if fp8_gather is not None:
                layout = flat.layout
                codecs = fp8_gather.attach(flat.params, layout.param_segment, layout.segments, persistent, self.device)  # fmt: skip
            gatherer = ParamGatherer(
                flat,
                shard_comm,
                replicas,
                self.module,
                persistent=persistent,
                prefetch_numel=int(zc.stage3_prefetch_bucket_size),
                max_live_numel=int(zc.stage3_max_live_parameters),
                max_reuse_numel=int(zc.stage3_max_reuse_distance),
                leaves=find_leaves(self.module, zc.leaf_module),
                check_every_pass=zc.enable_sanity_checks,
                expert_comm=expert_shard_comm,
                expert_replicas=expert_replicas,
                codecs=codecs,
            )
            params, on_bucket_ready = gatherer, gatherer.free_if_idle
            undo.append(gatherer.remove)
        else:
            if zc.overlap_param_gather and mesh.size("pp") > 1:
                raise ConfigError(
                    "zero_optimization.overlap_param_gather with pipeline stages is not "
                    "built yet; leave it out with a pipeline section"
                )
            params = WholeParams(
                flat,
                shard_comm,
                replicas,
                self.module,
                overlap=zc.overlap_param_gather,
                expert_comm=expert_shard_comm,
                expert_replicas=expert_replicas,
            )
            undo.append(params.remove)
        registration = {id(p): i for i, p in enumerate(self.module.parameters())}
        # as DeepSpeed: prescaling divides by the world size first, else by the factor
        predivide = config.gradient_predivide_factor
        if config.prescale_gradients:
            predivide = mesh.size("replicas")
        reducer = GradReducer(
            flat,
            reduce_comm,
            replicate=mesh.comm("zero_replicate"),
            dtype=self.policy.grad,
            sharded=sharding.gradients,
            overlap=zc.overlap_comm or not sharding.optimizer,
            registration_index=registration,
            predivide=predivide,
            # stage 3: a unit's parameters are freed once its gradients are in
            on_bucket_ready=on_bucket_ready,
            accum_device=self.placement.optimizer if self.placement.offload_optimizer else None,
            reduce_scatter_via={None: None, True: "native", False: "all_reduce"}[zc.reduce_scatter],
            count_unreached=sharding.parameters and reduce_comm.world_size > 1,
            expert_comm=expert_reduce,
            # Twin-Flow: the gradients of the optimizer's share on the device stay there
            device_segments=self.placement.device_segments(flat.layout) if self.trains else 0,
        )
        undo.append(reducer.remove_hooks)
        loss_scaler = LossScaler.from_config(config.fp16)
        optimizer = None
        if self.trains:
            optimizer = ShardedOptimizer(
                flat,
                self._optimizer_states(flat, swaps, client_optimizer),
                shard_comm,
                grad_comm=reduce_comm,
                zero_grads=reducer.grad_chunks,
                clear_grads=reducer.zero_grad,
                scaler=loss_scaler,
                tp=self._tp_grads(flat),
                clip=config.gradient_clipping,
                nonfinite=nonfinite_policy(config),
                expert_grad_comm=expert_reduce,
            )
        states = optimizer.states if optimizer is not None else None
        laid_out = {id(p) for p, g in zip(flat.params, flat.group_of, strict=True) if g >= 0}
        frozen = [
            (name, p)
            for name, p in self.module.named_parameters()
            if not p.requires_grad and id(p) not in laid_out
        ]
        return EngineParts(
            parallel=parallel,
            fp8=fp8,
            swaps=swaps,
            flat=flat,
            params=params,
            reducer=reducer,
            loss_scaler=loss_scaler,
            optimizer=optimizer,
            delayed=states if isinstance(states, DelayedUpdate) else None,
            frozen=frozen,
            bucket_numel=bucket,
        )

    def _optimizer_states(
        self, flat: FlatParams, swaps: EngineSwaps, client: torch.optim.Optimizer | None
    ) -> StateStore:
        """Masters and optimizer states: in swap files (NVMe offload) or in memory; with
        Twin-Flow and NVMe, the device's share in memory and the rest in swap files."""
        cfg = self.config.optimizer
        twin = self.placement.device_segments(flat.layout)
        if self.placement.optimizer_nvme and twin < len(flat.layout.segments):
            if client is not None:
                raise ConfigError(
                    "zero_optimization.offload_optimizer.device: NVMe offload steps the "
                    "config's Adam/AdamW itself; pass no optimizer to initialize() with it"
                )
            disk = swaps.swapped_adam(
                flat,
                self.placement.optimizer_nvme,
                take_edits=take_edits,
                progress=partial(progress, desc="writing NVMe swap files", enabled=self.rank == 0),
                start=sum(seg.chunk for seg in flat.layout.segments[:twin]),
            )
            if not twin or cfg is None:  # (swapped_adam refused a missing optimizer)
                return disk
            device = build_memory_states(
                flat,
                self.policy.master,
                self.placement,
                factory=optimizer_factory(cfg, self.device),
                device_only=True,
            )
            return TwinStates(device, disk)
        factory = optimizer_factory(cfg, self.device) if cfg is not None else None
        offload = self.config.zero_optimization.offload_optimizer
        if offload.delayed_update and not isinstance(client, (torch.optim.Optimizer, type(None))):
            raise ConfigError(
                "zero_optimization.offload_optimizer.delayed_update steps a twin of a "
                "torch.optim.Optimizer in a thread; "
                f"{type(client).__name__} is not one"
            )
        states = build_memory_states(
            flat,
            self.policy.master,
            self.placement,
            client=client,
            factory=factory,
            copy_masters=offload.delayed_update,
        )
        if offload.delayed_update:
            return DelayedUpdate(states, after=offload.delayed_update_after)
        return states

    def _flatten(
        self, param_groups: list[dict], swaps: EngineSwaps, bucket: int, alone: frozenset
    ) -> tuple[FlatParams, list[int]]:
        """Lay parameters out flat: gradient buckets of ``bucket`` elements (stages 0-2)
        or module units (stage 3)."""
        zc = self.config.zero_optimization
        world = self.mesh.size("zero_shard") if self.sharding.optimizer else 1
        if self.sharding.parameters:
            grouping = unit_segments(
                self.module,
                param_groups,
                int(zc.stage3_param_persistence_threshold),
                bucket,
                int(zc.stage3_model_persistence_threshold),
                alone=alone,
                kind_of=_kind,
            )
        else:
            grouping = bucket_segments(
                self.module, param_groups, bucket, alone=alone, kind_of=_kind
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
        store = self._param_store(layout, swaps) if self.sharding.parameters else None
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

    def _bucket_numel(self) -> int:
        """Elements per gradient bucket: the smaller of the two bucket sizes given (0: each
        gradient on its own, as DeepSpeed); none given: 25 MiB of gradients, DDP's
        default, so that reductions overlap backward (said once, on rank 0)."""
        zc = self.config.zero_optimization
        given = [int(b) for b in (zc.reduce_bucket_size, zc.allgather_bucket_size) if b is not None]
        if given:
            return max(1, min(given))
        esize = torch.empty((), dtype=self.policy.grad).element_size()
        numel = DEFAULT_BUCKET_BYTES // esize
        if self.rank == 0:
            log.info(
                "zeroshard: zero_optimization.reduce_bucket_size not given: buckets of %d "
                "elements (25 MiB of %s gradients, as DDP's), so reductions overlap backward",
                numel,
                str(self.policy.grad).removeprefix("torch."),
            )
        return numel

    def _param_store(self, layout: FlatLayout, swaps: EngineSwaps) -> ShardStore:
        """Stage 3's shard store: an NVMe swap file, or memory. In memory, where the
        optimizer states live too, the shard is kept in the master dtype: it *is* the
        fp32 master (no second copy, no write-back; gathers cast on the device)."""
        place = self.placement
        if place.param_nvme:
            return swaps.param_store(place.param_nvme, layout, self.policy.compute)
        # (without an optimizer there are no masters: the shard is in the working dtype)
        masters_here = self.trains and place.same_place_for_masters()
        dtype = self.policy.master if masters_here else self.policy.compute
        pin = place.pin_memory and place.param_shard.type == "cpu"
        return MemoryShard.empty(layout, dtype, place.param_shard, pin)

    def _tp_grads(self, flat: FlatParams) -> TensorParallelGrads | None:
        """Where the tensor-parallel group's replicated parameters sit in this rank's
        gradient chunks (see :class:`TensorParallelGrads`)."""
        if self.mesh.size("tp") == 1:
            return None
        replicated, partial_sums = [], []
        for piece in flat.layout.pieces(flat.rank):
            p = flat.params[piece.param]
            if flat.group_of[piece.param] < 0 or is_tp_sharded(p):
                continue
            lo = piece.shard_lo - flat.layout.segments[piece.segment].shard_start
            where = (piece.segment, lo, lo + piece.numel)
            replicated.append(where)
            if gradient_summed_over_tp(p):
                partial_sums.append(where)
        return TensorParallelGrads(self.mesh.comm("tp"), replicated, partial_sums)
