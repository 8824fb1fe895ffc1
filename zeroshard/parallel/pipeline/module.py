"""``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``: DeepSpeed's pipeline model API.

A :class:`PipelineModule` is a list of layers (``nn.Module`` instances, :class:`LayerSpec`
/ :class:`TiedLayerSpec` to build lazily, or plain callables such as ``torch.flatten``)
run one after the other, cut into ``num_stages x virtual_stages`` contiguous parts by
:func:`partition_layers`. Each rank builds only the parts of its own pipeline stage:
part ``c * num_stages + stage`` for its model chunks ``c < virtual_stages`` (one chunk
unless the schedule is interleaved).

Parameter names are global and independent of the cut, as in DeepSpeed: layer ``i``'s
parameters are ``"{i}.<name>"`` and a tied layer's are ``"tied_modules.<key>.<name>"``,
so a checkpoint written with two stages loads with one, or four, and back.

A :class:`TiedLayerSpec` key (or a ``TiedLayer`` from the Hugging Face splitter,
``split.py``) used on several stages is built on each of them; the engine
starts every copy from the first holder's values and sums the copies' gradients over
the stages that hold the key (``engine.py``).

Layers are looked up by name (their index, or their tie key) at every call, never held:
a layer replaced in place after construction (the fp8 section's ``Float8Linear``,
AutoTP's parallel layers, peft's LoRA layers, inference quantization) is the one that
runs, and ZeRO-3 gathers its parameters as it does the rest of the module tree.

No collectives: this module only builds and cuts layers. The stage is the rank's
coordinate on the mesh's ``pp`` axis (outermost: ``rank // (world / num_stages)``).
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeroshard import ZeroshardError


class PipelineError(ZeroshardError, ValueError):
    """A pipeline model that cannot be cut or run as asked; the message says why."""


class LayerSpec:
    """A layer to build later: ``LayerSpec(typename, *args, **kwargs)`` builds
    ``typename(*args, **kwargs)`` (an ``nn.Module`` class) on the stage that runs it."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise PipelineError(f"LayerSpec: {typename!r} is not an nn.Module class")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose parameters ``tied_weight_attr`` are shared by every TiedLayerSpec
    with the same ``key`` (e.g. an input embedding and the output projection);
    ``forward_fn(module, x)``, if given, replaces ``module(x)`` for this occurrence."""

    def __init__(
        self,
        key: str,
        typename: type,
        *module_args: Any,
        forward_fn: Callable[[Any, Any], Any] | None = None,  # (the module, x): any module type
        tied_weight_attr: str | Sequence[str] = ("weight",),
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key, self.forward_fn = key, forward_fn
        attrs = [tied_weight_attr] if isinstance(tied_weight_attr, str) else tied_weight_attr
        self.tied_weight_attr = tuple(attrs)


def _tied_key(layer: Any) -> str | None:
    """The tie key of a TiedLayerSpec or of the splitter's ``TiedLayer`` (duck-typed)."""
    if isinstance(layer, TiedLayerSpec):
        return layer.key
    if hasattr(layer, "key") and hasattr(layer, "forward_fn") and hasattr(layer, "module"):
        return layer.key
    return None


def _count_params(layer: Any) -> int:
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):  # count without allocating
            built = layer.build()
        return sum(p.numel() for p in built.parameters() if p.requires_grad)
    module = getattr(layer, "module", None)
    return _count_params(module) if isinstance(module, nn.Module) else 0


def _type_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    module = getattr(layer, "module", None)
    if _tied_key(layer) is not None and isinstance(module, nn.Module):
        return type(module).__name__
    return type(layer).__name__ if isinstance(layer, nn.Module) else getattr(layer, "__name__", "")


def _balanced(weights: list[float], parts: int) -> list[int]:
    """Boundaries ``[0, b1, ..., len]`` of ``parts`` non-empty contiguous parts that
    minimize the heaviest part (dynamic programming; ties: earlier cuts)."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the lightest possible heaviest part when the first i layers form k parts
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [n], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]


def partition_layers(layers: Sequence[Any], parts: int, method: str = "parameters") -> list[int]:
    """Cut ``layers`` into ``parts`` contiguous, non-empty parts; returns the boundaries
    ``[0, b1, ..., len(layers)]`` (part ``i`` is ``layers[b_i:b_{i+1}]``).

    ``method`` (DeepSpeed's ``partition_method``): ``"parameters"`` balances trainable
    parameter counts (a layer without parameters weighs as little as possible, so cuts
    fall between heavy layers); ``"uniform"`` balances the number of layers;
    ``"type:REGEX"`` balances the layers whose class name matches REGEX (case-insensitive),
    each weighing 1. ``"best"`` (DeepSpeed's config default) means ``"parameters"``."""
    n = len(layers)
    if parts < 1:
        raise PipelineError(f"PipelineModule: num_stages must be >= 1, got {parts}")
    if n < parts:
        raise PipelineError(
            f"PipelineModule: {parts} pipeline parts (stages x virtual stages) but only {n} "
            f"layer{'s' if n != 1 else ''}; every part needs at least one layer"
        )
    m = method.lower()
    if m in ("parameters", "best"):
        counts = [_count_params(layer) for layer in layers]
        # parameter-free layers get a tiny weight so ties split them evenly
        weights = [c + 1e-3 for c in counts]
    elif m == "uniform":
        weights = [1.0] * n
    elif m.startswith("type:"):
        pattern = re.compile(method[5:], re.IGNORECASE)
        weights = [1.0 if pattern.search(_type_name(layer)) else 1e-3 for layer in layers]
        matched = sum(w == 1.0 for w in weights)
        if matched < parts:
            raise PipelineError(
                f"PipelineModule: partition_method {method!r} matches {matched} layer"
                f"{'s' if matched != 1 else ''}, fewer than the {parts} pipeline parts"
            )
    else:
        raise PipelineError(
            f"PipelineModule: partition_method {method!r}: expected 'parameters', 'uniform' "
            "or 'type:REGEX'"
        )
    return _balanced(weights, parts)


@dataclass(frozen=True, kw_only=True)
class _Slot:
    """Where layer ``i`` lives: a child module (``child``, its name), a tied module
    (``tied``, its key, with the occurrence's ``forward_fn``) or a plain callable
    (``fn``). Modules are looked up by name at every call, never held: whatever swaps a
    layer in place (fp8's Float8Linear, AutoTP's parallel layers, peft's LoRA layers,
    inference quantization) is what runs. ``built``: the class name the layer was built
    with (``checkpointable_layers`` names the user's classes, not a swap's)."""

    child: str | None = None
    tied: str | None = None
    forward_fn: Callable[[Any, Any], Any] | None = None
    fn: Callable | None = None
    built: str = ""


def _checkpoint(function: Callable, *args: Any, use_reentrant: bool = True) -> Any:
    from torch.utils.checkpoint import checkpoint

    return checkpoint(function, *args, use_reentrant=use_reentrant)


class PipelineModule(nn.Module):
    """DeepSpeed's ``PipelineModule``: ``layers`` cut into ``num_stages`` stages.

    Args:
        layers: ``nn.Module``, :class:`LayerSpec`, :class:`TiedLayerSpec` or callables.
        num_stages: pipeline stages (default: ``pipeline.stages``... not known here, so
            required unless ``topology`` is given, which zeroshard does not take).
        loss_fn: ``loss_fn(outputs, labels)`` on the last stage.
        partition_method: see :func:`partition_layers`.
        activation_checkpoint_interval: checkpoint every this many layers (0: none).
        seed_layers / base_seed / seed_fn: seed ``base_seed + i`` before building layer
            ``i`` (so a layer's initial values do not depend on the cut).
        virtual_stages: zeroshard: model chunks per stage, for ``interleaved_1f1b``.
        stage_id: zeroshard: the stage to build (default: this rank's, from
            ``torch.distributed``); tests and tools build a given stage.
    """

    def __init__(
        self,
        layers: Sequence[Any],
        num_stages: int | None = None,
        topology: Any = None,
        loss_fn: Callable | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], None] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable | None = None,
        checkpointable_layers: Sequence[str] | None = None,
        dynamic_shape: bool = False,
        *,
        virtual_stages: int = 1,
        stage_id: int | None = None,
    ) -> None:
        super().__init__()
        if topology is not None:
            raise PipelineError(
                "PipelineModule: topology= is not built yet in zeroshard; give num_stages= "
                "(data and tensor parallel sizes come from the config)"
            )
        if num_stages is None:
            raise PipelineError("PipelineModule: num_stages is required")
        layers = list(layers)
        if not layers:
            raise PipelineError("PipelineModule: layers is empty")
        for i, layer in enumerate(layers):
            if not (isinstance(layer, (nn.Module, LayerSpec)) or callable(layer)):
                raise PipelineError(
                    f"PipelineModule: layers[{i}] ({type(layer).__name__}) is not an "
                    "nn.Module, a LayerSpec or a callable"
                )
        self.num_stages, self.virtual_stages = int(num_stages), int(virtual_stages)
        self.loss_fn = loss_fn
        self.partition_method = partition_method
        self.seed_layers, self.base_seed = seed_layers, base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self.dynamic_shape = dynamic_shape
        self.use_reentrant = True  # the config's pipeline.use_reentrant (set by the engine)
        self.stage_id = self._stage(stage_id)
        parts = self.num_stages * self.virtual_stages
        self.parts = partition_layers(layers, parts, partition_method)
        self.num_layers = len(layers)
        #: the global layer indices [lo, hi) of each model chunk on this stage
        mine = [c * self.num_stages + self.stage_id for c in range(self.virtual_stages)]
        self.chunk_ranges = [(self.parts[i], self.parts[i + 1]) for i in mine]
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, tuple[str, ...]] = {}
        #: every tie key -> the stages holding it (the same on every rank)
        self.tied_stages: dict[str, list[int]] = {}
        for part in range(parts):
            for i in range(self.parts[part], self.parts[part + 1]):
                key = _tied_key(layers[i])
                if key is not None:
                    stage = part % self.num_stages
                    holders = self.tied_stages.setdefault(key, [])
                    if stage not in holders:
                        holders.append(stage)
        #: layer index -> how to find it when called (see :meth:`layer`)
        self._slots: dict[int, _Slot] = {}
        for lo, hi in self.chunk_ranges:
            for i in range(lo, hi):
                self._slots[i] = self._build(i, layers[i], seed_fn)
        for key in self.tied_stages:
            self.tied_stages[key].sort()

    # -- construction ---------------------------------------------------------------
    def _stage(self, stage_id: int | None) -> int:
        if stage_id is None:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                world = dist.get_world_size()
                if world % self.num_stages:
                    raise PipelineError(
                        f"PipelineModule: num_stages={self.num_stages} does not divide the "
                        f"world size ({world})"
                    )
                stage_id = dist.get_rank() // (world // self.num_stages)  # pp is outermost
            elif self.num_stages == 1:
                stage_id = 0
            else:
                raise PipelineError(
                    f"PipelineModule: num_stages={self.num_stages} needs torch.distributed "
                    "initialized first (call zeroshard.init_distributed()), or stage_id="
                )
        if not 0 <= stage_id < self.num_stages:
            raise PipelineError(f"PipelineModule: stage_id {stage_id} out of range")
        return stage_id

    def _build(self, index: int, layer: Any, seed_fn: Callable | None) -> _Slot:
        key = _tied_key(layer)
        if key is not None:
            if key not in self.tied_modules:
                self._seed(index, seed_fn)
                module = layer.build() if isinstance(layer, LayerSpec) else layer.module
                self.tied_modules[key] = module
                self.tied_weight_attrs[key] = tuple(layer.tied_weight_attr)
            module = self.tied_modules[key]
            return _Slot(tied=key, forward_fn=layer.forward_fn, built=type(module).__name__)
        if isinstance(layer, LayerSpec):
            self._seed(index, seed_fn)
            layer = layer.build()
        if isinstance(layer, nn.Module):
            self.add_module(str(index), layer)
            return _Slot(child=str(index), built=type(layer).__name__)
        return _Slot(fn=layer, built=getattr(layer, "__name__", type(layer).__name__))

    def _seed(self, index: int, seed_fn: Callable | None) -> None:
        if not self.seed_layers:
            return
        if seed_fn is not None:
            seed_fn(self.base_seed + index)
        else:
            random.seed(self.base_seed + index)
            torch.manual_seed(self.base_seed + index)

    # -- queries ----------------------------------------------------------------------
    def stage_of_layer(self, index: int) -> int:
        """The pipeline stage that runs global layer ``index``."""
        for part in range(len(self.parts) - 1):
            if self.parts[part] <= index < self.parts[part + 1]:
                return part % self.num_stages
        raise IndexError(index)

    def tied_parameters(self, key: str) -> list[tuple[str, nn.Parameter]]:
        """``(global name, parameter)`` of the tied weights of ``key`` on this stage."""
        module = self.tied_modules[key]
        out = []
        for attr in self.tied_weight_attrs[key]:
            p: Any = module
            for part in attr.split("."):
                p = getattr(p, part)
            out.append((f"tied_modules.{key}.{attr}", p))
        return out

    def layer(self, index: int) -> Callable:
        """What runs as global layer ``index`` on this stage, looked up now: the module
        registered under its name (or its tie key) at this moment, so a module swapped
        in place after construction is the one that runs."""
        slot = self._slots.get(index)
        if slot is None:
            raise PipelineError(
                f"PipelineModule: layer {index} is not on stage {self.stage_id} (its layers: "
                f"{', '.join(f'{lo}-{hi - 1}' for lo, hi in self.chunk_ranges)})"
            )
        if slot.fn is not None:
            return slot.fn
        if slot.tied is not None:
            module = self.tied_modules._modules.get(slot.tied)
            where = f"tied_modules.{slot.tied}"
        else:
            assert slot.child is not None
            module = self._modules.get(slot.child)
            where = slot.child
        if module is None:
            raise PipelineError(
                f"PipelineModule: layer {index} ({where!r}) was removed from the module; "
                "replace a layer by assigning the new module under the same name"
            )
        if slot.forward_fn is not None:
            return functools.partial(slot.forward_fn, module)
        return module

    def is_first_chunk(self, chunk: int) -> bool:
        return self.chunk_ranges[chunk][0] == 0

    def is_last_chunk(self, chunk: int) -> bool:
        return self.chunk_ranges[chunk][1] == self.num_layers

    # -- forward ----------------------------------------------------------------------
    def forward(self, x: Any, chunk: int = 0) -> Any:
        """Run this stage's model chunk ``chunk`` on ``x`` (layer by layer; with
        ``activation_checkpoint_interval`` k, every k layers form one checkpoint)."""
        lo, hi = self.chunk_ranges[chunk]
        k = self.activation_checkpoint_interval
        if not k:
            for i in range(lo, hi):
                x = self.layer(i)(x)
            return x
        for start in range(lo, hi, k):
            end = min(start + k, hi)
            if not self._checkpointable(start, end):
                for i in range(start, end):
                    x = self.layer(i)(x)
                continue

            def run(*inputs: Any, start: int = start, end: int = end) -> Any:
                y = inputs[0] if len(inputs) == 1 else inputs
                for i in range(start, end):
                    y = self.layer(i)(y)
                return y

            args = x if isinstance(x, tuple) else (x,)
            if self.activation_checkpoint_func is not None:
                x = self.activation_checkpoint_func(run, *args)
            else:
                # torch's reentrant checkpoint gives no parameter gradients when no input
                # requires one (token ids into the first stage): non-reentrant there
                grad_in = any(torch.is_tensor(a) and a.requires_grad for a in args)
                reentrant = self.use_reentrant and grad_in
                x = _checkpoint(run, *args, use_reentrant=reentrant)
        return x

    def _checkpointable(self, start: int, end: int) -> bool:
        """DeepSpeed's rule: with ``checkpointable_layers``, only ranges holding one of
        those classes; else ranges with parameters."""
        if self.checkpointable_layers is not None:
            names = self.checkpointable_layers
            return any(
                self._slots[i].built in names or type(self.layer(i)).__name__ in names
                for i in range(start, end)
            )
        funcs = [self.layer(i) for i in range(start, end)]
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in funcs)


def check_config(module: nn.Module, config) -> None:
    """The pipeline section must agree with the PipelineModule (errors name the key)."""
    if not isinstance(module, PipelineModule):
        raise PipelineError(
            f"pipeline.stages: {config.pipeline_stages} stages, but the model "
            f"({type(module).__name__}) is not a zeroshard.pipe.PipelineModule"
        )
    pc = config.pipeline
    method = module.partition_method.lower()
    given = (pc.partition or "").lower().replace("best", "parameters")
    if given and given != method:
        raise PipelineError(
            f"pipeline.partition: {pc.partition!r}, but the PipelineModule was built with "
            f"partition_method={module.partition_method!r} (the module's argument cuts it)"
        )
    if pc.seed_layers is not None and pc.seed_layers != module.seed_layers:
        raise PipelineError(
            f"pipeline.seed_layers: {pc.seed_layers}, but the PipelineModule was built "
            f"with seed_layers={module.seed_layers}"
        )
    if pc.virtual_stages is not None and pc.virtual_stages != module.virtual_stages:
        raise PipelineError(
            f"pipeline.virtual_stages: {pc.virtual_stages}, but the PipelineModule was "
            f"built with virtual_stages={module.virtual_stages}"
        )
