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

No collectives; reads files only.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
from collections import defaultdict


def read_csv(path: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if len(row) == 2 and row[0] != "step":
                xs.append(float(row[0]))
                ys.append(float(row[1]))
    return xs, ys


def read_metrics(path: str) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                out.append(json.loads(line))
    return out


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


def plot_run(run_dir: str, out_dir: str | None = None) -> list[str]:
    """Write the charts of ``run_dir``; returns the PNG paths written."""
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
            xs, ys = read_csv(path)
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
            ax.plot(*read_csv(path), label=label)
        _save(fig, ax, os.path.join(out_dir, "timers.png"), written)
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics_path):
        written += _plot_metrics(read_metrics(metrics_path), out_dir)
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
    written = plot_run(args.run_dir, args.out)
    if not written:
        print(f"zeroshard plot: no CSV or metrics files in {args.run_dir!r}")
        return 1
    for path in written:
        print(path)
    return 0
