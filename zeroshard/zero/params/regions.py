"""The compile regions of a module: the units ``engine.compile()`` compiles one by one
when parameters are gathered per unit (stage 3, and stages 1-2 with
``overlap_param_gather``; ``runtime/compiling.py`` compiles them). No communication.

A region is a repeated block (a child of an ``nn.ModuleList`` that holds parameters),
a module gathered whole already (a stage-3 leaf), or a module that owns parameters
outside those (embeddings, final norm, head). The strategies gather a region whole, so
no collective and no parameter guard runs inside a compiled region.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


def find_regions(module: nn.Module, whole: Iterable[nn.Module] = ()) -> list[nn.Module]:
    """The regions of ``module`` (see the module docstring), outermost first, in module
    order; ``whole``: modules that are gathered as one piece already (stage-3 leaves),
    each one region."""
    whole_ids = {id(m) for m in whole}
    blocks: set[int] = set()
    for m in module.modules():
        if isinstance(m, nn.ModuleList):
            blocks.update(id(c) for c in m if any(True for _ in c.parameters()))
    regions: list[nn.Module] = []
    inside: set[int] = set()
    for m in module.modules():
        if id(m) in inside:
            continue
        owns = any(True for _ in m.parameters(recurse=False))
        if id(m) in blocks or id(m) in whole_ids or (owns and m is not module):
            regions.append(m)
            inside.update(id(d) for d in m.modules())
    if not regions and any(True for _ in module.parameters(recurse=False)):
        regions.append(module)  # a module that owns every parameter itself
    return regions
