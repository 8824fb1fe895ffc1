"""DeepSpeed's ``deepspeed.accelerator.get_accelerator()``: the device this rank computes
on, with the names integrations call. No communication."""

from __future__ import annotations

import torch

from zeroshard.distributed.device import runtime
from zeroshard.distributed.process_group import default_device, local_rank, use_cuda

__all__ = ["Accelerator", "get_accelerator"]


class Accelerator:
    """The CPU or this rank's CUDA device (``ZEROSHARD_ACCELERATOR`` / ``DS_ACCELERATOR``
    choose, as for the engine)."""

    def device_name(self, device_index: int | str | None = None) -> str:
        """``"cuda"`` / ``"cuda:N"``, or ``"cpu"`` (the CPU has no index)."""
        if not use_cuda():
            return "cpu"
        return "cuda" if device_index is None else f"cuda:{int(device_index)}"

    def current_device_name(self) -> str:
        return str(default_device())

    def current_device(self) -> int:
        if use_cuda():
            return default_device().index or 0
        return local_rank()

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def device_count(self) -> int:
        return runtime("cuda").device_count() if use_cuda() else 1

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "nccl" if use_cuda() else "gloo"

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if use_cuda() else True

    def is_fp16_supported(self) -> bool:
        return use_cuda()

    def synchronize(self, device_index: int | None = None) -> None:
        if use_cuda():
            runtime("cuda").synchronize(device_index)

    def empty_cache(self) -> None:
        if use_cuda():
            torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    @property
    def _name(self) -> str:
        return "cuda" if use_cuda() else "cpu"


_ACCELERATOR = Accelerator()


def get_accelerator() -> Accelerator:
    return _ACCELERATOR
