"""The optimizer-state store: where this rank's fp32 masters and optimizer states live
and how they are stepped. No communication. Structural types (``typing.Protocol``) that
the type checker holds the stores to:

* :class:`StateStore`, the store the sharded optimizer steps and checkpoints read:
  ``zero/optim/memory_store.MemoryStates`` (device or host memory),
  ``offload/swapped_adam.SwappedAdam`` (NVMe files) and ``offload/delayed.DelayedUpdate``
  (the memory store stepped one step late) satisfy it;
* :class:`StepGrads`, what a store's ``step`` reads of the reduced gradients
  (``zero/grads/result.ReducedGrads`` satisfies it), so the stores need nothing of
  ``zero/grads``.

Here, below ``zero/``, so that the stores of ``offload/`` need nothing of the sharding.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Protocol

import torch

from zeroshard.offload.store import Store


class StepGrads(Protocol):
    """This rank's reduced gradient: ``chunks[segment]`` (this rank's chunk of each
    segment), and ``range(a, b)``: shard positions ``[a, b)`` as one tensor."""

    @property
    def chunks(self) -> Sequence[torch.Tensor]: ...

    def range(self, a: int, b: int) -> torch.Tensor: ...


class StateStore(Store, Protocol):
    """Masters and optimizer states of this rank's shard (``Store``'s ``read``/``write``
    of a kind at shard positions, ``buffers``, ``disk_bytes``), and their step."""

    @property
    def separate(self) -> bool:
        """Whether the masters are apart from the parameters (written back each step)."""

    @property
    def inner(self) -> Any:
        """What holds the param groups: the torch optimizer (or the NVMe Adam itself),
        which learning-rate schedulers take."""

    @property
    def param_groups(self) -> list[dict]: ...

    @property
    def state(self) -> Any:
        """The inner optimizer's ``state`` (torch's per-tensor dict)."""

    def init_state(self, zero_grads: list[torch.Tensor]) -> None:
        """Create the states up front (on the still-zero gradient chunks)."""

    def step(self, grads: StepGrads, factor: float, unused: AbstractSet[int] = frozenset()) -> None:
        """Step on ``grads`` scaled by ``factor``, skipping the parameters in ``unused``;
        the new values reach the parameter store."""

    def refresh(self, segments: list[int]) -> None:
        """The parameters of ``segments`` were changed from outside: the masters take
        the changes."""

    def group_steps(self) -> list[float]:
        """Per param group, the most steps any of its parameters took."""

    def set_group_steps(self, steps: list[float]) -> None: ...
