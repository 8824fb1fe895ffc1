"""Stage-3 leaf modules: modules whose parameters are gathered together, as one piece,
when the module's forward starts, however its inside runs. No communication.

Data-dependent control flow inside a module (an MoE block that sends no token to some
expert on one rank, a branch taken on one rank only) would make ranks gather different
parameters, and the all-gathers would not match. Marking the module a *leaf* makes
every rank gather all of its parameters at its pre-forward (and again before its
backward), whatever runs inside. DeepSpeed's names and defaults: ``set_z3_leaf_modules``
(it sets ``module._z3_leaf``) and the config section ``zero_optimization.leaf_module``
(``classes``, ``names``, ``name_suffixes``; by default the MoE blocks of Mixtral,
Qwen2-MoE and Qwen3-MoE).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from zeroshard import ArgumentError
from zeroshard.config import DEFAULT_LEAF_CLASSES


def _class_matches(module: nn.Module, names: Iterable[type | str]) -> bool:
    cls = type(module)
    qualified = f"{cls.__module__}.{cls.__qualname__}"
    for want in names:
        if isinstance(want, type):
            if isinstance(module, want):
                return True
        elif want in (cls.__name__, qualified):
            return True
    return False


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Iterable[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Mark every module of ``model`` of one of ``leaf_module_classes`` (classes, or
    class names, plain or qualified) as a stage-3 leaf; returns the modules marked.
    Call it before ``initialize``."""
    classes = list(leaf_module_classes)
    marked = [m for m in model.modules() if _class_matches(m, classes)]
    if raise_if_not_found and not marked:
        raise ArgumentError(f"set_z3_leaf_modules: no module of {classes} in the model")
    for m in marked:
        m._z3_leaf = True  # type: ignore[assignment]
    return marked


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: Iterable[type | str]) -> None:
    """Undo :func:`set_z3_leaf_modules` for modules of those classes."""
    classes = list(leaf_module_classes)
    for m in model.modules():
        if _class_matches(m, classes) and getattr(m, "_z3_leaf", False):
            del m._z3_leaf


def z3_leaf_module(module: nn.Module) -> bool:
    """Whether ``module`` was marked a stage-3 leaf."""
    return bool(getattr(module, "_z3_leaf", False))


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` marked as stage-3 leaves (DeepSpeed's name)."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def find_leaves(model: nn.Module, config=None) -> list[nn.Module]:
    """The outermost leaf modules of ``model``: marked ones, and those the config's
    ``leaf_module`` section names (by class, by name, or by name suffix; without the
    section, DeepSpeed's default MoE block classes)."""
    classes = list(config.classes) if config is not None else list(DEFAULT_LEAF_CLASSES)
    names = set(config.names) if config is not None else set()
    suffixes = tuple(config.name_suffixes) if config is not None else ()
    leaves: list[nn.Module] = []
    inside: set[int] = set()
    for name, m in model.named_modules():
        if id(m) in inside:
            continue
        is_leaf = (
            z3_leaf_module(m)
            or _class_matches(m, classes)
            or name in names
            or (suffixes and name.endswith(suffixes))
        )
        if is_leaf and m is not model:
            leaves.append(m)
            inside.update(id(d) for d in m.modules())
    return leaves
