"""Pipeline bubbles: measured from an engine's trace, predicted by formula, drawn as a timeline.

A trace is the pipeline engine's ``engine.pipeline_trace`` for one ``train_batch``: a list of
dicts ``{stage, kind, microbatch, chunk, t_start, t_end}`` (``time.perf_counter`` seconds,
comparable across the processes of one host: Linux's monotonic clock). Traces of several
ranks are concatenated before they are measured or drawn.

* ``bubble_fractions(trace)``: per stage, the time inside the step's span (first start to
  last end over all stages) in which the stage computes nothing (no F, B, BI or BW action),
  divided by the span.
* ``theoretical_bubble(schedule, stages, microbatches, virtual)``: the same fraction for equal
  stages, from the papers: GPipe and 1F1B ``(p-1)/(m+p-1)``; interleaved 1F1B with ``v`` chunks
  per stage ``(p-1)/(v*m+p-1)``; ZB-H1 ``(p-1)(F+B-W) / (m(F+B+W) + (p-1)(F+B-W))`` with ``B``
  the input-gradient and ``W`` the weight-gradient half of the backward (a third of 1F1B's
  bubble when F = B = W).
* ``plot_timeline(trace, path)``: one row per stage, a box per compute action coloured by
  kind with its microbatch number (and chunk, when there are several) inside, sends and
  receives as a thin grey strip under the row, the measured bubble per stage in the
  labels; a PNG through matplotlib's Agg backend.

``python -m zeroshard.parallel.pipeline.plot TRACE.json [-o timeline.png]`` draws a trace saved
with ``save_trace``. No collectives; reads and writes files only.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Iterable, Sequence

from zeroshard.parallel.pipeline.module import PipelineError

COMPUTE_KINDS = ("F", "B", "BI", "BW", "W")
COLORS = {"F": "#4C72B0", "B": "#55A868", "BI": "#8ACB88", "BW": "#DD8452", "W": "#DD8452"}
OTHER_COLOR = "#BBBBBB"


def _union_length(intervals: Iterable[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def step_span(trace: Sequence[dict]) -> tuple[float, float]:
    """(first start, last end) over all actions of all stages."""
    if not trace:
        raise PipelineError("empty pipeline trace: run train_batch first (engine.pipeline_trace)")
    return min(a["t_start"] for a in trace), max(a["t_end"] for a in trace)


def bubble_fractions(
    trace: Sequence[dict], kinds: Sequence[str] = COMPUTE_KINDS
) -> dict[int, float]:
    """{stage: idle time within the step span / span}; busy means running an action in ``kinds``."""
    t0, t1 = step_span(trace)
    span = t1 - t0
    if span <= 0:
        raise PipelineError("pipeline trace spans no time")
    busy: dict[int, list[tuple[float, float]]] = defaultdict(list)
    stages = set()
    for a in trace:
        stages.add(a["stage"])
        if a["kind"] in kinds:
            busy[a["stage"]].append((a["t_start"], a["t_end"]))
    return {s: 1.0 - _union_length(busy[s]) / span for s in sorted(stages)}


def mean_bubble(trace: Sequence[dict]) -> float:
    fr = bubble_fractions(trace)
    return sum(fr.values()) / len(fr)


def theoretical_bubble(
    schedule: str,
    stages: int,
    microbatches: int,
    virtual: int = 1,
    *,
    t_f: float = 1.0,
    t_b: float = 1.0,
    t_w: float = 1.0,
) -> float:
    """Idle fraction of each stage's step for equal stages (the papers' formulas).

    ``t_f``, ``t_b``, ``t_w``: forward, input-gradient and weight-gradient time of one
    microbatch on one stage (only ZB-H1 splits the backward; the others use ``t_b + t_w``).
    """
    p, m, v = stages, microbatches, virtual
    if p < 1 or m < 1 or v < 1:
        raise PipelineError(f"stages, microbatches and virtual must be >= 1 (got {p}, {m}, {v})")
    if schedule in ("gpipe", "1f1b"):
        if v != 1:
            raise PipelineError(f"schedule {schedule!r} has one chunk per stage (virtual={v})")
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zb_h1":
        idle = (p - 1) * max(t_f + t_b - t_w, 0.0)
        return idle / (m * (t_f + t_b + t_w) + idle)
    raise PipelineError(
        f"no bubble formula for schedule {schedule!r} (gpipe, 1f1b, interleaved_1f1b, zb_h1)"
    )


def save_trace(trace: Sequence[dict], path: str) -> None:
    with open(path, "w") as f:
        json.dump(list(trace), f)


def load_trace(path: str) -> list[dict]:
    with open(path) as f:
        return json.load(f)


def plot_timeline(trace: Sequence[dict], path: str, title: str | None = None) -> str:
    """Draw the trace as one row per stage (stage 0 on top) into the PNG ``path``; returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0, t1 = step_span(trace)
    scale, unit = (1e3, "ms") if t1 - t0 < 10 else (1.0, "s")
    fractions = bubble_fractions(trace)
    stages = sorted(fractions)
    chunks = {a.get("chunk", 0) or 0 for a in trace}
    fig, ax = plt.subplots(
        figsize=(
            max(8.0, min(24.0, 0.3 * sum(a["kind"] in COLORS for a in trace) / len(stages))),
            0.6 * len(stages) + 1.6,
        ),
        dpi=100,
    )
    for a in trace:
        row = stages.index(a["stage"])
        x, w = (a["t_start"] - t0) * scale, (a["t_end"] - a["t_start"]) * scale
        kind = a["kind"]
        if kind not in COLORS:  # transfers and waits: a thin strip under the row, unlabelled
            ax.barh(row + 0.3, w, left=x, height=0.2, color=OTHER_COLOR, linewidth=0)
            continue
        ax.barh(row, w, left=x, height=0.8, color=COLORS[kind], edgecolor="black", linewidth=0.4)
        mb = a.get("microbatch")
        if mb is not None and w > 0.012 * (t1 - t0) * scale:  # no labels on slivers
            label = str(mb) if len(chunks) < 2 else f"{mb}.{a.get('chunk', 0)}"
            ax.text(x + w / 2, row, label, ha="center", va="center", fontsize=7, clip_on=True)
    ax.set_yticks(range(len(stages)), [f"stage {s}\nbubble {fractions[s]:.0%}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlim(0, (t1 - t0) * scale)
    ax.set_xlabel(f"time ({unit})")
    kinds = [k for k in COLORS if any(a["kind"] == k for a in trace)]
    others = sorted({a["kind"] for a in trace} - set(COLORS))
    handles = [Patch(color=COLORS[k], label=k) for k in kinds]
    handles += [Patch(color=OTHER_COLOR, label="sends/receives")] if others else []
    ax.legend(
        handles=handles,
        loc="upper right",
        fontsize=8,
        ncol=len(handles),
        bbox_to_anchor=(1.0, 1.18),
    )
    mean = sum(fractions.values()) / len(fractions)
    ax.set_title(title or f"pipeline timeline: mean bubble {mean:.1%}", loc="left", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m zeroshard.parallel.pipeline.plot", description=__doc__.split("\n")[0]
    )
    ap.add_argument(
        "trace", help="a JSON list of trace actions (save_trace / engine.pipeline_trace)"
    )
    ap.add_argument(
        "-o", "--out", default=None, help="PNG path (default: the trace's name with .png)"
    )
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    trace = load_trace(args.trace)
    out = args.out or args.trace.rsplit(".", 1)[0] + ".png"
    plot_timeline(trace, out, args.title)
    for stage, frac in bubble_fractions(trace).items():
        print(f"stage {stage}: bubble {frac:.3f}")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
