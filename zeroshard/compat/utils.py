"""DeepSpeed's ``deepspeed.utils`` names that user code reaches for. No communication."""

from __future__ import annotations

import logging

from zeroshard.compat.comm import is_initialized
from zeroshard.zero.params.leaves import set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module

logger = logging.getLogger("zeroshard")  # deepspeed.utils.logger (the Trainer sets its level)

__all__ = [
    "is_initialized",
    "logger",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]
