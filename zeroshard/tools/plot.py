"""`zeroshard plot RUN_DIR`: a run's CSV and metrics files as PNG charts (matplotlib).

RUN_DIR is a ``csv_monitor`` directory (``output_path/job_name``): DeepSpeed's
``Train_Samples_*.csv`` files and zeroshard's ``metrics.jsonl`` (one JSON object per
step). Written next to them (or into ``--out``), each only when its data is there:

* ``loss.png`` and ``lr.png``: against samples trained (the CSV files);
* ``throughput.png``: samples/s and tokens/s per step;
* ``memory.png``: bytes per rank and location (every rank's, at the steps they were
  gathered: the first and every ``steps_per_print``-th);
* ``comm.png``: rank 0's bytes per collective and step;
* ``timers.png``: forward, backward and step milliseconds (with ``wall_clock_breakdown``).

One run per chart: zeroshard gives each run its directory (an earlier run's files move to
``previous/``, see ``zeroshard.monitor.rundir``), but files written by DeepSpeed or by an
older zeroshard append run after run. Where a file's x (samples, or the step) goes back,
a new run started: only the last run is drawn, and a note says how many earlier ones the
file holds. A last line torn by a kill is skipped.

No collectives; reads files only.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
from collections import defaultdict


def _whole_lines(path: str) -> list[str]:
    """The lines of a file, less a last one without its newline (torn by a kill)."""
    with open(path, newline="") as f:
        return f.read().split("\n")[:-1]


def _last_run(items: list, key, path: str, notes: list[str] | None) -> list:
    """The items after the last place where ``key`` goes back (a new run started)."""
    starts = [i for i in range(1, len(items)) if key(items[i]) < key(items[i - 1])]
    if starts and notes is not None:
        notes.append(
            f"{path} holds {len(starts) + 1} runs one after another: drawing the last "
            f"({len(items) - starts[-1]} of {len(items)} rows)"
        )
    return items[starts[-1] :] if starts else items


def read_csv(path: str, notes: list[str] | None = None) -> tuple[list[float], list[float]]:
    """The (x, y) rows of a DeepSpeed CSV file's last run (see the module docstring)."""
    rows = []
    for row in csv.reader(_whole_lines(path)):
        if len(row) == 2 and row[0] != "step":
            try:
                rows.append((float(row[0]), float(row[1])))
            except ValueError:
                continue
    rows = _last_run(rows, lambda r: r[0], path, notes)
    return [x for x, _ in rows], [y for _, y in rows]


def read_metrics(path: str, notes: list[str] | None = None) -> list[dict]:
    """The records of ``metrics.jsonl``'s last run (see the module docstring)."""
    out = []
    for line in _whole_lines(path):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            out.append(record)
    return _last_run(out, lambda r: r["step"], path, notes)


def _figure(title: str, xlabel: str, ylabel: str):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig, ax, path: str, written: list[str]) -> None:
    import matplotlib.pyplot as plt

    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    written.append(path)


def plot_run(run_dir: str, out_dir: str | None = None, notes: list[str] | None = None) -> list[str]:  # fmt: skip
    """Write the charts of ``run_dir``; returns the PNG paths written. ``notes`` gets a
    line for each file that holds several runs (the last is drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    out_dir = out_dir or run_dir
    os.makedirs(out_dir, exist_ok=True)
    written: list[str] = []
    series = {
        "loss": ("Train_Samples_train_loss.csv", "training loss (rank 0)", "loss"),
        "lr": ("Train_Samples_lr.csv", "learning rate", "lr"),
    }
    for name, (file, title, ylabel) in series.items():
        path = os.path.join(run_dir, file)
        if os.path.exists(path):
            xs, ys = read_csv(path, notes)
            if xs:
                fig, ax = _figure(title, "samples", ylabel)
                ax.plot(xs, ys, marker="." if len(xs) < 50 else None)
                _save(fig, ax, os.path.join(out_dir, f"{name}.png"), written)
    timers = {
        "forward": "Train_Samples_elapsed_time_ms_forward.csv",
        "backward": "Train_Samples_elapsed_time_ms_backward.csv",
        "backward allreduce": "Train_Samples_elapsed_time_ms_backward_allreduce.csv",
        "step": "Train_Samples_elapsed_time_ms_step.csv",
    }
    present = {k: os.path.join(run_dir, v) for k, v in timers.items()}
    present = {k: p for k, p in present.items() if os.path.exists(p)}
    if present:
        fig, ax = _figure("wall-clock breakdown per step (rank 0)", "samples", "ms")
        for label, path in present.items():
            ax.plot(*read_csv(path, notes), label=label)
        _save(fig, ax, os.path.join(out_dir, "timers.png"), written)
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics_path):
        written += _plot_metrics(read_metrics(metrics_path, notes), out_dir)
    return written


def _plot_metrics(records: list[dict], out_dir: str) -> list[str]:
    written: list[str] = []
    records = [r for r in records if "step" in r]
    if not records:
        return written
    steps = [r["step"] for r in records]
    fig, ax = _figure("throughput", "step", "per second")
    ax.plot(steps, [r.get("samples_per_s", 0) for r in records], label="samples/s")
    if any("tokens_per_s" in r for r in records):
        ax2 = ax.twinx()
        tokens = [r.get("tokens_per_s", float("nan")) for r in records]
        ax2.plot(steps, tokens, color="tab:orange", label="tokens/s")
        ax2.set_ylabel("tokens/s")
        ax2.legend(loc="lower right", fontsize=8)
    _save(fig, ax, os.path.join(out_dir, "throughput.png"), written)
    memory: dict[str, tuple[list, list]] = defaultdict(lambda: ([], []))
    for r in records:
        for rank, locations in enumerate(r.get("memory_ranks") or []):
            for location, nbytes in locations.items():
                xs, ys = memory[f"rank {rank} {location}"]
                xs.append(r["step"])
                ys.append(nbytes / 1e6)
    if memory:
        fig, ax = _figure("memory per rank and location", "step", "MB")
        for label, (xs, ys) in sorted(memory.items()):
            ax.plot(xs, ys, marker="o", label=label)
        _save(fig, ax, os.path.join(out_dir, "memory.png"), written)
    ops = sorted({op for r in records for op in r.get("comm", {})})
    if ops:
        fig, ax = _figure("communication per step (rank 0)", "step", "MB")
        for op in ops:
            ax.plot(steps, [r.get("comm", {}).get(op, 0) / 1e6 for r in records], label=op)
        _save(fig, ax, os.path.join(out_dir, "comm.png"), written)
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0]
    parser.add_argument("run_dir", help="a csv_monitor directory (output_path/job_name)")
    parser.add_argument("--out", default=None, help="where to write the PNGs (default: run_dir)")


def main(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.run_dir):
        print(f"zeroshard plot: {args.run_dir!r} is not a directory")
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("zeroshard plot: needs matplotlib: pip install matplotlib (or zeroshard[monitor])")
        return 2
    notes: list[str] = []
    written = plot_run(args.run_dir, args.out, notes)
    for note in notes:
        print(f"zeroshard plot: {note}")
    if not written:
        print(f"zeroshard plot: no CSV or metrics files in {args.run_dir!r}")
        return 1
    for path in written:
        print(path)
    return 0
