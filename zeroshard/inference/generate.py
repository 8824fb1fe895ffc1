"""Token generation for models that return logits from ``model(idx)``: greedy decoding or
sampling (temperature, top-k, top-p), stop tokens, batches of prompts of different
lengths (padded on the left). With the built-in GPT the key/value cache
(``kv_cache.py``) makes each new token cost one position's compute; without it every step
recomputes the whole sequence. With a static decoder (``decode_graph.py``) each new token
is one captured (or compiled) step. No collectives (under tensor parallelism every rank runs
the same loop on the same whole logits, so ranks pick the same tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from zeroshard.inference.config import InferenceError
from zeroshard.inference.kv_cache import KVCache

if TYPE_CHECKING:
    from zeroshard.inference.decode_graph import StaticDecoder


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How the next token is chosen. ``do_sample=False`` (or temperature 0) is greedy."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise InferenceError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InferenceError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InferenceError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0


def next_token(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None):
    """Pick one token per row of ``logits`` [batch, vocab]."""
    if s.greedy:
        return logits.argmax(-1)
    logits = logits.float() / s.temperature
    if s.top_k and s.top_k < logits.shape[-1]:
        kth = logits.topk(s.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop = probs.cumsum(-1) - probs >= s.top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int, device=None):
    """Left-pad token lists into (ids [batch, T], valid [batch, T])."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InferenceError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        valid[i, width - len(p) :] = True
    return ids, valid


def check_left_padded(valid: torch.Tensor) -> None:
    """Padding must come before each row's tokens (as Hugging Face decoders want too)."""
    v = valid.long()
    if bool((v[:, 1:] < v[:, :-1]).any()):
        raise InferenceError(
            "attention_mask has padding after real tokens; pad prompts on the left "
            "(tokenizer.padding_side = 'left'), or pass a list of token lists"
        )
    if bool((v.sum(1) == 0).any()):
        raise InferenceError(
            "a prompt in the batch has no real tokens (its attention_mask is all 0)"
        )


@torch.no_grad()
def generate_tokens(
    model,
    ids: torch.Tensor,
    valid: torch.Tensor | None,
    *,
    max_new_tokens: int,
    sampling: Sampling,
    stop_ids: Sequence[int] = (),
    pad_id: int = 0,
    use_cache: bool = True,
    max_len: int | None = None,
    min_new_tokens: int = 0,
    generator: torch.Generator | None = None,
    decoder: StaticDecoder | None = None,
) -> torch.Tensor:
    """Prompt ids [batch, T] (left-padded, ``valid`` marks real tokens) -> [batch, T + n]
    with n <= max_new_tokens: the prompt, then the new tokens; rows that met a stop token
    are filled with ``pad_id`` after it, and the loop ends when every row has stopped.
    ``decoder``: the static decode step (``decode_graph.py``: prefill into its cache,
    then one captured or compiled step per token) instead of a cache made here."""
    b, t0 = ids.shape
    if valid is None:
        valid = torch.ones_like(ids, dtype=torch.bool)
    valid = valid.to(device=ids.device, dtype=torch.bool)
    check_left_padded(valid)
    padded = not bool(valid.all())
    if padded and not hasattr(model, "blocks"):
        raise InferenceError(
            "prompts of different lengths need a model that takes padding: the built-in GPT "
            "or a Hugging Face model; give this model prompts of one length"
        )
    total = t0 + max_new_tokens
    if max_len is not None and total > max_len:
        raise InferenceError(
            f"a prompt of {t0} tokens plus max_new_tokens={max_new_tokens} is {total} tokens, "
            f"over max_out_tokens={max_len}; ask for fewer tokens or raise max_out_tokens"
        )
    seq_limit = getattr(getattr(model, "cfg", None), "seq_len", None)
    if seq_limit is not None and total > seq_limit:
        raise InferenceError(
            f"a prompt of {t0} tokens plus max_new_tokens={max_new_tokens} is {total} tokens; "
            f"the model's position table holds {seq_limit} (GPTConfig.seq_len)"
        )
    stops = torch.tensor(list(stop_ids), dtype=torch.long, device=ids.device)
    done = torch.zeros(b, dtype=torch.bool, device=ids.device)
    out = ids
    cache = KVCache.for_model(model, b, total) if use_cache and decoder is None else None
    step_ids, step_valid = ids, valid
    for step in range(max_new_tokens):
        if decoder is not None:
            logits = decoder.prefill(ids, valid) if step == 0 else decoder.step(step_ids)
            logits = logits[:, None]
        elif cache is not None:
            cache.mark_padding(step_valid)
            logits = model(step_ids, cache=cache)
        elif padded:  # recompute everything, with the padding mask a fresh cache builds
            full = KVCache.for_model(model, b, out.shape[1])
            full.mark_padding(torch.cat([valid, valid.new_ones(b, out.shape[1] - t0)], 1))
            logits = model(out, cache=full)
        else:
            logits = model(out)
        logits = logits[:, -1]
        if step < min_new_tokens and len(stops):
            logits = logits.index_fill(-1, stops, float("-inf"))
        token = next_token(logits, sampling, generator)
        token = torch.where(done, torch.full_like(token, pad_id), token)
        out = torch.cat([out, token[:, None]], dim=1)
        if len(stops):
            done |= torch.isin(token, stops)
            if bool(done.all()):
                break
        step_ids, step_valid = token[:, None], torch.ones(b, 1, dtype=torch.bool, device=ids.device)  # fmt: skip
    return out
