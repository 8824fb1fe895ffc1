# ruff: noqa: RUF009  (fields are made by key(), which returns a dataclasses.field)
"""The ``tensor_parallel`` section: DeepSpeed's AutoTP training keys, plus zeroshard's
``tp_plan`` override and Megatron sequence-parallel switch; the ``expert_parallel``
section (DeepSpeed's AutoEP keys). Part of :mod:`zeroshard.config`; no
collectives, no devices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from zeroshard.config.schema import INERT, NOT_BUILT, ConfigError, Section, key


@dataclass(frozen=True, kw_only=True)
class TPSizeConfig(Section):
    """``tensor_parallel.tp`` (DeepSpeed's older spelling of the degree)."""

    # fmt: off
    tp_size: int = key(1, doc="Tensor-parallel degree.", min=1)
    tp_grain_size: int = key(1, INERT("weights are split evenly by the tensor-parallel degree"), doc="Split granularity.", min=1)
    # fmt: on


@dataclass(frozen=True, kw_only=True)
class TensorParallelConfig(Section):
    """``tensor_parallel``: AutoTP shards the model's layers over ``autotp_size`` ranks at
    ``initialize`` (zeroshard/parallel/tensor/autotp.py)."""

    # fmt: off
    enabled: bool | None = key(None, doc="false turns tensor parallelism off whatever the degree says.")
    autotp_size: int = key(0, doc="Tensor-parallel degree (0 or 1: off).", min=0)
    tp: TPSizeConfig = key(doc="DeepSpeed's older spelling: tp.tp_size.", factory=TPSizeConfig, nullable=True, aliases=("tensor_parallel",))
    tp_plan: dict[str, Any] | None = key(None, doc="zeroshard: module or parameter name patterns (fnmatch, or 're:' + a regex) -> a style ('column', 'row', 'replicate', or transformers' names), over the model's own plan.")
    sequence_parallel: bool = key(False, doc="zeroshard: Megatron sequence parallelism inside the tensor-parallel group (norms and dropout on 1/t of the sequence).")
    vocab_parallel_lm_head: bool = key(False, doc="Keep a Hugging Face causal LM's head vocabulary-split, with a vocab-parallel loss (no rank holds whole-vocabulary logits).")
    vocab_parallel_ce_backend: str = key("torch", NOT_BUILT("the Liger cross-entropy", lambda v: v != "torch"), doc="Cross-entropy kernel.", choices=("torch", "liger"))
    tp_overlap_comm: bool = key(False, NOT_BUILT("overlapping tensor-parallel all-reduces with compute"), doc="Overlap TP all-reduces.")
    dtype: str | None = key(None, INERT("the compute dtype comes from the bf16 / fp16 sections"), doc="Model dtype.")
    preset_model: str | None = key(None, INERT("AutoTP reads the model's own plan (transformers' base_model_tp_plan) or zeroshard's built-in one"), doc="DeepSpeed's policy preset.")
    partition_config: dict[str, Any] | None = key(None, NOT_BUILT("DeepSpeed's partition_config (zeroshard's override is tensor_parallel.tp_plan)"), doc="Layer partition specs.")
    keep_module_on_host: bool = key(False, INERT("AutoTP slices each rank's own copy of the model where it is"), doc="Load on the host.")
    replace_with_kernel_inject: bool = key(False, INERT("no kernels to inject: torch's own ops run"), doc="Kernel injection.", aliases=("kernel_inject",))
    injection_policy_tuple: list[Any] | None = key(None, NOT_BUILT("DeepSpeed injection policies"), doc="Injection policies.")
    # fmt: on

    @property
    def size(self) -> int:
        """The tensor-parallel degree asked for (1: off)."""
        if self.enabled is False:
            return 1
        return max(self.autotp_size, self.tp.tp_size, 1)


def _partition_spelling(value: Any, at: str) -> None:
    from zeroshard.config.schema import ConfigError

    ok = isinstance(value, str) and (
        value.lower() in ("parameters", "uniform", "best") or value.lower().startswith("type:")
    )
    if not ok:
        raise ConfigError(
            at, f"expected 'parameters', 'uniform', 'best' or 'type:REGEX', got {value!r}"
        )


@dataclass(frozen=True, kw_only=True)
class PipelineConfig(Section):
    """``pipeline``: DeepSpeed's pipeline section (the model is a
    ``zeroshard.pipe.PipelineModule``), plus zeroshard's schedule choice. The engine is
    ``zeroshard/parallel/pipeline/engine.py``; schedules
    ``zeroshard/parallel/pipeline/schedules.py``."""

    # fmt: off
    stages: int | None = key(None, doc="Pipeline stages; null or 'auto' (DeepSpeed's default): the PipelineModule's num_stages. Must agree with it.", min=1)
    schedule: str = key("1f1b", doc="zeroshard: 'gpipe', '1f1b' (DeepSpeed's), 'interleaved_1f1b' (needs virtual_stages >= 2) or 'zb_h1' (zero-bubble H1: backward split into input- and weight-gradient passes).", choices=("gpipe", "1f1b", "interleaved_1f1b", "zb_h1"))
    virtual_stages: int | None = key(None, doc="zeroshard: model chunks per pipeline rank, for interleaved_1f1b; null: the PipelineModule's virtual_stages (given, it must agree).", min=1)
    micro_batches: int | None = key(None, doc="zeroshard: micro-batches per train_batch; null: gradient_accumulation_steps (DeepSpeed's rule). Given, it must equal gradient_accumulation_steps.", min=1)
    partition: str | None = key(None, doc="DeepSpeed's partition method ('parameters', 'uniform', 'type:REGEX'; 'best' means 'parameters'); the PipelineModule's partition_method decides the layout, and a different value here is an error naming both.", check=_partition_spelling)
    seed_layers: bool | None = key(None, doc="DeepSpeed's per-layer seeding; the PipelineModule's seed_layers decides, and a different value here is an error.")
    activation_checkpoint_interval: int | None = key(None, doc="Checkpoint every this many layers of a stage (0: none); null: the PipelineModule's activation_checkpoint_interval.", min=0)
    use_reentrant: bool = key(True, doc="Activation checkpoints with torch's reentrant implementation (DeepSpeed's default) or not; zb_h1 (split backward) and a stage whose input needs no gradient (token ids) always use the non-reentrant one.")
    pipe_partitioned: bool = key(True, doc="With tensor parallelism: each tensor-parallel rank sends 1/t of an activation to the next stage, which all-gathers it over its tensor-parallel group (no effect without tensor parallelism).")
    grad_partitioned: bool = key(True, doc="The same for the gradients sent back to the previous stage.")
    # fmt: on


_OFF = "read only with expert_parallel.enabled true"
_EP_UNWIRED = INERT("read only with expert_parallel.enabled true (and not built with it)")
#: the model families expert parallelism converts (zeroshard/moe/hf.py's PRESETS)
EP_PRESETS = ("mixtral", "qwen2_moe", "qwen3_moe")
#: keys of the section the engine reads (the others are refused with enabled true)
_EP_WIRED = (
    "enabled",
    "autoep_size",
    "preset_model",
    "use_grouped_mm",
    "expert_tensor_parallel_size",
)


@dataclass(frozen=True, kw_only=True)
class ExpertParallelConfig(Section):
    """``expert_parallel``: DeepSpeed's AutoEP section. With ``enabled``, ``initialize``
    splits the experts of a Hugging Face MoE model over ``autoep_size`` ranks
    (zeroshard/moe/hf.py); DeepSpeed's routing overrides (top_k, score functions,
    custom patterns, ...) are refused then: the model's own router runs."""

    # fmt: off
    enabled: bool = key(False, doc="Turn on expert parallelism for Hugging Face MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE): their experts split over autoep_size ranks.")
    autoep_size: int = key(1, doc="Expert-parallel degree (the mesh's ep axis; it divides the data-parallel size).", min=1)
    expert_tensor_parallel_size: int = key(1, NOT_BUILT("experts split by tensor parallelism (expert_parallel.expert_tensor_parallel_size)", lambda v: v != 1), doc="Tensor-parallel degree inside experts.", min=1)
    validate_folding_routing: bool = key(False, _EP_UNWIRED, doc="Check the folded routing.")
    async_split_plan: bool = key(False, _EP_UNWIRED, doc="Plan the token split asynchronously.")
    preset_model: str | None = key(None, doc="The model family whose experts are converted ('mixtral', 'qwen2_moe', 'qwen3_moe'); null: any known one.")
    moe_layer_pattern: str | None = key(None, _EP_UNWIRED, doc="MoE layer name pattern.")
    expert_pattern: str | None = key(None, _EP_UNWIRED, doc="Experts' name pattern.")
    router_pattern: str | None = key(None, _EP_UNWIRED, doc="Router name pattern.")
    use_grouped_mm: bool = key(True, doc="Run each rank's experts as grouped matmuls (false: one matmul per expert).")
    disable_triton_grouped_mm: bool = key(False, _EP_UNWIRED, doc="No Triton grouped matmul.")
    route_norm: bool | None = key(None, _EP_UNWIRED, doc="Normalize routing weights.")
    route_scale: float = key(1.0, _EP_UNWIRED, doc="Routing weight scale.")
    score_apply: str = key("auto", _EP_UNWIRED, doc="Where scores apply.", auto=True)
    combine_impl: str = key("auto", _EP_UNWIRED, doc="Combine implementation.", auto=True)
    row_weighting_impl: str = key("auto", _EP_UNWIRED, doc="Row weighting implementation.", auto=True)
    gate_up_impl: str = key("separate", _EP_UNWIRED, doc="Gate/up projection layout.")
    comm_backend: str = key("comm", _EP_UNWIRED, doc="All-to-all backend.")
    comm_num_sm: int = key(12, _EP_UNWIRED, doc="SMs for communication.", min=1)
    comm_qp_margin: int = key(4, _EP_UNWIRED, doc="Queue-pair margin.", min=0)
    comm_max_tokens_per_rank: int = key(0, _EP_UNWIRED, doc="Most tokens per rank (0: any).", min=0)
    num_expert_groups: int | None = key(None, _EP_UNWIRED, doc="Expert groups.", min=1)
    num_limited_groups: int | None = key(None, _EP_UNWIRED, doc="Groups a token may reach.", min=1)
    score_func: str = key("auto", _EP_UNWIRED, doc="Router score function.", auto=True)
    top_k: object | None = key("auto", _EP_UNWIRED, doc="Experts per token (a number, or 'auto').", auto=True)
    load_balance_coeff: object | None = key(None, _EP_UNWIRED, doc="Load-balance loss coefficient.")
    routed_scaling_factor: object | None = key("auto", _EP_UNWIRED, doc="Routed experts' scale (a number, or 'auto').", auto=True)
    expert_w1: str | None = key(None, _EP_UNWIRED, doc="Experts' first weight name.")
    expert_w2: str | None = key(None, _EP_UNWIRED, doc="Experts' second weight name.")
    expert_w3: str | None = key(None, _EP_UNWIRED, doc="Experts' third weight name (null: fused).")
    num_experts_attr: str | None = key(None, _EP_UNWIRED, doc="Attribute holding the expert count.")
    top_k_attr: str | None = key(None, _EP_UNWIRED, doc="Attribute holding top-k.")
    has_shared_experts: bool | None = key(None, _EP_UNWIRED, doc="Whether the model has shared experts.")
    shared_experts_pattern: str | None = key(None, _EP_UNWIRED, doc="Shared experts' name pattern.")
    shared_experts_gate_pattern: str | None = key(None, _EP_UNWIRED, doc="Shared experts' gate pattern.")
    expert_activation: str | None = key(None, _EP_UNWIRED, doc="Experts' activation.")
    # fmt: on

    @classmethod
    def json_compat(
        cls, values: dict, given: dict[str, str], note: Callable[[str, str], None]
    ) -> dict:
        """The keys the engine reads mean nothing while ``enabled`` is off: reported as
        inert then (set away from their defaults)."""
        if not values.get("enabled"):
            defaults = {f.name: f.default for f in fields(cls)}
            for name in ("autoep_size", "preset_model", "use_grouped_mm"):
                if name in given and values[name] != defaults[name]:
                    note(given[name], _OFF)
        return values

    def __post_init__(self) -> None:
        if not self.enabled:
            return
        if self.preset_model is not None and self.preset_model not in EP_PRESETS:
            raise ConfigError(
                "preset_model",
                f"{self.preset_model!r} is not built yet in zeroshard (built: "
                f"{', '.join(EP_PRESETS)})",
            )
        for f in fields(self):
            if f.name in _EP_WIRED:
                continue
            if getattr(self, f.name) != f.default:
                raise ConfigError(
                    f.name,
                    "is not built yet in zeroshard (with expert_parallel.enabled the "
                    "model's own router and expert layout are used); leave it out",
                )
