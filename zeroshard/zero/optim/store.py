"""The seam between the gradients and the optimizer-state stores: what a store's
``step`` reads. No communication. Structural (a ``typing.Protocol``), so the stores in
``offload/`` need nothing from ``zero/grads``; ``zero/grads/result.ReducedGrads``
satisfies it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class StepGrads(Protocol):
    """This rank's reduced gradient: ``chunks[segment]`` (this rank's chunk of each
    segment), and ``range(a, b)``: shard positions ``[a, b)`` as one tensor."""

    @property
    def chunks(self) -> Sequence[torch.Tensor]: ...

    def range(self, a: int, b: int) -> torch.Tensor: ...
