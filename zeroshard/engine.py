"""The training engine: forward, scaled backward, and the step at accumulation boundaries.

The engine orchestrates strategy objects chosen once from the config and holds no
stage-specific branches: what is sharded (:class:`Sharding`) decides the flat layout's
world size, the gradient reducer's mode and, at stage 3, the parameter gatherer.

It works on a :class:`~zeroshard.parallel.mesh.Mesh`: ZeRO shards over the mesh's
``zero_shard`` group and replicates shards across ``zero_replicate`` (hybrid sharding,
MiCS / HSDP); the data loader splits batches over ``dp``; ranks that share a tensor,
sequence or pipeline group see the same batch.

Communication it issues itself: at construction, one broadcast per parameter and
buffer over the ``replicas`` group (its first rank's initial values). Everything else
comes from the reducer (backward) and the sharded optimizer (step); see their module
docstrings.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, replace

import torch
from torch import nn

from zeroshard import watchdog
from zeroshard.agreement import check_ranks_agree
from zeroshard.distributed import default_device, local_rank
from zeroshard.engine_compat import DeepSpeedEngineCompat
from zeroshard.first_batch import FirstBatchSize, not_learned
from zeroshard.memory import measure
from zeroshard.monitor.hub import EngineMonitor
from zeroshard.offload.placement import Placement
from zeroshard.offload.store import MemoryShard
from zeroshard.offload.swaps import EngineSwaps
from zeroshard.optim import optimizer_factory
from zeroshard.parallel.apply import (
    Parallelized,
    gradient_summed_over_tp,
    is_tp_sharded,
    parallelize,
)
from zeroshard.parallel.mesh import Mesh
from zeroshard.precision import DtypePolicy, LossScaler
from zeroshard.schedulers import build_scheduler
from zeroshard.zero.flat import FlatParams
from zeroshard.zero.gathered import register_owner, unregister_owner
from zeroshard.zero.gradients import GradReducer
from zeroshard.zero.init import is_sealed, take_value
from zeroshard.zero.leaves import find_leaves
from zeroshard.zero.optimizer import ShardedOptimizer, TensorParallelGrads
from zeroshard.zero.parameters import ParamGatherer
from zeroshard.zero.partition import FlatLayout
from zeroshard.zero.segments import bucket_segments, unit_segments
from zeroshard.zero.states import build_memory_states
from zeroshard.zero.whole import WholeParams

log = logging.getLogger("zeroshard")

# the live engine of each model, so a second initialize() tears the first one down
_ENGINES: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()

_ALIGN = 16  # chunk sizes are multiples of 16 elements (vector-friendly offsets)
DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb
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


def _nonfinite_policy(config) -> str:
    """What a step with inf/nan gradients or loss does: "skip", "raise" or "apply"
    (``nonfinite_gradients``; in bf16, DeepSpeed's ``check_grad_overflow`` when given)."""
    check = config.bf16.check_grad_overflow
    if config.bf16.enabled and check is not None:
        if not check:
            return "apply"
        return "skip" if config.nonfinite_gradients == "apply" else config.nonfinite_gradients
    return config.nonfinite_gradients


def _cast_floating(obj, dtype: torch.dtype):
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floating(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floating(v, dtype) for k, v in obj.items()}
    return obj


def _move_module(module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
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


class Engine(DeepSpeedEngineCompat, nn.Module):
    """What ``zeroshard.initialize`` returns first; call it like the model.

    ``engine.config`` is the DeepSpeed config as a dict (as DeepSpeed's engine has it);
    the parsed, typed one is ``engine.parsed_config``."""

    def __init__(
        self,
        module: nn.Module,
        config,
        mesh: Mesh,
        *,
        param_groups: list[dict],
        client_optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler=None,
        training_data=None,
        collate_fn=None,
    ) -> None:
        super().__init__()
        self.module = module
        self._config = config
        self.mesh = mesh
        self.comm = mesh.comm("world")  # every rank: checkpoints' agreement, barriers
        self._watchdog = watchdog.start(config.comm_timeout)
        self.global_steps = 0
        self._check_agreement(module, config)
        self.device = default_device()
        self.monitor = EngineMonitor(config, mesh, self.device)  # first: bad input fails here
        self.policy = DtypePolicy.from_config(config)
        self.placement = Placement.from_config(config.zero_optimization, self.device)
        self.sharding = Sharding.for_stage(config.zero_optimization.stage)
        if mesh.size("zero_replicate") > 1 and not self.sharding.optimizer:
            raise ValueError(
                "zero_optimization.mics_shard_size: hybrid sharding needs ZeRO stage 1, 2 or 3 "
                "(stage 0 shards nothing)"
            )
        # what ZeRO shards over, and the groups its collectives run in
        shard_comm = mesh.comm("zero_shard")
        replicas = mesh.comm("replicas")
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._step_applied = False
        self._backwards_in_window = 0  # backward() calls since the last boundary step
        self._loss_finite: torch.Tensor | None = None  # every loss of this window finite
        previous = _ENGINES[module]() if module in _ENGINES else None
        if previous is not None and not previous.destroyed:
            log.warning(
                "zeroshard: initialize() on a model another engine manages; that engine "
                "is destroyed first (call engine.destroy() yourself to silence this)"
            )
            previous.destroy()
        _ENGINES[module] = weakref.ref(self)
        self.destroyed = False
        self.preemption = None  # zeroshard.preemption.Preemption, set by enable()
        _move_module(module, self.device, self.policy.compute)
        self._installed = []
        if self.policy.compute != torch.float32:
            cast = module.register_forward_pre_hook(self._cast_inputs, with_kwargs=True)
            self._installed.append(cast)
        if config.train_micro_batch_size_per_gpu is None:  # see zeroshard/first_batch.py
            self._installed.append(
                FirstBatchSize(module, self.comm, self.device, self._micro_batch_seen)
            )
        param_groups = self._parallelize(param_groups)
        self._swaps = EngineSwaps(config, self.comm.rank)
        self._swap_spaces = self._swaps.spaces  # nvme_path -> this rank's swap directory
        self.flat, persistent = self._flatten(param_groups)
        zc = config.zero_optimization
        if self.sharding.parameters:
            self.params = ParamGatherer(
                self.flat,
                shard_comm,
                replicas,
                module,
                persistent=persistent,
                prefetch_numel=int(zc.stage3_prefetch_bucket_size),
                max_live_numel=int(zc.stage3_max_live_parameters),
                leaves=find_leaves(module, zc.leaf_module),
                check_every_pass=zc.enable_sanity_checks,
            )
        else:
            self.params = WholeParams(self.flat, shard_comm, replicas)
        registration = {id(p): i for i, p in enumerate(module.parameters())}
        # as DeepSpeed: prescaling divides by the world size first, else by the factor
        predivide = config.gradient_predivide_factor
        if config.prescale_gradients:
            predivide = mesh.size("replicas")
        self.reducer = GradReducer(
            self.flat,
            shard_comm if self.flat.partitioned else replicas,
            replicate=mesh.comm("zero_replicate"),
            dtype=self.policy.grad,
            sharded=self.sharding.gradients,
            overlap=zc.overlap_comm or not self.sharding.optimizer,
            registration_index=registration,
            predivide=predivide,
            on_bucket_ready=self.params.free_if_idle,
            accum_device=self.placement.optimizer if self.placement.offload_optimizer else None,
            reduce_scatter_via_all_reduce=(
                shard_comm.backend == "gloo" if zc.reduce_scatter is None else not zc.reduce_scatter
            ),
        )
        self.loss_scaler = LossScaler.from_config(config.fp16)
        self.optimizer = ShardedOptimizer(
            self.flat,
            self.reducer,
            self._optimizer_states(client_optimizer),
            shard_comm,
            policy=self.policy,
            scaler=self.loss_scaler,
            tp=self._tp_grads(),
            clip=config.gradient_clipping,
            nonfinite=_nonfinite_policy(config),
        )
        register_owner(module.parameters(), self)
        # parameters frozen now: unfreezing one later needs a new initialize()
        laid_out = {
            id(p) for p, g in zip(self.flat.params, self.flat.group_of, strict=True) if g >= 0
        }
        self._frozen = [
            (name, p)
            for name, p in module.named_parameters()
            if not p.requires_grad and id(p) not in laid_out
        ]
        self.lr_scheduler = self._make_scheduler(lr_scheduler)
        self.training_dataloader = self._make_loader(training_data, collate_fn)
        if "activation_checkpointing" in config.raw:  # as DeepSpeed: configures checkpoint()
            from zeroshard import checkpointing

            checkpointing.configure(deepspeed_config=config.activation_checkpointing)
        if self.comm.rank == 0:
            for key, reason in config.inert:
                log.warning("zeroshard: config key %s has no effect here: %s", key, reason)

    # -- construction -------------------------------------------------------------------
    def _check_agreement(self, module: nn.Module, config) -> None:
        """Every rank describes the same model and config (``agreement.py``)."""
        check_ranks_agree(self.comm, module, config)

    def _optimizer_states(self, client: torch.optim.Optimizer | None):
        """Masters and optimizer states: in swap files (NVMe offload) or in memory."""
        if self.placement.optimizer_nvme:
            if client is not None:
                raise ValueError(
                    "zero_optimization.offload_optimizer.device: NVMe offload steps the "
                    "config's Adam/AdamW itself; pass no optimizer to initialize() with it"
                )
            return self._swaps.swapped_adam(self.flat, self.placement.optimizer_nvme)
        cfg = self._config.optimizer
        factory = optimizer_factory(cfg, self.device) if cfg is not None else None
        return build_memory_states(
            self.flat, self.policy, self.placement, client=client, factory=factory
        )

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
            )
        else:
            grouping = bucket_segments(self.module, param_groups, bucket, alone=self._alone())
        # with the shard in swap files, chunks start and end on whole disk blocks
        align = _NVME_ALIGN if self.placement.param_nvme else _ALIGN if world > 1 else 1
        layout = FlatLayout(
            [p.numel() for p in grouping.params], world, groups=grouping.segments, align=align
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

    def _param_store(self, layout: FlatLayout):
        """Stage 3's shard store: an NVMe swap file, or memory. In memory, where the
        optimizer states live too, the shard is kept in the master dtype: it *is* the
        fp32 master (no second copy, no write-back; gathers cast on the device)."""
        place = self.placement
        if place.param_nvme:
            return self._swaps.param_store(place.param_nvme, layout, self.policy.compute)
        masters_here = place.same_place_for_masters()
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
        model next); then tensor and sequence parallelism; returns ``param_groups``
        holding the parameters that replaced sliced ones."""
        split = self._config.tensor_parallel.size > 1  # AutoTP (an mpu's model is split)
        if split and any(is_sealed(p) for p in self.module.parameters()):
            raise NotImplementedError(
                "tensor_parallel.autotp_size: a model built under zero.Init with tensor "
                "parallelism is not built yet; build the model without zero.Init"
            )
        source = self.mesh.comm("stage" if split else "replicas")
        for p in self.module.parameters():
            if not is_sealed(p):  # zero.Init slices are rank 0's values already
                source.broadcast(p.data, src=0)
        for b in self.module.buffers():
            source.broadcast(b, src=0)
        if not split and self.mesh.size("sp") == 1:
            self._parallel = Parallelized()
            return param_groups
        names = {id(p): n for n, p in self.module.named_parameters()}
        self._parallel = parallelize(self.module, self.mesh, self._config)
        now = dict(self.module.named_parameters())
        return [{**g, "params": [now[names[id(p)]] for p in g["params"]]} for g in param_groups]

    def _make_scheduler(self, client):
        sc = self._config.scheduler
        if sc is not None:
            if client is not None:
                raise ValueError(
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
        sampler = DistributedSampler(
            data, num_replicas=self.mesh.size("dp"), rank=self.mesh.coord("dp")
        )
        return DataLoader(
            data,
            batch_size=self._config.train_micro_batch_size_per_gpu,
            sampler=sampler,
            collate_fn=collate_fn,
            drop_last=self._config.dataloader_drop_last,  # as DeepSpeed: the sampler still pads
        )

    def _micro_batch_seen(self, rows: int) -> None:
        """The config left the micro-batch size out: take the first batch's ``rows``."""
        self._config = replace(
            self._config, train_micro_batch_size_per_gpu=rows, micro_batch_from_data=False
        )
        if self.monitor.throughput is not None:
            self.monitor.throughput.batch_size = self.train_batch_size()
        if self.comm.rank == 0:  # a warning, so that it shows by default, as config notes do
            log.warning(
                "zeroshard: train_micro_batch_size_per_gpu is not in the config; taken from "
                "the first batch: %d (train_batch_size %d = %d x gradient_accumulation_steps "
                "%d x %d data-parallel ranks)",
                rows,
                self.train_batch_size(),
                rows,
                self.gradient_accumulation_steps(),
                self._config.dp_world_size,
            )

    def _cast_inputs(self, module, args, kwargs):
        dtype = self.policy.compute
        return _cast_floating(args, dtype), _cast_floating(kwargs, dtype)

    # -- teardown ---------------------------------------------------------------------
    def destroy(self) -> None:
        """Remove every hook this engine installed and free its buffers (DeepSpeed's
        name). The module keeps its parameters, whole (stage 3 gathers them back unit by
        unit), as plain tensors: it trains as plain torch or goes to ``initialize``
        again. The engine is unusable afterwards."""
        if self.destroyed:
            return
        self.reducer.remove_hooks()
        self.params.remove()
        self._parallel.remove()
        for h in self._installed:
            h.remove()
        self._installed.clear()
        unregister_owner(self)
        for p in self.module.parameters():
            p.grad = None
        self._swaps.close()
        self.monitor.close()
        self.destroyed = True
        if self.module in _ENGINES and _ENGINES[self.module]() is self:
            del _ENGINES[self.module]
        # drop the buffers (the parameters at stages 0-2 keep their views of the flat one)
        self.reducer = self.optimizer = self.flat = self.params = None

    def _enter(self, phase: str) -> None:
        """Refuse a destroyed engine; tell the watchdog which call this rank is in."""
        if self.destroyed:
            raise RuntimeError(
                "this zeroshard engine was destroyed (engine.destroy(), or initialize() "
                "called again on its model); use the engine the latest initialize() returned"
            )
        if self._watchdog is not None:
            self._watchdog.enter(phase, self.global_steps)

    # -- the training loop --------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self._enter("forward")
        self.monitor.forward_start(self, args, kwargs)
        out = self.module(*args, **kwargs)
        self.monitor.forward_end()
        return out

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step ends the accumulation window: what
        ``set_gradient_accumulation_boundary`` said last, else the micro-step count."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backward of ``loss / accumulation steps`` (times the fp16 loss scale); on the
        reducing micro-steps, gradients are reduced while backward runs."""
        self._enter("backward")
        for name, p in self._frozen:
            if p.requires_grad:
                raise RuntimeError(
                    f"parameter {name!r} was frozen (requires_grad=False) when initialize() "
                    "ran and now requires grad: zeroshard laid out its gradient and optimizer "
                    "storage then. Call engine.destroy() and initialize() again after "
                    "changing requires_grad, or unfreeze it before initialize()"
                )
        finite = torch.isfinite(loss.detach()).all()  # read at the step (no sync here)
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite
        scaled = loss
        gas = self.gradient_accumulation_steps()
        if scale_wrt_gas and gas > 1:
            scaled = scaled / gas
        if self.loss_scaler.scale != 1.0:
            scaled = scaled * self.loss_scaler.scale
        self.monitor.backward_start(loss, gas)
        self.reducer.begin(self.is_gradient_accumulation_boundary())
        self.params.begin_backward()
        try:
            scaled.backward(retain_graph=retain_graph)
            self.monitor.backward_inner_end()
            self.reducer.finish()
        finally:
            self.params.end_backward()
        self.monitor.backward_end()
        self._backwards_in_window += 1
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Count a micro-step; at the accumulation boundary, update the model."""
        self._enter("step")
        if self._config.train_batch_size is None:
            raise not_learned()
        self.monitor.step_start()
        self._step_applied = False
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            if self.params.edited():  # e.g. p.clamp_() after the last step: keep it
                self.optimizer.refresh_masters(list(range(len(self.flat.layout.segments))))
            loss_finite = self._loss_finite is None or bool(self._loss_finite)
            self._loss_finite = None
            self._step_applied = self.optimizer.apply_step(loss_finite)
            if self._step_applied:
                self.params.after_step()
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step(**(lr_kwargs or {}))
            else:
                self.skipped_steps += 1
                if self.comm.rank == 0:
                    what = (
                        "fp16 overflow" if self.loss_scaler.dynamic else "inf/nan gradients or loss"
                    )
                    log.warning(
                        "zeroshard: step %d skipped on every rank (%s on some rank; %d "
                        "skipped so far)%s",
                        self.global_steps + 1,
                        what,
                        self.skipped_steps,
                        f"; loss scale now {self.loss_scaler.scale:g}"
                        if self.loss_scaler.dynamic
                        else "",
                    )
            self.reducer.zero_grad()
            self._backwards_in_window = 0
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
        self.monitor.step_end(self, boundary)
        self.micro_steps += 1
        if self.preemption is not None and boundary:
            self.preemption.at_step_boundary(self)  # SIGTERM: save, exit 0

    def zero_grad(self) -> None:
        self.reducer.zero_grad()

    # -- checkpoints ------------------------------------------------------------------
    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Write a universal checkpoint to ``save_dir/tag`` (default ``global_step<N>``).
        ``exclude_frozen_parameters``: leave out parameters that get no gradient (load it
        with ``load_module_strict=False``: they keep the model's values)."""
        self._enter("save_checkpoint")
        from zeroshard.checkpoint.save import save

        if self._backwards_in_window:
            log.warning("zeroshard: saving mid-accumulation; the partial gradients are not saved")
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        save(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        return True

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        *,
        verify: bool = True,
        allow_nonfinite: bool = False,
    ) -> tuple[str, dict]:
        """Load a checkpoint saved at any world size / stage; returns (path, client_state).
        ``verify``: check every byte against its checksum; ``allow_nonfinite``: accept
        NaN/inf values (see ``zeroshard.checkpoint.load.load_checkpoint``)."""
        self._enter("load_checkpoint")
        from zeroshard.checkpoint.load import load_checkpoint

        return load_checkpoint(
            self,
            load_dir,
            tag,
            strict=load_module_strict,
            optimizer_states=load_optimizer_states,
            scheduler_states=load_lr_scheduler_states,
            module_only=load_module_only,
            verify=verify,
            allow_nonfinite=allow_nonfinite,
        )

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors") -> bool:
        """Write the whole model (working dtype) as one safetensors file from rank 0."""
        self._enter("save_16bit_model")
        from zeroshard.checkpoint.export import save_16bit

        save_16bit(self, save_dir, save_filename)
        return True

    # -- zero.GatheredParameters support ----------------------------------------------
    def open_gathered(self, params: list[torch.Tensor]) -> None:
        self.params.open(params)

    def close_gathered(self, params: list[torch.Tensor], modifier_rank: int | None) -> None:
        self.optimizer.refresh_masters(self.params.close(params, modifier_rank))
        self.params.mark_clean()

    # -- DeepSpeed-compatible accessors ---------------------------------------------
    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self.optimizer.global_grad_norm

    def was_step_applied(self) -> bool:
        return self._step_applied

    def zero_optimization_stage(self) -> int:
        return self._config.zero_optimization.stage

    def fp16_enabled(self) -> bool:
        return self._config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self._config.bf16.enabled

    @property
    def config(self) -> dict:
        """The DeepSpeed config as a dict, as given ("auto" values filled), like
        DeepSpeed's ``engine.config`` (``engine.config["zero_optimization"]["stage"]``)."""
        return self._config.raw

    @property
    def parsed_config(self):
        """The typed :class:`~zeroshard.config.Config` this engine was built from."""
        return self._config

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.scale

    loss_scale = cur_scale

    @property
    def global_rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def dp_world_size(self) -> int:
        """Ranks that see different samples (the batch rule's data-parallel size)."""
        return self.mesh.size("dp")

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (the launcher's ``LOCAL_RANK``)."""
        return local_rank()

    # -- the ledger and the memory report -------------------------------------------
    def comm_stats(self, by_axis: bool = False) -> dict:
        """``{op: {"calls", "bytes", "seconds"}}`` on this rank since the last reset;
        with ``by_axis``, ``{axis: {op: {...}}}`` (axes and groups of the mesh)."""
        return self.comm.ledger.by_axis() if by_axis else self.comm.ledger.snapshot()

    def reset_comm_stats(self) -> None:
        self.comm.ledger.reset()

    def memory_stats(self) -> dict:
        """Bytes of the persistent buffers this rank holds, by kind and by location."""
        return measure(self)


DeepSpeedEngine = Engine  # DeepSpeed's name (accelerate unwraps models by it)
