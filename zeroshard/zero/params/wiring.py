"""Where the stage-3 gatherer's hooks sit on a model, which units each hooked module
gathers, and the autograd and attribute plumbing the hooks use (``gatherer.py`` decides
what they do). No communication here: these only call the callbacks they are handed.

* :class:`PreBackward`: identity in forward; in backward it asks for a module's units
  (the gatherer's callback) just before that module's backward runs.
* :func:`wrap_outputs`: routes the differentiable tensors of a module's output
  (tensor, tuple, named tuple, list, dict, ``ModelOutput``, dataclass instance: e.g.
  the MoE router's ``Routes``) through it.
* :class:`AccessTrackingDict`: a module's ``_parameters`` that reports each
  ``module.name`` read, so parameters used outside their own module are gathered too.

Every module gets a pre- and a post-forward hook, but for the modules inside a leaf
(``leaves.py``) or a compile region (``regions.py``): a leaf or a region gathers all of
its descendants' units at once. A module's units are those of the parameters it owns
directly (a leaf's or region's: of all its descendants), shared ones included, less
the persistent ones; the gatherer adds those it sees the module read from other modules.
Each module's ``_parameters`` reports reads through ``module.name``
(:class:`AccessTrackingDict`), but inside a region, whose forward must hold no Python
of ours (``torch.compile`` traces it). With more than one rank, modules carry FSDP2's
``_is_fsdp_managed_module`` marker, so Hugging Face ``generate()`` keeps every rank
running forwards until all are done (``synced_gpus``), as it does for DeepSpeed ZeRO-3
and FSDP.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch
from torch import nn


class PreBackward(torch.autograd.Function):
    """Identity in forward; in backward, ``gather(units)`` before the module's backward runs."""

    @staticmethod
    def forward(ctx, gather, units, *tensors):
        ctx.gather, ctx.units = gather, units
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.gather(ctx.units)
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


def wrap_outputs(output, gather: Callable[[tuple[int, ...]], None], units: tuple[int, ...]):
    """Route the floating-point tensors of ``output`` through :class:`PreBackward`, which
    calls ``gather(units)`` in backward."""
    if torch.is_tensor(output):
        if output.requires_grad:
            return PreBackward.apply(gather, units, output)
        return output
    if isinstance(output, (tuple, list)):
        idx = [i for i, o in enumerate(output) if torch.is_tensor(o) and o.requires_grad]
        if not idx:
            return output
        wrapped = PreBackward.apply(gather, units, *(output[i] for i in idx))
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
        wrapped = PreBackward.apply(gather, units, *(output[k] for k in keys))
        wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
        new = output.copy()  # keeps the mapping type (e.g. a transformers ModelOutput)
        for k, w in zip(keys, wrapped, strict=True):
            new[k] = w
        return new
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        # a router's Routes, say: without the wrap its module's units (a weight read
        # from a child, gathered on access) would not be gathered for its backward
        fields = [f.name for f in dataclasses.fields(output) if f.init]
        names = [n for n in fields if torch.is_tensor(v := getattr(output, n)) and v.requires_grad]
        if not names:
            return output
        wrapped = PreBackward.apply(gather, units, *(getattr(output, n) for n in names))
        wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
        return dataclasses.replace(output, **dict(zip(names, wrapped, strict=True)))
    return output


def _outermost(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """The modules of ``modules`` that are not inside another of them."""
    modules = list(dict.fromkeys(modules))
    inner = {id(d) for m in modules for d in m.modules() if d is not m}
    return [m for m in modules if id(m) not in inner]


class ModuleWiring:
    """The hooks on ``root``'s modules and each hooked module's units (:attr:`units_of`).

    ``segment_of`` maps ``id(parameter)`` to its unit; ``names`` (one entry per unit) is
    filled with the name of the module each unit belongs to. ``pre_forward``,
    ``post_forward`` and ``on_access`` are the callbacks the hooks call."""

    def __init__(
        self,
        root: nn.Module,
        leaves: Iterable[nn.Module],
        segment_of: dict[int, int],
        persistent: set[int],
        names: list[str],
        *,
        pre_forward: Callable,
        post_forward: Callable,
        on_access: Callable[[torch.Tensor], None],
        synced: bool,
    ) -> None:
        self.root, self.leaves = root, list(leaves)
        self._segment_of, self._persistent, self._names = segment_of, persistent, names
        self._pre, self._post, self._on_access = pre_forward, post_forward, on_access
        #: hooked module -> the units its pre-forward gathers
        self.units_of: dict[nn.Module, tuple[int, ...]] = {}
        self._hooks: list = []
        self.install(regions=())
        self._synced = synced
        for m in root.modules():
            if synced and not hasattr(m, "_is_fsdp_managed_module"):
                m._is_fsdp_managed_module = True  # type: ignore[assignment]

    def install(self, regions: Iterable[nn.Module]) -> None:
        """(Re)install the hooks, with each of ``regions`` gathered as a whole."""
        self._remove_hooks()
        regions = list(regions)
        whole = _outermost([*self.leaves, *regions])
        inside = {id(d) for m in whole for d in m.modules() if d is not m}
        plain = {id(d) for r in regions for d in r.modules()}
        whole_ids = {id(m) for m in whole}
        self.units_of.clear()
        for name, m in reversed(list(self.root.named_modules())):
            owned = m.parameters(recurse=id(m) in whole_ids)
            units = {self._segment_of[id(p)] for p in owned if id(p) in self._segment_of}
            for s in units:
                self._names[s] = name or "(the root module)"
            tracked = isinstance(m._parameters, AccessTrackingDict)
            if id(m) in plain and tracked:
                m._parameters = dict(m._parameters)
                # dynamo takes the marker for FSDP1's (graph break); generate() reads it
                # on the model only, never inside a region
                m.__dict__.pop("_is_fsdp_managed_module", None)
            elif id(m) not in plain and not tracked:
                m._parameters = AccessTrackingDict(m._parameters, self._on_access)
            if id(m) in inside:  # gathered with its leaf or region; no hooks of its own
                continue
            self.units_of[m] = tuple(sorted(units - self._persistent))
            self._hooks.append(m.register_forward_pre_hook(self._pre))
            self._hooks.append(m.register_forward_hook(self._post))

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def remove(self) -> None:
        """Teardown: every hook, tracking dict and marker goes."""
        self._remove_hooks()
        for m in self.root.modules():
            if isinstance(m._parameters, AccessTrackingDict):
                m._parameters = dict(m._parameters)
            if self._synced and getattr(m, "_is_fsdp_managed_module", False):
                del m._is_fsdp_managed_module
