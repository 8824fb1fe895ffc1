"""The engine methods Hugging Face ``transformers`` and ``accelerate`` call on a DeepSpeed
engine, beyond the training loop itself (a mixin of :class:`zeroshard.runtime.engine.Engine`).

* ``set_gradient_accumulation_boundary(is_boundary)``: accelerate says, before each
  backward, whether this micro-step ends the accumulation window; that decides when
  gradients are reduced and when ``step()`` updates, over the engine's own counter, until
  it is called with ``None``.
* ``zero_gather_16bit_weights_on_model_save()`` and
  ``_zero3_consolidated_16bit_state_dict()``: the whole model on rank 0 (``save_model``).
* ``compile()``: ``torch.compile`` of the wrapped module, as DeepSpeed's, at every stage
  (``compiling.py``).

Communication: ``_zero3_consolidated_16bit_state_dict`` gathers each parameter in turn
(stage 3: one all-gather per parameter, every rank joins; experts split over
expert-parallel ranks: one more all-gather over ``ep`` each); the rest issue none.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from zeroshard import NotBuiltError
from zeroshard.runtime.compiling import (
    check_backend,
    compile_options,
    compile_regions,
    uncompile_regions,
)

if TYPE_CHECKING:
    from zeroshard.distributed.comm import Comm
    from zeroshard.distributed.mesh import Mesh
    from zeroshard.runtime.build import Sharding
    from zeroshard.zero.params.manager import ParamManager


class DeepSpeedEngineCompat:
    """Methods of DeepSpeed's engine that integrations call; mixed into ``Engine``."""

    _boundary_override: bool | None = None
    # set by Engine
    module: torch.nn.Module
    _config: Any
    comm: Comm
    mesh: Mesh
    sharding: Sharding
    params: ParamManager

    if TYPE_CHECKING:

        def _land_delayed(self) -> None: ...  # Engine's

    _is_compiled: bool = False

    # -- gradient accumulation driven from outside ----------------------------------
    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Whether the coming micro-step ends an accumulation window (accelerate calls
        this before each backward with its ``sync_gradients``). It holds until changed;
        ``None`` goes back to counting ``gradient_accumulation_steps`` micro-steps."""
        self._boundary_override = None if is_boundary is None else bool(is_boundary)

    # -- whole weights for save_model -----------------------------------------------
    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's ``zero_optimization.stage3_gather_16bit_weights_on_model_save``:
        whether a stage-3 ``save_model`` may gather the whole weights."""
        return bool(self._config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> OrderedDict:
        """The module's ``state_dict`` with whole tensors in the working dtype, on the CPU,
        on rank 0 (other ranks get an empty dict; every rank must call it). Tied names
        share one tensor. ``exclude_frozen_parameters`` leaves out parameters that do not
        require gradients (buffers stay). Experts split over expert-parallel ranks come
        whole, under their global names (``save_pretrained(state_dict=...)`` of it loads
        into the stock model)."""
        from zeroshard.moe.whole import gather_global
        from zeroshard.zero import GatheredParameters

        self.params.settle()  # overlap_param_gather: the last step's gathers have landed
        self._land_delayed()  # offload_optimizer.delayed_update: the step in flight too
        ep = self.mesh.comm("ep")
        module = self.module
        named = dict(module.named_parameters(remove_duplicate=False))
        state = module.state_dict(keep_vars=True)
        out: OrderedDict = OrderedDict()
        copies: dict[int, torch.Tensor] = {}
        rank0 = self.comm.rank == 0
        for name, t in state.items():
            p = named.get(name)
            if p is not None and exclude_frozen_parameters and not p.requires_grad:
                continue
            t = p if p is not None else t
            if id(t) in copies:
                if rank0:
                    out[name] = copies[id(t)]
                continue
            with GatheredParameters([t] if isinstance(t, torch.nn.Parameter) else []):
                # experts: every expert-parallel rank's, under their global names
                for whole_name, value in gather_global(module, ep, name, t):
                    if rank0:
                        copies[id(t)] = out[whole_name] = value.to("cpu", copy=True)
        return out

    # -- torch.compile ----------------------------------------------------------------
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
        if schedule is not None:
            raise NotBuiltError(
                "engine.compile(schedule=...): DeepCompile's pass schedule; DeepCompile is "
                "not built yet in zeroshard (torch.compile is: leave schedule out)"
            )
        if compiled_autograd_enabled:
            raise NotBuiltError(
                "engine.compile(compiled_autograd_enabled=True): compiled autograd is not "
                "built yet in zeroshard (the backward runs the compiled regions' own "
                "backward graphs, with the engine's gradient hooks between them)"
            )
        options = compile_options(backend, compile_kwargs, kw)
        check_backend(options.get("backend"))
        self._land_delayed()
        self.params.settle()
        self.uncompile()
        regions = self.params.compile_regions(self.module)
        if regions is None:
            self.module.compile(**options)
        else:
            compile_regions(regions, options)
        self._is_compiled = True

    def uncompile(self) -> None:
        """Back to the eager module (also at ``destroy()``)."""
        uncompile_regions(self.module)
        self.module._compiled_call_impl = None  # what nn.Module.compile() set
        self._is_compiled = False

    @property
    def is_compiled(self) -> bool:
        return self._is_compiled
