"""Memory in use right now: the device allocator's counters, this process's RSS and the
host's used memory, read cheaply (``/proc``, no ``gc.collect``). ``memory_breakdown``
prints :func:`breakdown_line` where DeepSpeed prints ``see_memory_usage``: before and
after forward, backward and step. No collectives.
"""

from __future__ import annotations

import os

import torch

GB = 1024**3
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 8192)
    finally:
        os.close(fd)


def rss_bytes() -> int:
    """This process's resident set size (0 where ``/proc`` is missing)."""
    try:
        return int(_read("/proc/self/statm").split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _field(text: bytes, name: bytes) -> int:
    at = text.find(name)
    return int(text[at + len(name) :].split(None, 1)[0]) * 1024 if at >= 0 else 0


def host_used() -> tuple[int, float]:
    """(bytes used, percent used) of the host's memory: total less available."""
    try:
        text = _read("/proc/meminfo")
    except OSError:
        return 0, 0.0
    total, available = _field(text, b"MemTotal:"), _field(text, b"MemAvailable:")
    used = total - available
    return used, 100.0 * used / total if total else 0.0


def device_counters(device: torch.device) -> dict[str, int]:
    """The allocator's counters on a CUDA device ({} elsewhere)."""
    if device.type != "cuda":
        return {}
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "max_allocated": torch.cuda.max_memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "max_reserved": torch.cuda.max_memory_reserved(device),
    }


def breakdown_line(where: str, device: torch.device) -> str:
    """``Engine before forward | MA 0.12 GB Max_MA ... | CPU Virtual Memory: used = ...``
    (DeepSpeed's ``see_memory_usage`` fields; MA/CA on CUDA only). On CUDA the peak
    counters are reset after reading, as DeepSpeed does, so each line's Max is since the
    previous line."""
    parts = [where]
    counters = device_counters(device)
    if counters:
        c = {k: round(v / GB, 2) for k, v in counters.items()}
        parts.append(
            f"MA {c['allocated']} GB Max_MA {c['max_allocated']} GB "
            f"CA {c['reserved']} GB Max_CA {c['max_reserved']} GB"
        )
        torch.cuda.reset_peak_memory_stats(device)
    used, percent = host_used()
    parts.append(f"CPU Virtual Memory: used = {round(used / GB, 2)} GB, percent = {percent:.1f}%")
    parts.append(f"RSS {round(rss_bytes() / GB, 2)} GB")
    return " | ".join(parts)
