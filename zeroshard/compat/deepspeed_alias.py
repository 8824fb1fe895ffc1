"""Opt-in: ``import deepspeed`` gives zeroshard, so Hugging Face code runs on it unchanged.

``register()`` (what ``import zeroshard.as_deepspeed`` and ``zeroshard run --as-deepspeed``
do) appends two things to ``sys.meta_path``:

* a module finder that serves ``deepspeed`` and the ``deepspeed.*`` modules integrations
  import (table in ``deepspeed_names.MODULES``) as thin modules forwarding to zeroshard's
  names (``deepspeed.zero.Init is zeroshard.zero.Init``); modules zeroshard does not build
  (``deepspeed_names.NOT_BUILT``) raise ImportError saying so;
* a distribution finder, so ``importlib.metadata.version("deepspeed")`` answers
  :data:`DEEPSPEED_VERSION` (transformers requires ``deepspeed>=0.9.3``; accelerate and
  transformers gate a few calls on versions; the local part ``+zeroshard...`` says what
  it is).

It never shadows a real DeepSpeed: if one is installed (importable, or its distribution
metadata present), ``register()`` raises instead of registering, and the finders sit at
the end of ``sys.meta_path`` in any case. It must run before transformers or accelerate
look for DeepSpeed (they decide once, at import), so ``register()`` refuses to run after
``transformers.integrations.deepspeed`` or ``accelerate.utils`` were imported.

No communication.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import pathlib
import sys
import types

from zeroshard import ZeroshardError
from zeroshard.compat.deepspeed_names import DUNDERS, MODULES, NOT_BUILT
from zeroshard.compat.ds_version import DEEPSPEED_VERSION

__all__ = ["DEEPSPEED_VERSION", "AliasError", "register", "registered", "unregister"]

#: imported before ``register()``, these have already decided DeepSpeed is absent
_DECIDED_EARLY = ("transformers.integrations.deepspeed", "accelerate.utils")


class AliasError(ZeroshardError, RuntimeError):
    """``register()`` cannot (a real DeepSpeed is installed, or it came too late)."""


class _AliasModule(types.ModuleType):
    """A ``deepspeed.*`` module: its names come from zeroshard (see ``MODULES``)."""

    def __getattr__(self, name: str):
        if (self.__name__, name) in DUNDERS:  # deepspeed.__version__, ops.__compatible_ops__
            return DUNDERS[(self.__name__, name)]()
        if name.startswith("__"):
            raise AttributeError(name)
        sub = f"{self.__name__}.{name}"
        if sub in MODULES:
            return importlib.import_module(sub)
        if sub in NOT_BUILT:
            raise AttributeError(f"{sub}: {NOT_BUILT[sub]} is not built yet in zeroshard")
        target = MODULES[self.__name__]
        if isinstance(target, str):
            return getattr(importlib.import_module(target), name)
        names = target()
        if name in names:
            return names[name]
        raise AttributeError(
            f"module {self.__name__!r} (zeroshard's alias) has no attribute {name!r}"
        )

    def __dir__(self):
        target = MODULES[self.__name__]
        own = dir(importlib.import_module(target)) if isinstance(target, str) else list(target())
        subs = [m.rsplit(".", 1)[1] for m in MODULES if m.rpartition(".")[0] == self.__name__]
        return sorted({*own, *subs})


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return _AliasModule(spec.name)

    def exec_module(self, module) -> None:
        target = MODULES[module.__name__]
        module.__doc__ = f"zeroshard's stand-in for {module.__name__} (names from {target if isinstance(target, str) else 'zeroshard'})"


class _NotBuiltLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        name = module.__name__
        base = next(m for m in NOT_BUILT if name == m or name.startswith(m + "."))
        raise ImportError(f"{name}: {NOT_BUILT[base]} is not built yet in zeroshard", name=name)


class _Distribution(importlib.metadata.Distribution):
    """The metadata a ``deepspeed`` install would have: name and version."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return (
                "Metadata-Version: 2.1\nName: deepspeed\n"
                f"Version: {DEEPSPEED_VERSION}\n"
                "Summary: zeroshard answering as DeepSpeed (zeroshard.as_deepspeed)\n"
            )
        return None

    def locate_file(self, path) -> pathlib.Path:
        return pathlib.Path(__file__).parent / str(path)


class DeepSpeedAliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``deepspeed`` modules (zeroshard's) and the ``deepspeed`` distribution."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname in MODULES:
            is_pkg = any(m.startswith(fullname + ".") for m in (*MODULES, *NOT_BUILT))
            return importlib.machinery.ModuleSpec(
                fullname, _Loader(), origin="zeroshard", is_package=is_pkg
            )
        if any(fullname == m or fullname.startswith(m + ".") for m in NOT_BUILT):
            return importlib.machinery.ModuleSpec(fullname, _NotBuiltLoader(), origin="zeroshard")
        return None

    def find_distributions(self, context=None):
        name = getattr(context, "name", None)
        if name is not None and name.replace("_", "-").lower() == "deepspeed":
            return iter([_Distribution()])
        return iter(())


def registered() -> bool:
    return any(isinstance(f, DeepSpeedAliasFinder) for f in sys.meta_path)


def _real_deepspeed() -> str | None:
    """Where a real DeepSpeed is, if one is installed (our finder not registered)."""
    mod = sys.modules.get("deepspeed")
    if mod is not None and not isinstance(mod, _AliasModule):
        return getattr(mod, "__file__", None) or "an imported module"
    try:
        spec = importlib.util.find_spec("deepspeed")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        return spec.origin or "an importable package"
    try:
        dist = importlib.metadata.distribution("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None
    return f"distribution metadata of deepspeed {dist.version}"


def register() -> DeepSpeedAliasFinder:
    """Make ``import deepspeed`` (and its metadata) give zeroshard; idempotent.

    Raises :class:`AliasError` if a real DeepSpeed is installed, or if transformers or
    accelerate already decided DeepSpeed is absent (register first).
    """
    for f in sys.meta_path:
        if isinstance(f, DeepSpeedAliasFinder):
            return f
    real = _real_deepspeed()
    if real is not None:
        raise AliasError(
            f"zeroshard.as_deepspeed: a real DeepSpeed is installed ({real}); zeroshard "
            "does not shadow it. Uninstall it to run Hugging Face code on zeroshard, or "
            "call zeroshard's API directly (import zeroshard as deepspeed)"
        )
    early = [m for m in _DECIDED_EARLY if m in sys.modules]
    if early:
        raise AliasError(
            f"zeroshard.as_deepspeed: {early[0]} was imported before it, and has already "
            "decided that DeepSpeed is absent; put `import zeroshard.as_deepspeed` before "
            "any transformers / accelerate import, or launch with `zeroshard run --as-deepspeed`"
        )
    finder = DeepSpeedAliasFinder()
    sys.meta_path.append(finder)
    importlib.invalidate_caches()
    return finder


def unregister() -> None:
    """Remove the finders and the ``deepspeed`` modules they served (for tests)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, DeepSpeedAliasFinder)]
    for name in [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]:
        if isinstance(sys.modules[name], _AliasModule):
            del sys.modules[name]
