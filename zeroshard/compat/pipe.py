"""``zeroshard.pipe``: DeepSpeed's ``deepspeed.pipe`` names.

``PipelineModule``, ``LayerSpec`` and ``TiedLayerSpec`` (``parallel/pipeline/module.py``);
the schedules as data (``parallel/pipeline/schedules.py``). A ``PipelineModule`` given
to ``zeroshard.initialize`` returns a pipeline engine whose ``train_batch(data_iter)`` /
``eval_batch(data_iter)`` run one batch through every stage
(``parallel/pipeline/engine.py``). No collectives here.
"""

from __future__ import annotations

from zeroshard.parallel.pipeline.module import (
    LayerSpec,
    PipelineError,
    PipelineModule,
    TiedLayerSpec,
    partition_layers,
)
from zeroshard.parallel.pipeline.schedules import SCHEDULES, Action, build_schedule

__all__ = [
    "SCHEDULES",
    "Action",
    "LayerSpec",
    "PipelineError",
    "PipelineModule",
    "TiedLayerSpec",
    "build_schedule",
    "partition_layers",
]
