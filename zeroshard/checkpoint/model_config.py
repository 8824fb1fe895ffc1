"""What model a checkpoint holds: a JSON description saved with the weights, and the model
built back from it. No collectives.

The built-in GPT is described by its :class:`~zeroshard.models.GPTConfig`; a Hugging Face
model by its ``config.to_dict()``. Checkpoints record it in the manifest (``model``),
consolidated and quantized safetensors files in their header metadata
(``zeroshard_model``), so ``zeroshard generate --checkpoint DIR`` can build the model.
Other models are described as ``None`` (their weights still save and load).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from torch import nn

from zeroshard import ZeroshardError

GPT_CLASS = "zeroshard.models.GPT"
HF_CLASS = "transformers"


class ModelConfigError(ZeroshardError, ValueError):
    """A checkpoint whose model cannot be built (the message names the file)."""


def describe_model(model: nn.Module) -> dict[str, Any] | None:
    """The JSON description of ``model``, or None for a model zeroshard cannot rebuild."""
    from zeroshard.models import GPT

    if isinstance(model, GPT):
        return {"class": GPT_CLASS, "config": dataclasses.asdict(model.cfg)}
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict") and hasattr(model, "can_generate"):
        described = {"class": HF_CLASS, "config": config.to_dict()}
        try:
            json.dumps(described)
        except (TypeError, ValueError):
            return None  # a config that does not serialize: weights only
        return described
    return None


def build_model(description: dict[str, Any] | None, source: str) -> nn.Module:
    """A freshly initialized model from a description (``source``: the file it came from,
    for the error)."""
    if not description:
        raise ModelConfigError(
            f"{source}: the checkpoint records no model config (saved before zeroshard "
            "recorded it, or from a model it cannot rebuild); build the model yourself and "
            "pass it to zeroshard.init_inference(model, checkpoint=...)"
        )
    kind, config = description.get("class"), description.get("config")
    if kind == GPT_CLASS and isinstance(config, dict):
        from zeroshard.models import GPT, GPTConfig

        known = {f.name for f in dataclasses.fields(GPTConfig)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ModelConfigError(f"{source}: model config has unknown GPTConfig keys {unknown}")
        return GPT(GPTConfig(**config))
    if kind == HF_CLASS and isinstance(config, dict):
        from transformers import AutoConfig, AutoModelForCausalLM

        hf_config = AutoConfig.for_model(**config)
        return AutoModelForCausalLM.from_config(hf_config)
    raise ModelConfigError(f"{source}: unknown model class {kind!r} in the model config")
