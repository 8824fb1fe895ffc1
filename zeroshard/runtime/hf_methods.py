"""The engine methods Hugging Face ``transformers`` and ``accelerate`` call on a DeepSpeed
engine, beyond the training loop itself (a mixin of :class:`zeroshard.runtime.engine.Engine`).

* ``set_gradient_accumulation_boundary(is_boundary)``: accelerate says, before each
  backward, whether this micro-step ends the accumulation window; that decides when
  gradients are reduced and when ``step()`` updates, over the engine's own counter, until
  it is called with ``None``.
* ``zero_gather_16bit_weights_on_model_save()`` and
  ``_zero3_consolidated_16bit_state_dict()``: the whole model on rank 0 (``save_model``).
* ``compile()``: ``torch.compile`` of the wrapped module, as DeepSpeed's.

Communication: ``_zero3_consolidated_16bit_state_dict`` gathers each parameter in turn
(stage 3: one all-gather per parameter, every rank joins; experts split over
expert-parallel ranks: one more all-gather over ``ep`` each); the rest issue none.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from zeroshard import NotBuiltError

if TYPE_CHECKING:
    from zeroshard.distributed.comm import Comm
    from zeroshard.distributed.mesh import Mesh
    from zeroshard.runtime.build import Sharding
    from zeroshard.zero.params.gatherer import ParamGatherer
    from zeroshard.zero.params.whole import WholeParams


class DeepSpeedEngineCompat:
    """Methods of DeepSpeed's engine that integrations call; mixed into ``Engine``."""

    _boundary_override: bool | None = None
    # set by Engine
    module: torch.nn.Module
    _config: Any
    comm: Comm
    mesh: Mesh
    sharding: Sharding
    params: ParamGatherer | WholeParams

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
    def compile(self, backend: str | None = None, compile_kwargs: dict | None = None, **kw) -> None:
        """``torch.compile`` the wrapped module in place (DeepSpeed's ``engine.compile``);
        at stages 0-2 (stage 3's parameter guard is a torch function mode dynamo cannot
        trace yet: refused)."""
        if self.sharding.parameters:
            raise NotBuiltError(
                "engine.compile() at ZeRO stage 3 is not built yet in zeroshard (the "
                "released-parameter guard is not traceable by torch.compile)"
            )
        kwargs = dict(compile_kwargs or {})
        kwargs.update(kw)
        if backend is not None:
            kwargs["backend"] = backend
        self.module.compile(**kwargs)
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        return self._is_compiled
