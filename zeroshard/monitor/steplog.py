"""The step line, the monitor's logger, and the metrics file. No collectives.

Every ``steps_per_print`` steps rank 0 hands a :class:`StepRecord` to
``engine.monitor.step_handler`` (default :func:`log_step`), which logs its line to the
``zeroshard.monitor`` logger::

    step=10, skipped=0, loss=2.3456, lr=[0.001], grad_norm=0.53, samples/s=123.4,
    tokens/s=15795, memory: cpu 12.35 MB, rss 0.41 GB, comm: all_gather 1.23 MB, ...

(one line). That logger (INFO, also used for the timer, memory and profiler lines) prints
to stdout through a default handler when nothing else would show the record: no handler
on it or its parents (``logging.basicConfig`` and the like take over). Silence it with
``logging.getLogger("zeroshard.monitor").setLevel(logging.WARNING)`` or
``engine.monitor.step_handler = None``; replace it with a handler on that logger or
another ``step_handler`` (a function of the record).

``loss`` is rank 0's mean loss over the accumulation window (what it passed to
``engine.backward``); ``grad_norm`` is known when clipping or fp16 computes it;
``tokens/s`` when the forward's first integer tensor of two or more dimensions
(``input_ids``-like) gives the tokens, counted on rank 0 and multiplied by the
data-parallel size; ``comm`` is this rank's bytes of the last step, per op.

:class:`MetricsFile` writes one JSON line per step (the record's fields) into the
``csv_monitor`` directory, for ``zeroshard plot``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import TextIO

LOGGER = "zeroshard.monitor"


class _StdoutUnlessHandled(logging.StreamHandler):
    """Writes to the current ``sys.stdout`` unless another handler would get the record
    (like ``logging.lastResort``, but for INFO and to stdout)."""

    def emit(self, record: logging.LogRecord) -> None:
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            for h in logger.handlers:
                if h is not self and record.levelno >= h.level:
                    return
            logger = logger.parent if logger.propagate else None
        self.setStream(sys.stdout)
        super().emit(record)


def monitor_logger() -> logging.Logger:
    """The ``zeroshard.monitor`` logger, at INFO, with its default handler."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(h, _StdoutUnlessHandled) for h in logger.handlers):
        logger.addHandler(_StdoutUnlessHandled(sys.stdout))
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
    return logger


def echo(text: str) -> None:
    """One message of the monitors (timers, memory, profiler) to their logger."""
    logging.getLogger(LOGGER).info(text)


def _mb(nbytes: float) -> str:
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


@dataclass
class StepRecord:
    """What one optimizer step did, as the step line and the metrics file show it."""

    step: int
    samples: int
    skipped: int
    loss: float | None
    lr: list[float]
    grad_norm: float | None
    loss_scale: float | None
    step_s: float
    samples_per_s: float
    tokens_per_s: float | None
    comm: dict[str, int]  # op -> bytes this step (this rank)
    memory: dict[str, int] = field(default_factory=dict)  # location -> bytes (this rank)
    memory_ranks: list[dict[str, int]] | None = None  # every rank's, when gathered

    def line(self) -> str:
        parts = [f"step={self.step}", f"skipped={self.skipped}"]
        if self.loss is not None:
            parts.append(f"loss={self.loss:.4f}")
        parts.append(f"lr=[{', '.join(f'{v:.4g}' for v in self.lr)}]")
        if self.grad_norm is not None:
            parts.append(f"grad_norm={self.grad_norm:.4g}")
        parts.append(f"samples/s={self.samples_per_s:.1f}")
        if self.tokens_per_s is not None:
            parts.append(f"tokens/s={self.tokens_per_s:.0f}")
        if self.loss_scale is not None:
            parts.append(f"loss_scale={self.loss_scale:g}")
        if self.memory:
            parts.append("memory: " + ", ".join(f"{k} {_mb(v)}" for k, v in self.memory.items()))
        if self.comm:
            parts.append("comm: " + ", ".join(f"{k} {_mb(v)}" for k, v in self.comm.items()))
        return ", ".join(parts)

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        return {k: v for k, v in out.items() if v is not None and v != {}}


def log_step(record: StepRecord) -> None:
    """The default step handler: the record's line, to the ``zeroshard.monitor`` logger."""
    logging.getLogger(LOGGER).info(record.line())


def summary_text(totals: dict, last: StepRecord | None, memory: list[dict]) -> str:
    """The run summary of ``EngineMonitor.print_summary``."""
    seconds = max(totals["seconds"], 1e-9)
    head = f"trained {totals['steps']} steps in {seconds:.1f} s: {totals['samples'] / seconds:.1f} samples/s"  # fmt: skip
    if totals["tokens"]:
        head += f", {totals['tokens'] / seconds:.0f} tokens/s"
    if last is not None and last.loss is not None:
        head += f", last loss {last.loss:.4f}"
    lines = [head]
    if last is not None and last.comm:
        comm = ", ".join(f"{op} {_mb(b)}" for op, b in last.comm.items())
        lines.append(f"communication in the last step (rank 0): {comm}")
    for rank, m in enumerate(memory):
        kinds = ", ".join(f"{k.replace('_', ' ')} {_mb(m[k])}" for k in ("params", "grads", "optimizer_states"))  # fmt: skip
        where = ", ".join(f"{k} {_mb(v)}" for k, v in m["by_location"].items())
        lines.append(f"rank {rank} memory: {kinds}; by location {where}; rss {_mb(m['rss'])}")
    return "\n".join(lines)


class MetricsFile:
    """``metrics.jsonl`` in ``directory``: one JSON object per step, flushed every
    ``flush_every`` records and at :meth:`close`."""

    def __init__(self, directory: str, flush_every: int = 10) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, "metrics.jsonl")
        self._f: TextIO | None = None  # opened at the first record (the run dir settled)
        self.flush_every, self._pending = flush_every, 0

    def write(self, record: dict) -> None:
        if self._f is None:
            self._f = open(self.path, "a")  # noqa: SIM115  (closed in close())
        self._f.write(json.dumps(record) + "\n")
        self._pending += 1
        if self._pending >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()
        self._pending = 0

    def close(self) -> None:
        if self._f is not None and not self._f.closed:
            self._f.close()
