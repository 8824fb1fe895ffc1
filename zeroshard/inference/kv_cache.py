"""The built-in GPT's key/value cache for generation. No collectives.

One preallocated tensor pair per layer, [batch, heads, max_len, head_dim], filled left to
right. Prompts of different lengths are padded on the left, so every row writes the same
slots at each step; ``valid`` marks which slots hold real tokens, and positions count real
tokens only (a padded prompt gets the positions it would have alone). A forward with a
cache (``GPT.forward(idx, cache=cache)``) calls :meth:`KVCache.begin` (positions and the
attention mask for the new tokens), each attention layer calls ``update`` on its
:class:`LayerCache`, and :meth:`KVCache.end` advances the length.
"""

from __future__ import annotations

import torch

from zeroshard import ZeroshardError


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
    def for_model(cls, model, batch: int, max_len: int) -> KVCache:
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


class LayerCache:
    """One layer's view of a :class:`KVCache`: ``update(k, v)`` stores the new keys and
    values [batch, heads, t, head_dim] and returns every key, value and the mask."""

    __slots__ = ("cache", "index")

    def __init__(self, cache: KVCache, index: int) -> None:
        self.cache, self.index = cache, index

    def update(self, k: torch.Tensor, v: torch.Tensor):
        c = self.cache
        end = c.length + k.shape[2]
        keys, values = c.keys[self.index], c.values[self.index]
        keys[:, :, c.length : end] = k
        values[:, :, c.length : end] = v
        return keys[:, :, :end], values[:, :, :end], c.mask
