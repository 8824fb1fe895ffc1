"""Where the stage-3 gatherer's hooks sit on a model, and which units each hooked module
gathers (``gatherer.py`` decides what the hooks do). No communication here.

Every module gets a pre- and a post-forward hook, but for the modules inside a leaf
(``leaves.py``) or a compile region (``regions.py``): a leaf or a region gathers all of
its descendants' units at once. A module's units are those of the parameters it owns
directly (a leaf's or region's: of all its descendants), shared ones included, less
the persistent ones; the gatherer adds those it sees the module read from other modules.
Each module's ``_parameters`` reports reads through ``module.name``
(``hooks.AccessTrackingDict``), but inside a region, whose forward must hold no Python
of ours (``torch.compile`` traces it). With more than one rank, modules carry FSDP2's
``_is_fsdp_managed_module`` marker, so Hugging Face ``generate()`` keeps every rank
running forwards until all are done (``synced_gpus``), as it does for DeepSpeed ZeRO-3
and FSDP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from zeroshard.zero.params.hooks import AccessTrackingDict


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
