"""Where each kind of shard lives. No communication.

The ZeRO stage decides what is sharded; the ``offload_param`` / ``offload_optimizer``
config sections decide where those shards are kept:

* ``device``: the compute device (parameters are always *used* there);
* ``param_shard``: this rank's stage-3 parameter shard (device, or CPU memory);
* ``optimizer``: fp32 master weights, optimizer states and, from stage 2, the
  accumulated gradient shard (device, or CPU memory: ZeRO-Offload and the CPU-AdamW
  hybrid of seeds/004); with ``offload_optimizer.ratio`` below 1 (ZeRO-Offload++'s
  Twin-Flow) the leading segments of the shard keep all three on the device
  (:meth:`Placement.device_segments`) and only the rest is offloaded.

With CUDA, the CPU-side fp32 masters are page-locked unless ``pin_memory`` is false, so
their copies to the device run asynchronously (the gradient staging buffers of
``staging.py`` are always pinned on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroshard.distributed.device import host_apart, runtime
from zeroshard.offload.layout import ChunkLayout

_CPU = torch.device("cpu")


@dataclass(frozen=True)
class Placement:
    device: torch.device
    param_shard: torch.device
    optimizer: torch.device
    pin_memory: bool = False
    param_offload: str = "none"  # the config's offload_param.device
    optimizer_offload: str = "none"  # the config's offload_optimizer.device
    param_nvme: str | None = None
    optimizer_nvme: str | None = None
    #: the config's offload_optimizer.ratio: the share of the optimizer on the host
    optimizer_ratio: float = 1.0

    @classmethod
    def from_config(cls, zero, device: torch.device) -> Placement:
        op, pa = zero.offload_optimizer, zero.offload_param
        return cls(
            device=device,
            param_shard=_CPU if pa.device in ("cpu", "nvme") else device,
            optimizer=_CPU if op.device in ("cpu", "nvme") else device,
            # unset means pinned on CUDA: the masters' uploads must not block the host
            pin_memory=runtime(device).pin and (op.pin_memory is not False or pa.pin_memory),
            param_offload=pa.device,
            optimizer_offload=op.device,
            param_nvme=pa.nvme_path if pa.device == "nvme" else None,
            optimizer_nvme=op.nvme_path if op.device == "nvme" else None,
            optimizer_ratio=op.ratio,
        )

    @property
    def offload_optimizer(self) -> bool:
        """Masters and states are kept in CPU memory or NVMe files."""
        return self.optimizer_offload != "none"

    @property
    def host_is_separate(self) -> bool:
        """Whether CPU memory is apart from the compute device's memory. Not so when the
        device is the CPU: there, CPU optimizer offload keeps fp32 masters as views of
        the parameters (no second copy, no write-back), exactly as without offload.
        ``ZEROSHARD_STAGE_ON_CPU=1`` (or a fake device runtime) makes CPU-only runs act as
        if it were apart (the GPU code path: separate masters, staged gradient moves,
        write-back), for tests."""
        return host_apart(self.device)

    @property
    def optimizer_on_host(self) -> bool:
        """Masters and states in host memory apart from the device's (CPU offload on a
        GPU, or its CPU-only rehearsal)."""
        return self.optimizer_offload == "cpu" and self.host_is_separate

    @property
    def param_on_host(self) -> bool:
        """The stage-3 parameter shard in host memory apart from the device's."""
        return self.param_offload == "cpu" and self.host_is_separate

    def device_segments(self, layout: ChunkLayout) -> int:
        """Twin-Flow (``offload_optimizer.ratio`` below 1): how many leading segments of
        this rank's shard keep their masters, optimizer states and reduced gradients on
        the device; the others are offloaded. The most segments whose chunks hold at
        most ``1 - ratio`` of the shard's elements (the device never holds more than it
        was given); the same count on every rank (chunk sizes agree). 0 unless the
        optimizer is offloaded (CPU memory or NVMe files) from a device apart from the
        host (on a CPU-only run both are the one memory: nothing to split)."""
        offloaded = self.offload_optimizer and self.host_is_separate
        if not offloaded or self.optimizer_ratio >= 1:
            return 0
        room = (1.0 - self.optimizer_ratio) * layout.shard_numel
        held = count = 0
        for seg in layout.segments:
            if held + seg.chunk > room:
                break
            held += seg.chunk
            count += 1
        return count

    def same_place_for_masters(self) -> bool:
        """Whether the parameter shard and the optimizer states share one memory, so
        fp32 masters can be the parameter shard itself."""
        return self.param_on_host == self.optimizer_on_host and self.optimizer_offload != "nvme"

    @classmethod
    def on(cls, device: torch.device) -> Placement:
        """Everything on ``device`` (no offload)."""
        return cls(device=device, param_shard=device, optimizer=device)

    def zeros(self, numel: int, dtype: torch.dtype, where: torch.device) -> torch.Tensor:
        pin = self.pin_memory and where.type == "cpu"
        return torch.zeros(numel, dtype=dtype, device=where, pin_memory=pin)

    def empty(self, numel: int, dtype: torch.dtype, where: torch.device) -> torch.Tensor:
        pin = self.pin_memory and where.type == "cpu"
        return torch.empty(numel, dtype=dtype, device=where, pin_memory=pin)
