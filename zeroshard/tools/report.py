"""`zeroshard report`: what this machine offers zeroshard (like DeepSpeed's ``ds_report``).

Versions, backends, devices, dtype support (tested with tiny matmuls), the peak matmul
FLOP/s of each device per dtype (:func:`~zeroshard.monitor.flops.peak_flops`, the
denominator of the flops profiler's MFU), CPU, RAM, fused AdamW and, with ``--nvme-path``, a directory's
sequential write/read speed. A failing probe reads
"unavailable: <reason>" and the rest still prints; ``--json`` for machines. No collectives.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GiB = 1024**3
MiB = 1024**2


def _try(fn: Callable[..., Any], *args: Any) -> Any:
    """Run one probe; a failure becomes the string 'unavailable: <reason>'."""
    try:
        return fn(*args)
    except Exception as e:
        text = (str(e).strip().splitlines() or [""])[0][:200]
        return f"unavailable: {type(e).__name__}" + (f": {text}" if text else "")


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def zeroshard_facts() -> dict:
    """The report's [zeroshard] section: version, and the package's folder (this module
    is two levels below it, in zeroshard/tools/)."""
    import zeroshard
    from zeroshard.tools.cli import version

    return {"version": version(), "install path": str(Path(zeroshard.__file__).resolve().parent)}


def _python() -> dict:
    version, executable = platform.python_version(), sys.executable
    return {"version": version, "executable": executable, "platform": platform.platform()}


def _torch() -> dict:
    import torch

    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "version": torch.__version__,
        "install path": str(Path(torch.__file__).parent),
        "CUDA build": torch.version.cuda or "none",
        "ROCm build": getattr(torch.version, "hip", None) or "none",
        "cuDNN": cudnn or "none",
        "CPU capability": _try(torch.backends.cpu.get_cpu_capability),
    }


def _distributed() -> dict:
    import torch.distributed as dist

    out: dict[str, Any] = {"torch.distributed": _yes(dist.is_available())}
    for name in ("gloo", "nccl", "mpi", "ucc", "xccl"):
        probe = getattr(dist, f"is_{name}_available", None)
        out[name] = _try(lambda p=probe: _yes(p()) if p else "no (not in this torch)")
    return out


def _cuda_device(i: int) -> dict:
    import torch

    p = torch.cuda.get_device_properties(i)
    memory, capability = round(p.total_memory / GiB, 1), f"{p.major}.{p.minor}"
    return {"name": p.name, "memory GiB": memory, "compute capability": capability}


def _devices() -> dict:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out: dict[str, Any] = {"CUDA devices": count}
    for i in range(count):
        out[f"cuda:{i}"] = _try(_cuda_device, i)
    out["MPS"] = _try(lambda: _yes(torch.backends.mps.is_available()))
    xpu = getattr(torch, "xpu", None)
    out["XPU devices"] = _try(lambda: xpu.device_count() if xpu and xpu.is_available() else 0)
    return out


def _probe_devices() -> list[str]:
    import torch

    names = ["cpu"]
    if torch.cuda.is_available():
        names += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if _try(torch.backends.mps.is_available) is True:
        names.append("mps")
    return names


def _matmul(device: str, dtype_name: str) -> str:
    import torch

    a = torch.ones(16, 16, dtype=getattr(torch, dtype_name), device=device)
    value = (a @ a)[0, 0].item()
    return "yes" if value == 16 else f"no: 16x16 ones matmul gave {value}"


def _fp8_matmul(device: str) -> str:
    import torch

    if not hasattr(torch, "float8_e4m3fn"):
        return "no: torch has no float8_e4m3fn"
    if device.startswith("cuda"):
        cap = torch.cuda.get_device_capability(torch.device(device))
        if cap < (8, 9):
            return f"no: needs compute capability >= 8.9, this device is {cap[0]}.{cap[1]}"
    a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device=device)
    out = torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    value = out[0, 0].item()
    return "yes (torch._scaled_mm)" if value == 16 else f"no: result {value}"


def _dtypes() -> dict:
    import torch

    out: dict[str, Any] = {"fp8 dtype (float8_e4m3fn)": _yes(hasattr(torch, "float8_e4m3fn"))}
    for device in _probe_devices():
        out[device] = {
            "bf16 matmul": _try(_matmul, device, "bfloat16"),
            "fp16 matmul": _try(_matmul, device, "float16"),
            "fp8 matmul": _try(_fp8_matmul, device),
        }
        if device.startswith("cuda"):
            out[device]["bf16 native"] = _try(lambda: _yes(torch.cuda.is_bf16_supported()))
    return out


def _peaks() -> dict:
    from zeroshard.monitor.flops import peak_flops

    out: dict[str, Any] = {}
    for device in _probe_devices():
        names = ("fp32", "bf16") if device == "cpu" else ("fp32", "bf16", "fp16")
        out[device] = {
            f"{d} TFLOPS": _try(lambda dev=device, d=d: round(peak_flops(dev, d) / 1e12, 4))
            for d in names
        }
    return out


def _cpu() -> dict:
    info = Path("/proc/cpuinfo").read_text() if os.path.exists("/proc/cpuinfo") else ""
    model = re.search(r"^model name\s*:\s*(.*)$", info, re.MULTILINE)
    topology = Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology/thread_siblings_list")
    physical = len({p.read_text() for p in topology})  # one sibling set per physical core
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "model": model.group(1) if model else platform.processor() or "unknown",
        "logical cores": os.cpu_count(),
        "usable cores (affinity)": usable or "unknown",
        "physical cores": physical or "unknown",
    }


def _memory() -> dict:
    info: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        info["MemTotal"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    avail = info.get("MemAvailable")
    return {
        "total GiB": round(info["MemTotal"] / GiB, 1),
        "available GiB": round(avail / GiB, 1) if avail else "unknown",
    }


def _fused_adamw(device: str) -> str:
    import torch

    p = torch.zeros(8, device=device, requires_grad=True)
    p.grad = torch.ones(8, device=device)
    torch.optim.AdamW([p], lr=0.1, fused=True).step()
    return "yes" if p.detach().cpu().lt(0).all() else "no: step did not update the parameter"


def _optimizers() -> dict:
    out = {"fused CPU AdamW": _try(_fused_adamw, "cpu")}
    for device in _probe_devices()[1:]:
        out[f"fused {device} AdamW"] = _try(_fused_adamw, device)
    return out


def disk_speed(directory: str | os.PathLike, size_mb: int = 256) -> dict:
    """Sequential write and read speed of a temporary file in `directory` (then removed).

    Uses O_DIRECT (page-aligned buffers) where the filesystem allows; otherwise buffered
    I/O with fsync after writing and the file's page cache dropped before reading.
    """
    folder = Path(directory)
    if not folder.is_dir():
        raise FileNotFoundError(f"not a directory: {folder}")
    chunk = min(8 * MiB, max(1, size_mb) * MiB)
    count = max(1, size_mb * MiB // chunk)
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(chunk))  # incompressible
    path = folder / f".zeroshard-speed-{os.getpid()}.tmp"
    fd, direct = -1, 0
    start = time.perf_counter()
    try:
        for direct in (getattr(os, "O_DIRECT", 0), 0):  # O_DIRECT first, buffered if refused
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o600)
                os.write(fd, buf)
                break
            except OSError:
                if fd >= 0:
                    os.close(fd)
                    fd = -1
                if not direct:
                    raise
        note = "O_DIRECT" if direct else "buffered + fsync (O_DIRECT not supported here)"
        for _ in range(count - 1):
            os.write(fd, buf)
        os.fsync(fd)
        write_s = time.perf_counter() - start
        os.close(fd)
        fd = -1
        fd = os.open(path, os.O_RDONLY | direct)
        if not direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            note += "; page cache dropped before reading"
        start = time.perf_counter()
        nread = 0
        while (n := os.readv(fd, [buf])) > 0:
            nread += n
        read_s = time.perf_counter() - start
    finally:
        if fd >= 0:
            os.close(fd)
        path.unlink(missing_ok=True)
        buf.close()
    write, read = count * chunk / max(write_s, 1e-9), nread / max(read_s, 1e-9)
    out = {"path": str(folder.resolve()), "file MiB": count * chunk // MiB, "mode": note}
    return {**out, "write GB/s": round(write / 1e9, 3), "read GB/s": round(read / 1e9, 3)}


def collect(nvme_path: str | None = None, nvme_size_mb: int = 256) -> dict[str, Any]:
    """Run every probe; returns {section: {item: value}} (JSON-serialisable)."""
    sections: dict[str, Callable[[], Any]] = {
        "zeroshard": zeroshard_facts,
        "python": _python,
        "torch": _torch,
        "distributed backends": _distributed,
        "devices": _devices,
        "dtype support": _dtypes,
        "peak matmul (measured)": _peaks,
        "cpu": _cpu,
        "memory": _memory,
        "optimizers": _optimizers,
    }
    if nvme_path is not None:
        sections["nvme/disk speed"] = lambda: disk_speed(nvme_path, nvme_size_mb)
    from zeroshard.monitor.progress import progress

    shown = progress(sections.items(), desc="probing", total=len(sections), delay=0.5)
    return {name: _try(fn) for name, fn in shown}


def render(report: dict[str, Any]) -> str:
    """The human-readable text of a `collect()` result."""
    lines = ["zeroshard environment report", "=" * 29]

    def emit(key: str, value: Any, depth: int) -> None:
        pad = "  " * depth
        if depth == 0:
            lines.append(f"\n[{key}]" + ("" if isinstance(value, dict) else f" {value}"))
        elif isinstance(value, dict):
            lines.append(f"{pad}{key}:")
        else:
            lines.append(f"{pad}{key + ' ':.<{max(8, 34 - len(pad))}} {value}")
        for k, v in value.items() if isinstance(value, dict) else ():
            emit(k, v, depth + 1)

    for section, value in report.items():
        emit(section, value, 0)
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `zeroshard report`."""
    parser.description = "Print what this machine offers zeroshard (like ds_report)."
    a = parser.add_argument
    a("--json", action="store_true", help="print JSON instead of text")
    a("--nvme-path", "--nvme_path", metavar="DIR", help="measure disk write/read GB/s in DIR")
    a("--nvme-size-mb", type=int, default=256, metavar="MB", help="test file size (default 256)")


def main(args: argparse.Namespace) -> int:
    """Print the report; returns 0."""
    report = collect(args.nvme_path, args.nvme_size_mb)
    print(json.dumps(report, indent=2, default=str) if args.json else render(report))
    return 0
