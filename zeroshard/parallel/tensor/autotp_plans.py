"""Tensor-parallel plans: the styles a layer can take, and which layer takes which.

A plan maps module- or parameter-name patterns to a style. Patterns are shell-style
(``fnmatch``: ``"blocks.*.attn.qkv"``; ``*`` also matches dots) or, prefixed with
``re:``, regular expressions matched against the whole name. Styles are zeroshard's
names or transformers' (its ``base_model_tp_plan`` / ``_tp_plan`` values):

=======================  ==================================  ===========================
zeroshard                transformers                        meaning
=======================  ==================================  ===========================
``column``               ``colwise``                         output features split
``column_gather``        ``colwise_rep``,                    output split, then gathered
                         ``colwise_gather_output``
``packed_column``        ``packed_colwise``                  two fused outputs (gate/up)
``qkv_column``           (none)                              three fused outputs (q/k/v)
``row``                  ``rowwise``                         input features split
``row_split_input``      ``rowwise_rep``,                    row, from a replicated input
                         ``rowwise_split_input``
``embedding``            ``embedding_rowwise``               vocabulary rows split
``experts``              ``moe_tp_experts``                  f on inputs, g on output
``replicate``            ``replicate``                       every rank keeps all of it
``replicate_sum_grad``   ``replicated_with_grad_allreduce``  replicated, partial gradient
=======================  ==================================  ===========================

Built-in plans cover the zeroshard GPT and the transformers models that define no
plan of their own (GPT-2, BERT); models that do (Llama, Mixtral, ...) use theirs.
``autotp_tree.py`` finds such models anywhere in a module tree and applies each plan
under its prefix.

No communication.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from torch import nn

from zeroshard import models
from zeroshard.parallel.tensor.slices import TensorParallelError


@dataclass(frozen=True, kw_only=True)
class Style:
    """How one layer (or parameter) is split over the tensor-parallel group."""

    kind: str  # "column" | "row" | "embedding" | "experts" | "replicate"
    gather_output: bool = False
    parts: int = 1  # fused outputs of a column layer, each split on its own
    input_is_parallel: bool = True
    partial_grad: bool = False
    # reads the input of the column layers beside it, already brought into the TP region
    # (LoRA's A and B around a column-parallel layer, autotp_tree.py)
    in_region: bool = False


_STYLES = {
    "column": Style(kind="column"),
    "colwise": Style(kind="column"),
    "column_gather": Style(kind="column", gather_output=True),
    "colwise_rep": Style(kind="column", gather_output=True),
    "colwise_gather_output": Style(kind="column", gather_output=True),
    "packed_column": Style(kind="column", parts=2),
    "packed_colwise": Style(kind="column", parts=2),
    "qkv_column": Style(kind="column", parts=3),
    "row": Style(kind="row"),
    "rowwise": Style(kind="row"),
    "row_split_input": Style(kind="row", input_is_parallel=False),
    "rowwise_rep": Style(kind="row", input_is_parallel=False),
    "rowwise_split_input": Style(kind="row", input_is_parallel=False),
    "embedding": Style(kind="embedding"),
    "embedding_rowwise": Style(kind="embedding"),
    "experts": Style(kind="experts"),
    "moe_tp_experts": Style(kind="experts"),
    "replicate": Style(kind="replicate"),
    "replicate_sum_grad": Style(kind="replicate", partial_grad=True),
    "replicated_with_grad_allreduce": Style(kind="replicate", partial_grad=True),
}


def parse_style(value: str | Style, where: str) -> Style:
    """A :class:`Style` from a plan value; ``where`` names the entry for errors."""
    if isinstance(value, Style):
        return value
    style = _STYLES.get(value) if isinstance(value, str) else None
    if style is None:
        raise TensorParallelError(
            f"{where}: tensor-parallel style {value!r} is not one zeroshard can apply; "
            f"use one of {', '.join(sorted(_STYLES))}"
        )
    return style


@dataclass(frozen=True)
class PlanEntry:
    pattern: str
    style: Style
    source: str  # where the entry came from, for error messages

    def matches(self, name: str) -> bool:
        if self.pattern.startswith("re:"):
            return re.fullmatch(self.pattern[3:], name) is not None
        return fnmatch.fnmatchcase(name, self.pattern)


_GPT = {
    "tok_emb": "embedding",
    "pos_emb": "replicate",
    "blocks.*.attn.qkv": "qkv_column",
    "blocks.*.attn.proj": "row",
    "blocks.*.mlp.fc": "column",
    "blocks.*.mlp.proj": "row",
    "head": "column_gather",
}

# transformers models without a plan of their own: (base-model plan, top-level plan)
_HF_BUILTIN = {
    "gpt2": (
        {
            "wte": "embedding",
            "wpe": "replicate",
            "h.*.attn.c_attn": "qkv_column",
            "h.*.attn.c_proj": "row",
            "h.*.mlp.c_fc": "column",
            "h.*.mlp.c_proj": "row",
        },
        {"lm_head": "column_gather", "score": "replicate"},
    ),
    "bert": (
        {
            "embeddings.word_embeddings": "embedding",
            "embeddings.position_embeddings": "replicate",
            "embeddings.token_type_embeddings": "replicate",
            "encoder.layer.*.attention.self.query": "column",
            "encoder.layer.*.attention.self.key": "column",
            "encoder.layer.*.attention.self.value": "column",
            "encoder.layer.*.attention.output.dense": "row",
            "encoder.layer.*.intermediate.dense": "column",
            "encoder.layer.*.output.dense": "row",
            "pooler.dense": "replicate",
        },
        {
            "cls.predictions.transform.dense": "replicate",
            "cls.predictions.decoder": "column_gather",
            "cls.seq_relationship": "replicate",
            "classifier": "replicate",
            "qa_outputs": "replicate",
        },
    ),
}


def _hf_prefix(model: nn.Module) -> str:
    prefix = getattr(model, "base_model_prefix", "")
    return f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""


def model_plan(model: nn.Module) -> tuple[dict, str]:
    """The plan a model brings (or zeroshard knows for it), and its source's name."""
    if isinstance(model, models.GPT):
        return dict(_GPT), "zeroshard's plan for the built-in GPT"
    config = getattr(model, "config", None)
    hf_plan = getattr(model, "tp_plan", None)
    if isinstance(hf_plan, dict) and hf_plan:
        return dict(hf_plan), f"{type(model).__name__}.tp_plan (transformers)"
    base = getattr(config, "base_model_tp_plan", None)
    if isinstance(base, dict) and base:
        prefix = _hf_prefix(model)
        plan = {f"{prefix}{k}": v for k, v in base.items()}
        plan.update(getattr(model, "_tp_plan", None) or {})
        return plan, "config.base_model_tp_plan (transformers)"
    model_type = getattr(config, "model_type", None)
    known = _HF_BUILTIN.get(model_type) if isinstance(model_type, str) else None
    if known is not None:
        prefix = _hf_prefix(model)
        plan = {f"{prefix}{k}": v for k, v in known[0].items()}
        plan.update(known[1])
        return plan, f"zeroshard's plan for {model_type}"
    return {}, "no plan"


def user_plan_entries(tp_plan: dict | None) -> list[PlanEntry]:
    """The ``tp_plan`` entries (they come first: they win), named from the root."""
    return [
        PlanEntry(k, parse_style(v, f"tp_plan[{k!r}]"), "tp_plan")
        for k, v in (tp_plan or {}).items()
    ]
