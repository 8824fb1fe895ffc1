# ruff: noqa: RUF009  (fields are made by key(), which returns a dataclasses.field)
"""DeepSpeed sections for features zeroshard does not build, each a frozen kw_only
dataclass whose fields are DeepSpeed's keys (see :mod:`zeroshard.config.schema`), so an
unknown or misspelled key is an error naming it, as everywhere else. Part of
:mod:`zeroshard.config`'s ``Config``. No collectives, no devices.

Key names and defaults are DeepSpeed 0.19's: ``compile/config.py`` (``compile``, and the
``enabled``/``backend``/``kwargs`` of its 0.14 form, which is wired: ``engine.compile``),
``runtime/config.py`` (``hybrid_engine``, ``torch_autocast``), ``autotuning/``,
``runtime/data_pipeline/`` (``data_efficiency``); ``expert_parallel`` is built and lives in
``parallel.py``. Each section's switch is refused when on ("not built yet"); its other
keys mean nothing while it is off (inert, reported when set). Sections DeepSpeed 0.19 removed (its config refuses them)
take only ``{"enabled": false}`` here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, make_dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from zeroshard.config.schema import INERT, NOT_BUILT, ConfigError, Section, key


def _off(section: str, switch: str = "enabled") -> Any:
    return INERT(f"read only with {section}.{switch} true, which is not built yet")


def _on_anywhere(value: Any) -> bool:
    """Whether a JSON object, or one nested in it, says ``"enabled": true``."""
    if not isinstance(value, Mapping):
        return False
    return value.get("enabled") is True or any(_on_anywhere(v) for v in value.values())


#: torch.compile's keyword arguments besides the backend (``compile.kwargs``)
COMPILE_KWARGS = ("fullgraph", "dynamic", "mode", "options", "disable")


def _check_compile_kwargs(value: Any, at: str) -> None:
    if not isinstance(value, Mapping):
        return  # the type check names it
    for name in value:
        if name == "backend":
            raise ConfigError(f"{at}.backend", "give the backend as compile.backend")
        if name not in COMPILE_KWARGS:
            raise ConfigError(f"{at}.{name}", f"not a keyword of torch.compile (it takes {', '.join(COMPILE_KWARGS)}; the backend is compile.backend)")  # fmt: skip


_DC = NOT_BUILT("DeepCompile (compile.deepcompile)")


# fmt: off
@dataclass(frozen=True, kw_only=True)
class CompileConfig(Section):
    """``compile``: DeepSpeed 0.14's torch.compile switch (``enabled``, ``backend``,
    ``kwargs``: the engine calls ``engine.compile(backend, kwargs)`` at ``initialize``),
    and DeepSpeed 0.19's DeepCompile settings (not built: refused when set away from
    their defaults)."""

    enabled: bool = key(False, doc="DeepSpeed 0.14: torch.compile the model at initialize (engine.compile(backend=compile.backend, compile_kwargs=compile.kwargs)).")
    backend: str = key("inductor", doc="DeepSpeed 0.14: torch.compile's backend (a name torch._dynamo.list_backends() knows).")
    kwargs: dict[str, Any] | None = key(None, doc="DeepSpeed 0.14: torch.compile's keyword arguments (fullgraph, dynamic, mode, options, disable).", check=_check_compile_kwargs)
    deepcompile: bool = key(False, _DC, doc="Turn on DeepCompile.")
    autoep_non_moe: bool = key(False, INERT("a DeepCompile setting for AutoEP layers; DeepCompile is not built"), doc="Compile the callable parents of AutoEP layers.")
    free_activation: bool = key(False, _DC, doc="DeepCompile: free activations eagerly.")
    free_activation_threshold: int = key(10 * 1024 * 1024, _DC, doc="DeepCompile: bytes from which an activation is freed eagerly.", min=0)
    offload_activation: bool = key(False, _DC, doc="DeepCompile: offload saved activations to pinned host memory.")
    offload_activation_pin_memory: bool = key(True, _DC, doc="DeepCompile: pin the activation offload buffers.")
    offload_opt_states: bool = key(False, _DC, doc="DeepCompile: offload optimizer states during forward/backward.")
    double_buffer: bool = key(True, _DC, doc="DeepCompile: double buffering.")
    symmetric_memory: bool = key(False, _DC, doc="DeepCompile: symmetric memory.")
    debug_log: bool = key(False, _DC, doc="DeepCompile: dump the graphs.")
    offload_parameters: bool = key(False, _DC, doc="DeepCompile: offload parameters.")
    sync_before_reduce: bool = key(False, _DC, doc="DeepCompile: synchronize before a reduction.")
    sync_after_reduce: bool = key(False, _DC, doc="DeepCompile: synchronize after a reduction.")
    sync_before_allgather: bool = key(False, _DC, doc="DeepCompile: synchronize before an all-gather.")
    sync_after_allgather: bool = key(False, _DC, doc="DeepCompile: synchronize after an all-gather.")
    keep_int_input_tensors: bool = key(True, _DC, doc="DeepCompile: keep int input tensors' values.")
    keep_all_input_tensors: bool = key(False, _DC, doc="DeepCompile: keep every input tensor's values.")
    passes: list[str] | None = key(None, _DC, doc="DeepCompile passes ('z1', 'z3', 'autosp', 'autotp').")

    @classmethod
    def json_compat(cls, values: dict, given: dict[str, str], note: Callable[[str, str], None]) -> dict:
        """``backend`` and ``kwargs`` are read only with ``enabled`` true: given without
        it, they are reported as meaning nothing."""
        if not values.get("enabled"):
            for name in ("backend", "kwargs"):
                if name in given:
                    note(given[name], "read only with compile.enabled true (or pass it to engine.compile())")
        return values


@dataclass(frozen=True, kw_only=True)
class HybridEngineConfig(Section):
    """``hybrid_engine``: DeepSpeed-Chat's training/generation engine."""

    enabled: bool = key(False, NOT_BUILT("the hybrid (RLHF) engine"), doc="Turn on the hybrid engine.")
    max_out_tokens: int = key(512, _off("hybrid_engine"), doc="Most tokens generated.", above=0)
    inference_tp_size: int = key(1, _off("hybrid_engine"), doc="Tensor-parallel size of generation.", min=1)
    release_inference_cache: bool = key(False, _off("hybrid_engine"), doc="Free the KV cache after generation.")
    pin_parameters: bool = key(True, _off("hybrid_engine"), doc="Pin gathered parameters.")
    tp_gather_partition_size: int = key(8, _off("hybrid_engine"), doc="Layers gathered at a time.", min=1)
    enable_cuda_graph: bool = key(False, _off("hybrid_engine"), doc="CUDA graphs for generation.")


@dataclass(frozen=True, kw_only=True)
class TorchAutocastConfig(Section):
    """``torch_autocast``: mixed precision by ``torch.autocast`` (zeroshard: fp16/bf16)."""

    enabled: bool = key(False, NOT_BUILT("torch.autocast mixed precision"), doc="Turn on torch.autocast.")
    dtype: str | None = key(None, _off("torch_autocast"), doc="The autocast dtype.")
    lower_precision_safe_modules: list[str] | None = key(None, _off("torch_autocast"), doc="Module classes run in the lower precision.")


@dataclass(frozen=True, kw_only=True)
class AutotuningConfig(Section):
    """``autotuning``: DeepSpeed's autotuner (launched by ``deepspeed --autotuning``)."""

    enabled: bool = key(False, NOT_BUILT("the autotuner"), doc="Turn on autotuning.")
    fast: bool = key(True, _off("autotuning"), doc="Tune only the micro-batch size and ZeRO stage.")
    results_dir: str = key("autotuning_results", _off("autotuning"), doc="Where results go.")
    exps_dir: str = key("autotuning_exps", _off("autotuning"), doc="Where experiments go.")
    overwrite: bool = key(True, _off("autotuning"), doc="Overwrite earlier results.")
    start_profile_step: int = key(3, _off("autotuning"), doc="First profiled step.", min=0)
    end_profile_step: int = key(5, _off("autotuning"), doc="Last profiled step.", min=0)
    metric_path: str | None = key(None, _off("autotuning"), doc="Where the metric is written.")
    tuner_type: str = key("gridsearch", _off("autotuning"), doc="The search.", choices=("gridsearch", "random", "model_based"))
    tuner_early_stopping: int = key(5, _off("autotuning"), doc="Trials without improvement before stopping.", min=0)
    tuner_num_trials: int = key(50, _off("autotuning"), doc="Most trials.", min=1)
    arg_mappings: dict[str, Any] | None = key(None, _off("autotuning"), doc="Config keys -> script arguments.")
    max_train_batch_size: int | None = key(None, _off("autotuning"), doc="Largest global batch tried.", min=1)
    min_train_batch_size: int = key(1, _off("autotuning"), doc="Smallest global batch tried.", min=1)
    max_train_micro_batch_size_per_gpu: int = key(1024, _off("autotuning"), doc="Largest micro-batch tried.", min=1)
    min_train_micro_batch_size_per_gpu: int = key(1, _off("autotuning"), doc="Smallest micro-batch tried.", min=1)
    num_tuning_micro_batch_sizes: int = key(3, _off("autotuning"), doc="Micro-batch sizes tried.", min=1)
    mp_size: int = key(1, _off("autotuning"), doc="Model-parallel size.", min=1)
    metric: str = key("throughput", _off("autotuning"), doc="What is optimized.", choices=("latency", "throughput", "flops"))
    model_info: dict[str, Any] | None = key(None, _off("autotuning"), doc="The model's size and shape.")
    model_info_path: str | None = key(None, _off("autotuning"), doc="Where the model info is written.")


@dataclass(frozen=True, kw_only=True)
class DataEfficiencyConfig(Section):
    """``data_efficiency``: curriculum data sampling and random-LTD data routing (their
    own ``enabled`` switches, at any depth, are refused when on: DeepSpeed reads them
    whatever the top switch says)."""

    enabled: bool = key(False, NOT_BUILT("the data efficiency library"), doc="Turn on data efficiency.")
    seed: int = key(1234, _off("data_efficiency"), doc="Seed of the data sampler.", min=0)
    data_sampling: dict[str, Any] | None = key(None, NOT_BUILT("curriculum data sampling (data_efficiency)", _on_anywhere), doc="Curriculum learning and dynamic batching.")
    data_routing: dict[str, Any] | None = key(None, NOT_BUILT("random-LTD data routing (data_efficiency)", _on_anywhere), doc="Random layerwise token dropping.")
# fmt: on


def removed(cls_name: str, name: str, feature: str) -> type:
    """A section DeepSpeed 0.19 removed (its config refuses it): only its ``enabled``
    switch is read here, refused when true; any other key is an error saying so."""
    note = f"DeepSpeed 0.19 removed {feature}, and zeroshard does not build it"
    namespace = {
        "__module__": __name__,
        "__doc__": f"``{name}``: {feature}, removed in DeepSpeed 0.19.",
        "UNKNOWN": f"{note}; only '{name}': {{\"enabled\": false}} is accepted",
    }
    field = key(False, NOT_BUILT(feature), doc=f"Turn on {feature} (removed in DeepSpeed 0.19).")
    return make_dataclass(
        cls_name,
        [("enabled", bool, field), ("UNKNOWN", ClassVar[str])],
        bases=(Section,),
        namespace=namespace,
        frozen=True,
        kw_only=True,
    )


if TYPE_CHECKING:  # the checker's view of the classes removed() makes

    class _Removed(Section):
        enabled: bool

    AmpConfig = _Removed
    ElasticityConfig = _Removed
    EigenvalueConfig = _Removed
    QuantizeTrainingConfig = _Removed
    CurriculumLearningConfig = _Removed
    ProgressiveLayerDropConfig = _Removed
    NebulaConfig = _Removed
else:
    AmpConfig = removed("AmpConfig", "amp", "Apex AMP")
    ElasticityConfig = removed("ElasticityConfig", "elasticity", "elastic training")
    EigenvalueConfig = removed("EigenvalueConfig", "eigenvalue", "eigenvalue computation")
    QuantizeTrainingConfig = removed(
        "QuantizeTrainingConfig", "quantize_training", "quantization-aware training (MoQ)"
    )
    CurriculumLearningConfig = removed(
        "CurriculumLearningConfig",
        "curriculum_learning",
        "the legacy top-level curriculum learning (use data_efficiency.data_sampling)",
    )
    ProgressiveLayerDropConfig = removed(
        "ProgressiveLayerDropConfig", "progressive_layer_drop", "progressive layer drop"
    )
    NebulaConfig = removed("NebulaConfig", "nebula", "the Nebula checkpoint engine")
