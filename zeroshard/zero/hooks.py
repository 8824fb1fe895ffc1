"""Autograd and attribute plumbing for the stage-3 gatherer (``zero/parameters.py``). No
communication here: these only call back into the gatherer.

* :class:`PreBackward`: identity in forward; in backward it asks the gatherer for a
  module's units just before that module's backward runs.
* :func:`wrap_outputs`: routes the differentiable tensors of a module's output
  (tensor, tuple, named tuple, list, dict, ``ModelOutput``) through it.
* :class:`AccessTrackingDict`: a module's ``_parameters`` that reports each
  ``module.name`` read, so parameters used outside their own module are gathered too.
"""

from __future__ import annotations

import torch


class PreBackward(torch.autograd.Function):
    """Identity in forward; in backward, gathers a module's units before its backward runs."""

    @staticmethod
    def forward(ctx, gatherer, units, *tensors):
        ctx.gatherer, ctx.units = gatherer, units
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.gatherer.gather_for_backward(ctx.units)
        return (None, None, *grads)


class AccessTrackingDict(dict):
    """A module's ``_parameters`` that reports each ``module.name`` read (``nn.Module.
    __getattr__`` indexes this dict), so parameters used outside their own module's
    forward are gathered too. Iteration and ``parameters()`` do not report."""

    __slots__ = ("_on_access",)

    def __init__(self, params: dict, on_access) -> None:
        super().__init__(params)
        self._on_access = on_access

    def __getitem__(self, name: str):
        value = dict.__getitem__(self, name)
        if value is not None:
            self._on_access(value)
        return value


def wrap_outputs(output, gatherer, units: tuple[int, ...]):
    """Route the floating-point tensors of ``output`` through :class:`PreBackward`."""
    if torch.is_tensor(output):
        if output.requires_grad:
            return PreBackward.apply(gatherer, units, output)
        return output
    if isinstance(output, (tuple, list)):
        idx = [i for i, o in enumerate(output) if torch.is_tensor(o) and o.requires_grad]
        if not idx:
            return output
        wrapped = PreBackward.apply(gatherer, units, *(output[i] for i in idx))
        wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
        items = list(output)
        for i, w in zip(idx, wrapped, strict=True):
            items[i] = w
        return (
            type(output)(items)
            if isinstance(output, tuple) and not hasattr(output, "_fields")
            else (type(output)(*items) if hasattr(output, "_fields") else items)
        )
    if isinstance(output, dict):
        keys = [k for k, v in output.items() if torch.is_tensor(v) and v.requires_grad]
        if not keys:
            return output
        wrapped = PreBackward.apply(gatherer, units, *(output[k] for k in keys))
        wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
        new = output.copy()  # keeps the mapping type (e.g. a transformers ModelOutput)
        for k, w in zip(keys, wrapped, strict=True):
            new[k] = w
        return new
    return output
