"""The built-in GPT's decode step, captured once and replayed per token. No collectives
(tensor-parallel and streamed models are refused: ``InferenceEngine``).

A batch-1 decode step of a 1B model is about 360 small kernels; launched one by one
from Python it runs at a few percent of the memory roof. :class:`StaticDecoder` runs the
step with a :class:`~zeroshard.inference.kv_cache.StaticKVCache` (preallocated to
``max_out_tokens``, all its shapes fixed, its state in tensors), so the step's work is
the same every token and can be

* **captured** as a device graph (CUDA graphs, through the device seam
  ``zeroshard/distributed/device.py``: ``capture_graph`` / ``replay_graph``) at the first step of a
  batch and replayed for every later token: one launch per token;
* **compiled** with ``torch.compile`` (fused kernels; dynamo compiles it once, the
  shapes never change), eagerly run or captured in turn;
* or run as it is (the eager reference the captured path must equal, token for token).

Each step, the host copies the new token ids into the static ``ids`` buffer and the
write slot into the cache, replays, reads the logits from the static ``logits`` buffer,
then advances the cache (positions, length) outside the graph: the graph is a pure
function of its static tensors, so a warm-up run before the capture and the replay write
the same values. A new batch size builds a new decoder (and captures again); one decoder
is kept per engine. The prompt (prefill) runs eagerly, into the same cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zeroshard.distributed.device import runtime
from zeroshard.inference.kv_cache import StaticKVCache


class StaticDecoder:
    """Decode steps of ``model`` for ``batch`` rows of up to ``max_len`` tokens (see the
    module docstring). ``capture``: replay a device graph per token; ``compiled``: the
    step as ``torch.compile`` made it (None: eager)."""

    def __init__(
        self,
        model: nn.Module,
        batch: int,
        max_len: int,
        *,
        capture: bool,
        compile_options: dict[str, Any] | None = None,
    ) -> None:
        self.model, self.batch, self.max_len = model, batch, max_len
        self.cache = StaticKVCache.for_model(model, batch, max_len)
        device = self.cache.valid.device
        self.device = device
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        dtype: torch.dtype = model.tok_emb.weight.dtype  # type: ignore[union-attr, assignment]  # the GPT's
        vocab: int = model.cfg.vocab_size  # type: ignore[union-attr, assignment]
        self.logits = torch.zeros(batch, vocab, dtype=dtype, device=device)
        self.capture = capture
        self.rt = runtime(device)  # kept: the runtime it was built under
        self.graph: Any = None
        self._step: Callable[[], None] = self._run
        if compile_options is not None:
            self._step = torch.compile(self._run, **compile_options)
        #: graphs captured and replays run (for tests and benchmarks)
        self.captures = self.replays = 0

    def _run(self) -> None:
        """The step: the logits of the token in ``ids``, into ``logits``."""
        self.logits.copy_(self.model(self.ids, cache=self.cache)[:, -1])

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Empty the cache and run the prompts ([batch, T], left-padded; eager);
        returns the last position's logits [batch, vocab]."""
        self.cache.reset()
        self.cache.mark_padding(valid)
        return self.model(ids, cache=self.cache)[:, -1]

    def _load(self, token: torch.Tensor) -> None:
        """Copy the step's input into its static buffer."""
        self.ids.copy_(token.view(self.batch, 1))

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        """The logits [batch, vocab] after the tokens ``token`` [batch] (a view of the
        static output: read it before the next step)."""
        cache = self.cache
        cache.prepare_step()
        self._load(token)
        cache.stepping = True
        try:
            if not self.capture:
                self._step()
            else:
                rt = self.rt
                if self.graph is None:
                    self.graph = rt.capture_graph(self._step)
                    self.captures += 1
                rt.replay_graph(self.graph)
                self.replays += 1
        finally:
            cache.stepping = False
        cache.advance()
        return self.logits
