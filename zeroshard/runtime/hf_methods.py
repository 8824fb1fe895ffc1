"""What the engine methods Hugging Face ``transformers`` and ``accelerate`` call on a
DeepSpeed engine do, beyond the training loop itself; the engine's methods
(``runtime/engine.py``) delegate here:

* ``set_gradient_accumulation_boundary(is_boundary)``: accelerate says, before each
  backward, whether this micro-step ends the accumulation window; that decides when
  gradients are reduced and when ``step()`` updates, over the engine's own counter, until
  it is called with ``None`` (the engine's own state).
* ``zero_gather_16bit_weights_on_model_save()`` and
  ``_zero3_consolidated_16bit_state_dict()``: the whole model on rank 0 (``save_model``):
  :func:`consolidated_16bit_state_dict`.
* ``compile()``: ``torch.compile`` of the wrapped module, as DeepSpeed's, at every stage
  (``compiling.ModuleCompiler``).

Communication: :func:`consolidated_16bit_state_dict` gathers each parameter in turn
(stage 3: one all-gather per parameter, every rank joins; experts split over
expert-parallel ranks: one more all-gather over ``ep`` each); the rest issue none.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from zeroshard.distributed.comm import Comm


def consolidated_16bit_state_dict(
    module: nn.Module, ep: Comm, rank0: bool, exclude_frozen_parameters: bool = False
) -> OrderedDict:
    """``module``'s ``state_dict`` with whole tensors in the working dtype, on the CPU,
    on rank 0 (``rank0``; other ranks get an empty dict; every rank must call it). Tied
    names share one tensor. ``exclude_frozen_parameters`` leaves out parameters that do
    not require gradients (buffers stay). Experts split over the expert-parallel ranks
    of ``ep`` come whole, under their global names (``save_pretrained(state_dict=...)``
    of it loads into the stock model). The caller has landed the engine's gathers and
    steps in flight."""
    from zeroshard.moe.whole import gather_global
    from zeroshard.zero import GatheredParameters

    named = dict(module.named_parameters(remove_duplicate=False))
    state = module.state_dict(keep_vars=True)
    out: OrderedDict = OrderedDict()
    copies: dict[int, torch.Tensor] = {}
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
