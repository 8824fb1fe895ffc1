"""DeepSpeed's ``deepspeed.utils`` names that user code reaches for. No communication."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from zeroshard.compat.comm import get_rank, is_initialized
from zeroshard.compat.ds_fragments import FRAGMENT_FUNCTIONS
from zeroshard.zero.params.leaves import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
)

logger = logging.getLogger("zeroshard")  # deepspeed.utils.logger (the Trainer sets its level)


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the ``ranks`` listed (None or [-1]: every rank), prefixed with the
    rank, as DeepSpeed's ``log_dist``."""
    rank = get_rank()
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, "[Rank %d] %s", rank, message)


class RepeatingLoader:
    """DeepSpeed's ``deepspeed.utils.RepeatingLoader``: iterates ``loader`` for ever,
    starting it again each time it is exhausted."""

    def __init__(self, loader: Iterable) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)  # an empty loader ends here: StopIteration


def __getattr__(name: str) -> Any:
    if name in FRAGMENT_FUNCTIONS:  # deepspeed.utils.safe_get_full_grad, ...: not built yet
        return FRAGMENT_FUNCTIONS[name]
    raise AttributeError(f"module 'zeroshard.utils' has no attribute {name!r}")


__all__ = [
    "RepeatingLoader",
    "get_z3_leaf_modules",
    "is_initialized",
    "log_dist",
    "logger",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]
