"""``torch.compile`` for the training engine (``engine.compile()`` and the config's
``compile`` section): which modules are compiled, and how. No communication.

Two ways, chosen by the parameter strategy (``zero/params/whole.py``,
``zero/params/gatherer.py``; the regions: ``zero/params/regions.py``):

* **the whole module** (stages 0-2 without ``overlap_param_gather``): ``module.compile()``,
  as DeepSpeed's ``engine.compile``; the forward hooks the engine installs there (input
  cast, first-batch size) are plain tensor code dynamo traces;
* **one region per gathered unit** (stage 3, and stages 1-2 with ``overlap_param_gather``),
  as FSDP2 is compiled block by block: the *regions* are the repeated blocks (the
  children of every ``nn.ModuleList`` that hold parameters) and every module that owns
  parameters outside them (embeddings, final norm, head). Each region's ``forward`` is
  compiled on its own; the strategy's hooks (stage 3: gather before the region, free
  after, gather again before its backward) run eagerly around it, and the strategy
  gathers a region whole, so no collective and no parameter guard is inside a graph.
  The glue between regions (the root's forward) stays eager.

Same blocks share one compiled graph (dynamo caches per code object; parameters are
graph inputs), so a 24-layer model compiles its block once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from zeroshard import ArgumentError, NotBuiltError

#: the attribute holding a compiled region's own forward (for :func:`uncompile_regions`)
_EAGER = "_zs_eager_forward"


def compile_regions(regions: Iterable[nn.Module], options: dict[str, Any]) -> None:
    """Replace each region's ``forward`` by ``torch.compile(forward, **options)``; its
    hooks stay outside the compiled code. Compiling again recompiles from the eager one."""
    for m in regions:
        eager = m.__dict__.get(_EAGER) or m.forward
        m.__dict__[_EAGER] = eager
        m.forward = torch.compile(eager, **options)


def uncompile_regions(module: nn.Module) -> None:
    """Give every compiled region of ``module`` its eager forward back."""
    for m in module.modules():
        eager = m.__dict__.pop(_EAGER, None)
        if eager is not None:
            if getattr(eager, "__self__", None) is m:  # the class's forward: drop the override
                m.__dict__.pop("forward", None)
            else:
                m.forward = eager


def compile_options(
    backend: str | Callable | None, compile_kwargs: dict | None, extra: dict
) -> dict[str, Any]:
    """``torch.compile``'s keyword arguments from ``engine.compile``'s: ``compile_kwargs``,
    then ``extra`` keywords, then ``backend`` (None: torch's default, inductor)."""
    options = dict(compile_kwargs or {})
    options.update(extra)
    if backend is not None:
        options["backend"] = backend
    return options


class UnknownBackendError(ArgumentError):
    """A ``torch.compile`` backend name torch does not know."""


def check_backend(backend: str | Callable | None) -> None:
    """Refuse a backend name dynamo does not know now, not at the first forward."""
    if not isinstance(backend, str):
        return
    from torch._dynamo import list_backends

    known = list_backends(exclude_tags=())
    if backend not in known:
        raise UnknownBackendError(
            f"unknown torch.compile backend {backend!r}; torch knows {', '.join(sorted(known))}"
        )


class ModuleCompiler:
    """``engine.compile()`` / ``uncompile()`` on one module: ``before()`` runs first (the
    engine lands what is in flight), ``regions_of(module)`` says what to compile (None:
    the whole module; see the module docstring)."""

    def __init__(
        self,
        module: nn.Module,
        *,
        before: Callable[[], None],
        regions_of: Callable[[nn.Module], list[nn.Module] | None],
    ) -> None:
        self.module, self.before, self.regions_of = module, before, regions_of
        self.is_compiled = False

    def compile(
        self,
        backend: str | Callable | None,
        compile_kwargs: dict | None,
        schedule: Any,
        compiled_autograd_enabled: bool,
        extra: dict[str, Any],
    ) -> None:
        """``torch.compile`` the module in place (see ``Engine.compile``)."""
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
        options = compile_options(backend, compile_kwargs, extra)
        check_backend(options.get("backend"))
        self.before()
        self.uncompile()
        regions = self.regions_of(self.module)
        if regions is None:
            self.module.compile(**options)
        else:
            compile_regions(regions, options)
        self.is_compiled = True

    def uncompile(self) -> None:
        """Back to the eager module."""
        uncompile_regions(self.module)
        self.module._compiled_call_impl = None  # what nn.Module.compile() set
        self.is_compiled = False
