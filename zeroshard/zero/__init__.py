"""ZeRO: which model states are sharded across data-parallel ranks, and how.

Public (DeepSpeed-compatible) names: ``GatheredParameters``.
"""

from zeroshard.zero.gathered import GatheredParameters

__all__ = ["GatheredParameters"]
