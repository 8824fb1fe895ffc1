# ruff: noqa: RUF009  (fields are made by key(), which returns a dataclasses.field)
"""DeepSpeed's ``init_inference`` config, read through the training config's one schema
(``zeroshard.config.schema``): every key is wired, refused ("not built yet") or reported as
meaning nothing here, with the reason. No collectives, no devices.

DeepSpeed's spelling is accepted as a dict, a JSON file, keyword arguments, or both
(keywords win over the dict, as in DeepSpeed). ``dtype`` may be a ``torch.dtype``;
``torch.int8`` means int8 weight quantization, as in DeepSpeed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from zeroshard import ZeroshardError
from zeroshard.config.schema import (
    INERT,
    NOT_BUILT,
    ConfigError,
    Reading,
    Section,
    key,
    read_section,
)

DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
_DTYPE_SPELLINGS = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "torch.float": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "torch.half": "fp16",
    "int8": "int8",
    "torch.int8": "int8",
}


class InferenceError(ZeroshardError, ValueError):
    """A model, prompt or option that inference cannot serve as asked."""


@dataclass(frozen=True, kw_only=True)
class TPConfig(Section):
    """``tensor_parallel`` (alias ``tp``): ranks that split each layer and generate together."""

    # fmt: off
    enabled: bool = key(True, doc="false turns tensor parallelism off whatever tp_size says.")
    tp_size: int = key(1, doc="Tensor-parallel degree: the model's layers are split over this many ranks (zeroshard/inference/tensor_parallel.py).", min=1)
    tp_grain_size: int = key(1, INERT("weights are split evenly by the tensor-parallel degree"), doc="Split granularity.", min=1)
    tp_plan: dict[str, Any] | None = key(None, doc="zeroshard: module or parameter name patterns (fnmatch, or 're:' + a regex) -> a style ('column', 'row', 'replicate', or transformers' names), over the model's own plan, as in training's tensor_parallel.tp_plan.")
    # fmt: on

    @property
    def size(self) -> int:
        return self.tp_size if self.enabled else 1


@dataclass(frozen=True, kw_only=True)
class WeightQuantConfig(Section):
    """``quant.weight``: weight-only quantization of the Linear layers."""

    # fmt: off
    enabled: bool = key(True, doc="Quantize weights when quant.enabled is true.")
    num_bits: int = key(8, doc="8: int8 per output channel; 4: int4 in groups of group_size along the input, packed two per byte.", choices=(8, 4))
    group_size: int = key(128, doc="int4: input features per scale (32, 64, 128 or 256; must divide each quantized layer's in_features). int8 always uses one scale per output channel.", choices=(32, 64, 128, 256))
    q_type: str = key("symmetric", doc="'symmetric' (scale only) or 'asymmetric' (scale and offset).", choices=("symmetric", "asymmetric"))
    q_groups: int = key(1, INERT("groups are set by group_size (int4) or per output channel (int8)"), doc="DeepSpeed's number of groups.", min=1)
    # fmt: on


@dataclass(frozen=True, kw_only=True)
class QuantConfig(Section):
    """``quant``: DeepSpeed's quantization section (weights only here)."""

    # fmt: off
    enabled: bool = key(False, doc="Quantize the Linear layers' weights (quant.weight says how).")
    weight: WeightQuantConfig = key(doc="How weights are quantized.", factory=WeightQuantConfig, nullable=True)
    activation: dict[str, Any] | None = key(None, NOT_BUILT("activation quantization"), doc="Activation quantization.")
    qkv: dict[str, Any] | None = key(None, INERT("qkv projections are Linear layers and follow quant.weight"), doc="qkv quantization.")
    skip: list[str] = key(factory=list, doc="zeroshard: Linear layers left unquantized, as fnmatch patterns of their names (e.g. 'lm_head'). Layers whose weight is shared with another module (tied heads) are always left as they are.")
    # fmt: on


@dataclass(frozen=True, kw_only=True)
class InferenceConfig(Section):
    """DeepSpeed's ``DeepSpeedInferenceConfig``, as far as zeroshard builds it."""

    # fmt: off
    dtype: str | None = key(None, doc="Compute dtype of the model: fp32, bf16 or fp16 (torch dtypes accepted); int8 means fp32 activations with int8 weights. Default: the model's own dtype (DeepSpeed defaults to fp16; on CPU that is slow and lossy, so zeroshard keeps the model's).", choices=("fp32", "bf16", "fp16", "int8"))
    tensor_parallel: TPConfig = key(doc="Tensor-parallel inference.", factory=TPConfig, nullable=True, aliases=("tp",))
    mp_size: int | None = key(None, doc="DeepSpeed's older spelling of tensor_parallel.tp_size.", min=1)
    quant: QuantConfig = key(doc="Weight quantization.", factory=QuantConfig, nullable=True)
    max_out_tokens: int = key(1024, doc="Most tokens (prompt plus generated) one sequence may hold; the KV cache is sized from it.", min=1, aliases=("max_tokens",))
    min_out_tokens: int = key(1, INERT("generate() takes min_new_tokens per call"), doc="Fewest tokens to generate.", min=1, aliases=("min_tokens",))
    replace_with_kernel_inject: bool = key(False, INERT("there are no kernels to inject: torch's own matmul and int8/int4 kernels run"), doc="DeepSpeed's kernel injection.", aliases=("kernel_inject",))
    enable_cuda_graph: bool = key(False, doc="Capture the built-in GPT's one-token decode step as a CUDA graph at the first step of a batch and replay it per token, over a KV cache preallocated to max_out_tokens (zeroshard/inference/decode_graph.py). Needs a CUDA device; refused with tensor parallelism, weight streaming (zero) and models other than zeroshard's GPT (Hugging Face models: generate(cache_implementation='static') with torch.compile).")
    use_triton: bool = key(False, NOT_BUILT("Triton kernels"), doc="Triton kernels.")
    triton_autotune: bool = key(False, INERT("no Triton kernels"), doc="Triton autotuning.")
    triangular_masking: bool = key(True, INERT("the model's own attention masks apply"), doc="Causal masking.", aliases=("tm",))
    return_tuple: bool = key(True, INERT("the model's own return type is kept"), doc="Return tuples.")
    checkpoint: str | None = key(None, doc="A zeroshard checkpoint directory, a safetensors file or directory, or a quantized export, loaded into the model (see zeroshard/inference/weights.py).")
    base_dir: str = key("", doc="Directory that relative checkpoint paths start from.")
    save_mp_checkpoint_path: str | None = key(None, NOT_BUILT("saving tensor-parallel inference checkpoints (save quantized weights with engine.save_quantized)"), doc="Where to save MP checkpoints.")
    injection_policy: dict[str, Any] | None = key(None, NOT_BUILT("DeepSpeed injection policies (use tensor_parallel with a tp_plan)"), doc="Injection policy.", aliases=("injection_dict",))
    injection_policy_tuple: list[Any] | None = key(None, NOT_BUILT("DeepSpeed injection policies"), doc="Injection policies.")
    replace_method: str = key("auto", INERT("nothing is replaced but Linear layers by quantization"), doc="Replacement method.")
    zero: dict[str, Any] | None = key(None, doc="ZeRO-Inference: weights streamed from CPU memory or NVMe layer by layer (zeroshard/inference/streaming.py).")
    keep_module_on_host: bool = key(False, INERT("the model stays where it is given"), doc="Keep the module on the host.")
    moe: dict[str, Any] | bool | None = key(None, NOT_BUILT("mixture-of-experts inference with expert parallelism"), doc="MoE settings.")
    ep_size: int = key(1, NOT_BUILT("expert parallelism", lambda v: v != 1), doc="Expert-parallel degree.", min=1)
    training_mp_size: int = key(1, INERT("checkpoints are resharded on load whatever their layout"), doc="MP size of the training checkpoint.", min=1)
    set_empty_params: bool = key(False, INERT("parameters are always materialized"), doc="Empty parameters.")
    transposed_mode: bool = key(False, INERT("no kernels to inject"), doc="Transposed kernels.")
    config: dict[str, Any] | None = key(None, INERT("the model's own config is used"), doc="The model's HF config.")
    # fmt: on

    @property
    def tp_size(self) -> int:
        return max(self.tensor_parallel.size, self.mp_size or 1)

    @property
    def num_bits(self) -> int | None:
        """Weight bits (8 or 4), or None when weights stay floating point."""
        if self.quant.enabled and self.quant.weight.enabled:
            return self.quant.weight.num_bits
        return 8 if self.dtype == "int8" else None

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype the model computes in (None: keep the model's)."""
        return None if self.dtype in (None, "int8") else DTYPES[self.dtype]


def _jsonable(value: Any, at: str) -> Any:
    if isinstance(value, torch.dtype):
        name = str(value)
        if name not in _DTYPE_SPELLINGS:
            raise ConfigError(at, f"dtype {name} is not supported; use fp32, bf16, fp16 or int8")
        return _DTYPE_SPELLINGS[name]
    return value


def load_inference_config(
    config: Mapping[str, Any] | str | InferenceConfig | None = None, **kwargs: Any
) -> tuple[InferenceConfig, Reading]:
    """Read DeepSpeed's inference config (dict, JSON path, or ready config) merged with
    keyword arguments; returns the config and what it set that is inert."""
    if isinstance(config, InferenceConfig):
        if kwargs:
            raise ConfigError("init_inference", "give keyword arguments or an InferenceConfig, not both")  # fmt: skip
        return config, Reading(InferenceConfig)
    if isinstance(config, str):
        from zeroshard.config.jsonc import read_config_file

        data = dict(read_config_file(config))
    else:
        data = dict(config or {})
    data.update(kwargs)
    for section in ("tensor_parallel", "tp"):  # objects, not JSON: refused before reading
        for name in ("mpu", "tp_group"):
            if isinstance(data.get(section), Mapping) and data[section].get(name) is not None:
                raise ConfigError(f"{section}.{name}", "a given process group or mpu for inference is not built yet in zeroshard (groups are built from the world)")  # fmt: skip
    if data.get("mpu") is not None:
        raise ConfigError("mpu", "an mpu for inference is not built yet in zeroshard")
    data.pop("mpu", None)
    if "checkpoint" in data and isinstance(data["checkpoint"], os.PathLike):
        data["checkpoint"] = os.fspath(data["checkpoint"])
    if "dtype" in data and data["dtype"] is not None:
        value = _jsonable(data["dtype"], "dtype")
        spelled = _DTYPE_SPELLINGS.get(str(value).lower())
        if spelled is None:
            raise ConfigError("dtype", f"expected fp32, bf16, fp16 or int8, got {value!r}")
        data["dtype"] = spelled
    reading = Reading(InferenceConfig)
    cfg = read_section(InferenceConfig, data, "", reading)
    if reading.not_built:
        at, feature = reading.not_built[0]
        raise ConfigError(at, f"{feature} is not built yet in zeroshard")
    return cfg, reading
