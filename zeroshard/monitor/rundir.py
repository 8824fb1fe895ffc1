"""A monitor directory belongs to one run: what a new run does with an earlier run's
files. No collectives; each writing rank manages its own directory.

DeepSpeed's ``csv_monitor`` and ``tensorboard`` write into ``output_path/job_name`` and
append, so a second launch with the same config continues the first run's curves from
the start (a line that jumps back). Here, when a rank is about to write its first event,
:func:`open_run` looks at the directory:

* nothing of an earlier run: the run writes there;
* a fresh run (from step 0) and an earlier run's files: they move to
  ``previous/run-<its start time>/`` inside the directory (nothing is deleted), and the
  new run writes where DeepSpeed would;
* a resumed run (from a checkpoint's step N) and the files of the run it resumes (their
  metrics hold step N; a save flushes them, so they do after a kill): the run continues
  them. Rows past the checkpoint, written by the
  attempt that died after it, are dropped, since the resumed run does those steps again:
  ``metrics.jsonl`` records after step N, CSV rows after the checkpoint's sample count
  (``train_loss``, logged at the samples *before* its step, from that count on).
  TensorBoard hides them itself (``purge_step``);
* a resumed run and another run's files (no step N): moved as for a fresh run.

``run.json`` records when the run started and where it resumed. The choice is returned
as a line for rank 0 to print. Ctrl-C closes the files with whole rows; a row torn by a
kill is dropped here (on resume) and by ``zeroshard plot``.
"""

from __future__ import annotations

import csv
import json
import os
import time
from collections.abc import Callable
from typing import Any

RUN_FILE = "run.json"
ARCHIVE = "previous"
LOSS_FILE = "Train_Samples_train_loss.csv"  # x = the samples before its step


def is_run_file(name: str) -> bool:
    """The files of a run in a monitor directory (a user's other files stay put)."""
    return (
        name.endswith((".csv", ".png"))
        or name in (RUN_FILE, "metrics.jsonl")
        or name.startswith("events.out.tfevents.")
    )


def _run_files(directory: str) -> list[str]:
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    return [n for n in names if is_run_file(n) and os.path.isfile(os.path.join(directory, n))]


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def _read_run(directory: str) -> dict:
    try:
        with open(os.path.join(directory, RUN_FILE)) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_run(directory: str, data: dict) -> None:
    tmp = os.path.join(directory, f".{RUN_FILE}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, os.path.join(directory, RUN_FILE))


def _read_lines(path: str) -> tuple[list[str], bool]:
    """The whole lines of a file, and whether a last line was torn (no newline: a kill)."""
    with open(path, newline="") as f:
        text = f.read()
    parts = text.split("\n")
    return [line + "\n" for line in parts[:-1]], parts[-1] != ""


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def _x_of(line: str) -> float | None:
    row = next(csv.reader([line]), [])
    try:
        return float(row[0]) if len(row) == 2 else None
    except ValueError:
        return None


def _metric_steps(directory: str) -> list[int] | None:
    path = os.path.join(directory, "metrics.jsonl")
    if not os.path.isfile(path):
        return None
    return [s for s in map(_step_of, _read_lines(path)[0]) if s is not None]


def _holds_step(directory: str, step: int, samples: int) -> bool | None:
    """Whether the earlier run's files reached step ``step`` (None: nothing to tell by)."""
    steps = _metric_steps(directory)
    if steps is not None:
        return step in steps
    lr = os.path.join(directory, "Train_Samples_lr.csv")
    if os.path.isfile(lr):
        return samples in (_x_of(line) for line in _read_lines(lr)[0])
    return None


def _keeps(name: str, step: int, samples: int) -> Callable[[str], bool] | None:
    """Which lines of run file ``name`` come from the run up to the checkpoint (step,
    samples); None for files not cut (PNGs, event files, run.json)."""
    if name == "metrics.jsonl":
        return lambda line: (s := _step_of(line)) is not None and s <= step
    if not name.endswith(".csv"):
        return None
    strict = name == LOSS_FILE  # its x is the samples before its step

    def keep(line: str) -> bool:
        if line.startswith("step,"):
            return True
        x = _x_of(line)
        return x is not None and (x < samples if strict else x <= samples)

    return keep


def _cut(directory: str, step: int, samples: int) -> int:
    """Drop what the files hold past the checkpoint (step, samples), and torn last lines;
    return the rows dropped."""
    dropped = 0
    for name in _run_files(directory):
        keep = _keeps(name, step, samples)
        if keep is None:
            continue
        path = os.path.join(directory, name)
        lines, torn = _read_lines(path)
        kept = [line for line in lines if keep(line)]
        if torn or len(kept) != len(lines):
            tmp = path + ".tmp"
            with open(tmp, "w", newline="") as f:
                f.writelines(kept)
            os.replace(tmp, path)
        dropped += len(lines) - len(kept)
    return dropped


def _archive(directory: str, names: list[str]) -> str:
    started = _read_run(directory).get("started")
    if not isinstance(started, str):
        oldest = min(os.path.getmtime(os.path.join(directory, n)) for n in names)
        started = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(oldest))
    base = os.path.join(directory, ARCHIVE, "run-" + started.replace(":", "").replace("-", ""))
    target, n = base, 1
    while os.path.exists(target):
        n += 1
        target = f"{base}-{n}"
    os.makedirs(target)
    for name in names:
        os.replace(os.path.join(directory, name), os.path.join(target, name))
    return target


def open_run(directory: str, step: int, samples: int) -> str | None:
    """Make ``directory`` this run's before its first event (the run starts after
    optimizer step ``step``, ``samples`` samples: 0 unless resumed). Returns the line
    saying what was done with an earlier run's files, None if there were none."""
    os.makedirs(directory, exist_ok=True)
    names = _run_files(directory)
    record: dict[str, Any] = {"started": _now(), "first_step": step + 1}
    if not names:
        _write_run(directory, record)
        return None
    if step > 0 and _holds_step(directory, step, samples) is not False:
        dropped = _cut(directory, step, samples)
        run: dict[str, Any] = _read_run(directory) or record
        run.setdefault("resumes", []).append({"step": step, "samples": samples, "time": _now()})
        _write_run(directory, run)
        past = f"; {dropped} rows past it dropped" if dropped else ""
        return f"zeroshard: resumed at step {step}: {directory} continues this run's files{past}"
    moved = _archive(directory, names)
    _write_run(directory, record)
    why = "an earlier run" if step == 0 else f"another run (without step {step})"
    return f"zeroshard: {directory} held {why}: moved to {moved}; this run writes {directory}"
