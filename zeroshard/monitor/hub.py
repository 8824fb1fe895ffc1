"""What the engine calls around forward, backward and step: the monitors of the config.

:class:`EngineMonitor` is ``engine.monitor``. Built first in the engine (so bad monitor
input fails at ``initialize``, before any collective), it owns the event writers
(TensorBoard, CSV, wandb, Comet: ``write_events`` as in DeepSpeed), the wall-clock and
throughput timers, the memory breakdown, the comms logger, the flops profiler, the step
line and the metrics file. DeepSpeed's events, at each optimizer step (x = samples):
``Train/Samples/train_loss`` (at the samples before the step, as DeepSpeed logs it),
``Train/Samples/lr``, ``Train/Samples/loss_scale`` (fp16) and, with the timers, the five
``Train/Samples/elapsed_time_ms_*``.

Communication: with ``csv_monitor`` on, one ``all_gather_object`` of each rank's memory
(a small dict) over the world at the first step and every ``steps_per_print`` steps, so
the metrics file has every rank's memory; ``print_summary`` does one too. Otherwise
none; each completed collective is counted by a ledger observer (the comm bytes of the
step line).

The monitors never hold the engine: it hands them frozen records of what they read
(``readings.py``: :class:`EngineInfo` once, :class:`StepState` after each step) and the
values of each call.
"""

from __future__ import annotations

import atexit
import dataclasses
import time
import weakref
from typing import TYPE_CHECKING

import torch

from zeroshard import InternalError
from zeroshard.monitor.events import EventWriters
from zeroshard.monitor.readings import EngineInfo, StepState
from zeroshard.monitor.steplog import (
    MetricsFile,
    StepRecord,
    echo,
    log_step,
    monitor_logger,
    summary_text,
)
from zeroshard.monitor.timers import EVENTS, ThroughputTimer, WallClock
from zeroshard.monitor.usage import breakdown_line, device_counters, rss_bytes

if TYPE_CHECKING:
    from zeroshard.monitor.flops import FlopsProfiler

# Monitor lines and events are held and written together at most this often (and at
# every steps_per_print step): each write to stdout or to a writer's thread costs ~1-2 ms
# of wall time on a busy host where wandb or Comet capture the console.
FLUSH_S = 1.0


def _tokens(args, kwargs) -> int:
    """Tokens in a forward's input: the first integer tensor of 2+ dimensions
    (``input_ids`` first), else 0 (unknown)."""
    first = kwargs.get("input_ids")
    for value in (first, *args, *kwargs.values()):
        if torch.is_tensor(value) and value.dim() >= 2 and not value.is_floating_point():
            return value.numel()
    return 0


class EngineMonitor:
    """The monitors of one engine; see the module docstring."""

    def __init__(self, config, mesh, device: torch.device) -> None:
        self.config, self.device = config, device
        self.comm = mesh.comm("world")
        self.rank = self.comm.rank
        self.dp_size = mesh.size("dp")
        self.events = EventWriters(config, self.rank)  # checks output dirs and packages
        self.enabled = self.events.enabled  # DeepSpeed's monitor.enabled
        monitor_logger()
        self.every = config.steps_per_print
        self.step_handler = log_step  # None silences the step line
        timed = config.wall_clock_breakdown or config.flops_profiler.enabled
        self.timers = WallClock(device, micro=config.wall_clock_breakdown) if timed else None
        tput = config.timers.throughput
        self.throughput_line = tput.enabled
        self.throughput = ThroughputTimer(  # engine.tput_timer: counts whatever the config
            synchronized=tput.enabled and tput.synchronized,
            batch_size=config.train_batch_size,
            device=device,
        )
        self.memory_breakdown = config.memory_breakdown
        self.comms = None
        if config.comms_logger.enabled:
            from zeroshard.monitor.comms import CommsLogger

            self.comms = CommsLogger(config.comms_logger, mesh.ledger, self.rank, echo)
        self.flops = None
        if config.flops_profiler.enabled:
            from zeroshard.monitor.flops import FlopsProfiler

            self.flops = FlopsProfiler(config.flops_profiler, self.rank, device)
        self.gather_memory = config.csv_monitor.enabled
        self.metrics = MetricsFile(self.events.csv_dir) if self.events.csv_dir else None
        self._ledger = mesh.ledger
        self._ledger.observers.append(self._count)
        self._step_comm: dict[str, int] = {}
        self._lines: list[str] = []  # rank 0's monitor lines not printed yet
        self._flushed = time.perf_counter()
        self._loss: torch.Tensor | None = None
        self._tokens = 0
        self._window_start: float | None = None
        self._last_boundary: float | None = None
        self._last_step_s: float | None = None
        self.records: list[StepRecord] = []  # the latest record (step line, summary)
        self._run_open = False  # the output directories settled (at the first event)
        self.info: EngineInfo | None = None  # what the engine told bind()
        self.totals = {"steps": 0, "seconds": 0.0, "samples": 0, "tokens": 0}
        self.closed = False
        atexit.register(_close_at_exit, weakref.ref(self))  # files flushed without destroy()
        if config.dump_state and self.rank == 0:
            echo(_dump(config))

    # -- called by the engine ------------------------------------------------------------
    def bind(self, info: EngineInfo) -> None:
        """What the engine tells of itself once built: its counters say where the run
        starts (0, or a resumed step); see :class:`EngineInfo`."""
        self.info = info

    def _info(self) -> EngineInfo:
        if self.info is None:
            raise InternalError("internal: EngineMonitor used before bind()")
        return self.info

    def _open_run(self, step: int, samples: int) -> None:
        """Before the first event: settle the output directories (an earlier run's files
        are moved, a resumed run's continued; rank 0 says which)."""
        self._run_open = True
        for line in self.events.open_run(step, samples):
            if self.rank == 0:
                echo(line)

    def _count(self, event) -> None:
        self._step_comm[event.op] = self._step_comm.get(event.op, 0) + event.nbytes

    def _memory(self, where: str) -> None:
        if self.memory_breakdown and self.rank == 0:
            self._lines.append(breakdown_line(where, self.device))

    def forward_start(self, args, kwargs, *, training: bool, step: int) -> None:
        """Before the module's forward on ``args``/``kwargs``; ``training``: the module's
        mode; ``step``: the engine's ``global_steps``."""
        training = training and torch.is_grad_enabled()
        if self._window_start is None and training:
            self._window_start = time.perf_counter()
        if training:
            self._tokens += _tokens(args, kwargs)
            if self.flops is not None:
                self._profile_forward(self.flops, step)
        self._memory("Engine before forward")
        self.throughput.start()
        if self.timers is not None:
            self.timers.start("fwd")

    def _profile_forward(self, flops: FlopsProfiler, step: int) -> None:
        if not flops.active and flops.wants(step):
            info = self._info()
            flops.start(info.module, info.name, dict(info.param_numels))
        if flops.active:
            flops.forward_start()

    def forward_end(self) -> None:
        if self.timers is not None:
            self.timers.stop("fwd")
        self._memory("Engine after forward")

    def whole_batch(self, loss: torch.Tensor, started: float) -> None:
        """A pipeline engine's ``train_batch``: the window's mean loss and start time
        (it runs forward and backward itself, micro-batch by micro-batch)."""
        self._loss = loss.detach().float()
        if self._window_start is None:
            self._window_start = started

    def backward_start(self, loss: torch.Tensor, gas: int) -> None:
        self._memory("Engine before backward")
        mean = loss.detach().float().mean() / gas
        self._loss = mean if self._loss is None else self._loss + mean
        if self.flops is not None and self.flops.active:
            self.flops.backward_start()
        if self.timers is not None:
            self.timers.start("bwd")
            self.timers.start("bwd_inner")

    def backward_inner_end(self) -> None:
        """Autograd's backward is done; the wait for gradient reductions starts."""
        if self.timers is not None:
            self.timers.stop("bwd_inner")
            self.timers.start("bwd_allreduce")

    def backward_end(self) -> None:
        if self.timers is not None:
            self.timers.stop("bwd_allreduce")
            self.timers.stop("bwd")
        self._memory("Engine after backward")

    def step_start(self) -> None:
        self._memory("Engine before step")
        if self.timers is not None:
            self.timers.start("step")

    def step_end(self, state: StepState, boundary: bool) -> None:
        """After ``engine.step()``; at a boundary, after the step counters moved on."""
        if self.timers is not None:
            self.timers.stop("step")
        self.throughput.stop(global_step=boundary, report_speed=self.rank == 0)
        self._memory("Engine after step")
        if self.timers is not None and self.timers.micro:
            # DeepSpeed prints this line every micro-step; with no accumulation it repeats
            # the step line's numbers under other names, so it is printed only with some
            line = self.timers.micro_line()  # read (and reset) on every rank alike
            if self.rank == 0 and state.gradient_accumulation_steps > 1:
                self._lines.append(line)
        due = False
        if boundary:
            due = self._boundary(state)
        now = time.perf_counter()
        if due or now - self._flushed >= FLUSH_S:
            self.flush()
            self._flushed = now

    def _say(self) -> None:
        """The held monitor lines, as one message: one write to stdout."""
        if self._lines:
            echo("\n".join(self._lines))
            self._lines.clear()

    def flush(self) -> None:
        """Print the held lines; hand the held events to the writers and flush files."""
        self._say()
        self.events.flush()
        if self.metrics is not None:
            self.metrics.flush()

    # -- at the end of an optimizer step -------------------------------------------------
    def _boundary(self, state: StepState) -> bool:
        """The end of an optimizer step; True when it is a ``steps_per_print`` step."""
        now = time.perf_counter()
        start = self._window_start or self._last_boundary or now
        step_s, self._last_boundary = now - start, now
        steps, samples = state.global_steps, state.global_samples
        if not self._run_open:  # the run started before this step
            self._open_run(steps - 1, samples - state.train_batch_size)
        due = self.every is not None and steps % self.every == 0
        show = due and self.rank == 0 and self.step_handler is not None
        gather = self.gather_memory and (steps == 1 or due)  # the same on every rank
        fp16 = self.config.fp16.enabled
        loss = None
        if self._loss is not None and (self.events.writers or show or self.metrics is not None):
            loss = float(self._loss)
        timer_line = self.timers.global_line() if self.timers is not None else None
        if self.events.writers:
            events = []
            if loss is not None:
                before = samples - state.train_batch_size
                events.append(("Train/Samples/train_loss", loss, before))
            events.append(("Train/Samples/lr", state.lr[0], samples))
            if fp16:
                events.append(("Train/Samples/loss_scale", state.loss_scale, samples))
            if self.timers is not None:
                events += [(EVENTS[n], ms, samples) for n, ms in self.timers.last.items()]
            self.events.write_events(events)
        if timer_line is not None and self.rank == 0:
            self._lines.append(timer_line)
        if self.flops is not None and self.flops.active:
            self._say()
            self._profile(state, self.flops, step_s)
        if show or gather or self.metrics is not None:
            record = self._record(state, loss, step_s, fp16, memory=show or gather)
            if gather:
                record.memory_ranks = self.comm.all_gather_object(record.memory)
            if show:
                self._say()  # the lines of the step first
                self.step_handler(record)
            if self.metrics is not None:
                self.metrics.write(record.as_dict())
            self.records[:] = [record]
        tput = self.throughput
        if due and self.throughput_line and tput.report and self.rank == 0:
            self._lines.append(tput.line())
        self._last_step_s = step_s
        for k, v in (("steps", 1), ("seconds", step_s), ("samples", state.train_batch_size), ("tokens", self._tokens * self.dp_size)):  # fmt: skip
            self.totals[k] += v
        self._loss, self._tokens, self._window_start = None, 0, None
        self._step_comm = {}
        return due

    def _record(self, state: StepState, loss, step_s, fp16, memory: bool) -> StepRecord:
        tokens = self._tokens * self.dp_size
        mem: dict[str, int] = {}
        if memory:
            mem = dict(self._info().memory_stats()["by_location"])
            mem.update({f"{self.device} {k}": v for k, v in device_counters(self.device).items() if k in ("allocated", "max_allocated")})  # fmt: skip
            mem["rss"] = rss_bytes()
        return StepRecord(
            step=state.global_steps,
            samples=state.global_samples,
            skipped=state.skipped_steps,
            loss=loss,
            lr=list(state.lr),
            grad_norm=state.grad_norm,
            loss_scale=state.loss_scale if fp16 else None,
            step_s=step_s,
            samples_per_s=state.train_batch_size / step_s if step_s > 0 else 0.0,
            tokens_per_s=tokens / step_s if tokens and step_s > 0 else None,
            comm=dict(sorted(self._step_comm.items())),
            memory=mem,
        )

    def _profile(self, state: StepState, flops: FlopsProfiler, step_s: float) -> None:
        from zeroshard.monitor.flops import peak_flops

        flops.stop()
        bound = self._info()
        dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(bound.dtype, "fp32")
        info = {
            "world_size": bound.world_size,
            "dp_size": self.dp_size,
            "micro_batch": state.micro_batch_size,
            "batch": state.micro_batch_size * state.gradient_accumulation_steps,
            "device": str(self.device),
            "dtype": dtype,
        }
        latencies = dict(self.timers.last) if self.timers is not None else {}
        iter_s = self._last_step_s or step_s
        peak = peak_flops(str(self.device), dtype)
        text = flops.report(step=state.global_steps, info=info, latencies=latencies, iter_s=iter_s, peak=peak)  # fmt: skip
        path = self.config.flops_profiler.output_file
        if path:
            with open(path, "w") as f:
                f.write(text + "\n")
        else:
            echo(text)

    # -- DeepSpeed's surface and teardown ------------------------------------------------
    def write_events(self, event_list: list[tuple[str, float, int]]) -> None:
        """DeepSpeed's ``engine.monitor.write_events``: ``(tag, value, samples)`` events
        to every writer of this rank."""
        if not self._run_open:
            self._open_run(*(self.info.counters() if self.info is not None else (0, 0)))
        self.events.write_events(event_list)

    def summary(self) -> StepRecord | None:
        """The latest step record (loss, throughput, memory, comm bytes), if any."""
        return self.records[-1] if self.records else None

    def print_summary(self) -> None:
        """The run so far, printed by rank 0: steps, time, throughput, the last loss and
        step's comm bytes, and every rank's memory. Every rank must call it (one
        ``all_gather_object`` of each rank's ``memory_stats()``)."""
        self._say()  # the lines held back so far come before the summary
        stats = self._info().memory_stats()
        mems = self.comm.all_gather_object({**stats, "rss": rss_bytes()})
        if self.rank != 0:
            return
        echo(summary_text(self.totals, self.summary(), mems))

    def close(self) -> None:
        """Flush and close the writers, stop observing the ledger (``engine.destroy()``)."""
        if self.closed:
            return
        self.closed = True
        if self.flops is not None and self.flops.active:  # ended inside the profiled step
            self.flops.stop()
        if self._count in self._ledger.observers:
            self._ledger.observers.remove(self._count)
        self._say()
        if self.comms is not None:
            if self.comms.comms and self.rank == 0:
                self.comms.log_all()
            self.comms.close()
        self.events.close()
        if self.metrics is not None:
            self.metrics.close()


def _close_at_exit(ref: weakref.ref) -> None:
    monitor = ref()
    if monitor is not None:
        monitor.close()


def _dump(config) -> str:
    """DeepSpeed's ``dump_state``: every setting of the resolved config, one per line."""
    lines = ["zeroshard engine configuration:"]

    def walk(obj, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            if f.name in ("raw", "inert", "not_built"):
                continue
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            else:
                lines.append(f"  {prefix + f.name:<60} {value!r}")

    walk(config, "")
    return "\n".join(lines)
