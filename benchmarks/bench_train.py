"""Training-step benchmark: zeroshard ZeRO 0-3 against DDP, ZeroRedundancyOptimizer,
FSDP2 and DeepSpeed ZeRO 0-3, on 2 CPU ranks (gloo), fp32, the reference GPT.

    make bench        # the whole matrix at the defaults, 5 rounds, RESULTS.md + PNG (~2 h)
    .venv/bin/python benchmarks/bench_train.py --shape both --rounds 3
    .venv/bin/python benchmarks/bench_train.py --model tiny --seq 32 --steps 2 \
        --rounds 1 --shape compute --no-record                            # smoke test

Systems: zeroshard stages 0-3, and 1-3 with the optimizer offloaded to the CPU
(``zeroshard-sN-offload``); DDP, ZeroRedundancyOptimizer + DDP, FSDP2; DeepSpeed stages
0-3. Every system runs at its own defaults unless ``--bucket`` sets one bucket size for
all (zeroshard: 25 MiB of gradients; DeepSpeed: 5e8 elements; DDP: 25 MiB).

Shapes: *compute* (GPT 25M, seq 256, micro-batch 4) and *state* (GPT 100M, seq 32,
micro-batch 1). Every system trains the same model from the same seed on the same
batches with AdamW (lr 3e-4, betas 0.9/0.95, wd 0.1, no clipping); see
``_systems.py`` for each system's setup and how its model-state bytes are counted.

Every run of every system is a fresh pair of processes (``benchmarks/_systems.py``),
so allocator state and peak RSS never leak between systems. Rounds interleave the
systems (the order rotates each round); noise on this machine is about +-40% run to
run, so the table gives the median over rounds of each run's median step time, and
the ratio to DDP is computed within each round and then the median taken.

DeepSpeed runs in a separate interpreter (``--ds-python``, default ``.venv-bench``)
so the project's venv stays free of it; without it, its rows say "not installed"::

    python3 -m venv .venv-bench
    .venv-bench/bin/pip install torch==2.13.0 deepspeed numpy
    .venv-bench/bin/pip install -e . --no-deps

Its CPU FusedAdam is a C++ JIT build (about 1-2 minutes, once per machine, cached
in ~/.cache/torch_extensions); ``--ds-optimizer torch`` uses torch's fused AdamW.
Results go to stdout, are appended to ``benchmarks/RESULTS.md`` (unless
``--no-record``), and with ``--json PATH`` are written in full as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "_systems.py")

ZEROSHARD = (
    [f"zeroshard-s{s}" for s in range(4)]
    + [f"zeroshard-s{s}-lap" for s in (1, 2)]
    + [f"zeroshard-s{s}-offload" for s in (1, 2, 3)]
)
TORCH = ["ddp", "zero-redundancy", "fsdp2"]
DEEPSPEED = [f"deepspeed-s{s}" for s in range(4)]
ALL_SYSTEMS = ZEROSHARD + TORCH + DEEPSPEED

# name: (description, model preset, seq_len, micro-batch, default timed steps)
SHAPES = {
    "compute": ("compute-bound", "25M", 256, 4, 5),
    "state": ("state-bound", "100M", 32, 1, 6),
}
MiB = 2**20


# -- machine ----------------------------------------------------------------------------
def _meminfo_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        return kib / 2**20
    except (OSError, StopIteration, ValueError):
        return float("nan")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return (
                next(line for line in f if line.startswith("model name")).split(":", 1)[1].strip()
            )
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def deepspeed_version(python: str | None) -> str | None:
    """DeepSpeed's version in ``python``'s environment, or None if it does not import."""
    if not python or not os.path.exists(python):
        return None
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    try:
        r = subprocess.run(
            [python, "-c", "import deepspeed; print(deepspeed.__version__)"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
    except subprocess.TimeoutExpired:
        return None
    return r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else None


def machine(ds: str | None) -> dict:
    return {
        "cores": os.cpu_count(),
        "ram_gib": round(_meminfo_gib(), 1),
        "cpu": _cpu_model(),
        "python": platform.python_version(),
        "torch": importlib.metadata.version("torch"),
        "deepspeed": ds or "not installed",
    }


# -- one run: a fresh process per rank ------------------------------------------------------
def wait_all(procs: list[subprocess.Popen], timeout: float) -> str | None:
    """Wait for every rank; on a failed rank or the timeout, kill the others. Says why."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        failed = None
        if time.monotonic() > deadline:
            failed = f"timed out after {timeout:.0f} s"
        elif any(p.returncode not in (None, 0) for p in procs):
            failed = "a rank failed"
        if failed:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            return failed
        time.sleep(0.2)
    return None


def run_once(spec: dict, python: str, timeout: float) -> dict:
    """Run ``spec`` on ``spec['world']`` fresh ranks; return ``{"status", "ranks": [...]}``."""
    with tempfile.TemporaryDirectory(prefix="zs-bench-") as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = {
            **os.environ,
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        with contextlib.ExitStack() as stack:
            procs = [
                subprocess.Popen(
                    [python, WORKER, spec_path, str(rank)],
                    stdout=stack.enter_context(open(os.path.join(tmp, f"log{rank}.txt"), "w")),
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=ROOT,
                )
                for rank in range(spec["world"])
            ]
            failed = wait_all(procs, timeout)
        results = []
        # a rank that raised explains more than one killed because of it
        for rank in sorted(range(len(procs)), key=lambda r: procs[r].returncode <= 0):
            p = procs[rank]
            path = os.path.join(tmp, f"result{rank}.json")
            if p.returncode == 0 and os.path.exists(path):
                with open(path) as f:
                    results.append(json.load(f))
                continue
            with open(os.path.join(tmp, f"log{rank}.txt")) as f:
                tail = f.read().strip().splitlines()[-15:]
            errors = [
                ln.split("]:", 1)[-1].strip() for ln in tail if "Error" in ln or "Exception" in ln
            ]
            why = failed or f"rank {rank} exit {p.returncode}"
            reason = f"{why}: {errors[-1]}" if errors else why
            return {"status": "error", "reason": reason, "log_tail": tail}
        status = results[0]["status"]
        if status != "ok":
            return {"status": status, "reason": results[0].get("reason", "")}
        return {"status": "ok", "ranks": results}


def per_run(run: dict) -> dict:
    """One run's numbers: the step time is the median over steps of the slowest rank."""
    ranks = run["ranks"]
    slowest = [max(ts) for ts in zip(*(r["step_times"] for r in ranks), strict=True)]
    return {
        "step_s": statistics.median(slowest),
        "rss_mib": [r["maxrss_kib"] / 1024 for r in ranks],
        "state_mib": [
            sum(v for k, v in r["tracked"].items() if k != "buffers") / MiB
            if "tracked_error" not in r
            else math.nan
            for r in ranks
        ],
        "tracked_error": ranks[0].get("tracked_error"),
        "buffer_mib": [r["tracked"].get("buffers", 0) / MiB for r in ranks],
        "comm_mib": ranks[0].get("comm_bytes_per_step", None),
        "setup_s": max(r["setup_s"] for r in ranks),
        "first_loss": ranks[0]["losses"][0],
        "final_loss": ranks[0]["final_loss"],
    }


# -- summaries ------------------------------------------------------------------------------
def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """``runs[system][round]`` -> per-system medians; ratios to DDP within each round."""
    out = {}
    ddp = runs.get("ddp", [])
    for name, rounds in runs.items():
        ok = [r for r in rounds if r["status"] == "ok"]
        if not ok:
            first = rounds[0] if rounds else {"status": "not run", "reason": ""}
            out[name] = {"status": first["status"], "reason": first.get("reason", "")}
            continue
        nums = [per_run(r) for r in ok]
        ratios = [
            per_run(r)["step_s"] / per_run(d)["step_s"]
            for r, d in zip(rounds, ddp, strict=False)
            if r["status"] == "ok" and d["status"] == "ok"
        ]
        comm = nums[0]["comm_mib"]
        world = len(nums[0]["rss_mib"])
        out[name] = {
            "status": "ok" if len(ok) == len(rounds) else f"ok in {len(ok)}/{len(rounds)} rounds",
            "step_s": statistics.median(n["step_s"] for n in nums),
            "step_s_min": min(n["step_s"] for n in nums),
            "step_s_max": max(n["step_s"] for n in nums),
            "ratio_to_ddp": statistics.median(ratios) if ratios else None,
            "rss_mib": [statistics.median(n["rss_mib"][i] for n in nums) for i in range(world)],
            "state_mib": [statistics.median(n["state_mib"][i] for n in nums) for i in range(world)],
            "buffer_mib": [
                statistics.median(n["buffer_mib"][i] for n in nums) for i in range(world)
            ],
            "tracked_bytes_rank0": ok[0]["ranks"][0]["tracked"],
            "comm_mib_per_step": None if comm is None else comm / MiB,
            "setup_s": statistics.median(n["setup_s"] for n in nums),
            "first_loss": nums[0]["first_loss"],
            "final_loss": nums[0]["final_loss"],
            "note": ok[0]["ranks"][0]["note"]
            + (f"; bytes: {nums[0]['tracked_error']}" if nums[0]["tracked_error"] else ""),
        }
    return out


COLUMNS = (
    "system",
    "step (s), median [min-max]",
    "× DDP",
    "peak RSS r0/r1 (MiB)",
    "model state r0/r1 (MiB)",
    "comm/step (MiB)",
    "init (s)",
    "loss first → final",
    "setup",
)


def table(summary: dict[str, dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---" * len(COLUMNS) + "|"]
    for name, s in summary.items():
        if not s["status"].startswith("ok"):
            reason = s.get("reason", "").replace("|", "/").replace("\n", " ")[:160]
            cells = [name, s["status"], *[""] * (len(COLUMNS) - 3), reason]
        else:
            flag = "" if s["status"] == "ok" else f" ({s['status']})"
            extra = max(s["buffer_mib"])
            cells = [
                name,
                f"{s['step_s']:.3f} [{s['step_s_min']:.3f}-{s['step_s_max']:.3f}]{flag}",
                "n/a" if s["ratio_to_ddp"] is None else f"{s['ratio_to_ddp']:.2f}",
                " / ".join(f"{v:.0f}" for v in s["rss_mib"]),
                " / ".join(f"{v:.1f}" for v in s["state_mib"])
                + (f" (+{extra:.0f} buffers)" if extra > 0 else ""),
                "" if s["comm_mib_per_step"] is None else f"{s['comm_mib_per_step']:.1f}",
                f"{s['setup_s']:.1f}",
                f"{s['first_loss']:.5f} → {s['final_loss']:.5f}",
                s["note"],
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(report: dict, path: str) -> None:
    """One row per shape: step time as a multiple of DDP's, and rank 0's peak RSS and
    model-state bytes, per system (systems that did not run are left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = report["shapes"]
    fig, axes = plt.subplots(len(shapes), 2, figsize=(12, 4.2 * len(shapes)), squeeze=False)
    for row, data in zip(axes, shapes.values(), strict=True):
        ok = {n: s for n, s in data["summary"].items() if s["status"].startswith("ok")}
        names = list(ok)
        ratio = [ok[n]["ratio_to_ddp"] or math.nan for n in names]
        colors = ["tab:blue" if n.startswith("zeroshard") else "tab:gray" for n in names]
        row[0].barh(names, ratio, color=colors)
        row[0].axvline(1.0, color="k", lw=0.8)
        row[0].set_xlabel("step time / DDP's (median of rounds)")
        row[0].set_title(f"{data['spec']['desc']}: GPT {data['spec']['model']}")
        rss = [ok[n]["rss_mib"][0] for n in names]
        state = [ok[n]["state_mib"][0] for n in names]
        y = range(len(names))
        row[1].barh([i + 0.2 for i in y], rss, height=0.4, label="peak RSS, rank 0")
        row[1].barh([i - 0.2 for i in y], state, height=0.4, label="model state, rank 0")
        row[1].set_yticks(list(y), names)
        row[1].set_xlabel("MiB")
        row[1].legend(loc="lower right")
        for ax in row:
            ax.invert_yaxis()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


RESULTS_HEADER = """# Benchmark results

Each section is one run of a script in `benchmarks/`, with the exact command that made
it. Compare numbers only within one section (one run, interleaved); across sections the
machine's load differs.

`bench_train.py` columns: *step* is the median over rounds of each run's median step
time (slowest rank), with the range over rounds; *× DDP* is the median over rounds of
step time / DDP's step time in the same round; *peak RSS* is `ru_maxrss` of each rank's
own fresh process; *model state* is params + grads + optimizer state held on that rank
(zeroshard: `engine.memory_stats()`; others: distinct tensor storages reachable from the
parameters, their grads and the optimizer object), measured after the last backward;
"(+N buffers)" is communication staging buffers a system allocates besides that
(DeepSpeed stage 3's reduce bucket, `reduce_bucket_size` elements, mostly untouched
pages, so not in RSS); *comm/step* is zeroshard's ledger (all-reduce counted 2×);
*init* is the seconds to build the model, wrap it and make the optimizer (slowest rank;
DeepSpeed's includes `import deepspeed`); *loss* is rank 0's loss at the first and the
last step: equal first losses mean equal init and data, close last losses mean the
same update rule.
"""


def record(path: str, text: str) -> None:
    new = not os.path.exists(path)
    with open(path, "a") as f:
        f.write((RESULTS_HEADER if new else "") + "\n" + text + "\n")


# -- main -----------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", choices=["compute", "state", "both"], default="both")
    p.add_argument(
        "--systems",
        default=",".join(ALL_SYSTEMS),
        help=f"comma-separated subset of: {','.join(ALL_SYSTEMS)}",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--steps", type=int, default=None, help="timed steps (default: 5 compute, 6 state)"
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--model", default=None, help="override the shape's GPT preset (e.g. tiny)")
    p.add_argument("--seq", type=int, default=None, help="override the shape's sequence length")
    p.add_argument("--micro-batch", type=int, default=None, help="override the shape's micro-batch")
    p.add_argument(
        "--bucket",
        type=float,
        default=None,
        help="reduce/all-gather bucket elements for zeroshard and DeepSpeed, DDP's buckets "
        "the same size in bytes (default: each system's own default)",
    )
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--ds-python",
        default=os.path.join(ROOT, ".venv-bench", "bin", "python"),
        help="interpreter with deepspeed installed (default .venv-bench)",
    )
    p.add_argument(
        "--ds-optimizer",
        choices=["deepspeed", "torch"],
        default="deepspeed",
        help="DeepSpeed's own AdamW from its config (CPU: its JIT-built FusedAdam; falls back to "
        "torch's if the build fails) or torch's fused AdamW via torch_adam",
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per run")
    p.add_argument("--json", default=None, help="write full results as JSON here")
    p.add_argument("--png", default=None, help="draw step time (x DDP) and memory per system here")
    p.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    p.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CI: GPT tiny, zeroshard stage 3 against DDP, 1 step; chart and JSON to a temp dir",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.systems, args.rounds, args.steps, args.warmup = (
            "compute",
            "zeroshard-s3,ddp",
            1,
            1,
            1,
        )
        args.model, args.seq, args.micro_batch, args.no_record = "tiny", 16, 1, True
        tmp = tempfile.mkdtemp(prefix="zs-smoke-train-")
        args.json, args.png = os.path.join(tmp, "train.json"), os.path.join(tmp, "train.png")
        print(
            "smoke: DeepSpeed systems skipped: they run from .venv-bench, which CI does not build"
        )
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in ALL_SYSTEMS]
    if unknown:
        p.error(f"unknown system(s): {', '.join(unknown)}")
    return args


def shape_spec(args, shape: str) -> dict:
    desc, model, seq, mb, steps = SHAPES[shape]
    return {
        "shape": shape,
        "desc": desc,
        "model": args.model or model,
        "seq": args.seq or seq,
        "micro_batch": args.micro_batch or mb,
        "steps": args.steps or steps,
        "warmup": args.warmup,
        "world": args.world,
        "seed": args.seed,
        "bucket": args.bucket,
        "ds_optimizer": args.ds_optimizer,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    command = shlex.join(
        [
            os.path.relpath(sys.executable, ROOT)
            if sys.executable.startswith(ROOT)
            else sys.executable,
            "benchmarks/bench_train.py",
            *(argv or sys.argv[1:]),
        ]
    )
    shapes = ["compute", "state"] if args.shape == "both" else [args.shape]
    ds = deepspeed_version(args.ds_python) if any(s in DEEPSPEED for s in args.systems) else None
    info = machine(ds)
    started = datetime.datetime.now()
    print(f"# {command}\n# {info}", flush=True)
    runs: dict[str, dict[str, list[dict]]] = {s: {n: [] for n in args.systems} for s in shapes}
    for rnd in range(args.rounds):
        k = rnd * len(args.systems) // args.rounds  # rotate by 1/rounds of the list
        order = args.systems[k:] + args.systems[:k]
        for shape in shapes:
            base = shape_spec(args, shape)
            for name in order:
                if name in DEEPSPEED and ds is None:
                    res: dict[str, Any] = {
                        "status": "not installed",
                        "reason": f"no deepspeed in {args.ds_python}",
                    }
                else:
                    python = args.ds_python if name in DEEPSPEED else sys.executable
                    t0 = time.monotonic()
                    res = run_once({**base, "system": name}, python, args.timeout)
                    res["wall_s"] = time.monotonic() - t0
                runs[shape][name].append(res)
                brief = (
                    f"{per_run(res)['step_s']:.3f} s/step"
                    if res["status"] == "ok"
                    else f"{res['status']}: {res.get('reason', '')}"
                )
                print(
                    f"  round {rnd + 1}/{args.rounds} {shape:7s} {name:16s} {brief}"
                    f"  ({res.get('wall_s', 0):.0f} s wall)",
                    flush=True,
                )
                if res["status"] == "error":
                    print("    " + "\n    ".join(res.get("log_tail", [])), flush=True)
    elapsed = (datetime.datetime.now() - started).total_seconds()
    out = [
        f"## {started:%Y-%m-%d %H:%M} bench_train: {info['cores']} cores, {info['ram_gib']} GiB RAM, "
        f"torch {info['torch']}, DeepSpeed {info['deepspeed']}",
        "",
        f"`{command}`",
        "",
        f"{info['cpu']}; Python {info['python']}; {args.world} ranks (gloo, 1 thread each), fp32; "
        f"{args.rounds} round(s), {elapsed / 60:.1f} min in all.",
        "",
    ]
    report: dict[str, Any] = {
        "machine": info,
        "command": command,
        "started": started.isoformat(),
        "shapes": {},
    }
    for shape in shapes:
        spec = shape_spec(args, shape)
        summary = summarize(runs[shape])
        out += [
            f"### {spec['desc']}: GPT {spec['model']}, seq {spec['seq']}, micro-batch "
            f"{spec['micro_batch']}, {spec['steps']} timed steps after {spec['warmup']} warmup",
            "",
            table(summary),
            "",
        ]
        report["shapes"][shape] = {"spec": spec, "summary": summary, "runs": runs[shape]}
    text = "\n".join(out)
    print("\n" + text)
    if not args.no_record:
        record(args.results, text)
        print(f"appended to {os.path.relpath(args.results, ROOT)}")
    if args.png:
        chart(report, args.png)
        print(f"chart: {args.png}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
