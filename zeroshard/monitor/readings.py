"""What the monitors read of their engine, handed to them as frozen records the engine
builds (the monitors never hold the engine). No communication.

* :class:`EngineInfo`, once, when the engine is built (``EngineMonitor.bind``): what
  the flops profiler hooks and how it labels its report, and two readers for what is
  only known later (the step counters before a first step, e.g. after a resume; the
  memory the memory columns and ``print_summary`` show, measured when asked).
* :class:`StepState`, after each ``step()`` (``EngineMonitor.step_end``): the
  counters and the values the step line, the events and the metrics file show.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, kw_only=True)
class EngineInfo:
    """What the monitors know of their engine from its start."""

    #: the engine's class name (the flops report names the model by it)
    name: str
    #: the module the flops profiler hooks
    module: nn.Module
    #: ``id(parameter) -> numel`` of the trainable parameters, from the flat layout
    #: (ZeRO-3 releases parameters: their own sizes read 0)
    param_numels: Mapping[int, int]
    #: the compute dtype (the flops report's peak)
    dtype: torch.dtype
    #: ranks of the whole run
    world_size: int
    #: ``(global_steps, global_samples)`` now: where events before a first step sit
    counters: Callable[[], tuple[int, int]]
    #: the engine's ``memory_stats()``, measured when called
    memory_stats: Callable[[], dict]


@dataclass(frozen=True, kw_only=True)
class StepState:
    """The engine after one ``step()`` (at a boundary: after its counters moved on)."""

    global_steps: int
    global_samples: int
    skipped_steps: int
    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    #: each param group's learning rate
    lr: tuple[float, ...]
    #: the last step's global gradient norm (None without clipping)
    grad_norm: float | None
    #: the fp16 loss scale (1 otherwise)
    loss_scale: float
