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
    """DeepSpeed's throughput timer (``engine.tput_timer``; ``timers.throughput``), with
    its attributes and their meaning: every ``start()`` (the engine calls it at each
    forward) opens an interval and every ``stop()`` (at each ``engine.step()``) closes
    it and counts a micro-step, and a global step when ``global_step``. Intervals are
    timed only from step ``start_step`` on (``start_time`` stays 0 before), summed into
    ``step_elapsed_time`` (reset at each global step) and ``total_elapsed_time``. The
    engine prints :meth:`line` every ``steps_per_print`` steps on rank 0 unless the
    boundary's ``stop`` said ``report_speed=False``, when ``timers.throughput.enabled``.

    The timer counts and times whatever the config says (host clock reads, as cheap as
    a step counter), so that ``engine.tput_timer`` answers as DeepSpeed's does with its
    default config; zeroshard's own default prints no line (its step line has samples/s)
    and synchronizes the device only when the line is on and ``synchronized``."""

    def __init__(
        self,
        *,
        synchronized: bool,
        batch_size: int | None,
        device: torch.device,
        start_step: int = 2,
    ) -> None:
        self.synchronized, self.device = synchronized, device
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.start_time = self.end_time = 0.0
        self.started = self.initialized = False
        self.epoch_count = self.micro_step_count = self.global_step_count = 0
        self.total_elapsed_time = self.step_elapsed_time = 0.0
        self.last_step_time = 0.0  # the last global step's step_elapsed_time, for line()
        self.report = True  # the last boundary's report_speed

    def _sync(self) -> None:
        if self.synchronized:
            runtime(self.device).synchronize(self.device)

    def update_epoch_count(self) -> None:
        """A new epoch of the data: counts it and restarts the micro-step count."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        self.initialized = self.started = True
        if self.global_step_count >= self.start_step:
            self._sync()
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
            self.report = report_speed
        if self.start_time > 0:
            self._sync()
            self.end_time = time.time()
            duration = self.end_time - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            if global_step:
                self.last_step_time = self.step_elapsed_time
                self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the timed global steps (-inf before any)."""
        counted = self.global_step_count - self.start_step
        if counted <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size * counted / self.total_elapsed_time

    def line(self) -> str:
        current = self.batch_size / (self.last_step_time + 1e-5)
        allocated = peak = 0.0
        if self.device.type == "cuda":
            allocated = round(torch.cuda.memory_allocated(self.device) / 1024**3, 2)
            peak = round(torch.cuda.max_memory_allocated(self.device) / 1024**3, 2)
        return (
            f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/"
            f"global_step={self.global_step_count}, "
            f"RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, CurrSamplesPerSec={current}, "
            f"MemAllocated={allocated}GB, MaxMemAllocated={peak}GB"
        )
