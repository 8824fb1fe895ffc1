"""Split a Hugging Face decoder into a pipeline's layer list, with its causal-LM loss.

``split_for_pipeline(model)`` turns a ``transformers`` Llama (``LlamaForCausalLM``) or GPT-2
(``GPT2LMHeadModel``) into the flat list of layers a ``PipelineModule`` cuts into stages —
embedding, one layer per decoder block, final norm, head — without rewriting the model: every
layer wraps the model's own submodules (same parameters, same forward code), so running the
layers one after another in one process gives the model's logits and loss bitwise.

What travels between layers (and so between stages) is tensors only:

* ``hidden`` when the batch's input is ``input_ids`` alone;
* ``(hidden, attention_mask)`` when it is ``(input_ids, attention_mask)`` (the 2-D padding
  mask rides along; it has no gradient).

Each block rebuilds what the model computes once for all blocks and is not worth sending:
position ids (``arange``, the model's default), the 4-D causal mask (the model's own
``create_causal_mask`` with its config, so eager, sdpa and flex attention see what they would
see unsplit) and, for Llama, the rotary ``(cos, sin)`` from the model's ``rotary_emb`` (a few
``seq x head_dim`` elementwise ops per block).

Each block also makes the empty ``DynamicCache`` the model makes for itself when
``config.use_cache`` is on (the default, in training too), builds the mask with it and runs its
layer with it, then drops it. The cache is not for decoding here: its ``update`` concatenates
the layer's keys and values onto an empty tensor, so attention gets contiguous copies where a
layer run without a cache gets the transposed views. Same values, but ``matmul``'s backward
rounds differently on the two layouts on some CPUs (MKL on AMD EPYC: the query gradient of
``q @ k^T``), so without it GPT-2 with eager attention misses the model's gradients by an ulp.

Tied input/output embeddings (GPT-2 always, Llama with ``tie_word_embeddings``) become two
``TiedLayer`` entries with the same key: the embedding module, used once as a lookup and once
as the output projection. A pipeline keeps one copy per stage that holds the key and sums the
copies' gradients over those stages (DeepSpeed's ``TiedLayerSpec``); in one process both
entries are the same module.

``causal_lm_loss(logits, labels)`` is the models' shifted cross-entropy (mean over the labels
that are not -100), computed as ``transformers`` computes it.

Dropout (GPT-2's ``*_pdrop``, Llama's ``attention_dropout``) draws its masks from each
stage's own generator, so a split model with dropout trains like the whole one but not
bitwise; the parity tests run with dropout off (``eval()`` or zero rates).

A plain ``nn.Sequential`` splits into its children (no loss: pass your own). Anything else is
refused with an error naming the model class and what to do.

No collectives: this module only rearranges modules.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zeroshard.parallel.pipeline.module import PipelineError

IGNORE_INDEX = -100


@dataclass(kw_only=True)
class TiedLayer:
    """A layer whose ``module`` is shared with every other TiedLayer of the same ``key``.

    ``forward_fn(module, x)`` is this occurrence's forward (the lookup for the embedding,
    the output projection for the head). ``tied_weight_attr`` names the shared parameters.
    """

    key: str
    module: nn.Module
    forward_fn: Callable[[nn.Module, Any], Any]
    tied_weight_attr: tuple[str, ...] = ("weight",)

    def __call__(self, x: Any) -> Any:
        return self.forward_fn(self.module, x)


@dataclass(kw_only=True)
class PipelineSplit:
    """What ``split_for_pipeline`` returns: the layers in order, the loss, and what they came from."""

    layers: list[nn.Module | TiedLayer]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    family: str
    tied_keys: tuple[str, ...] = field(default=())

    def run(self, inputs: Any) -> Any:
        """All layers in sequence in this process (the single-stage reference)."""
        x = inputs
        for layer in self.layers:
            x = layer(x)
        return x


def _unpack(x: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(x, (tuple, list)):
        if len(x) == 1:
            return x[0], None
        if len(x) == 2:
            return x[0], x[1]
        raise PipelineError(
            f"pipeline layer got a tuple of {len(x)} tensors: expected hidden or (hidden, attention_mask)"
        )
    return x, None


def _pack(hidden: torch.Tensor, mask: torch.Tensor | None) -> Any:
    return hidden if mask is None else (hidden, mask)


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def _cache_kwarg(fn: Callable) -> str:
    """The name ``fn`` takes the KV cache under: ``cache`` (transformers >= 5.24) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"


def _model_cache(config: Any):
    """The empty cache the model's own forward would make (``config.use_cache``), else None."""
    if not getattr(config, "use_cache", False):
        return None
    from transformers.cache_utils import DynamicCache

    return DynamicCache(config=config)


def _causal_mask(
    config: Any, hidden: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor, cache
):
    try:
        from transformers.masking_utils import create_causal_mask
    except ImportError as e:  # pragma: no cover - depends on the installed transformers
        raise ImportError(
            "splitting a Hugging Face model into pipeline stages needs transformers >= 4.53"
        ) from e
    return create_causal_mask(
        config=config,
        inputs_embeds=hidden,
        attention_mask=mask,
        position_ids=positions,
        **{_cache_kwarg(create_causal_mask): cache},
    )


def embed_tokens_forward(embedding: nn.Module, inputs: Any) -> Any:
    """The embedding lookup: ``input_ids`` or ``(input_ids, attention_mask)`` -> hidden (+ mask)."""
    ids, mask = _unpack(inputs)
    return _pack(embedding(ids), mask)


def tied_logits_forward(embedding: nn.Module, hidden: Any) -> torch.Tensor:
    """The output projection through the (tied) embedding matrix: hidden -> logits."""
    h, _ = _unpack(hidden)
    return F.linear(h, embedding.weight)  # type: ignore[arg-type]


class Embedding(nn.Module):
    """The token embedding as its own layer (untied models)."""

    def __init__(self, embedding: nn.Module):
        super().__init__()
        self.embedding = embedding

    def forward(self, inputs: Any) -> Any:
        return embed_tokens_forward(self.embedding, inputs)


class GPT2Positions(nn.Module):
    """GPT-2's learned positions added to the token embeddings, then embedding dropout."""

    def __init__(self, wpe: nn.Module, drop: nn.Module):
        super().__init__()
        self.wpe = wpe
        self.drop = drop

    def forward(self, x: Any) -> Any:
        h, mask = _unpack(x)
        h = h + self.wpe(_positions(h)).to(h.device)
        return _pack(self.drop(h), mask)


class LlamaBlock(nn.Module):
    """One Llama decoder layer; rebuilds positions, causal mask and rotary (cos, sin) itself.

    ``rotary_emb`` (buffers only) is shared by all blocks of the model.
    """

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module, config: Any):
        super().__init__()
        self.layer = layer
        self.rotary_emb = rotary_emb
        self.config = config
        self._cache_kw = _cache_kwarg(layer.forward)

    def forward(self, x: Any) -> Any:
        h, mask = _unpack(x)
        positions = _positions(h)
        cache = _model_cache(self.config)
        causal = _causal_mask(self.config, h, mask, positions, cache)
        rotary = self.rotary_emb(h, position_ids=positions)
        h = self.layer(
            h,
            attention_mask=causal,
            position_embeddings=rotary,
            position_ids=positions,
            use_cache=cache is not None,
            **{self._cache_kw: cache},
        )
        return _pack(h, mask)


class GPT2Block(nn.Module):
    """One GPT-2 block; rebuilds positions and the causal mask itself."""

    def __init__(self, block: nn.Module, config: Any):
        super().__init__()
        self.block = block
        self.config = config
        self._cache_kw = _cache_kwarg(block.forward)

    def forward(self, x: Any) -> Any:
        h, mask = _unpack(x)
        positions = _positions(h)
        cache = _model_cache(self.config)
        causal = _causal_mask(self.config, h, mask, positions, cache)
        h = self.block(
            h,
            attention_mask=causal,
            use_cache=cache is not None,
            position_ids=positions,
            **{self._cache_kw: cache},
        )
        return _pack(h, mask)


class FinalNorm(nn.Module):
    """The final norm; drops the padding mask (only the head follows)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x: Any) -> torch.Tensor:
        h, _ = _unpack(x)
        return self.norm(h)


class LMHead(nn.Module):
    """The untied output projection: hidden -> logits."""

    def __init__(self, lm_head: nn.Module):
        super().__init__()
        self.lm_head = lm_head

    def forward(self, x: Any) -> torch.Tensor:
        h, _ = _unpack(x)
        return self.lm_head(h)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token ``t`` predicts label ``t+1``; mean cross-entropy over labels that are not -100.

    Computed as ``transformers``' ``ForCausalLMLoss`` computes it (fp32 logits, labels padded
    with -100 on the right), so it equals ``model(input_ids, labels=labels).loss`` bitwise.
    """
    logits = logits.float()
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
    return F.cross_entropy(
        logits.view(-1, logits.shape[-1]),
        shifted.view(-1).to(logits.device),
        ignore_index=IGNORE_INDEX,
    )


def _tied(model: nn.Module) -> bool:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None  # type: ignore[operator]
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None  # type: ignore[operator]
    return head is not None and emb is not None and head.weight is emb.weight


def _head_layers(model: nn.Module, embedding: nn.Module, key: str) -> tuple[list, tuple[str, ...]]:
    """The output side: a TiedLayer on the embedding if lm_head shares its weight, else lm_head."""
    head = model.lm_head
    if getattr(head, "bias", None) is not None:
        raise PipelineError(
            f"{type(model).__name__}.lm_head has a bias: the pipeline splitter does not handle it"
        )
    if _tied(model):
        return [TiedLayer(key=key, module=embedding, forward_fn=tied_logits_forward)], (key,)
    return [LMHead(head)], ()  # type: ignore[arg-type]


def _first_layer(embedding: nn.Module, key: str, tied: bool) -> nn.Module | TiedLayer:
    if tied:
        return TiedLayer(key=key, module=embedding, forward_fn=embed_tokens_forward)
    return Embedding(embedding)


def _split_llama(model: nn.Module) -> PipelineSplit:
    inner, config = model.model, model.config
    layers: list = [_first_layer(inner.embed_tokens, "embed_tokens", _tied(model))]  # type: ignore[arg-type, union-attr]
    for layer in inner.layers[: config.num_hidden_layers]:  # type: ignore[index, union-attr]
        layers.append(LlamaBlock(layer, inner.rotary_emb, config))  # type: ignore[arg-type, union-attr]
    layers.append(FinalNorm(inner.norm))  # type: ignore[arg-type]
    head, keys = _head_layers(model, inner.embed_tokens, "embed_tokens")  # type: ignore[arg-type, union-attr]
    return PipelineSplit(
        layers=layers + head, loss_fn=causal_lm_loss, family="llama", tied_keys=keys
    )


def _split_gpt2(model: nn.Module) -> PipelineSplit:
    inner, config = model.transformer, model.config
    if getattr(config, "add_cross_attention", False):
        raise PipelineError(
            "GPT-2 with add_cross_attention=True has no pipeline splitter (encoder states per block)"
        )
    layers: list = [
        _first_layer(inner.wte, "wte", _tied(model)),  # type: ignore[arg-type, union-attr]
        GPT2Positions(inner.wpe, inner.drop),  # type: ignore[arg-type, union-attr]
    ]
    layers += [GPT2Block(block, config) for block in inner.h]  # type: ignore[union-attr]
    layers.append(FinalNorm(inner.ln_f))  # type: ignore[arg-type, union-attr]
    head, keys = _head_layers(model, inner.wte, "wte")  # type: ignore[arg-type, union-attr]
    return PipelineSplit(
        layers=layers + head, loss_fn=causal_lm_loss, family="gpt2", tied_keys=keys
    )


def _model_type(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


# model_type -> (required attributes, splitter). Llama's layout is shared by many families
# (Mistral, Qwen2, ...), but their masks differ (sliding windows, layer types): each gets an
# entry here once its parity test exists, not before.
_SPLITTERS: dict[str, tuple[tuple[str, ...], Callable[[nn.Module], PipelineSplit]]] = {
    "llama": (
        ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head"),
        _split_llama,
    ),
    "gpt2": (
        ("transformer.wte", "transformer.wpe", "transformer.h", "transformer.ln_f", "lm_head"),
        _split_gpt2,
    ),
}


def _has(model: nn.Module, dotted: str) -> bool:
    obj: Any = model
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def supported_families() -> tuple[str, ...]:
    return tuple(_SPLITTERS)


def split_for_pipeline(model: nn.Module) -> PipelineSplit:
    """The layer list (and loss) of ``model`` for a pipeline; refuses models it cannot split.

    Accepted: transformers causal-LM models whose ``config.model_type`` has a splitter
    (``supported_families()``), and ``nn.Sequential`` (its children, no loss function).
    """
    if isinstance(model, nn.Sequential):
        return PipelineSplit(layers=list(model.children()), loss_fn=None, family="sequential")
    kind = _model_type(model)
    name = type(model).__name__
    if kind in _SPLITTERS:
        needed, splitter = _SPLITTERS[kind]
        missing = [a for a in needed if not _has(model, a)]
        if missing:
            raise PipelineError(
                f"cannot split {name} (model_type {kind!r}) into pipeline stages: it lacks {', '.join(missing)} "
                f"(the splitter wants the causal-LM class, e.g. LlamaForCausalLM / GPT2LMHeadModel)"
            )
        return splitter(model)
    what = f"model_type {kind!r}" if kind else "not a Hugging Face model"
    raise PipelineError(
        f"cannot split {name} ({what}) into pipeline stages: it is not an nn.Sequential and zeroshard has "
        f"splitters only for Hugging Face model types {', '.join(supported_families())}. Describe the model as "
        f"a zeroshard.pipe.PipelineModule (a list of layers or LayerSpecs passing tensors) instead."
    )


def pipeline_module(model: nn.Module, num_stages: int, **kwargs: Any) -> nn.Module:
    """``split_for_pipeline(model)`` as a ``zeroshard.pipe.PipelineModule`` of ``num_stages``.

    ``kwargs`` go to ``PipelineModule`` (``partition_method``, ``stage_id``,
    ``activation_checkpoint_interval``, ...); ``loss_fn`` defaults to the split's.
    """
    from zeroshard.parallel.pipeline.module import PipelineModule

    split = split_for_pipeline(model)
    kwargs.setdefault("loss_fn", split.loss_fn)
    return PipelineModule(split.layers, num_stages, **kwargs)
