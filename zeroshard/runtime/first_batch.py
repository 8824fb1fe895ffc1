"""The micro-batch size taken from the first batch, when the config leaves it out.

Seed 001's method B gives only ``gradient_accumulation_steps`` (and ``"train_batch_size":
0``, "computed"). DeepSpeed refuses that; when the user feeds their own batches (no
``training_data``) zeroshard instead reads the rows of the first batch the model's
forward receives (the first tensor argument with a batch dimension), says so in one log
line, and the batch sizes are resolved as if the config had given it. Where it cannot be
known (a first batch with no such tensor, ranks feeding different sizes, ``step()``
before any forward) the error names ``train_micro_batch_size_per_gpu``.

Communication: one all-reduce (max) of two int64 at the first forward, so that every rank
takes the same size or every rank raises.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zeroshard.config import ConfigError
from zeroshard.distributed.comm import Comm

KEY = "train_micro_batch_size_per_gpu"

log = logging.getLogger("zeroshard")


def rows_of(args, kwargs) -> int | None:
    """Rows of the first tensor with a batch dimension among the forward's arguments
    (depth first through tuples, lists and dicts), or None."""
    return _rows([*args, *kwargs.values()])


def _rows(obj) -> int | None:
    if torch.is_tensor(obj):
        return obj.shape[0] if obj.dim() >= 1 else None
    items: Iterable[Any]
    if isinstance(obj, (tuple, list)):
        items = obj
    elif isinstance(obj, dict):
        items = obj.values()
    else:
        return None
    for item in items:
        found = _rows(item)
        if found is not None:
            return found
    return None


class FirstBatchSize:
    """A forward pre-hook on ``module`` that calls ``learned(rows)`` once, at the first
    forward, with the rows every rank fed."""

    def __init__(
        self, module: nn.Module, comm: Comm, device: torch.device, learned: Callable[[int], None]
    ) -> None:
        self.comm, self.device, self.learned = comm, device, learned
        self._hook: RemovableHandle | None = module.register_forward_pre_hook(
            self._on_forward, with_kwargs=True
        )

    def _on_forward(self, module, args, kwargs):
        self.remove()
        rows = rows_of(args, kwargs) or 0
        both = torch.tensor([rows, -rows], dtype=torch.int64, device=self.device)
        self.comm.all_reduce(both, op="max")
        top, low = both.tolist()
        low = -low
        if low == 0:
            raise ConfigError(
                KEY,
                "not in the config, and the first batch (on some rank) has no tensor with a "
                "batch dimension to take it from; set train_micro_batch_size_per_gpu",
            )
        if top != low:
            raise ConfigError(
                KEY,
                f"not in the config, and ranks fed first batches of different sizes ({low} "
                f"to {top} rows); set train_micro_batch_size_per_gpu",
            )
        self.learned(rows)

    def remove(self) -> None:
        """Teardown (also done by the first forward)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def say_taken(config, rows: int) -> None:
    """The log line (a warning, so that it shows by default, as config notes do) saying
    the size was taken: ``config`` has it filled in now. Rank 0 says it."""
    log.warning(
        "zeroshard: train_micro_batch_size_per_gpu is not in the config; taken from "
        "the first batch: %d (train_batch_size %d = %d x gradient_accumulation_steps "
        "%d x %d data-parallel ranks)",
        rows,
        config.train_batch_size,
        rows,
        config.gradient_accumulation_steps,
        config.dp_world_size,
    )


def not_learned() -> ConfigError:
    return ConfigError(
        KEY,
        "not in the config, and no batch has gone through the model's forward yet to take "
        "it from; set train_micro_batch_size_per_gpu",
    )
