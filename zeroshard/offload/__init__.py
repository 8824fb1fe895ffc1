"""Offload: *where* a shard lives (device, CPU memory, NVMe files), independent of the
ZeRO stage that decides *what* is sharded. It sits below ``zero/``: what it reads of
zero's layout and stores is declared here as ``typing.Protocol``s (``layout``,
``store``, ``states``) that zero's types satisfy."""

from zeroshard.offload.placement import Placement

__all__ = ["Placement"]
