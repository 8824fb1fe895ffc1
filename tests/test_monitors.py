"""Issue 16: what a run writes and prints when DeepSpeed's monitoring sections are on.

* ``test_every_monitor_on_two_ranks``: tests/scripts/monitored.py on 2 ranks through
  ``zeroshard run`` (ZeRO-3, every section on, no logging configuration): TensorBoard
  events (read back with tensorboard's EventAccumulator), DeepSpeed's CSV files, a wandb
  offline run, Comet's offline archive (when comet_ml is installed), the flops table
  against FlopCounterMode and 6·N·tokens, the wall-clock, memory, throughput and step
  lines on stdout, the comms logger's bytes against the ledger's, and ``zeroshard plot``
  PNGs that open with PIL and are not blank.
* ``test_bad_input_fails_at_initialize``: on 2 ranks, an unwritable output directory or
  a missing package fails ``initialize`` on every rank, naming the key, and writes
  nothing.
* the rest: no processes (bandwidth formulas, CSV names, the step line's handler,
  progress bars, plots of synthetic files, the peak FLOP/s probe).
"""

from __future__ import annotations

import csv
import glob
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
from typing import Any

import multirank
import numpy as np
import pytest
import torch
from logs import ListHandler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, SAMPLES = 4, 8  # monitored.py: 4 steps of 2 ranks x micro 2 x accumulation 2
CSV_FILES = {
    "Train_Samples_train_loss.csv": "train_loss",
    "Train_Samples_lr.csv": "lr",
    "Train_Samples_elapsed_time_ms_forward.csv": "elapsed_time_ms_forward",
    "Train_Samples_elapsed_time_ms_backward.csv": "elapsed_time_ms_backward",
    "Train_Samples_elapsed_time_ms_backward_inner.csv": "elapsed_time_ms_backward_inner",
    "Train_Samples_elapsed_time_ms_backward_allreduce.csv": "elapsed_time_ms_backward_allreduce",
    "Train_Samples_elapsed_time_ms_step.csv": "elapsed_time_ms_step",
}


def _csv(path: str) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def _not_blank(path: str) -> None:
    from PIL import Image

    with Image.open(path) as img:
        img.load()
        gray = img.convert("L")
        lo, hi = gray.getextrema()
        assert isinstance(lo, (int, float)) and isinstance(hi, (int, float))  # one band
        inked = int((np.asarray(gray) < 200).sum())
    assert img.size[0] > 100 and hi - lo > 100, (path, img.size, lo, hi)
    assert inked > 0.005 * img.size[0] * img.size[1], (path, inked)


@pytest.mark.timeout(600)
def test_every_monitor_on_two_ranks(tmp_path) -> None:
    for package in ("tensorboard", "wandb", "matplotlib", "PIL"):
        pytest.importorskip(package)
    comet = importlib.util.find_spec("comet_ml") is not None
    out = tmp_path / "out"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(tmp_path),
        "COMET_OFFLINE_DIRECTORY": str(tmp_path / "comet"),
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    script = os.path.join(ROOT, "tests", "scripts", "monitored.py")
    cmd = [
        sys.executable,
        "-m",
        "zeroshard.tools.cli",
        "run",
        "--nproc",
        "2",
        script,
        "--out",
        str(out),
    ]
    run = subprocess.run(
        cmd + (["--comet"] if comet else []),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    stdout = run.stdout

    # the step line, every steps_per_print (2) steps, rank 0 only, with no logging setup;
    # on gloo the reduce-scatter is point-to-point sends plus a sum, filed as a reduce-scatter
    steps = re.findall(r"^step=(\d+), skipped=0, loss=[\d.]+, lr=\[[\d.e-]+\], grad_norm=[\d.]+, samples/s=[\d.]+, tokens/s=\d+, memory: cpu [\d.]+ [KMG]?B, rss [\d.]+ [KMG]B, comm: all_gather [\d.]+ [KMG]?B, all_reduce [\d.]+ [KMG]?B, reduce_scatter [\d.]+ [KMG]?B$", stdout, re.M)  # fmt: skip
    assert steps == ["2", "4"], stdout[-3000:]
    # wall clock: a micro-step line per engine.step(), a step line per optimizer step
    micro = r"^time \(ms\) \| fwd_microstep: [\d.]+ \| bwd_microstep: [\d.]+ \| bwd_inner_microstep: [\d.]+ \| bwd_allreduce_microstep: [\d.]+ \| step_microstep: [\d.]+$"  # fmt: skip
    whole = r"^time \(ms\) \| fwd: [\d.]+ \| bwd: [\d.]+ \| bwd_inner: [\d.]+ \| bwd_allreduce: [\d.]+ \| step: [\d.]+$"  # fmt: skip
    assert len(re.findall(micro, stdout, re.M)) == 2 * STEPS
    assert len(re.findall(whole, stdout, re.M)) == STEPS
    assert len(re.findall(r"^Engine before forward \| CPU Virtual Memory: used = ", stdout, re.M)) == 2 * STEPS  # fmt: skip
    assert len(re.findall(r"^epoch=0/micro_step=\d+/global_step=\d+, RunningAvgSamplesPerSec=", stdout, re.M)) == 2  # fmt: skip
    assert stdout.count("zeroshard engine configuration:") == 1  # dump_state, rank 0
    assert stdout.count("Comm. Op            Message Size") == 2  # log_summary() and at close
    assert "Profile Summary at step 2:" in stdout and "MFU = model FLOPS / peak:" in stdout

    # TensorBoard: rank 0 only, every tag once per step, at DeepSpeed's sample counts
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = out / "tb" / "job"
    events_files = [n for n in os.listdir(tb) if n != "run.json"]  # run.json: when it started
    assert len(events_files) == 1 and events_files[0].startswith("events.out.tfevents")
    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == {"Train/Samples/" + name[len("Train_Samples_") : -4] for name in CSV_FILES}
    after = [SAMPLES * (i + 1) for i in range(STEPS)]
    for tag in tags:
        events = acc.Scalars(tag)
        expected = [s - SAMPLES for s in after] if tag.endswith("train_loss") else after
        assert [e.step for e in events] == expected, tag
    losses = [e.value for e in acc.Scalars("Train/Samples/train_loss")]
    assert all(3.0 < v < 7.0 for v in losses), losses  # ~log(256) = 5.5 at the start

    # CSV: DeepSpeed's file names and columns; all_ranks: rank 1 under rank1/
    for where in (out / "csv" / "job", out / "csv" / "job" / "rank1"):
        names = {n for n in os.listdir(where) if n.endswith(".csv")}
        assert names == set(CSV_FILES), (where, names)
        for name, column in CSV_FILES.items():
            rows = _csv(str(where / name))
            assert rows[0] == ["step", column] and len(rows) == STEPS + 1, (name, rows)
    rows = _csv(str(out / "csv" / "job" / "Train_Samples_train_loss.csv"))
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(losses, rel=1e-6)
    lines = (out / "csv" / "job" / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [len(m.get("memory_ranks", [])) for m in metrics] == [2, 2, 0, 2]
    assert all(m["comm"]["all_gather"] > 0 and m["tokens_per_s"] > 0 for m in metrics)

    # wandb: an offline run directory with the events in it
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, os.listdir(tmp_path / "wandb")
    with open(runs[0], "rb") as f:
        assert b"Train/Samples/train_loss" in f.read()
    if comet:
        assert len(glob.glob(str(tmp_path / "comet" / "*.zip"))) == 1

    # the flops profiler: its total against FlopCounterMode and 6·N·tokens
    result = json.loads((out / "result.json").read_text())
    flops, n, tokens = result["flops"], result["params"], result["tokens"]
    assert abs(flops["flops"] / result["flop_counter"] - 1) < 0.10, (flops, result)
    assert abs(flops["flops"] / (6 * n * tokens) - 1) < 0.10, (flops, n, tokens)
    assert flops["params"] == n and 0 < flops["mfu"] < 1
    table = result["table"]
    assert table["GPT"]["params"] == n and table["GPT"]["fwd_flops"] == flops["fwd_flops"]
    children = ("GPT.blocks.0", "GPT.blocks.1", "GPT.head")
    assert sum(table[c]["fwd_flops"] for c in children) == flops["fwd_flops"]
    assert all(table[c]["fwd_latency_s"] > 0 for c in children)
    # the comms logger's bytes are the ledger's, op by op
    assert result["summary"] == {op: v["bytes"] for op, v in result["comm"].items()}

    # zeroshard plot: PNGs that open and are not blank
    plot = subprocess.run(
        [sys.executable, "-m", "zeroshard.tools.cli", "plot", str(out / "csv" / "job")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plot.returncode == 0, plot.stdout + plot.stderr
    written = plot.stdout.split()
    pngs = sorted(os.path.basename(p) for p in written)
    assert pngs == ["comm.png", "loss.png", "lr.png", "memory.png", "throughput.png", "timers.png"]  # fmt: skip
    for path in written:
        _not_blank(path)


def _bad_inputs(rank: int, world: int, tmp: str) -> dict:
    import importlib.util as iu

    import zeroshard
    from zeroshard.config import ConfigError

    blocker = os.path.join(tmp, "a_file")
    if rank == 0:
        open(blocker, "w").close()
    torch.distributed.barrier()
    base = {"train_batch_size": 4 * world, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    under_file = {"enabled": True, "output_path": blocker, "job_name": "j"}
    cases: dict[str, dict[str, Any]] = {
        "tensorboard_under_file": {"tensorboard": {**under_file, "output_path": f"{blocker}/tb"}},
        "csv_under_file": {"csv_monitor": under_file},
        "wandb_missing": {"wandb": {"enabled": True}},
        "tensorboard_missing": {"tensorboard": {"enabled": True, "output_path": tmp}},
    }
    if os.geteuid() != 0:  # root may write anywhere
        locked = os.path.join(tmp, "locked")
        os.makedirs(locked, exist_ok=True)
        os.chmod(locked, 0o500)
        cases["csv_locked"] = {"csv_monitor": {"enabled": True, "output_path": locked}}
    real = iu.find_spec
    out: dict[str, Any] = {}
    for name, extra in cases.items():
        missing = {"wandb_missing": "wandb", "tensorboard_missing": "tensorboard"}.get(name)
        iu.find_spec = lambda pkg, *a, missing=missing: None if pkg == missing else real(pkg, *a)
        model = torch.nn.Linear(4, 4)
        try:
            zeroshard.initialize(model=model, config={**base, **extra})
            out[name] = "no error"
        except ConfigError as err:
            out[name] = str(err)
        finally:
            iu.find_spec = real
        out[name + "_hooks"] = len(model._forward_pre_hooks) + len(model._forward_hooks)
    out["files"] = sorted(os.listdir(tmp))
    return out


def test_bad_input_fails_at_initialize(tmp_path) -> None:
    results = multirank.run(_bad_inputs, 2, str(tmp_path), timeout=300)
    assert results[0] == results[1]  # every rank fails alike: none waits for another
    r = results[0]
    assert r["tensorboard_under_file"].startswith("tensorboard.output_path: cannot create the output directory"), r  # fmt: skip
    assert "is not a directory" in r["tensorboard_under_file"]
    assert r["csv_under_file"].startswith("csv_monitor.output_path: cannot create"), r
    assert r["wandb_missing"].startswith("wandb.enabled: needs the 'wandb' package"), r
    assert "pip install 'wandb'" in r["wandb_missing"]
    assert r["tensorboard_missing"].startswith("tensorboard.enabled: needs the 'tensorboard'"), r
    if "csv_locked" in r:
        assert r["csv_locked"].startswith("csv_monitor.output_path: cannot"), r
    assert all(r[k] == 0 for k in r if k.endswith("_hooks"))  # failed before any hook
    assert r["files"] in (["a_file"], ["a_file", "locked"])  # nothing written


# -- no processes ----------------------------------------------------------------------------
def test_bandwidths_are_deepspeeds() -> None:
    from zeroshard.monitor.comms import bandwidths, message_size

    n, s, t = 4, 1_000_000, 0.002  # 1 MB buffer, 2 ms
    gbps = 8 / 1e9
    # all-reduce: the ledger counts 2S; DeepSpeed: algbw 2S/t, busbw S/t * 2(n-1)/n
    alg, bus = bandwidths("all_reduce", 2 * s, n, t)
    assert alg == pytest.approx(2 * s / t * gbps) and bus == pytest.approx(s / t * 2 * (n - 1) / n * gbps)  # fmt: skip
    assert message_size("all_reduce", 2 * s, n) == s
    # all-gather / reduce-scatter: the ledger counts the whole buffer n*m; DeepSpeed's
    # message is one rank's m, its bandwidths those of n*m
    for op in ("all_gather", "reduce_scatter"):
        alg, bus = bandwidths(op, n * s, n, t)
        assert alg == pytest.approx(n * s / t * gbps) and bus == pytest.approx(alg * (n - 1) / n)
        assert message_size(op, n * s, n) == s
    alg, bus = bandwidths("broadcast", s, n, t)
    assert alg == bus == pytest.approx(s / t * gbps)


def test_comms_logger_records_from_the_ledger() -> None:
    from types import SimpleNamespace

    from zeroshard.distributed.ledger import Ledger, OpEvent
    from zeroshard.monitor.comms import CommsLogger

    lines: list[str] = []
    cfg = SimpleNamespace(verbose=True, debug=True, prof_all=False, prof_ops=["all_gather_into_tensor"])  # fmt: skip
    ledger = Ledger()
    logger = CommsLogger(cfg, ledger, rank=0, echo=lines.append)
    for seconds in (0.001, 0.002, 0.003):
        for observe in ledger.observers:
            observe(OpEvent("zero_shard", "all_gather", 4 * 2**20, seconds, 4, "gather"))
            observe(OpEvent("replicas", "all_reduce", 2 * 2**20, seconds, 2, "reduce"))
    summary = logger.summary()  # prof_ops keeps all_gather only (DeepSpeed's name given)
    assert list(summary) == ["all_gather | [Caller Func: gather]"]
    s = summary["all_gather | [Caller Func: gather]"][2**20]  # one rank's part: 1 MiB
    assert s["count"] == 3 and s["bytes"] == 12 * 2**20 and s["msg_size_str"] == "1.0 MB"
    assert s["total_latency_ms"] == pytest.approx(6.0) and s["avg_latency_ms"] == pytest.approx(2.0)
    assert len(lines) == 3 and lines[0].startswith("comm op: all_gather | [Caller Func: gather] | time (ms): 1.00 | msg size: 1.0 MB")  # fmt: skip
    logger.log_all()
    assert lines[-1].startswith("Comm. Op") and "1.0 MB" in lines[-1]
    logger.close()
    assert ledger.observers == []


def test_csv_writer_names_and_appends(tmp_path) -> None:
    from zeroshard.monitor.csv import CSVWriter, file_name

    assert file_name("Train/Samples/train_loss") == "Train_Samples_train_loss.csv"
    assert file_name("My Metric/x y") == "My_Metric_x_y.csv"
    for values in ([(1.5, 8), (1.25, 16)], [(1.0, 24)]):  # a second writer: a resumed run
        writer = CSVWriter(str(tmp_path))
        writer.write_events([("Train/Samples/train_loss", v, s) for v, s in values])
        writer.close()
    rows = _csv(str(tmp_path / "Train_Samples_train_loss.csv"))
    assert rows == [["step", "train_loss"], ["8", "1.5"], ["16", "1.25"], ["24", "1.0"]]


def _record():
    from zeroshard.monitor.steplog import StepRecord

    return StepRecord(step=10, samples=80, skipped=0, loss=2.5, lr=[1e-3], grad_norm=0.5,
                      loss_scale=None, step_s=0.1, samples_per_s=800.0, tokens_per_s=None,
                      comm={"all_gather": 2_000_000}, memory={"cpu": 1_500})  # fmt: skip


def test_step_line_handler(capsys, monkeypatch) -> None:
    from zeroshard.monitor.steplog import log_step, monitor_logger

    monitor_logger()
    line = "step=10, skipped=0, loss=2.5000, lr=[0.001], grad_norm=0.5, samples/s=800.0, memory: cpu 1.50 KB, comm: all_gather 2.00 MB"  # fmt: skip
    assert _record().line() == line
    # no handler anywhere (pytest's own sit on the root logger: remove them): stdout
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    log_step(_record())
    assert capsys.readouterr().out == line + "\n"
    # a handler of the user's takes it instead; the default prints nothing
    seen: list[str] = []
    handler = ListHandler(seen, messages=True)
    logging.getLogger("zeroshard").addHandler(handler)
    try:
        log_step(_record())
    finally:
        logging.getLogger("zeroshard").removeHandler(handler)
    assert seen == [line] and capsys.readouterr().out == ""
    # silenced through the logger's level
    logger = logging.getLogger("zeroshard.monitor")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        log_step(_record())
    finally:
        logger.setLevel(level)
    assert capsys.readouterr().out == ""


def _timer_lines(rank: int, world: int) -> dict:
    import zeroshard
    from zeroshard.models import GPT, GPTConfig

    lines: list[str] = []
    handler = ListHandler(lines, messages=True)
    logging.getLogger("zeroshard.monitor").addHandler(handler)
    counts = {}
    for gas in (1, 2):
        model = GPT(GPTConfig.preset("tiny", seq_len=8))
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": gas,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "wall_clock_breakdown": True,
        }
        engine, *_ = zeroshard.initialize(model=model, config=config)
        for _ in range(3 * gas):  # three optimizer steps
            ids = torch.randint(0, 256, (2, 9))
            engine.backward(engine(ids[:, :-1], ids[:, 1:]))
            engine.step()
        engine.destroy()  # prints what is held
        text = "\n".join(lines)
        counts[gas] = [text.count("| fwd_microstep: "), text.count("| fwd: ")]
        lines.clear()
    return counts


def test_wall_clock_lines_per_step() -> None:
    # DeepSpeed 0.19: the micro-step line every micro-step, the step line at each
    # boundary; without accumulation the micro-step line would repeat the step line
    (counts,) = multirank.run(_timer_lines, 1, timeout=180)
    assert counts == {"1": [0, 3], "2": [6, 3]}


def test_progress_bars(capsys, monkeypatch) -> None:
    pytest.importorskip("tqdm")
    from zeroshard.monitor.progress import progress

    items = [1, 2, 3]
    monkeypatch.setenv("ZEROSHARD_PROGRESS", "0")
    assert progress(items, desc="x") is items
    monkeypatch.setenv("ZEROSHARD_PROGRESS", "1")
    assert list(progress(items, desc="saving checkpoint")) == items
    assert "saving checkpoint" in capsys.readouterr().err
    assert progress(items, desc="x", enabled=False) is items  # ranks other than 0
    monkeypatch.delenv("ZEROSHARD_PROGRESS")
    assert progress(items, desc="x") is items  # stderr is not a terminal here


def _synthetic_run(path) -> None:
    """20 steps of 8 samples on 2 ranks whose memory is equal (as it is under ZeRO), with
    tokens/s = 128 x samples/s, two collectives of one size, and the timers."""
    from zeroshard.monitor.csv import CSVWriter

    writer = CSVWriter(str(path))
    for i in range(1, 21):
        events = [("Train/Samples/train_loss", 5.0 / i, 8 * (i - 1)), ("Train/Samples/lr", 1e-3 * min(1, i / 5), 8 * i)]  # fmt: skip
        events += [(f"Train/Samples/elapsed_time_ms_{t}", 10.0, 8 * i) for t in ("forward", "backward", "backward_allreduce", "step")]  # fmt: skip
        writer.write_events(events)
    writer.close()
    with open(path / "metrics.jsonl", "w") as f:
        for i in range(1, 21):
            rec: dict[str, Any] = {"step": i, "samples": 8 * i, "samples_per_s": 100 + i, "tokens_per_s": 128 * (100 + i), "comm": {"all_gather": 1e6, "reduce_scatter": 1e6}}  # fmt: skip
            if i % 5 == 0:
                rec["memory_ranks"] = [{"cpu": 1e6 + i * 1e4, "rss": 3e8} for _ in (0, 1)]
            f.write(json.dumps(rec) + "\n")


def test_plot_of_synthetic_run(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    pytest.importorskip("PIL")
    from zeroshard.tools.plot import plot_run

    _synthetic_run(tmp_path)
    written = plot_run(str(tmp_path))
    names = sorted(os.path.basename(p) for p in written)
    assert names == ["comm.png", "loss.png", "lr.png", "memory.png", "throughput.png", "timers.png"]  # fmt: skip
    for path in written:
        _not_blank(path)


def test_plots_share_the_samples_axis_and_show_every_series(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from zeroshard.tools.plot import figures

    _synthetic_run(tmp_path)
    figs = figures(str(tmp_path))
    try:
        for name, fig in figs.items():  # one x axis: samples, as DeepSpeed's monitors
            assert fig.axes[-1].get_xlabel() == "samples", name
            assert all(len(ax.get_shared_x_axes().get_siblings(ax)) == len(fig.axes) for ax in fig.axes), name  # fmt: skip
        # throughput: samples/s and tokens/s in panels of their own (on one axis, tokens/s
        # = 128 x samples/s and the twin axis drew one line over the other)
        throughput = figs["throughput"].axes
        assert [ax.get_ylabel() for ax in throughput] == ["samples/s", "tokens/s"]
        assert [len(ax.get_lines()) for ax in throughput] == [1, 1]
        assert list(throughput[0].get_lines()[0].get_xdata()) == [8 * i for i in range(1, 21)]
        # memory: a panel per location; equal ranks told apart by line style and marker
        memory = figs["memory"].axes
        assert [ax.get_ylabel() for ax in memory] == ["cpu (MB)", "rss (MB)"]
        for ax in memory:
            lines = ax.get_lines()
            assert [line.get_label() for line in lines] == ["rank 0", "rank 1"]
            assert list(lines[0].get_ydata()) == list(lines[1].get_ydata())  # they coincide
            assert _distinct(lines)
        for name in ("comm", "timers"):  # collectives / timers of equal values
            assert _distinct(figs[name].axes[0].get_lines()), name
    finally:
        for fig in figs.values():
            plt.close(fig)


def _distinct(lines) -> bool:
    """Each line differs from every other in colour, dashes, marker and marker size."""
    looks = [(ln.get_color(), ln.get_linestyle(), ln.get_marker(), ln.get_markersize()) for ln in lines]  # fmt: skip
    return len(lines) > 1 and all(len({look[k] for look in looks}) == len(lines) for k in range(4))


def test_peak_flops_is_measured() -> None:
    from zeroshard.monitor.flops import peak_flops

    torch.set_num_threads(1)
    peak = peak_flops("cpu", "fp32", seconds=0.05)
    assert 1e8 < peak < 1e13  # a CPU core: between 0.1 GFLOP/s and 10 TFLOP/s
    assert peak_flops("cpu", "fp32") == peak  # cached


def test_plot_never_joins_two_runs(tmp_path) -> None:
    """Files that hold runs one after another (DeepSpeed's CSV monitor appends; so did
    zeroshard before a run got its own directory) and a row torn by a kill: the charts
    draw the last run only, and say so."""
    pytest.importorskip("matplotlib")
    from zeroshard.tools.plot import plot_run, read_csv, read_metrics

    rows = ["step,train_loss"] + [f"{8 * i},{5.0 / (i + 1)}" for i in range(150)]
    again = ["step,train_loss"] + [
        f"{8 * i},{4.0 / (i + 1)}" for i in range(80)
    ]  # DeepSpeed's repeated header
    (tmp_path / "Train_Samples_train_loss.csv").write_text("\n".join(rows + again) + "\n7")  # fmt: skip
    records = [{"step": s, "samples": 8 * s, "samples_per_s": 1.0} for s in [*range(1, 151), *range(1, 81)]]  # fmt: skip
    text = "".join(json.dumps(r) + "\n" for r in records) + '{"step": 81, "samp'
    (tmp_path / "metrics.jsonl").write_text(text)
    notes: list[str] = []
    xs, ys = read_csv(str(tmp_path / "Train_Samples_train_loss.csv"), notes)
    assert xs == [8.0 * i for i in range(80)] and ys[0] == 4.0
    steps = [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"), notes)]
    assert steps == list(range(1, 81))
    assert notes == [
        f"{tmp_path}/Train_Samples_train_loss.csv holds 2 runs one after another: drawing the last (80 of 230 rows)",
        f"{tmp_path}/metrics.jsonl holds 2 runs one after another: drawing the last (80 of 230 rows)",
    ]
    notes.clear()
    assert sorted(os.path.basename(p) for p in plot_run(str(tmp_path), notes=notes)) == ["loss.png", "throughput.png"]  # fmt: skip
    assert len(notes) == 2


def test_run_directory_rules(tmp_path) -> None:
    """zeroshard.monitor.rundir without processes: a fresh run moves an earlier run's
    files (and only run files), a resume continues its own with the rows past the
    checkpoint dropped (a torn row too), a resume into another run's files moves them."""
    from zeroshard.monitor.rundir import open_run

    d = tmp_path / "job"
    assert open_run(str(d), 0, 0) is None and sorted(os.listdir(d)) == ["run.json"]

    def write_run(last_step: int, torn: bool = False) -> None:
        loss = "".join(f"{8 * (s - 1)},{1.0 / s}\n" for s in range(1, last_step + 1))
        lr = "".join(f"{8 * s},0.001\n" for s in range(1, last_step + 1))
        (d / "Train_Samples_train_loss.csv").write_text("step,train_loss\n" + loss + ("99,0." if torn else ""))  # fmt: skip
        (d / "Train_Samples_lr.csv").write_text("step,lr\n" + lr)
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, last_step + 1)))  # fmt: skip

    write_run(5, torn=True)
    (d / "notes.txt").write_text("mine")  # a user's file
    (d / "rank1").mkdir()  # another rank's directory
    said = open_run(str(d), 3, 24)  # resumed from step 3 (24 samples)
    assert said == f"zeroshard: resumed at step 3: {d} continues this run's files; 6 rows past it dropped"  # fmt: skip
    assert _csv(str(d / "Train_Samples_train_loss.csv")) == [["step", "train_loss"], ["0", "1.0"], ["8", "0.5"], ["16", str(1 / 3)]]  # fmt: skip
    assert [r[0] for r in _csv(str(d / "Train_Samples_lr.csv"))] == ["step", "8", "16", "24"]
    assert (d / "metrics.jsonl").read_text().splitlines() == ['{"step": 1}', '{"step": 2}', '{"step": 3}']  # fmt: skip
    assert json.loads((d / "run.json").read_text())["resumes"][0]["step"] == 3
    said = open_run(str(d), 0, 0)  # a fresh run
    assert said is not None and said.startswith(f"zeroshard: {d} held an earlier run: moved to {d}/previous/run-")  # fmt: skip
    (archived,) = os.listdir(d / "previous")
    moved = sorted(os.listdir(d / "previous" / archived))
    assert moved == ["Train_Samples_lr.csv", "Train_Samples_train_loss.csv", "metrics.jsonl", "run.json"]  # fmt: skip
    assert sorted(os.listdir(d)) == ["notes.txt", "previous", "rank1", "run.json"]
    write_run(2)
    said = open_run(str(d), 9, 72)  # resumed at step 9: these files never reached it
    assert said is not None and f"{d} held another run (without step 9): moved to" in said
    assert len(os.listdir(d / "previous")) == 2
