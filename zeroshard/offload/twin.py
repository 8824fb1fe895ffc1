"""Twin-Flow with NVMe (``offload_optimizer: {device: "nvme", ratio: r}``): this rank's
optimizer states split at a segment boundary between a store in device memory (the
leading segments: masters and moments there, stepped by a torch optimizer on the device)
and NVMe swap files (the rest: masters and moments on disk, stepped on the host through
its sub-group buffers). No communication.

:class:`TwinStates` is one optimizer-state store (:class:`~zeroshard.offload.states.
StateStore`) made of the two: ``read``/``write`` dispatch by shard position, a step
queues the device's share first (its kernels run while the host steps the swapped
share), and the swapped store's ``param_groups`` are the ones schedulers and checkpoints
see: their hyperparameters are copied into the device optimizer's groups before each
step. With ratio 1 there is no device share and the swap files hold everything (this
class is not used); with a device share covering the whole shard the builder makes the
device store alone.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import Any, Protocol

import torch

from zeroshard.offload.states import StateStore, StepGrads


class DeviceShare(StateStore, Protocol):
    """The device's share (``zero/optim/memory_store.MemoryStates`` built for its
    segments only)."""

    @property
    def device_segments(self) -> int: ...

    @property
    def device_numel(self) -> int: ...


class TwinStates:
    """Shard positions ``[0, device.device_numel)`` in ``device``, the rest in ``disk``
    (``offload/swapped_adam.SwappedAdam`` built from that position)."""

    separate = True  # the masters are copies on both sides
    masters = None  # not one set of tensors: part of them are in swap files

    def __init__(self, device: DeviceShare, disk: StateStore) -> None:
        self.device, self.disk = device, disk
        #: the leading segments and the shard positions kept on the device
        self.device_segments = device.device_segments
        self.device_numel = device.device_numel

    # -- what schedulers and checkpoints see: the swapped store's groups ------------------
    @property
    def inner(self) -> Any:
        return self.disk.inner

    @property
    def param_groups(self) -> list[dict]:
        return self.disk.param_groups

    @property
    def state(self) -> Any:
        return self.disk.state

    @property
    def kinds(self) -> list[str]:
        return sorted(set(self.device.kinds) | set(self.disk.kinds))

    def init_state(self, zero_grads: list[torch.Tensor]) -> None:
        self.device.init_state(zero_grads)
        self.disk.init_state(zero_grads)

    def step(self, grads: StepGrads, factor: float, unused: AbstractSet[int] = frozenset()) -> None:
        """The device's share first (queued on the device), then the swapped share (read,
        stepped and written back on the host meanwhile)."""
        for mine, theirs in zip(self.device.param_groups, self.disk.param_groups, strict=True):
            mine.update({k: v for k, v in theirs.items() if k != "params"})
        self.device.step(grads, factor, unused)
        self.disk.step(grads, factor, unused)

    def refresh(self, segments: list[int]) -> None:
        k = self.device_segments
        self.device.refresh([s for s in segments if s < k])
        self.disk.refresh([s for s in segments if s >= k])

    # -- the store protocol, by shard position -------------------------------------------
    def read(self, kind: str, a: int, b: int) -> torch.Tensor:
        cut = self.device_numel
        if b <= cut:
            return self.device.read(kind, a, b)
        if a >= cut:
            return self.disk.read(kind, a, b)
        return torch.cat([self.device.read(kind, a, cut).cpu(), self.disk.read(kind, cut, b)])

    def write(self, kind: str, a: int, values: torch.Tensor) -> None:
        cut = self.device_numel
        if a < cut:
            self.device.write(kind, a, values[: cut - a])
        if a + values.numel() > cut:
            self.disk.write(kind, max(a, cut), values[max(0, cut - a) :])

    def group_steps(self) -> list[float]:
        """Per group, the most steps any of its parameters took, on either side."""
        return [max(x, y) for x, y in zip(self.device.group_steps(), self.disk.group_steps(), strict=True)]  # fmt: skip

    def set_group_steps(self, steps: list[float]) -> None:
        self.device.set_group_steps(steps)
        self.disk.set_group_steps(steps)

    def buffers(self) -> list[torch.Tensor]:
        return self.device.buffers() + self.disk.buffers()

    def buffers_by_place(self) -> dict[str, list[torch.Tensor]]:
        """The device's share, and the swapped share's sub-group buffers in host memory."""
        return {"device": self.device.buffers(), "host": self.disk.buffers()}

    def disk_bytes(self) -> int:
        return self.disk.disk_bytes()
