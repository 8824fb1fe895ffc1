"""Offload: *where* a shard lives (device, CPU memory, NVMe files), independent of the
ZeRO stage that decides *what* is sharded."""

from zeroshard.offload.placement import Placement

__all__ = ["Placement"]
