"""ZeRO: which model states are sharded across data-parallel ranks, and how.

Public (DeepSpeed-compatible) names: ``Init``, ``GatheredParameters``.
"""

from zeroshard.zero.gathered import GatheredParameters
from zeroshard.zero.init import Init

__all__ = ["GatheredParameters", "Init"]
