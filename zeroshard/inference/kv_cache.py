"""The built-in GPT's key/value cache for generation. No collectives.

One preallocated tensor pair per layer, [batch, heads, max_len, head_dim], filled left to
right. Prompts of different lengths are padded on the left, so every row writes the same
slots at each step; ``valid`` marks which slots hold real tokens, and positions count real
tokens only (a padded prompt gets the positions it would have alone). A forward with a
cache (``GPT.forward(idx, cache=cache)``) calls :meth:`KVCache.begin` (positions and the
attention mask for the new tokens), each attention layer calls ``update`` on its
:class:`LayerCache`, and :meth:`KVCache.end` advances the length.

:class:`StaticKVCache` is the same cache with a one-token *step* whose shapes never
change and whose state is read from tensors, not Python numbers: the slot written
(``slot``), the positions (``seen``) and the mask (``valid``, over all ``max_len``
slots; slots not written yet are masked). So the step can be captured once as a device
graph, or compiled once, and replayed for every token (``decode_graph.py``); the prompt
(prefill) goes through the ordinary path, into the same buffers.
"""

from __future__ import annotations

from typing import Self

import torch

from zeroshard import InternalError, ZeroshardError


class CacheFullError(ZeroshardError, ValueError):
    """More tokens than the cache was sized for."""


class KVCache:
    """Keys and values of every layer for ``batch`` sequences of up to ``max_len`` tokens."""

    def __init__(self, *, n_layer: int, batch: int, n_head: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:  # fmt: skip
        shape = (batch, n_head, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.seen = torch.zeros(batch, dtype=torch.long, device=device)  # real tokens so far
        self.batch, self.max_len, self.length = batch, max_len, 0
        self.mask: torch.Tensor | None = None
        self._next_valid: torch.Tensor | None = None
        self._t = 0

    @classmethod
    def for_model(cls, model, batch: int, max_len: int) -> Self:
        """A cache shaped for the built-in GPT ``model`` (its attention heads may be the
        local ones of a tensor-parallel rank)."""
        cfg = model.cfg
        attn = model.blocks[0].attn
        n_head = getattr(attn, "n_head", cfg.n_head)
        p = next(model.parameters())
        dtype = p.dtype if p.is_floating_point() else torch.float32
        return cls(n_layer=len(model.blocks), batch=batch, n_head=n_head,
                   head_dim=cfg.d_model // cfg.n_head, max_len=max_len, dtype=dtype,
                   device=p.device)  # fmt: skip

    def mark_padding(self, new_valid: torch.Tensor) -> None:
        """Say which of the next forward's tokens are real ([batch, t], False: padding)."""
        self._next_valid = new_valid

    def begin(self, t: int) -> torch.Tensor:
        """Start a forward of ``t`` new tokens (all real unless :meth:`mark_padding` said
        otherwise). Returns their positions [batch, t] and builds the attention mask."""
        new_valid, self._next_valid = self._next_valid, None
        if self.length + t > self.max_len:
            raise CacheFullError(
                f"the KV cache holds {self.max_len} tokens; {self.length} are used and {t} "
                "more were given (raise max_out_tokens, or ask for fewer new tokens)"
            )
        dev = self.valid.device
        if new_valid is None:
            new_valid = torch.ones(self.batch, t, dtype=torch.bool, device=dev)
        new_valid = new_valid.to(device=dev, dtype=torch.bool)
        end = self.length + t
        self.valid[:, self.length : end] = new_valid
        positions = self.seen[:, None] + new_valid.long().cumsum(1) - 1
        positions = positions.clamp_min(0)
        self.seen += new_valid.long().sum(1)
        # query j (absolute slot length + j) sees real slots s <= length + j, and itself
        slots = torch.arange(end, device=dev)
        queries = torch.arange(self.length, end, device=dev)
        causal = slots[None, :] <= queries[:, None]  # [t, end]
        mask = causal[None] & self.valid[:, None, :end]
        mask |= slots[None, None, :] == queries[None, :, None]  # padding rows: themselves
        self.mask = mask[:, None]  # [batch, 1, t, end]
        self._t = t
        return positions

    def layer(self, i: int) -> LayerCache:
        return LayerCache(self, i)

    def end(self) -> None:
        """Finish a forward: the new tokens are now part of the cache."""
        self.length += self._t
        self.mask = None

    #: a one-token step of fixed shapes (:class:`StaticKVCache`)
    stepping = False
    slot: torch.Tensor


class StaticKVCache(KVCache):
    """A :class:`KVCache` with a shape-stable one-token step (see the module docstring).

    The host sets the step's inputs before each step (:meth:`prepare_step`), the step
    (``model(ids, cache=cache)`` while :attr:`stepping`) writes keys and values at
    ``slot`` and marks it valid, and the host advances after it (:meth:`advance`): the
    step is a pure function of its input tensors, so running it twice (a graph's warm-up,
    then its replay) writes the same values."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.slot = torch.zeros(1, dtype=torch.long, device=self.valid.device)

    def reset(self) -> None:
        """Empty (a new batch of prompts): every slot is masked again; keys and values
        keep their old, finite, masked values."""
        self.valid.zero_()
        self.seen.zero_()
        self.length = 0
        self.stepping = False

    def prepare_step(self) -> None:
        """Before a step: the slot it writes is the next free one."""
        if self.length + 1 > self.max_len:
            raise CacheFullError(
                f"the KV cache holds {self.max_len} tokens and all are used (raise "
                "max_out_tokens, or ask for fewer new tokens)"
            )
        self.slot.fill_(self.length)

    def advance(self) -> None:
        """After a step: its token is part of the cache."""
        self.length += 1
        self.seen += 1

    def begin(self, t: int) -> torch.Tensor:
        if not self.stepping:
            return super().begin(t)
        if t != 1:
            raise InternalError(f"a static decode step takes one token per row, got {t}")
        self.valid.index_fill_(1, self.slot, True)
        self.mask = self.valid[:, None, None, :]  # [batch, 1, 1, max_len]
        return self.seen[:, None]

    def end(self) -> None:
        if not self.stepping:
            super().end()
        # a step: the host advances (advance()), outside any captured graph


class LayerCache:
    """One layer's view of a :class:`KVCache`: ``update(k, v)`` stores the new keys and
    values [batch, heads, t, head_dim] and returns every key, value and the mask."""

    __slots__ = ("cache", "index")

    def __init__(self, cache: KVCache, index: int) -> None:
        self.cache, self.index = cache, index

    def update(self, k: torch.Tensor, v: torch.Tensor):
        c = self.cache
        if c.stepping:  # every slot, the step's written at c.slot (a tensor)
            keys, values = c.keys[self.index], c.values[self.index]
            keys.index_copy_(2, c.slot, k)
            values.index_copy_(2, c.slot, v)
            return keys, values, c.mask
        end = c.length + k.shape[2]
        keys, values = c.keys[self.index], c.values[self.index]
        keys[:, :, c.length : end] = k
        values[:, :, c.length : end] = v
        return keys[:, :, :end], values[:, :, :end], c.mask
