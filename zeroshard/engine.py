"""The training engine: forward, scaled backward, and the step at accumulation boundaries.

The engine orchestrates strategy objects chosen once from the config and holds no
stage-specific branches: what is sharded (:class:`Sharding`) decides the flat layout's
world size, the gradient reducer's mode and, at stage 3, the parameter gatherer.

Communication it issues itself: at construction, one broadcast per flat group, frozen
parameter and buffer (rank 0's initial values). Everything else comes from the reducer
(backward) and the sharded optimizer (step); see their module docstrings.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.comm import Comm
from zeroshard.distributed import default_device
from zeroshard.memory import measure
from zeroshard.offload.placement import Placement
from zeroshard.offload.swaps import EngineSwaps
from zeroshard.optim import optimizer_factory
from zeroshard.precision import DtypePolicy, LossScaler
from zeroshard.schedulers import build_scheduler
from zeroshard.zero.flat import FlatParams
from zeroshard.zero.gathered import register_owner
from zeroshard.zero.gradients import GradReducer
from zeroshard.zero.init import is_sealed, take_value
from zeroshard.zero.optimizer import ShardedOptimizer, build_inner_optimizer
from zeroshard.zero.parameters import ParamGatherer, WholeParams
from zeroshard.zero.partition import FlatLayout
from zeroshard.zero.plan import plan_buckets, plan_units

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


class Engine(nn.Module):
    """What ``zeroshard.initialize`` returns first; call it like the model."""

    def __init__(
        self,
        module: nn.Module,
        config,
        comm: Comm,
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
        self.comm = comm
        self.device = default_device()
        self.policy = DtypePolicy.from_config(config)
        self.placement = Placement.from_config(config.zero_optimization, self.device)
        self.sharding = Sharding.for_stage(config.zero_optimization.stage)
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._step_applied = False
        self.preemption = None  # zeroshard.preemption.Preemption, set by enable()
        _move_module(module, self.device, self.policy.compute)
        if self.policy.compute != torch.float32:
            module.register_forward_pre_hook(self._cast_inputs, with_kwargs=True)
        self._broadcast_initial_state()
        self._swaps = EngineSwaps(config, comm.rank)
        self._swap_spaces = self._swaps.spaces  # nvme_path -> this rank's swap directory
        self.flat, persistent = self._flatten(param_groups)
        zc = config.zero_optimization
        if self.sharding.parameters:
            self.params = ParamGatherer(
                self.flat,
                comm,
                module,
                persistent=persistent,
                prefetch_numel=int(zc.stage3_prefetch_bucket_size),
                max_live_numel=int(zc.stage3_max_live_parameters),
            )
        else:
            self.params = WholeParams(self.flat, comm)
        registration = {id(p): i for i, p in enumerate(module.parameters())}
        self.reducer = GradReducer(
            self.flat,
            comm,
            dtype=self.policy.grad,
            sharded=self.sharding.gradients,
            overlap=zc.overlap_comm or not self.sharding.optimizer,
            registration_index=registration,
            predivide=config.gradient_predivide_factor if config.prescale_gradients else 1.0,
            on_bucket_ready=self.params.release,
            accum_device=self.placement.optimizer if self.placement.offload_optimizer else None,
        )
        factory = optimizer_factory(config.optimizer, self.device) if config.optimizer else None
        inner, masters = build_inner_optimizer(
            self.flat,
            self.policy,
            self.placement,
            client=client_optimizer,
            factory=factory,
            swapped=(
                (lambda: self._swaps.swapped_adam(self.flat, self.placement.optimizer_nvme))
                if self.placement.optimizer_nvme
                else None
            ),
        )
        self.loss_scaler = LossScaler.from_config(config.fp16)
        self.optimizer = ShardedOptimizer(
            self.flat,
            self.reducer,
            inner,
            masters,
            comm,
            policy=self.policy,
            scaler=self.loss_scaler,
            clip=config.gradient_clipping,
            check_overflow=config.fp16.enabled,
        )
        register_owner(module.parameters(), self)
        self.lr_scheduler = self._make_scheduler(lr_scheduler)
        self.training_dataloader = self._make_loader(training_data, collate_fn)
        if "activation_checkpointing" in config.raw:  # as DeepSpeed: configures checkpoint()
            from zeroshard import checkpointing

            checkpointing.configure(deepspeed_config=config.activation_checkpointing)
        for name in config.ignored_enabled:
            if comm.rank == 0:
                log.warning("zeroshard: config section %r is accepted but has no effect", name)

    # -- construction -------------------------------------------------------------------
    def _flatten(self, param_groups: list[dict]) -> tuple[FlatParams, list[int]]:
        """Lay parameters out flat: gradient buckets (stages 0-2) or module units (stage 3)."""
        zc = self._config.zero_optimization
        world = self.comm.world_size if self.sharding.optimizer else 1
        bucket = int(min(zc.reduce_bucket_size, zc.allgather_bucket_size))
        if self.sharding.parameters:
            plan = plan_units(
                self.module,
                param_groups,
                int(zc.stage3_param_persistence_threshold),
                bucket,
                int(zc.stage3_model_persistence_threshold),
            )
        else:
            plan = plan_buckets(self.module, param_groups, bucket)
        # with the shard in swap files, chunks start and end on whole disk blocks
        align = _NVME_ALIGN if self.placement.param_nvme else _ALIGN if world > 1 else 1
        layout = FlatLayout(
            [p.numel() for p in plan.params], world, groups=plan.segments, align=align
        )
        swap = pool = None
        if self.placement.param_nvme:
            esize = torch.empty((), dtype=self.policy.compute).element_size()
            swap, pool = self._swaps.param_store(self.placement.param_nvme, layout, esize)
        flat = FlatParams(
            plan.params,
            plan.group_of,
            [{k: v for k, v in spec.items() if k != "params"} for spec in param_groups],
            layout,
            self.comm.rank,
            device=self.device,
            dtype=self.policy.compute,
            full=not self.sharding.parameters,
            value_of=take_value,
            shard_device=self.placement.param_shard,
            swap=swap,
            swap_pool=pool,
        )
        return flat, plan.persistent

    def _broadcast_initial_state(self) -> None:
        """Every rank starts from rank 0's parameters and buffers."""
        for p in self.module.parameters():
            if not is_sealed(p):  # zero.Init slices are rank 0's values already
                self.comm.broadcast(p.data, src=0)
        for b in self.module.buffers():
            self.comm.broadcast(b, src=0)

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

        sampler = DistributedSampler(data, num_replicas=self.comm.world_size, rank=self.comm.rank)
        return DataLoader(
            data,
            batch_size=self._config.train_micro_batch_size_per_gpu,
            sampler=sampler,
            collate_fn=collate_fn,
        )

    def _cast_inputs(self, module, args, kwargs):
        dtype = self.policy.compute
        return _cast_floating(args, dtype), _cast_floating(kwargs, dtype)

    # -- the training loop --------------------------------------------------------------
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backward of ``loss / accumulation steps`` (times the fp16 loss scale); on the
        reducing micro-steps, gradients are reduced while backward runs."""
        scaled = loss
        gas = self.gradient_accumulation_steps()
        if scale_wrt_gas and gas > 1:
            scaled = scaled / gas
        if self.loss_scaler.scale != 1.0:
            scaled = scaled * self.loss_scaler.scale
        self.reducer.begin(self.is_gradient_accumulation_boundary())
        self.params.begin_backward()
        try:
            scaled.backward(retain_graph=retain_graph)
            self.reducer.finish()
        finally:
            self.params.end_backward()
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Count a micro-step; at the accumulation boundary, update the model."""
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            self._step_applied = self.optimizer.step()
            if self._step_applied:
                self.params.after_step()
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step(**(lr_kwargs or {}))
            else:
                self.skipped_steps += 1
            self.reducer.zero_grad()
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            self._report_progress()
        self.micro_steps += 1
        if (
            self.preemption is not None
            and self.micro_steps % self.gradient_accumulation_steps() == 0
        ):
            self.preemption.at_step_boundary(self)  # SIGTERM: save, exit 0

    def _report_progress(self) -> None:
        every = self._config.steps_per_print
        if every and self.global_steps % every == 0 and self.comm.rank == 0:
            log.info(
                "step=%d skipped=%d lr=%s", self.global_steps, self.skipped_steps, self.get_lr()
            )

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
        """Write a universal checkpoint to ``save_dir/tag`` (default ``global_step<N>``)."""
        from zeroshard.checkpoint.save import save

        if self.micro_steps % self.gradient_accumulation_steps():
            log.warning("zeroshard: saving mid-accumulation; the partial gradients are not saved")
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        save(self, save_dir, tag, client_state, save_latest)
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
        from zeroshard.checkpoint.export import save_16bit

        save_16bit(self, save_dir, save_filename)
        return True

    # -- zero.GatheredParameters support ----------------------------------------------
    def gather_params(self, params: list[torch.Tensor]) -> None:
        self.params.open(params)

    def release_params(self, params: list[torch.Tensor], modifier_rank: int | None) -> None:
        self.optimizer.refresh_masters(self.params.close(params, modifier_rank))

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
    def config(self):
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
        return self.comm.world_size

    @property
    def local_rank(self) -> int:
        return self.device.index or 0

    # -- the ledger and the memory report -------------------------------------------
    def comm_stats(self) -> dict[str, dict[str, float | int]]:
        """``{op: {"calls", "bytes", "seconds"}}`` on this rank since the last reset."""
        return self.comm.ledger.snapshot()

    def reset_comm_stats(self) -> None:
        self.comm.ledger.reset()

    def memory_stats(self) -> dict:
        """Bytes of the persistent buffers this rank holds, by kind and by location."""
        return measure(self)
