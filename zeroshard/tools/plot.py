"""`zeroshard plot RUN_DIR`: a run's CSV and metrics files as PNG charts (matplotlib).

RUN_DIR is a ``csv_monitor`` directory (``output_path/job_name``): DeepSpeed's
``Train_Samples_*.csv`` files and zeroshard's ``metrics.jsonl`` (one JSON object per
step). Written next to them (or into ``--out``), each only when its data is there, all
against one x axis, samples trained (DeepSpeed's monitors' x):

* ``loss.png`` and ``lr.png`` (the CSV files);
* ``throughput.png``: samples/s and, when the model reads token ids, tokens/s, each in
  its own panel (tokens/s is samples/s times the sequence length: on one axis one line
  hides the other);
* ``memory.png``: one panel per location (device, CPU, RSS, ...), one line per rank
  (every rank's, at the steps they were gathered: the first and every
  ``steps_per_print``-th);
* ``comm.png``: rank 0's bytes per collective and step;
* ``timers.png``: forward, backward and step milliseconds (with ``wall_clock_breakdown``).

Lines that may coincide (ranks, collectives of equal size, timers) differ in colour,
line style and hollow markers of decreasing size, so each stays visible where they
overlap.

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
from typing import Any

X_LABEL = "samples"
_STYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*")


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


def series_style(i: int, n: int, points: int) -> dict[str, Any]:
    """Line style of the ``i``-th of ``n`` series that may lie on top of each other:
    its own colour, dash pattern and hollow marker, markers shrinking with ``i`` so
    that coinciding points nest instead of covering each other."""
    size = 9 - 5 * i / max(n - 1, 1)
    return {
        "color": f"C{i % 10}",
        "linestyle": _STYLES[i % len(_STYLES)],
        "marker": _MARKERS[i % len(_MARKERS)],
        "markersize": size,
        "markerfacecolor": "none",
        "markevery": max(1, points // 25),
    }


def _figure(title: str, panels: list[str]):
    """A figure of stacked panels sharing the samples axis; ``panels`` are the y labels."""
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(
        len(panels), 1, figsize=(7, 2.2 + 1.8 * len(panels)), dpi=100, sharex=True, squeeze=False
    )
    axes = [row[0] for row in grid]
    axes[0].set_title(title)
    for ax, ylabel in zip(axes, panels, strict=True):
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel(X_LABEL)
    return fig, axes


def figures(run_dir: str, notes: list[str] | None = None) -> dict[str, Any]:
    """The charts of ``run_dir`` as matplotlib figures, by PNG name (without .png).
    ``notes`` gets a line for each file that holds several runs (the last is drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    out: dict[str, Any] = {}
    series = {
        "loss": ("Train_Samples_train_loss.csv", "training loss (rank 0)", "loss"),
        "lr": ("Train_Samples_lr.csv", "learning rate", "lr"),
    }
    for name, (file, title, ylabel) in series.items():
        path = os.path.join(run_dir, file)
        if os.path.exists(path):
            xs, ys = read_csv(path, notes)
            if xs:
                fig, (ax,) = _figure(title, [ylabel])
                ax.plot(xs, ys, marker="." if len(xs) < 50 else None)
                out[name] = fig
    timers = {
        "forward": "Train_Samples_elapsed_time_ms_forward.csv",
        "backward": "Train_Samples_elapsed_time_ms_backward.csv",
        "backward allreduce": "Train_Samples_elapsed_time_ms_backward_allreduce.csv",
        "step": "Train_Samples_elapsed_time_ms_step.csv",
    }
    present = {k: os.path.join(run_dir, v) for k, v in timers.items()}
    present = {k: p for k, p in present.items() if os.path.exists(p)}
    if present:
        fig, (ax,) = _figure("wall-clock breakdown per step (rank 0)", ["ms"])
        for i, (label, path) in enumerate(present.items()):
            xs, ys = read_csv(path, notes)
            ax.plot(xs, ys, label=label, **series_style(i, len(present), len(xs)))
        out["timers"] = fig
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics_path):
        out.update(_metric_figures(read_metrics(metrics_path, notes)))
    return out


def _metric_figures(records: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    records = [r for r in records if "step" in r and "samples" in r]
    if not records:
        return out
    xs = [r["samples"] for r in records]
    tokens = any(r.get("tokens_per_s") is not None for r in records)
    fig, axes = _figure("throughput", ["samples/s", "tokens/s"] if tokens else ["samples/s"])
    axes[0].plot(xs, [r.get("samples_per_s", 0) for r in records], color="C0")
    if tokens:
        per_s = [r.get("tokens_per_s") for r in records]
        axes[1].plot(xs, [float("nan") if t is None else t for t in per_s], color="C1")
    out["throughput"] = fig
    # location -> rank -> (samples, bytes)
    memory: dict[str, dict[int, tuple[list, list]]] = defaultdict(dict)
    for r in records:
        for rank, locations in enumerate(r.get("memory_ranks") or []):
            for location, nbytes in locations.items():
                mx, my = memory[location].setdefault(rank, ([], []))
                mx.append(r["samples"])
                my.append(nbytes)
    if memory:
        locations = sorted(memory)
        units = {loc: _unit(max(max(b) for _, b in memory[loc].values())) for loc in locations}
        fig, axes = _figure("memory per rank", [f"{loc} ({units[loc][0]})" for loc in locations])
        ranks = max(len(by_rank) for by_rank in memory.values())
        for ax, location in zip(axes, locations, strict=True):
            scale = units[location][1]
            for rank, (mx, my) in sorted(memory[location].items()):
                ys = [b / scale for b in my]
                ax.plot(mx, ys, label=f"rank {rank}", **series_style(rank, ranks, len(mx)))
            _readable_range(ax)
            ax.legend(fontsize=8, loc="best")
        out["memory"] = fig
    ops = sorted({op for r in records for op in r.get("comm", {})})
    if ops:
        unit, scale = _unit(max(max(r.get("comm", {}).values(), default=0) for r in records))
        fig, (ax,) = _figure("communication per step (rank 0)", [unit])
        for i, op in enumerate(ops):
            ys = [r.get("comm", {}).get(op, 0) / scale for r in records]
            ax.plot(xs, ys, label=op, **series_style(i, len(ops), len(xs)))
        out["comm"] = fig
    return out


def _unit(nbytes: float) -> tuple[str, float]:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return unit, scale
    return "B", 1.0


def _readable_range(ax) -> None:
    """Plain tick labels, and a y range of at least 2% of the values: ranks that differ
    by a few bytes share a line (their markers still tell them apart) instead of a
    range blown up to those bytes."""
    ax.ticklabel_format(axis="y", useOffset=False, style="plain")
    lo, hi = ax.get_ylim()
    span = max(abs(lo), abs(hi)) * 0.02
    if hi - lo < span:
        mid = (hi + lo) / 2
        ax.set_ylim(mid - span / 2, mid + span / 2)


def plot_run(run_dir: str, out_dir: str | None = None, notes: list[str] | None = None) -> list[str]:  # fmt: skip
    """Write the charts of ``run_dir``; returns the PNG paths written. ``notes`` gets a
    line for each file that holds several runs (the last is drawn)."""
    import matplotlib.pyplot as plt

    out_dir = out_dir or run_dir
    os.makedirs(out_dir, exist_ok=True)
    written: list[str] = []
    for name, fig in figures(run_dir, notes).items():
        for ax in fig.axes:
            if ax.get_legend() is None and len(ax.get_legend_handles_labels()[0]) > 1:
                ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
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
