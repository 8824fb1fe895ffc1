"""``zeroshard.pipe``: DeepSpeed's ``deepspeed.pipe`` names.

``PipelineModule``, ``LayerSpec`` and ``TiedLayerSpec`` (``zeroshard/parallel/
pipeline_module.py``); the schedules as data (``zeroshard/parallel/schedules.py``). A
``PipelineModule`` given to ``zeroshard.initialize`` returns a pipeline engine whose
``train_batch(data_iter)`` / ``eval_batch(data_iter)`` run one batch through every stage
(``zeroshard/parallel/pipeline_engine.py``). No collectives here.
"""

from __future__ import annotations

from zeroshard.parallel.pipeline_module import (
    LayerSpec,
    PipelineError,
    PipelineModule,
    TiedLayerSpec,
    partition_layers,
)
from zeroshard.parallel.schedules import SCHEDULES, Action, build_schedule

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
