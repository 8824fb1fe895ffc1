"""DeepSpeed's ``deepspeed.runtime.zero.*`` names beyond ``Init`` and
``GatheredParameters``: the parameter-status enum, the offload enums, and the config
classes (``DeepSpeedZeroConfig`` and its offload sections) read by zeroshard's own
``zero_optimization`` schema. No communication.

The config classes answer with DeepSpeed's attribute names (``prefetch_bucket_size``,
``param_persistence_threshold``, ...; zeroshard's schema spells them with the
``stage3_`` prefix) and DeepSpeed's defaults where they differ in form: an offload
section not given is ``None``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from enum import Enum
from typing import Any

from zeroshard import NotBuiltError, ZeroshardError
from zeroshard.config.schema import read_section
from zeroshard.config.sections import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig


class ZeroParamStatus(Enum):
    """Where a ZeRO-3 parameter's data is, in DeepSpeed's terms. zeroshard keeps this
    on the engine, not on the parameter (no ``param.ds_status``)."""

    AVAILABLE = 1  # whole on every rank
    NOT_AVAILABLE = 2  # partitioned: this rank holds a slice
    INFLIGHT = 3  # being gathered


#: the data shape of a partitioned parameter in DeepSpeed (an empty 1-d tensor)
partitioned_param_data_shape = [0]


class OffloadDeviceEnum(str, Enum):
    """``offload_param.device`` / ``offload_optimizer.device``."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """The state kinds ``engine.offload_states`` names."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


class _SectionView:
    """Attribute access to a parsed zeroshard config section."""

    _section: Any

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._section, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._section!r})"


class DeepSpeedZeroOffloadParamConfig(_SectionView):
    """``zero_optimization.offload_param``, read by zeroshard's schema."""

    def __init__(self, **values: Any) -> None:
        self._section = read_section(OffloadParamConfig, values, "zero_optimization.offload_param")


class DeepSpeedZeroOffloadOptimizerConfig(_SectionView):
    """``zero_optimization.offload_optimizer``, read by zeroshard's schema."""

    def __init__(self, **values: Any) -> None:
        self._section = read_section(
            OffloadOptimizerConfig, values, "zero_optimization.offload_optimizer"
        )

    @property
    def pipeline(self) -> bool:
        """Whether NVMe swaps overlap the step (``pipeline_read`` or ``pipeline_write``)."""
        return bool(self._section.pipeline_read or self._section.pipeline_write)


# DeepSpeed's attribute names for keys zeroshard's schema spells with ``stage3_``
_STAGE3 = (
    "prefetch_bucket_size",
    "param_persistence_threshold",
    "model_persistence_threshold",
    "max_live_parameters",
    "max_reuse_distance",
    "gather_16bit_weights_on_model_save",
    "module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
)


class DeepSpeedZeroConfig(_SectionView):
    """``zero_optimization`` as DeepSpeed's config object: ``DeepSpeedZeroConfig(stage=3,
    stage3_prefetch_bucket_size=...)``; validated by zeroshard's schema (an unknown key
    or a bad value raises a ``ConfigError`` naming it)."""

    def __init__(self, **values: Any) -> None:
        self._given = {k for k, v in values.items() if v is not None}
        self._section = read_section(ZeroConfig, values, "zero_optimization")

    def __getattr__(self, name: str) -> Any:
        if name in _STAGE3:
            return getattr(self._section, "stage3_" + name)
        return super().__getattr__(name)

    @property
    def offload_param(self) -> DeepSpeedZeroOffloadParamConfig | None:
        return self._offload("param", DeepSpeedZeroOffloadParamConfig)

    @property
    def offload_optimizer(self) -> DeepSpeedZeroOffloadOptimizerConfig | None:
        return self._offload("optimizer", DeepSpeedZeroOffloadOptimizerConfig)

    def _offload(self, kind: str, view: type[_SectionView]) -> Any:
        """None unless the section (or its deprecated ``cpu_offload*`` switch) was given."""
        section = getattr(self._section, f"offload_{kind}")
        switch = "cpu_offload" if kind == "optimizer" else "cpu_offload_param"
        given = f"offload_{kind}" in self._given or bool(getattr(self._section, switch))
        if section is None or not given:
            return None
        out = object.__new__(view)
        out._section = section
        return out


class ZeRORuntimeException(ZeroshardError, RuntimeError):
    """DeepSpeed's ``deepspeed.runtime.zero.utils.ZeRORuntimeException`` (zeroshard raises
    its own named errors: ``ConfigError``, ``CheckpointError``, ...)."""


class _NoInstances:
    """A DeepSpeed optimizer wrapper zeroshard does not have: nothing is an instance of
    it (``isinstance`` checks against it are False); constructing one is refused."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotBuiltError(
            f"{type(self).__name__}: DeepSpeed's fp16 optimizer wrappers are not built in "
            "zeroshard; the engine's optimizer (one ShardedOptimizer at every ZeRO stage) "
            "does loss scaling itself"
        )


class FP16_Optimizer(_NoInstances):
    """DeepSpeed's fused fp16 optimizer wrapper (not in zeroshard)."""


class FP16_UnfusedOptimizer(_NoInstances):
    """DeepSpeed's unfused fp16 optimizer wrapper (not in zeroshard)."""


@contextlib.contextmanager
def unwrap_model_for_generation(model) -> Iterator[Any]:
    """DeepSpeed's ``deepspeed.runtime.zero.unwrap_model_for_generation``: inside the
    block every parameter of ``model`` (an engine, or a module an engine manages) is
    whole on every rank, so ``generate`` runs without a gather per step; yields
    ``model``. Collective at stage 3 (one all-gather per parameter on entry)."""
    from zeroshard.zero import GatheredParameters

    module = getattr(model, "module", model)
    with GatheredParameters(list(module.parameters())):
        yield model
