"""Wall-clock timers with DeepSpeed's names and lines, and DeepSpeed's throughput timer.
No collectives.

``wall_clock_breakdown`` times, per micro-step (``*_microstep``, reset every
``engine.step()`` and printed then when ``gradient_accumulation_steps`` > 1: without
accumulation that line would repeat the step line's numbers, which DeepSpeed prints
both) and per optimizer step (summed over the accumulation window, printed and reset at
its boundary):

* ``fwd``: ``engine(...)``;
* ``bwd``: ``engine.backward``, of which ``bwd_inner`` is autograd's backward (gradient
  reduction overlaps it) and ``bwd_allreduce`` the wait for the reductions still in
  flight when it ends;
* ``step``: ``engine.step``.

Lines read ``time (ms) | fwd_microstep: 12.34 | bwd_microstep: ...`` as DeepSpeed's do.
On a GPU the times come from device events (no synchronization until a line is
printed); on the CPU from ``time.perf_counter``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from zeroshard.distributed.device import runtime

MICRO = ("fwd_microstep", "bwd_microstep", "bwd_inner_microstep", "bwd_allreduce_microstep", "step_microstep")  # fmt: skip
GLOBAL = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")
# DeepSpeed's monitor events of the global timers
EVENTS = {
    "fwd": "Train/Samples/elapsed_time_ms_forward",
    "bwd": "Train/Samples/elapsed_time_ms_backward",
    "bwd_inner": "Train/Samples/elapsed_time_ms_backward_inner",
    "bwd_allreduce": "Train/Samples/elapsed_time_ms_backward_allreduce",
    "step": "Train/Samples/elapsed_time_ms_step",
}


class _Timer:
    """Sums intervals; on CUDA as event pairs read when asked."""

    def __init__(self, device: torch.device) -> None:
        self.rt = runtime(device)
        self.started: Any = None  # a timing event, or the host's clock
        self.host_ms = 0.0
        self.pairs: list[tuple[Any, Any]] = []

    def start(self) -> None:
        self.started = self.rt.timing_event()
        if self.started is None:
            self.started = time.perf_counter()

    def stop(self) -> None:
        if self.started is None:  # not started (an exception skipped the start)
            return
        if isinstance(self.started, float):
            self.host_ms += (time.perf_counter() - self.started) * 1e3
        else:
            self.pairs.append((self.started, self.rt.timing_event()))
        self.started = None

    def elapsed_ms(self, reset: bool = True) -> float:
        ms = self.host_ms
        for begin, end in self.pairs:
            end.synchronize()
            ms += begin.elapsed_time(end)
        if reset:
            self.host_ms, self.pairs = 0.0, []
        return ms


class WallClock:
    """The five timers, per micro-step and per optimizer step. ``micro`` says whether
    the micro-step timers run (``wall_clock_breakdown``; the flops profiler needs only
    the global ones, as in DeepSpeed)."""

    def __init__(self, device: torch.device, micro: bool) -> None:
        names = (MICRO if micro else ()) + GLOBAL
        self.timers = {name: _Timer(device) for name in names}
        self.micro = micro
        self.last: dict[str, float] = {}  # the latest global values, ms

    def start(self, name: str) -> None:
        for key in (f"{name}_microstep", name):
            if key in self.timers:
                self.timers[key].start()

    def stop(self, name: str) -> None:
        for key in (f"{name}_microstep", name):
            if key in self.timers:
                self.timers[key].stop()

    def micro_line(self) -> str:
        return _line((n, self.timers[n].elapsed_ms()) for n in MICRO)

    def global_line(self) -> str:
        self.last = {n: self.timers[n].elapsed_ms() for n in GLOBAL}
        return _line(self.last.items())


def _line(items) -> str:
    return "time (ms)" + "".join(f" | {name}: {ms:.2f}" for name, ms in items)


class ThroughputTimer:
    """DeepSpeed's ``timers.throughput``: samples/s from the first forward of a step to
    its end, a running average that skips the first ``start_step`` steps, and its line
    ``epoch=0/micro_step=20/global_step=20, RunningAvgSamplesPerSec=..., ...``."""

    start_step = 2

    def __init__(self, synchronized: bool, batch_size: int, device: torch.device) -> None:
        self.synchronized, self.batch_size, self.device = synchronized, batch_size, device
        self.started: float | None = None
        self.micro_steps = self.global_steps = 0
        self.total_s = self.step_s = 0.0

    def _sync(self) -> None:
        if self.synchronized:
            runtime(self.device).synchronize(self.device)

    def start(self) -> None:
        if self.started is None:
            self._sync()
            self.started = time.perf_counter()

    def stop(self, boundary: bool) -> None:
        if self.started is None:
            return
        self.micro_steps += 1
        self._sync()
        duration = time.perf_counter() - self.started
        self.started = None
        self.step_s += duration
        if boundary:
            self.global_steps += 1
            if self.global_steps > self.start_step:
                self.total_s += self.step_s

    def line(self) -> str:
        current = self.batch_size / max(self.step_s, 1e-6)
        counted = self.global_steps - self.start_step
        average = self.batch_size * counted / self.total_s if counted > 0 else float("-inf")
        allocated = peak = 0.0
        if self.device.type == "cuda":
            allocated = round(torch.cuda.memory_allocated(self.device) / 1024**3, 2)
            peak = round(torch.cuda.max_memory_allocated(self.device) / 1024**3, 2)
        return (
            f"epoch=0/micro_step={self.micro_steps}/global_step={self.global_steps}, "
            f"RunningAvgSamplesPerSec={average}, CurrSamplesPerSec={current}, "
            f"MemAllocated={allocated}GB, MaxMemAllocated={peak}GB"
        )

    def end_step(self) -> None:
        """After a boundary: the next step's time starts from zero."""
        self.step_s = 0.0
