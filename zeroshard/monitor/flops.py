"""DeepSpeed's ``flops_profiler``: FLOPs, parameters and forward latency per module at one
step, with model TFLOPS and MFU. No collectives.

FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` (matmuls,
convolutions and attention kernels it knows; element-wise ops count zero, as in most
MFU accounting), over the whole step on rank 0: forward, backward (recomputed forwards
included) and the step. Forward FLOPs are those counted between the start of a forward
and the next backward. As in DeepSpeed, the profiled step is the one that starts with
``profile_step`` steps done (``profile_step: 1`` is the second step), on rank 0 only.

Model FLOPs = 3 x forward FLOPs (backward = 2 x forward, recomputation not counted: the
MFU convention of the PaLM paper; 6·N·tokens for a transformer's matmuls). MFU = model
FLOPs per second / the device's peak, measured by :func:`peak_flops`
(a large matmul in the compute dtype, as ``zeroshard report`` shows it). The iteration
latency behind TFLOPS and MFU is the previous step's (the profiler slows its own step);
per-module latencies are measured in the profiled step, with hooks (and a device
synchronization per module on GPUs), so they include the profiler's cost.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import TYPE_CHECKING

import torch
from torch import nn

from zeroshard.distributed.device import runtime

if TYPE_CHECKING:
    from torch.utils.flop_counter import FlopCounterMode


def number(n: float, unit: str = "") -> str:
    """``1.23 G``-style numbers (DeepSpeed's units)."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.2f} {unit}".rstrip()


def _seconds(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


class FlopsProfiler:
    """Counts one step; :meth:`report` renders the profile."""

    def __init__(self, cfg, rank: int, device: torch.device) -> None:
        self.cfg, self.rank, self.device = cfg, rank, device
        self.active = self.done = False
        self._counter: FlopCounterMode | None = None
        self._hooks: list = []
        self._names: dict[int, str] = {}
        self.latency: dict[str, float] = defaultdict(float)
        self.fwd: dict[str, int] = defaultdict(int)  # module -> forward FLOPs
        self._at_forward: dict[str, int] = {}

    def _params(self, m: nn.Module) -> int:
        return sum(self._sizes.get(id(p), p.numel()) for p in m.parameters())

    def wants(self, global_steps: int) -> bool:
        return not self.done and self.rank == 0 and global_steps == self.cfg.profile_step

    # -- counting ----------------------------------------------------------------------
    def start(self, module: nn.Module, wrapper: str, sizes: dict[int, int]) -> None:
        """Count from now on. ``wrapper``: the class name of the engine around ``module``;
        ``sizes``: elements of the parameters (by ``id``) that ZeRO-3 has released."""
        from torch.utils.flop_counter import FlopCounterMode

        self.module, self.root, self._wrapper = module, type(module).__name__, wrapper
        self._sizes = sizes
        for name, m in module.named_modules():
            full = f"{self.root}.{name}" if name else self.root
            self._names[id(m)] = full
            self._hooks.append(m.register_forward_pre_hook(self._enter))
            self._hooks.append(m.register_forward_hook(self._leave))
        self._started: dict[int, list[float]] = defaultdict(list)
        self._counter = FlopCounterMode(display=False)
        self._counter.__enter__()
        self.active = True

    def _clock(self) -> float:
        runtime(self.device).synchronize(self.device)
        return time.perf_counter()

    def _enter(self, module, args) -> None:
        self._started[id(module)].append(self._clock())

    def _leave(self, module, args, output) -> None:
        starts = self._started[id(module)]
        if starts:
            self.latency[self._names[id(module)]] += self._clock() - starts.pop()

    def counts(self) -> dict[str, int]:
        """FLOPs so far per module name (``Root.child.grandchild``) and ``Global``."""
        out: dict[str, int] = defaultdict(int)
        assert self._counter is not None, "FlopsProfiler.counts() before start()"
        for name, ops in self._counter.get_flop_counts().items():
            # FlopCounterMode's module tracker sees the engine's own hooks too: it names
            # the engine by its class and, from then on, the model "<Engine>.module"
            if name == self._wrapper:
                continue
            if name.startswith(self._wrapper + ".module"):
                name = self.root + name[len(self._wrapper) + len(".module") :]
            out[name] += sum(ops.values())
        return out

    def forward_start(self) -> None:
        self._at_forward = self.counts()

    def backward_start(self) -> None:
        now = self.counts()
        for name, flops in now.items():
            self.fwd[name] += flops - self._at_forward.get(name, 0)

    def stop(self) -> None:
        self.total = self.counts()
        assert self._counter is not None  # counts() checked it
        self._counter.__exit__(None, None, None)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.active, self.done = False, True

    # -- the report ------------------------------------------------------------------
    def report(self, *, step: int, info: dict, latencies: dict, iter_s: float, peak: float) -> str:
        """The profile text. ``info``: world/dp size, micro-batch; ``latencies``: the
        profiled step's fwd/bwd/step ms; ``iter_s``: an unprofiled step's seconds;
        ``peak``: the device's FLOP/s."""
        total, fwd_total = self.total.get("Global", 0), self.fwd.get("Global", 0)
        model_flops = 3 * fwd_total
        params = self._params(self.module)
        fmt = "{:<64}  {}"
        lines = [
            "",
            "-------------------------- zeroshard Flops Profiler --------------------------",
        ]
        lines.append(f"Profile Summary at step {step}:")
        rows = [
            ("world size: ", info["world_size"]),
            ("data parallel size: ", info["dp_size"]),
            ("batch size per GPU: ", info["micro_batch"]),
            ("params per GPU: ", number(params)),
            ("fwd flops per GPU: ", number(fwd_total)),
            ("fwd+bwd flops per GPU (counted, recomputation included): ", number(total)),
            ("model flops per GPU = 3 * fwd flops: ", number(model_flops)),
        ]
        for name in ("fwd", "bwd", "step"):
            if name in latencies:
                rows.append((f"{name} latency (profiled step): ", _seconds(latencies[name] / 1e3)))
        rows.append(("iter latency (an unprofiled step): ", _seconds(iter_s)))
        tflops = model_flops / iter_s if iter_s > 0 else 0.0
        rows.append(("model FLOPS per GPU = model flops / iter latency: ", number(tflops, "FLOPS")))
        hw = total / iter_s if iter_s > 0 else 0.0
        rows.append(
            ("hardware FLOPS per GPU = fwd+bwd flops / iter latency: ", number(hw, "FLOPS"))
        )
        rows.append((f"peak FLOPS per GPU ({info['device']}, {info['dtype']} matmul, measured): ", number(peak, "FLOPS")))  # fmt: skip
        rows.append(
            ("MFU = model FLOPS / peak: ", f"{100 * tflops / peak:.2f}%" if peak else "n/a")
        )
        rows.append(("samples/second: ", f"{info['batch'] / iter_s:.2f}" if iter_s > 0 else "n/a"))
        lines += [fmt.format(k, v) for k, v in rows]
        lines += self._aggregated(self.cfg.top_modules)
        if self.cfg.detailed:
            lines += self._table()
        lines.append("-" * 78)
        self.summary = {"fwd_flops": fwd_total, "flops": total, "model_flops": model_flops,
                        "params": params, "iter_s": iter_s, "model_flops_per_s": tflops,
                        "peak_flops_per_s": peak, "mfu": tflops / peak if peak else None}  # fmt: skip
        return "\n".join(lines)

    def _rows(self):
        """(depth, name, module) in module order, within module_depth."""
        depth_cap = self.cfg.module_depth
        for name, m in self.module.named_modules():
            depth = name.count(".") + 1 if name else 0
            if depth_cap < 0 or depth <= depth_cap:
                yield depth, f"{self.root}.{name}" if name else self.root, m

    def _aggregated(self, top: int) -> list[str]:
        """DeepSpeed's "top modules per depth" by params, FLOPs and latency, per class."""
        by_depth: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0, 0.0]))  # fmt: skip
        for depth, name, m in self._rows():
            acc = by_depth[depth][type(m).__name__]
            acc[0] += self._params(m)
            acc[1] += self.fwd.get(name, 0)
            acc[2] += self.latency.get(name, 0.0)
        lines = ["", "----------------------------- Aggregated Profile per GPU -----------------------------"]  # fmt: skip
        lines.append(f"Top {top} modules in terms of params, fwd FLOPs or fwd latency at different model depths:")  # fmt: skip
        for depth in sorted(by_depth):
            items = list(by_depth[depth].items())

            def best(i, show, items=items):
                ranked = sorted(items, key=lambda kv: -kv[1][i])[:top]
                return {k: show(v[i]) for k, v in ranked}

            lines.append(f"depth {depth}:")
            lines.append(f"    params      - {best(0, number)}")
            lines.append(f"    fwd FLOPs   - {best(1, number)}")
            lines.append(f"    fwd latency - {best(2, _seconds)}")
        return lines

    def _table(self) -> list[str]:
        """Per module: parameters, forward FLOPs (share of the model's), forward latency
        and rate. Backward FLOPs are in the summary only: FlopCounterMode's module
        tracker misattributes the backward of modules whose output is their input (e.g.
        dropout at p=0)."""
        fwd_total = self.fwd.get(self.root, 0) or 1
        head = f"{'module':<44}{'params':>12}{'fwd FLOPs':>14}{'% fwd':>9}{'fwd latency':>13}{'fwd FLOPS':>16}"  # fmt: skip
        lines = ["", "------------------------------ Detailed Profile per GPU ------------------------------", head]  # fmt: skip
        for depth, name, m in self._rows():
            label = "  " * depth + (name.rsplit(".", 1)[-1] if depth else name)
            label = f"{label} ({type(m).__name__})"
            fwd, lat = self.fwd.get(name, 0), self.latency.get(name, 0.0)
            rate = number(fwd / lat, "FLOPS") if lat > 0 else "-"
            params = number(self._params(m))
            lines.append(f"{label:<44}{params:>12}{number(fwd):>14}{100 * fwd / fwd_total:>8.1f}%{_seconds(lat):>13}{rate:>16}")  # fmt: skip
        return lines

    def table(self) -> dict[str, dict]:
        """``{module: {"params", "fwd_flops", "fwd_latency_s"}}`` of the profiled step."""
        return {
            name: {
                "params": self._params(m),
                "fwd_flops": self.fwd.get(name, 0),
                "fwd_latency_s": self.latency.get(name, 0.0),
            }
            for _, name, m in self._rows()
        }


_PEAK_CACHE: dict[tuple[str, str], float] = {}


def peak_flops(device: str = "cpu", dtype: str = "fp32", seconds: float = 0.25) -> float:
    """The best measured FLOP/s of a square matmul on ``device`` in ``dtype`` ("fp32",
    "bf16" or "fp16") with this process's threads: sizes from 256 up (to 8192 on GPUs,
    2048 on CPUs, while one product takes under ``seconds / 4``), then the fastest size
    for about ``seconds``. Cached per (device, dtype) for the process."""
    key = (str(device), dtype)
    if key in _PEAK_CACHE:
        return _PEAK_CACHE[key]
    dev = torch.device(device)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    sync = runtime(dev).synchronize

    def timed(a, b) -> float:
        sync(dev)
        t0 = time.perf_counter()
        a @ b
        sync(dev)
        return time.perf_counter() - t0

    # small products run far below peak (measured on CPU: 1 GFLOP/s at 256, 25 at 1024),
    # so the size grows while the rate does, and one product stays under seconds / 4
    n, cap, rates = 256, 8192 if dev.type == "cuda" else 2048, {}
    while True:
        a, b = torch.randn(n, n, device=dev).to(dt), torch.randn(n, n, device=dev).to(dt)
        timed(a, b)  # warm-up
        once = timed(a, b)
        rates[n] = once
        if once >= seconds / 4 or n >= cap:
            break
        n *= 2
    n = max(rates, key=lambda k: k**3 / rates[k])
    a, b = torch.randn(n, n, device=dev).to(dt), torch.randn(n, n, device=dev).to(dt)
    best, spent = rates[n], 0.0
    while spent < seconds:
        t = timed(a, b)
        best, spent = min(best, t), spent + t
    _PEAK_CACHE[key] = 2 * n**3 / best
    return _PEAK_CACHE[key]
