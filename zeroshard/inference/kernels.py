"""Which kernel computes each quantized layer, measured on the card it runs on (issue 32.2).
No collectives.

A quantized layer (``quantize.py``'s :class:`QuantLinear`) can be computed by torch's
int8 or int4 matmul kernels or by a dequantize-then-matmul form (which ``torch.compile``
fuses into one kernel: gpt-fast's int8 path); which is fastest depends on the card, the
shape and on whether the decode step is compiled, so on a GPU :func:`pick_kernels` times
each candidate on a batch-1 input (the decode shape) for each distinct layer shape, the
way the step will run it (eager, or compiled with the engine's options), and sets the
fastest on every layer of that shape. The choices (with the times) are returned for the
engine to report. On the CPU the defaults stay (torch's CPU kernels; measured in
benchmarks/bench_inference.py): nothing is timed unless a test passes a timer.

Timing goes through the device seam (``zeroshard/distributed/device.py``: timing events,
synchronize).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zeroshard.distributed.device import runtime
from zeroshard.inference.config import InferenceError
from zeroshard.inference.quantize import COMPUTE_DTYPE, QuantLinear

#: (kernel, run it once) -> seconds per call
Timer = Callable[[str, Callable[[], object]], float]


@dataclass(frozen=True, kw_only=True)
class KernelChoice:
    """The kernel picked for the layers of one shape, and what each candidate took."""

    bits: int
    out_features: int
    in_features: int
    group_size: int
    kernel: str
    layers: int  # how many layers have this shape
    seconds: dict[str, float] = field(default_factory=dict)  # per call, batch 1

    def row(self) -> str:
        times = ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in sorted(self.seconds.items()))
        g = f" g{self.group_size}" if self.bits == 4 else ""
        return f"int{self.bits}{g} {self.out_features}x{self.in_features} (x{self.layers}): {self.kernel} ({times})"  # fmt: skip


def device_timer(device: torch.device, rounds: int = 30, warmup: int = 5) -> Timer:
    """Mean time per call of ``fn`` over ``rounds`` calls on ``device`` (timing events on
    a GPU, the host clock on the CPU), after ``warmup`` calls."""
    rt = runtime(device)

    def timer(kernel: str, fn: Callable[[], object]) -> float:
        for _ in range(warmup):
            fn()
        rt.synchronize(device)
        start, t0 = rt.timing_event(), time.perf_counter()
        for _ in range(rounds):
            fn()
        stop = rt.timing_event()
        rt.synchronize(device)
        if start is None:
            return (time.perf_counter() - t0) / rounds
        return start.elapsed_time(stop) / 1e3 / rounds

    return timer


def pick_kernels(
    model: nn.Module,
    *,
    compile_options: dict[str, Any] | None = None,
    timer: Timer | None = None,
) -> list[KernelChoice]:
    """Time every kernel each quantized layer shape of ``model`` can use (batch 1, bf16
    activations; compiled with ``compile_options`` if given) and set the fastest on the
    layers of that shape. A kernel that fails on this device (not built for it) is left
    out. ``timer``: how to time (default: :func:`device_timer`)."""
    shapes: dict[tuple, list[QuantLinear]] = {}
    for m in model.modules():
        if isinstance(m, QuantLinear):
            key = (m.bits, m.out_features, m.in_features, m.group_size, m.symmetric, m.kernels())
            shapes.setdefault(key, []).append(m)
    choices = []
    for (bits, n, k, g, _, kernels), layers in shapes.items():
        layer = layers[0]
        device = layer.scale.device
        time_it = timer or device_timer(device)
        x = torch.randn(1, k, dtype=COMPUTE_DTYPE, device=device)
        seconds: dict[str, float] = {}
        for kernel in kernels:
            layer.set_kernel(kernel)
            fn: Callable[[], object] = _call(layer, x)
            if compile_options is not None:
                fn = torch.compile(fn, **compile_options)
            try:
                with torch.no_grad():
                    seconds[kernel] = time_it(kernel, fn)
            except (RuntimeError, NotImplementedError):  # not built for this device
                continue
        if not seconds:
            raise InferenceError(f"{layer.name}: none of the kernels {kernels} runs on {device}")
        best = min(seconds, key=seconds.__getitem__)
        for m in layers:
            m.set_kernel(best)
        choices.append(KernelChoice(bits=bits, out_features=n, in_features=k, group_size=g,
                                    kernel=best, layers=len(layers), seconds=seconds))  # fmt: skip
    return choices


def _call(layer: QuantLinear, x: torch.Tensor) -> Callable[[], object]:
    def run() -> object:
        return layer(x)

    return run
