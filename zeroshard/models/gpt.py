"""A small reference GPT (pre-LN decoder) for the demo, the tests and the benchmarks.

Plain PyTorch, no communication. Sizes are named presets (``GPTConfig.preset``);
``tie_embeddings`` shares the token embedding with the output projection, the case
that trips naive sharding. ``forward(idx, cache=...)`` runs with a key/value cache for
generation (zeroshard/inference/kv_cache.py); without one, the training path is unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from zeroshard import ArgumentError

PRESETS = {
    # name: (n_layer, n_head, d_model)
    "tiny": (2, 2, 32),
    "small": (4, 4, 128),
    "6x256": (6, 8, 256),  # the "small GPT" of issue 20's measurements (~4.8M at vocab 256)
    "25M": (8, 8, 512),  # ~25.3M parameters at vocab 256
    "100M": (14, 12, 768),  # ~99.5M parameters at vocab 256
    "350M": (24, 16, 1024),
    "1B": (24, 16, 1856),
    "1.6B": (32, 16, 2048),
    "3B": (40, 20, 2560),  # ~3.15B: issue 31's CPU-machine target (NVMe offload)
    "10B": (50, 32, 4096),  # ~10.07B: issue 31's one-GPU-host target
}


def preset_names() -> tuple[str, ...]:
    """Names ``GPTConfig.preset`` knows."""
    return tuple(PRESETS)


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the reference GPT."""

    vocab_size: int = 256  # byte-level by default
    seq_len: int = 256  # maximum sequence length (position table size)
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 32
    mlp_ratio: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = True
    bias: bool = True

    @classmethod
    def preset(cls, name: str, **overrides) -> GPTConfig:
        if name not in PRESETS:
            raise ArgumentError(f"unknown GPT preset {name!r}; choose from {', '.join(PRESETS)}")
        n_layer, n_head, d_model = PRESETS[name]
        return replace(cls(n_layer=n_layer, n_head=n_head, d_model=d_model), **overrides)

    def num_params(self) -> int:
        d, v = self.d_model, self.vocab_size
        per_block = 4 * d + 4 * d * d + 4 * d + 2 * self.mlp_ratio * d * d + self.mlp_ratio * d + d
        if not self.bias:
            per_block -= 4 * d + self.mlp_ratio * d + d + 2 * d
        head = 0 if self.tie_embeddings else v * d
        final_ln = 2 * d if self.bias else d
        return v * d + self.seq_len * d + self.n_layer * per_block + final_ln + head


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, kv=None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        drop = self.dropout if self.training else 0.0
        if kv is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        else:  # generation: keys and values so far come from the cache, with its mask
            k, v, mask = kv.update(k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, kv=None) -> torch.Tensor:
        a = self.ln1(x)
        x = x + self.drop(self.attn(a) if kv is None else self.attn(a, kv))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """Decoder-only transformer. ``forward(idx, targets=None)`` returns the mean
    cross-entropy loss when ``targets`` is given, else the logits."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style init: N(0, 0.02), residual projections scaled by 1/sqrt(2L)."""
        std_resid = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                else:
                    nn.init.ones_(p)
            elif name.endswith("proj.weight"):
                nn.init.normal_(p, std=std_resid)
            else:
                nn.init.normal_(p, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, cache=None
    ) -> torch.Tensor:
        t = idx.shape[1]
        # with a cache, positions count each row's real tokens (left padding gets none)
        pos = torch.arange(t, device=idx.device) if cache is None else cache.begin(t)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for i, block in enumerate(self.blocks):
            x = block(x) if cache is None else block(x, cache.layer(i))
        if cache is not None:
            cache.end()
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
