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

#: DeepSpeed's ``zero.MiCS_Init``: builds the model partitioned as ``Init`` does;
#: ``initialize`` re-slices it into the hybrid-sharding layout of the config's
#: ``zero_optimization.mics_shard_size``
MiCS_Init = Init

__all__ = [
    "GatheredParameters",
    "Init",
    "MiCS_Init",
    "register_external_parameter",
    "unregister_external_parameter",
]
