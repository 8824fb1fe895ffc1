"""Which Linear layers of a model run fp8 matmuls (the config's ``fp8`` section), and the
swap that makes them, done by the engine after tensor parallelism and before ZeRO lays
the parameters out.

* ``nn.Linear`` (exactly that class) becomes torchao's ``Float8Linear``: the same
  ``weight`` and ``bias`` Parameters (so the high-precision weights, their names and
  checkpoints are unchanged), an fp8 matmul inside. torchao is the optional extra
  ``zeroshard[fp8]``, imported only here.
* What torchao does not convert gets the hand-written matmul of ``scaled_mm.py`` (the
  same numerics): the tensor-parallel column/row layers, whose scales must be the unsplit
  tensor's (torchao's come from the local shard unless the weights are DTensors), and
  Hugging Face's ``Conv1D`` (GPT-2's Linear, stored transposed).
* Kept in bf16, each named once at start-up with the reason: layers named by
  ``fp8.filter_fqns``, layers whose matmul dimensions (this rank's shard under tensor
  parallelism) are not multiples of 16 (the fp8 kernels refuse them), subclasses of
  ``nn.Linear`` with a forward of their own, layers whose swap would drop what they
  carry (a forward set on the instance, such as an activation checkpointing wrapper;
  hooks on an ``nn.Linear``), and a model that is one Linear itself.
* Whatever holds a converted layer must look it up by name when it runs (a
  ``PipelineModule`` does: ``layer(i)``); a reference kept from before the swap runs
  the old bf16 layer.

:meth:`Fp8Model.undo` puts every layer back (``engine.destroy()``). No communication
here; the tensor-parallel matmuls all-reduce their amaxes (``scaled_mm.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import MethodType
from typing import Any, cast

import torch
from torch import nn

from zeroshard import ZeroshardError
from zeroshard.fp8.scaled_mm import RECIPES, Recipe, Split, fp8_linear
from zeroshard.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear, is_conv1d

_TP_LAYERS = (ColumnParallelLinear, RowParallelLinear)

INSTALL = "pip install 'zeroshard[fp8]' (torchao >= 0.18)"
# fp8 tensor cores: Ada (8.9: L4, L40, RTX 4090), Hopper (9.0: H100, H200), Blackwell (10+)
MIN_CAPABILITY = (8, 9)


class Fp8Error(ZeroshardError, ValueError):
    """fp8 asked of a model or an environment that cannot run it; names the key."""


@contextlib.contextmanager
def _quiet(*names: str) -> Iterator[None]:
    """Raise these loggers to ERROR for a moment (torchao's import reports the CUDA
    kernels a CPU build of torch cannot load, and a deprecation inside torch)."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def torchao_float8() -> Any:
    """torchao's ``float8`` package, or :class:`Fp8Error` saying how to install it."""
    try:
        with _quiet("torchao", "torch.utils._pytree"):
            import torchao.float8 as float8
    except ImportError as err:
        raise Fp8Error(
            f"fp8.enabled: fp8 training needs torchao, which is not installed ({err}); {INSTALL}"
        ) from None
    return float8


def check_fp8_device(
    device: torch.device, capability: Callable[[torch.device], tuple[int, int]] | None = None
) -> None:
    """Refuse a CUDA device without fp8 tensor cores (``torch._scaled_mm`` would fail at
    the first step, or an A100 would run a slow emulation), naming the card and the key.
    The CPU runs fp8 matmuls (numerics, not speed: the tests). ``capability``: how to ask
    (torch.cuda.get_device_capability)."""
    if device.type != "cuda":
        return
    major, minor = (capability or torch.cuda.get_device_capability)(device)
    if (major, minor) < MIN_CAPABILITY:
        raise Fp8Error(
            f"fp8.enabled: {device} has compute capability {major}.{minor}; fp8 matmuls need "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or higher (L4/L40/RTX 4090, H100/H200, "
            "B200). Train in bf16 on this GPU (leave the fp8 section out)"
        )


def is_torchao_linear(module: nn.Module) -> bool:
    """torchao's ``Float8Linear`` (checked by name: torchao need not be importable)."""
    cls = type(module)
    return cls.__name__ == "Float8Linear" and cls.__module__.startswith("torchao.")


@dataclass
class Fp8Model:
    """What :func:`convert_to_fp8` did to a model."""

    recipe: str
    torchao: list[str] = field(default_factory=list)  # now torchao Float8Linear
    hand: list[str] = field(default_factory=list)  # the hand-written matmul (TP, Conv1D)
    before: list[str] = field(default_factory=list)  # Float8Linear before initialize()
    kept: list[tuple[str, str]] = field(default_factory=list)  # (name, why) in bf16
    _swapped: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list, repr=False)
    _patched: list[nn.Module] = field(default_factory=list, repr=False)
    _also: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def also_undo(self, step: Callable[[], None]) -> None:
        """Run ``step`` first at :meth:`undo` (the fp8 all-gather's forwards, gather.py)."""
        self._also.append(step)

    def summary(self) -> str:
        """One start-up line: how many layers run fp8, and each kept in bf16, with why."""
        n = len(self.torchao) + len(self.hand) + len(self.before)
        parts = [f"fp8 ({self.recipe}): {n} Linear layer(s) run fp8 matmuls"]
        if self.hand:
            parts.append(f"{len(self.hand)} of them tensor-parallel or Conv1D (global scales)")
        if self.before:
            parts.append(f"{len(self.before)} converted by torchao before initialize()")
        if self.kept:
            kept = "; ".join(f"{name} ({why})" for name, why in self.kept)
            parts.append(f"kept in bf16: {kept}")
        return "zeroshard: " + "; ".join(parts)

    def undo(self) -> None:
        """Every converted layer back to what it was (the same Parameters)."""
        for step in reversed(self._also):
            step()
        self._also.clear()
        for parent, attr, original in reversed(self._swapped):
            setattr(parent, attr, original)
        for m in self._patched:
            if isinstance(m, _TP_LAYERS):
                m.linear_fn = None
            else:
                m.__dict__.pop("forward", None)
        self._swapped.clear()
        self._patched.clear()


def _conv1d_forward(self: nn.Module, x: torch.Tensor, *, recipe: Recipe) -> torch.Tensor:
    w, bias = cast(torch.Tensor, self.weight), cast(torch.Tensor | None, self.bias)
    y = fp8_linear(x, w.t(), recipe)  # Conv1D stores (in, out)
    return y if bias is None else y + bias.to(y.dtype)


def _matmul_shape(m: nn.Module) -> tuple[int, int]:
    """(out, in) of the matmul this layer runs on this rank."""
    w = cast(torch.Tensor, m.weight)
    transposed = is_conv1d(m) or getattr(m, "transposed", False)
    return (w.shape[1], w.shape[0]) if transposed else (w.shape[0], w.shape[1])


_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _lost_in_swap(m: nn.Module) -> str | None:
    """Why converting ``m`` would silently drop something it carries, or None: torchao
    builds a new module from the weights (an instance ``forward`` such as an activation
    checkpointing wrapper, and hooks, stay on the old one), and Conv1D's fp8 forward is
    set on the instance (it would replace one already there)."""
    if "forward" in m.__dict__:
        return "its forward was replaced on the instance (activation checkpointing or another wrapper), which the fp8 swap would drop"  # fmt: skip
    if type(m) is nn.Linear and any(getattr(m, h, None) for h in _HOOKS):
        return "it has forward or backward hooks, which the fp8 swap would drop"
    return None


def _parent(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (root.get_submodule(path) if path else root), attr


def preconverted(module: nn.Module) -> list[str]:
    """Names of the torchao ``Float8Linear`` layers a model arrives with."""
    return [n for n, m in module.named_modules() if is_torchao_linear(m)]


def unwrap_fp8_weights(module: nn.Module) -> dict[int, nn.Parameter]:
    """Replace every Parameter that wraps its tensor for FSDP2's fp8 all-gather (torchao's
    ``WeightWithDynamicFloat8CastTensor``: zeroshard's flat layout cannot hold it, and
    training it gives wrong results) by the Parameter it wraps (the one an optimizer built
    before the conversion holds), in every module that holds it (tied ones too); returns
    ``{id(wrapper): parameter}``."""
    plain: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is None or type(p) is nn.Parameter or not is_torchao_linear(m):
                continue
            inner = getattr(p, "_tensor", None)
            if inner is None:
                continue
            if id(p) not in plain:
                keep = type(inner) is nn.Parameter
                plain[id(p)] = inner if keep else nn.Parameter(inner.detach(), requires_grad=p.requires_grad)  # fmt: skip
            m._parameters[name] = plain[id(p)]
    return plain


def convert_to_fp8(module: nn.Module, cfg: Any) -> Fp8Model:
    """Give ``module``'s Linear layers fp8 matmuls as the ``fp8`` section ``cfg`` says
    (tensor-parallel layers reduce their amaxes over their own ``comm``). Raises
    :class:`Fp8Error` when torchao is missing, a ``filter_fqns`` entry matches no Linear
    layer, or no layer can run fp8 at all."""
    recipe = RECIPES[cfg.recipe_name]
    report = Fp8Model(recipe.name)
    candidates: list[tuple[str, nn.Module]] = []
    linear_names: list[str] = []
    for name, m in module.named_modules():
        if is_torchao_linear(m):
            report.before.append(name)
            linear_names.append(name)
        elif type(m) is nn.Linear or is_conv1d(m) or isinstance(m, _TP_LAYERS):
            candidates.append((name, m))
            linear_names.append(name)
        elif isinstance(m, nn.Linear):
            report.kept.append((name, f"{type(m).__name__}, a subclass of nn.Linear with its own forward"))  # fmt: skip
            linear_names.append(name)
    for i, pattern in enumerate(cfg.filter_fqns):
        if not any(pattern in n for n in linear_names):
            shown = ", ".join(linear_names[:12]) + (", ..." if len(linear_names) > 12 else "")
            raise Fp8Error(
                f"fp8.filter_fqns[{i}]: {pattern!r} is in the name of no Linear layer of the "
                f"model (a layer is kept in bf16 when its name contains an entry); its Linear "
                f"layers: {shown or 'none'}"
            )
    chosen: list[tuple[str, nn.Module]] = []
    for name, m in candidates:
        skip = next((p for p in cfg.filter_fqns if p in name), None)
        out_f, in_f = _matmul_shape(m)
        lost = None if isinstance(m, _TP_LAYERS) else _lost_in_swap(m)
        if skip is not None:
            report.kept.append((name, f"fp8.filter_fqns {skip!r}"))
        elif out_f % 16 or in_f % 16:
            where = " on this rank" if isinstance(m, _TP_LAYERS) else ""  # fmt: skip
            report.kept.append((name, f"matmul {in_f} -> {out_f}{where}: fp8 kernels need dimensions divisible by 16"))  # fmt: skip
        elif name == "" and type(m) is nn.Linear:
            report.kept.append(("(the model)", "the model is one nn.Linear: nothing holds it to swap"))  # fmt: skip
        elif lost is not None:
            report.kept.append((name, lost))
        else:
            chosen.append((name, m))
    if not chosen and not report.before:
        why = "; ".join(f"{n} ({w})" for n, w in report.kept) or "the model has no Linear layer"
        raise Fp8Error(f"fp8.enabled: no Linear layer of the model can run fp8 matmuls: {why}")
    to_torchao = {name: m for name, m in chosen if type(m) is nn.Linear}
    if to_torchao:
        float8 = torchao_float8()
        config = dataclasses.replace(
            float8.Float8LinearConfig.from_recipe_name(recipe.name), pad_inner_dim=True
        )
        for name, m in to_torchao.items():
            parent, attr = _parent(module, name)
            report._swapped.append((parent, attr, m))
        float8.convert_to_float8_training(
            module, config=config, module_filter_fn=lambda m, fqn: fqn in to_torchao
        )
        report.torchao = list(to_torchao)
    for name, m in chosen:
        if isinstance(m, _TP_LAYERS):
            split = Split(m.comm, "out" if isinstance(m, ColumnParallelLinear) else "in")
            m.linear_fn = functools.partial(fp8_linear, recipe=recipe, split=split)
        elif is_conv1d(m):
            m.forward = MethodType(functools.partial(_conv1d_forward, recipe=recipe), m)
        else:
            continue
        report._patched.append(m)
        report.hand.append(name)
    return report
