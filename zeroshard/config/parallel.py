# ruff: noqa: RUF009  (fields are made by key(), which returns a dataclasses.field)
"""The ``tensor_parallel`` section: DeepSpeed's AutoTP training keys, plus zeroshard's
``tp_plan`` override and Megatron sequence-parallel switch. Part of
:mod:`zeroshard.config`'s ``Config``; no collectives, no devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zeroshard.config.schema import INERT, NOT_BUILT, Section, key


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
