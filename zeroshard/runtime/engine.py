"""The training engine: forward, scaled backward, and the step at accumulation boundaries.

The engine orchestrates strategy objects chosen once from the config and holds no
stage-specific branches: what is sharded (:class:`~zeroshard.runtime.build.Sharding`)
decides the flat layout's world size, the gradient reducer's mode and, at stage 3, the
parameter gatherer.

It works on a :class:`~zeroshard.distributed.mesh.Mesh`: ZeRO shards over the mesh's
``zero_shard`` group and replicates shards across ``zero_replicate`` (hybrid sharding,
MiCS / HSDP); expert parameters of mixture-of-experts layers, which differ along the
``ep`` axis, are sharded and reduced over ``expert_shard`` (``expert_replicas`` when
unsharded) instead; the data loader splits batches over ``dp``; ranks that share a
tensor, sequence or pipeline group see the same batch.

It is composed, not mixed in: ``build.py``'s :class:`~zeroshard.runtime.build.EngineBuilder`
makes the parts it holds (the model prepared by ``prepare.py``, layout, stores,
parameter manager, reducer, optimizer); ``step.py`` is what backward and step do to
them; the methods integrations call on a DeepSpeed engine delegate to ``hf_methods.py``
and ``compiling.py``; the monitors get records of it (``monitor/readings.py``).

Communication it issues itself: at construction, the agreement digest
(``agreement.py``) and one broadcast per parameter and buffer over the ``replicas``
group (its first rank's initial values; ``prepare.py``). Everything else comes from
the reducer (backward) and the sharded optimizer (step); see their module docstrings.
With ``offload_optimizer.delayed_update`` the all-gather of the updated parameters
(stages 1-2) moves from the end of ``step()`` to the next step boundary, or to the first
earlier call that needs the parameters (``offload/delayed.py``).
"""

from __future__ import annotations

import logging
import math
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zeroshard import ArgumentError, UsageError
from zeroshard.config.schema import ConfigError
from zeroshard.distributed import watchdog
from zeroshard.distributed.mesh import Mesh
from zeroshard.distributed.process_group import default_device, local_rank
from zeroshard.monitor.hub import EngineMonitor
from zeroshard.monitor.memory import measure
from zeroshard.monitor.readings import EngineInfo, StepState
from zeroshard.runtime import step as steps
from zeroshard.runtime.agreement import check_ranks_agree
from zeroshard.runtime.build import EngineBuilder
from zeroshard.runtime.compiling import ModuleCompiler, UnknownBackendError
from zeroshard.runtime.first_batch import FirstBatchSize, not_learned, say_taken
from zeroshard.runtime.hf_methods import consolidated_16bit_state_dict
from zeroshard.runtime.optim import make_scheduler
from zeroshard.runtime.prepare import cast_floating, check_fp8_model, make_loader, move_module
from zeroshard.zero.params.gathered import register_owner, unregister_owner
from zeroshard.zero.params.manager import ParamManager

if TYPE_CHECKING:
    from zeroshard.checkpoint.preemption import Preemption

log = logging.getLogger("zeroshard")

# the live engine of each model, so a second initialize() tears the first one down
_ENGINES: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()


class Engine(nn.Module):
    """What ``zeroshard.initialize`` returns first; call it like the model.

    ``engine.config`` is the DeepSpeed config as a dict (as DeepSpeed's engine has it);
    the parsed, typed one is ``engine.parsed_config``.

    ``param_groups=None`` builds an engine without an optimizer, as DeepSpeed does when
    ``initialize`` gets none (no ``optimizer=`` and no ``optimizer`` section): for
    inference and evaluation at every stage (stage 3 partitions and gathers the
    parameters, in the working dtype, with no fp32 masters and no gradient buffers).
    ``engine.optimizer`` is None; forward, ``eval()``, ``generate`` through the module,
    ``save_16bit_model``, ``GatheredParameters`` and checkpoints of the parameters work;
    ``backward`` and ``step`` raise, naming the missing optimizer."""

    def __init__(
        self,
        module: nn.Module,
        config,
        mesh: Mesh,
        *,
        param_groups: list[dict] | None,
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
        #: whether this engine trains (has an optimizer); see the class docstring
        self.trains = param_groups is not None
        self._check_agreement(module, config)
        self.device = default_device()
        self.monitor = EngineMonitor(config, mesh, self.device)  # first: bad input fails here
        builder = EngineBuilder(module, config, mesh, device=self.device, trains=self.trains)
        self.policy, self.placement = builder.policy, builder.placement
        self.sharding = builder.sharding
        self.micro_steps = self.global_steps = self.global_samples = self.skipped_steps = 0
        self.checkpointed_step = 0  # global_steps at the last save or load
        self._step_applied = False
        self._boundary_override: bool | None = None  # set_gradient_accumulation_boundary
        self._backwards_in_window = 0  # backward() calls since the last boundary step
        self._loss_finite: torch.Tensor | None = None  # every loss of this window finite
        self._take_over(module)
        self.destroyed = False
        self.preemption: Preemption | None = None  # set by Preemption.enable()
        check_fp8_model(module, config, self.device)
        move_module(module, self.device, self.policy.compute)
        self._installed: list[RemovableHandle | FirstBatchSize] = []
        if self.policy.compute != torch.float32:
            cast = module.register_forward_pre_hook(self._cast_inputs, with_kwargs=True)
            self._installed.append(cast)
        if config.train_micro_batch_size_per_gpu is None:  # see zeroshard/runtime/first_batch.py
            self._installed.append(
                FirstBatchSize(module, self.comm, self.device, self._micro_batch_seen)
            )
        try:
            parts = builder.build(
                param_groups or [], client_optimizer=client_optimizer, alone=self._alone()
            )
        except BaseException:
            self._abandon()  # the builder removed what it made
            raise
        self._parallel, self._fp8, self._swaps = parts.parallel, parts.fp8, parts.swaps
        self._swap_spaces = self._swaps.spaces  # nvme_path -> this rank's swap directory
        self.flat, self.reducer = parts.flat, parts.reducer
        # whole parameters (stages 0-2) or gathered per unit (stage 3): one Protocol
        self.params: ParamManager = parts.params
        self.loss_scaler, self.optimizer = parts.loss_scaler, parts.optimizer
        #: offload_optimizer.delayed_update: the store stepping one step late, else None
        self._delayed = parts.delayed
        self._frozen, self.bucket_numel = parts.frozen, parts.bucket_numel
        self._compiler = ModuleCompiler(
            module,
            before=self._before_compile,
            regions_of=lambda m: self.params.compile_regions(m),
        )
        # from here on a failed initialize() leaves an engine destroy() tears down (the
        # next initialize() on the model does)
        self.monitor.bind(self._monitor_info())
        register_owner(module.parameters(), self)
        self.lr_scheduler = make_scheduler(config, self.optimizer, lr_scheduler)
        self.training_dataloader = make_loader(config, mesh, training_data, collate_fn)
        if "activation_checkpointing" in config.raw:  # as DeepSpeed: configures checkpoint()
            from zeroshard.activation import checkpointing

            checkpointing.configure_from_config(config.activation_checkpointing)
        if self.comm.rank == 0:
            for key, reason in config.inert:
                log.warning("zeroshard: config key %s has no effect here: %s", key, reason)
        if config.compile.enabled:  # DeepSpeed 0.14's switch: engine.compile() now
            try:
                self.compile(backend=config.compile.backend, compile_kwargs=config.compile.kwargs)
            except UnknownBackendError as err:
                raise ConfigError("compile.backend", str(err)) from None

    # -- construction (the pipeline engine overrides these two) --------------------------
    def _check_agreement(self, module: nn.Module, config) -> None:
        """Every rank describes the same model and config (``agreement.py``)."""
        check_ranks_agree(self.comm, module, config)

    def _alone(self) -> frozenset:
        """Ids of parameters laid out in segments of their own (the pipeline engine's
        tied layers); none here."""
        return frozenset()

    def _take_over(self, module: nn.Module) -> None:
        """This engine manages ``module`` now; another live one is destroyed first."""
        previous = _ENGINES[module]() if module in _ENGINES else None
        if previous is not None and not previous.destroyed:
            log.warning(
                "zeroshard: initialize() on a model another engine manages; that engine "
                "is destroyed first (call engine.destroy() yourself to silence this)"
            )
            previous.destroy()
        _ENGINES[module] = weakref.ref(self)

    def _abandon(self) -> None:
        """The parts could not be built: remove this engine's own hooks, let go of the
        model and close the monitors (nothing else to tear down)."""
        for h in self._installed:
            h.remove()
        self._installed.clear()
        if self.module in _ENGINES and _ENGINES[self.module]() is self:
            del _ENGINES[self.module]
        self.monitor.close()
        self.destroyed = True

    def _micro_batch_seen(self, rows: int) -> None:
        """The config left the micro-batch size out: take the first batch's ``rows``."""
        self._config = replace(
            self._config, train_micro_batch_size_per_gpu=rows, micro_batch_from_data=False
        )
        self.monitor.throughput.batch_size = self.train_batch_size()
        if self.comm.rank == 0:
            say_taken(self._config, rows)

    def _cast_inputs(self, module, args, kwargs):
        dtype = self.policy.compute
        return cast_floating(args, dtype), cast_floating(kwargs, dtype)

    def _monitor_info(self) -> EngineInfo:
        """What the monitors read of this engine once (``monitor/readings.py``)."""
        flat = self.flat  # ZeRO-3 releases parameters: their sizes are the layout's
        return EngineInfo(
            name=type(self).__name__,
            module=self.module,
            param_numels={
                id(p): math.prod(s) for p, s in zip(flat.params, flat.shapes, strict=True)
            },
            dtype=self.policy.compute,
            world_size=self.world_size,
            counters=lambda: (self.global_steps, self.global_samples),
            memory_stats=self.memory_stats,
        )

    def _step_state(self) -> StepState:
        """What the monitors read after a step."""
        return StepState(
            global_steps=self.global_steps,
            global_samples=self.global_samples,
            skipped_steps=self.skipped_steps,
            train_batch_size=self.train_batch_size(),
            micro_batch_size=self.train_micro_batch_size_per_gpu(),
            gradient_accumulation_steps=self.gradient_accumulation_steps(),
            lr=tuple(self.get_lr()),
            grad_norm=self.get_global_grad_norm(),
            loss_scale=self.cur_scale,
        )

    # -- teardown ---------------------------------------------------------------------
    def destroy(self) -> None:
        """Remove every hook this engine installed and free its buffers (DeepSpeed's
        name). The module keeps its parameters, whole (stage 3 gathers them back unit by
        unit), as plain tensors: it trains as plain torch or goes to ``initialize``
        again. The process groups initialize() made for this engine's mesh are destroyed
        (never the default group or an mpu's). The engine is unusable afterwards. With the
        config's ``checkpoint.dir``, it first saves the run's last step there
        (``zeroshard.checkpoint.resume.save_at_end``)."""
        if self.destroyed:
            return
        from zeroshard.checkpoint.resume import save_at_end

        save_at_end(self)
        self._land_delayed()
        self.uncompile()
        self.reducer.remove_hooks()
        self.params.remove()
        self._parallel.remove()
        if self._fp8 is not None:
            self._fp8.undo()
        for h in self._installed:
            h.remove()
        self._installed.clear()
        unregister_owner(self)
        for p in self.module.parameters():
            p.grad = None
        self._swaps.close()
        self.monitor.close()
        # the groups initialize() created for this engine's mesh: an idle gloo group's
        # threads keep waking (a process building engine after engine would pay for all)
        self.mesh.release()
        self.destroyed = True
        if self.module in _ENGINES and _ENGINES[self.module]() is self:
            del _ENGINES[self.module]
        # drop the buffers (the parameters at stages 0-2 keep their views of the flat one);
        # the attributes stay typed as live: a destroyed engine refuses every call (_enter)
        self._delayed = None
        for name in ("reducer", "optimizer", "flat", "params"):
            setattr(self, name, None)

    def _leave(self, publish: bool = False) -> None:
        """Tell the watchdog the call returned (``publish``: report it now, once a step)."""
        if self._watchdog is not None:
            self._watchdog.leave(self.global_steps, publish)

    def _enter(self, phase: str) -> None:
        """Refuse a destroyed engine; tell the watchdog which call this rank is in."""
        if self.destroyed:
            raise UsageError(
                "this zeroshard engine was destroyed (engine.destroy(), or initialize() "
                "called again on its model); use the engine the latest initialize() returned"
            )
        if self._watchdog is not None:
            self._watchdog.enter(phase, self.global_steps)
        if phase != "forward":  # overlap_param_gather: forward waits layer by layer
            self.params.settle()
        if phase not in ("forward", "backward", "step"):  # step lands at its boundary
            self._land_delayed()

    def _land_delayed(self) -> None:
        """offload_optimizer.delayed_update: land the step in flight (``step.py``)."""
        steps.land_delayed(self._delayed, self.params)

    def wait_param_gather(self) -> None:
        """With ``zero_optimization.overlap_param_gather``: wait until the parameters
        updated by the last ``step()`` are whole (before reading them outside the engine;
        the next forward and every engine call do it themselves)."""
        self._enter("wait_param_gather")

    # -- the training loop --------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self._enter("forward")
        if not (torch.is_grad_enabled() and self.module.training):
            self._land_delayed()  # evaluation sees the latest update
        self.monitor.forward_start(
            args, kwargs, training=self.module.training, step=self.global_steps
        )
        out = self.module(*args, **kwargs)
        self.monitor.forward_end()
        self._leave()
        return out

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step ends the accumulation window: what
        ``set_gradient_accumulation_boundary`` said last, else the micro-step count."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backward of ``loss / accumulation steps`` (times the fp16 loss scale); on the
        reducing micro-steps, gradients are reduced while backward runs. Returns, as
        DeepSpeed's does, the loss divided by the accumulation steps (in fp32) when
        ``scale_wrt_gas`` and more than one step accumulate (detached: its graph is
        spent), else ``loss`` itself."""
        self._refuse_without_optimizer("backward")
        self._enter("backward")
        steps.check_frozen(self._frozen)
        finite = torch.isfinite(loss.detach()).all()  # read at the step (no sync here)
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite
        gas = self.gradient_accumulation_steps()
        scaled = steps.scaled_loss(loss, gas, self.loss_scaler.scale, scale_wrt_gas)
        self.monitor.backward_start(loss, gas)
        steps.run_backward(
            scaled,
            boundary=self.is_gradient_accumulation_boundary(),
            retain_graph=retain_graph,
            reducer=self.reducer,
            params=self.params,
            monitor=self.monitor,
            delayed=self._delayed,
        )
        self.monitor.backward_end()
        self._backwards_in_window += 1
        self._leave()
        if scale_wrt_gas and gas > 1:
            return loss.detach().float() / gas
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Count a micro-step; at the accumulation boundary, update the model."""
        self._refuse_without_optimizer("step")
        self._enter("step")
        if self._config.train_batch_size is None:
            raise not_learned()
        self.monitor.step_start()
        self._step_applied = False
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            assert self.optimizer is not None  # refused above
            loss_finite = self._loss_finite is None or bool(self._loss_finite)
            self._loss_finite = None
            self._step_applied = steps.optimizer_step(
                optimizer=self.optimizer,
                reducer=self.reducer,
                params=self.params,
                delayed=self._delayed,
                global_steps=self.global_steps,
                loss_finite=loss_finite,
            )
            if not self._step_applied:
                self.skipped_steps += 1
                if self.comm.rank == 0:
                    steps.say_skipped(self.global_steps + 1, self.skipped_steps, self.loss_scaler)
            elif self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
            self.reducer.zero_grad()
            self._backwards_in_window = 0
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
        self.monitor.step_end(self._step_state(), boundary)
        self.micro_steps += 1
        if self.preemption is not None and boundary:
            self.preemption.at_step_boundary(self)  # SIGTERM: save, exit 0
        self._leave(publish=True)

    def _refuse_without_optimizer(self, what: str) -> None:
        if self.optimizer is None and not self.destroyed:
            raise UsageError(
                f"engine.{what}(): this engine has no optimizer (initialize() got no "
                "optimizer= and the config has no 'optimizer' section), so it runs forward, "
                "evaluation and generation only; to train, give an optimizer to initialize()"
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a new accumulation window: every ``param.grad`` is unset (gradients
        live in the engine's buffers); ``set_to_none=False`` (zeroed tensors) is refused."""
        if not set_to_none:
            raise ArgumentError(
                "engine.zero_grad(set_to_none=False): the engine keeps gradients in its own "
                "buffers and unsets param.grad; zeroed param.grad tensors are not built"
            )
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
        self.checkpointed_step = self.global_steps
        # the monitor files hold every step up to the checkpoint: a run resumed from it
        # after a kill finds its step there and continues them (monitor/rundir.py)
        self.monitor.flush()
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

        loaded = load_checkpoint(
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
        self.checkpointed_step = self.global_steps
        return loaded

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors") -> bool:
        """Write the whole model (working dtype) as one safetensors file from rank 0."""
        self._enter("save_16bit_model")
        from zeroshard.checkpoint.export import save_16bit

        save_16bit(self, save_dir, save_filename)
        return True

    # -- zero.GatheredParameters support ----------------------------------------------
    def open_gathered(self, params: list[torch.Tensor]) -> None:
        self._land_delayed()
        self.params.open(params)

    def close_gathered(self, params: list[torch.Tensor], modifier_rank: int | None) -> None:
        # edits to whole parameters first (this rank's, made inside the block or before)
        edited = self.params.take_edits()
        closed = self.params.close(params, modifier_rank)
        if self.optimizer is not None:  # without one there are no masters to refresh
            self.optimizer.refresh_masters(edited)
            self.optimizer.refresh_masters(closed)
        self.params.mark_clean()

    # -- what transformers and accelerate call (hf_methods.py, compiling.py) -----------
    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Whether the coming micro-step ends an accumulation window (accelerate calls
        this before each backward with its ``sync_gradients``). It holds until changed;
        ``None`` goes back to counting ``gradient_accumulation_steps`` micro-steps."""
        self._boundary_override = None if is_boundary is None else bool(is_boundary)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's ``zero_optimization.stage3_gather_16bit_weights_on_model_save``:
        whether a stage-3 ``save_model`` may gather the whole weights."""
        return bool(self._config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> OrderedDict:
        """The module's ``state_dict``, whole, in the working dtype, on rank 0's CPU
        (``hf_methods.consolidated_16bit_state_dict``; every rank must call it)."""
        self.params.settle()  # overlap_param_gather: the last step's gathers have landed
        self._land_delayed()  # offload_optimizer.delayed_update: the step in flight too
        rank0 = self.comm.rank == 0
        ep = self.mesh.comm("ep")
        return consolidated_16bit_state_dict(self.module, ep, rank0, exclude_frozen_parameters)

    def compile(
        self,
        backend: str | Callable | None = None,
        compile_kwargs: dict | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
        **kw: Any,
    ) -> None:
        """``torch.compile`` the wrapped module in place (DeepSpeed's ``engine.compile``),
        at every ZeRO stage, offload included: the whole module, or one region per
        gathered unit with the engine's hooks outside the compiled code (stage 3; see
        ``zeroshard/runtime/compiling.py``). ``backend`` and ``compile_kwargs`` (and further
        keywords) go to ``torch.compile``. Call it between steps; again to recompile
        with other options."""
        self._compiler.compile(backend, compile_kwargs, schedule, compiled_autograd_enabled, kw)

    def _before_compile(self) -> None:
        self._land_delayed()
        self.params.settle()

    def uncompile(self) -> None:
        """Back to the eager module (also at ``destroy()``)."""
        self._compiler.uncompile()

    @property
    def is_compiled(self) -> bool:
        return self._compiler.is_compiled

    # -- DeepSpeed-compatible accessors ---------------------------------------------
    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    def get_lr(self) -> list[float]:
        """Each param group's learning rate (none without an optimizer, as DeepSpeed)."""
        if self.optimizer is None:
            return []
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self.optimizer.global_grad_norm if self.optimizer is not None else None

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
    def tput_timer(self):
        """DeepSpeed's throughput timer (:class:`zeroshard.monitor.timers.ThroughputTimer`,
        ``timers.throughput``): started at each forward, stopped at each ``step()``."""
        return self.monitor.throughput

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
