"""Inference: ``init_inference`` (DeepSpeed's entry point), weight-only int8/int4
quantization of Linear layers on torch's own kernels, generation with a KV cache,
tensor-parallel inference and ZeRO-Inference weight streaming.

Modules: ``config.py`` (the config schema), ``engine.py`` (the engine), ``quantize.py``
(quantized Linear), ``kv_cache.py`` and ``generate.py`` (decoding), ``weights.py``
(loading checkpoints and safetensors, saving quantized weights), ``tensor_parallel.py``,
``streaming.py``; ``zeroshard generate`` is ``tools/generate.py``.
"""

from __future__ import annotations

from zeroshard.inference.config import InferenceConfig, load_inference_config
from zeroshard.inference.engine import InferenceEngine, init_inference
from zeroshard.inference.quantize import QuantizationError, QuantLinear, quantize_model

__all__ = [
    "InferenceConfig",
    "InferenceEngine",
    "QuantLinear",
    "QuantizationError",
    "init_inference",
    "load_inference_config",
    "quantize_model",
]
