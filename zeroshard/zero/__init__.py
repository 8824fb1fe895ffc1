"""ZeRO: which model states are sharded across data-parallel ranks, and how.

Public (DeepSpeed-compatible) names: ``Init``, ``GatheredParameters``,
``register_external_parameter`` / ``unregister_external_parameter`` (nothing to register
here: external reads are found by the gatherer).
"""

from zeroshard.zero.params.external import (
    register_external_parameter,
    unregister_external_parameter,
)
from zeroshard.zero.params.gathered import GatheredParameters
from zeroshard.zero.params.init import Init

__all__ = [
    "GatheredParameters",
    "Init",
    "register_external_parameter",
    "unregister_external_parameter",
]
