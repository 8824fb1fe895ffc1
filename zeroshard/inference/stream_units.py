"""The units ZeRO-Inference streams a model by (``streaming.py``), and where each of
their tensors sits: which modules form a unit, each tensor's slot in the store and in a
unit's buffer, the reads that fill a buffer, placeholders. No communication, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from zeroshard.offload.nvme import round_up

# -- units --------------------------------------------------------------------------------


def _layer_lists(model: nn.Module) -> set[str]:
    """Names of the outermost ``ModuleList``s of two or more layers that hold parameters
    (decoder blocks; an encoder-decoder's two stacks); lists inside them (experts) are
    part of their layer."""
    lists: set[str] = set()
    for name, m in model.named_modules():
        if not (isinstance(m, nn.ModuleList) and len(m) > 1 and any(True for _ in m.parameters())):
            continue
        if not any(name.startswith(outer + ".") for outer in lists):
            lists.add(name)
    return lists


def plan_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The units weights are streamed by, in registration order: each layer of the
    outermost layer lists (``_layer_lists``), then every other module that owns
    parameters itself."""
    lists = _layer_lists(model)
    units: list[tuple[str, nn.Module]] = []
    inside: str | None = None
    for name, m in model.named_modules():
        if inside is not None and name.startswith(inside + "."):
            continue
        inside = None
        parent, _, _ = name.rpartition(".")
        if name and parent in lists:
            units.append((name, m))
            inside = name
        elif any(True for _ in m.parameters(recurse=False)):
            units.append((name, m))
    return units


def placeholder(shape, dtype, device) -> torch.Tensor:
    return torch.empty((), dtype=dtype, device=device).expand(shape)


@dataclass
class Slot:
    """One tensor's place: its bytes in the source and in a unit's buffer. A parameter
    (shared by every module that holds it) or a tensor attribute of one module (the
    kernel tensors of a quantized layer)."""

    offset: int  # in the source
    shape: tuple[int, ...]
    dtype: torch.dtype
    param: nn.Parameter | None = None
    owner: nn.Module | None = None
    attr: str = ""
    nbytes: int = 0
    at: int = 0  # in the unit's buffer

    def point(self, t: torch.Tensor) -> None:
        if self.param is not None:
            self.param.data = t
        else:
            setattr(self.owner, self.attr, t)

    def current(self) -> torch.Tensor:
        return self.param if self.param is not None else getattr(self.owner, self.attr)


@dataclass
class Unit:
    name: str
    module: nn.Module
    slots: list[Slot] = field(default_factory=list)
    nbytes: int = 0  # of its buffer (aligned slots)
    runs: list[tuple[int, int, int]] = field(default_factory=list)  # (source, buffer, bytes)


def kernel_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A quantized layer's tensors (buffers and the kernel forms it derives), by attribute
    name; other modules have none here (their parameters are streamed)."""
    from zeroshard.inference.quantize import QuantLinear

    if not isinstance(module, QuantLinear):
        return []
    out = []
    for attr, t in list(vars(module).items()) + list(module._buffers.items()):
        if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and t.numel():
            out.append((attr, t))
    return out


def with_values(module: nn.Module, values: dict[int, torch.Tensor], fn) -> None:
    """Run ``fn`` with ``module``'s placeholder parameters temporarily set to real
    tensors ``values`` (by id of the placeholder), then put the placeholders back."""
    saved = []
    for m in module.modules():
        for attr, p in list(m._parameters.items()):
            if p is not None and id(p) in values:
                saved.append((m, attr, p))
                m._parameters[attr] = nn.Parameter(values[id(p)], requires_grad=False)
    try:
        with torch.no_grad():
            fn()
    finally:
        for m, attr, p in saved:
            m._parameters[attr] = p


def reads(slots: list[Slot]) -> list[tuple[int, int, int]]:
    """Coalesce slots contiguous in both the source and the buffer into single reads."""
    runs: list[tuple[int, int, int]] = []
    for s in slots:
        n = round_up(s.nbytes)
        if runs and runs[-1][0] + runs[-1][2] == s.offset and runs[-1][1] + runs[-1][2] == s.at:
            src, at, m = runs[-1]
            runs[-1] = (src, at, m + n)
        else:
            runs.append((s.offset, s.at, n))
    return runs
