"""DeepSpeed's ``deepspeed.accelerator.get_accelerator()``: the device this rank computes
on, with the names integrations and DeepSpeed's own test harness call. No communication.

Memory figures are the CUDA caching allocator's on CUDA; on the CPU, which has no device
allocator, they are this process's resident memory (``memory_allocated``) and its peak
(``max_memory_allocated``), as DeepSpeed's CPU accelerator reports.
"""

from __future__ import annotations

import os
import resource
import sys

import torch

from zeroshard import ArgumentError
from zeroshard.distributed.device import runtime
from zeroshard.distributed.process_group import default_device, local_rank, use_cuda

__all__ = ["Accelerator", "get_accelerator", "is_current_accelerator_supported"]


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
        """CUDA's device count; on the CPU, as DeepSpeed's CPU accelerator counts: the
        launcher's ``LOCAL_SIZE`` (the ranks it starts on this node, each a CPU
        "device") when set and positive, else the host's NUMA nodes that have cores."""
        if use_cuda():
            return runtime("cuda").device_count()
        size = os.environ.get("LOCAL_SIZE", "")
        try:
            if int(size) > 0:
                return int(size)
        except ValueError:
            if size.strip():
                raise ArgumentError(f"LOCAL_SIZE={size!r} is not a number of local ranks") from None
        return _numa_nodes_with_cores()

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "nccl" if use_cuda() else "gloo"

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if use_cuda() else True

    def is_fp16_supported(self) -> bool:
        return use_cuda()

    def supported_dtypes(self) -> list[torch.dtype]:
        """The floating dtypes this device computes in, fp32 first (DeepSpeed's tests
        parametrize over it)."""
        out = [torch.float32]
        if self.is_fp16_supported():
            out.append(torch.float16)
        if self.is_bf16_supported():
            out.append(torch.bfloat16)
        return out

    def synchronize(self, device_index: int | None = None) -> None:
        if use_cuda():
            runtime("cuda").synchronize(device_index)

    def empty_cache(self) -> None:
        if use_cuda():
            torch.cuda.empty_cache()

    def set_device(self, device_index: int | str | torch.device) -> None:
        """Make ``device_index`` this process's current CUDA device (on the CPU there is
        one device: nothing to select)."""
        if not use_cuda():
            return
        if isinstance(device_index, int):
            device = torch.device("cuda", device_index)
        else:
            device = torch.device(device_index)
        runtime("cuda").set_device(device)

    def memory_allocated(self, device_index: int | None = None) -> int:
        if use_cuda():
            return torch.cuda.memory_allocated(device_index)
        return _rss_bytes()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        if use_cuda():
            return torch.cuda.max_memory_allocated(device_index)
        return max(_peak_rss_bytes(), _rss_bytes())

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """Reset the CUDA allocator's peak (the CPU's peak resident size cannot be reset)."""
        if use_cuda():
            torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        if use_cuda():
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def is_triton_supported(self) -> bool:
        return False

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    @property
    def _name(self) -> str:
        return "cuda" if use_cuda() else "cpu"


def _rss_bytes() -> int:
    """This process's resident memory now (Linux /proc; else the peak)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return _peak_rss_bytes()
    return pages * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # kilobytes on Linux


_ACCELERATOR = Accelerator()


def _numa_nodes_with_cores(root: str = "/sys/devices/system/node") -> int:
    """NUMA nodes that own at least one CPU (a memory-only node, such as HBM in flat
    mode, does not count), at least 1."""
    try:
        nodes = [n for n in os.listdir(root) if n.startswith("node") and n[4:].isdigit()]
    except OSError:
        return 1
    count = 0
    for node in nodes:
        try:
            with open(os.path.join(root, node, "cpulist")) as f:
                count += bool(f.read().strip())
        except OSError:
            continue
    return max(count, 1)


def get_accelerator() -> Accelerator:
    return _ACCELERATOR


def is_current_accelerator_supported() -> bool:
    """DeepSpeed's ``deepspeed.accelerator.is_current_accelerator_supported``: whether the
    accelerator in use is one this build runs on (the CPU and CUDA: always)."""
    return True
