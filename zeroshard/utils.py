"""DeepSpeed's ``deepspeed.utils`` names that user code reaches for. No communication."""

from __future__ import annotations

from zeroshard.zero.leaves import set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module

__all__ = ["set_z3_leaf_modules", "unset_z3_leaf_modules", "z3_leaf_module"]
