"""What the engine asks of the parameter manager, whichever the stage: a Protocol that
:class:`~zeroshard.zero.params.whole.WholeParams` (stages 0-2) and
:class:`~zeroshard.zero.params.gatherer.ParamGatherer` (stage 3) both satisfy; the type
checker holds them to it where the engine stores either (``Engine.params``). No
communication here; each implementation's module says what its methods issue.

The engine calls every method on either manager without asking which it holds; a
method with nothing to do at one stage is a no-op there that says why
(``WholeParams.end_backward``, ``ParamGatherer.settle``).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class ParamManager(Protocol):
    """Where the model's parameters are whole, and how they become so."""

    def settle(self) -> None:
        """Wait for gathers still in flight from the last step (before a call that reads
        the parameters)."""

    def begin_backward(self) -> None:
        """The engine's backward starts."""

    def end_backward(self) -> None:
        """The engine's backward ended (or raised)."""

    def after_step(self) -> None:
        """The optimizer has written new shards: make the parameters whole from them."""

    def edited(self) -> bool:
        """Whether a whole parameter may have been changed outside the engine since
        :meth:`mark_clean` (``zero/params/edits.py``)."""

    def take_edits(self) -> list[int]:
        """The segments whose parameters were changed since :meth:`mark_clean`, written
        into this rank's shard (their masters take them); clean again."""

    def mark_clean(self) -> None:
        """The parameters and the masters agree now."""

    def open(self, params: list[torch.Tensor]) -> None:
        """``GatheredParameters`` enters: ``params`` are whole until :meth:`close`."""

    def close(self, params: list[torch.Tensor], modifier_rank: int | None) -> list[int]:
        """``GatheredParameters`` exits: with ``modifier_rank``, that rank's values reach
        every rank's shard; the segments whose chunks changed."""

    def compile_regions(self, module: nn.Module) -> list[nn.Module] | None:
        """``engine.compile``: the regions to compile one by one, or None (compile the
        whole module)."""

    def buffers(self) -> list[torch.Tensor]:
        """The tensors holding the parameters on this rank (memory accounting)."""

    def remove(self) -> None:
        """Teardown: remove every hook; the parameters stay whole, plain tensors."""
