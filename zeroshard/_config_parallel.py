# ruff: noqa: RUF009  (fields are made by key(), which returns a dataclasses.field)
"""The ``tensor_parallel`` section: DeepSpeed's AutoTP training keys, plus zeroshard's
``tp_plan`` override and Megatron sequence-parallel switch. Private helper of
:mod:`zeroshard.config`; no collectives, no devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zeroshard._config_schema import INERT, NOT_BUILT, Section, key


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
    ``initialize`` (zeroshard/parallel/autotp.py)."""

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
