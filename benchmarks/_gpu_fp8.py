"""``make gpu-check``'s fp8 section (issue 33): bf16 against fp8 matmuls, in at most
``BUDGET_S`` seconds on one GPU, start-up and compilation included. ``gpu_check.py``
calls :func:`section`; it never raises and reports a part it could not run as a failed
row with the reason.

1. The matmul at Llama-3-8B's MLP shape (16384 x 4096 @ 4096 x 14336) through
   ``torch._scaled_mm``: bf16, fp8 with one scale per tensor and with one scale per row
   (no torchao needed), and what a dynamic cast of the activation written plainly (amax,
   scale, cast: the eager path) costs next to it.
2. Training steps of zeroshard's GPT at d_model 4096 (Llama-3-8B's width: 32 heads, GELU
   MLP 4 x 4096), 2 layers, seq 2048, micro-batch 4, on the bytes of Python's standard
   library (``stdlib_gpt.py``: the loss means something), the same batches for every row:
   bf16, fp8 tensorwise and fp8 rowwise (the config's ``fp8`` section: torchao's
   ``Float8Linear``) at ZeRO stage 2, compiled (``engine.compile()``: inductor fuses
   torchao's amax/scale/cast into neighbouring kernels) and eager (each cast is kernels
   of its own, which is where most of fp8's gain goes), and stage 3 eager
   (``engine.compile()`` is not built at stage 3), bf16 weights gathered and then cast,
   or (``fp8.enable_fsdp_float8_all_gather``) cast before an all-gather of 1 byte per
   element. On one GPU that gather is a local copy: the row measures what the cast before
   it costs, not the bytes it saves between GPUs (benchmarks/bench_fp8_gather.py counts
   those on 2 ranks; not yet measured on a GPU). Step time (median of the steps after
   the warm-up, which holds compilation), MFU against the bf16 peak, the loss after the
   last steps against bf16's.

Rows run in ``ORDER`` (bf16 and fp8 tensorwise eager, then the issue's comparison:
compiled bf16 against compiled fp8 tensorwise) in one child process (one CUDA start-up),
each started only if the time it needs is left (the compiled pair whenever a few steps
fit); the child prints each result as it finishes, so a part cut off by the cap is named
and the ones before it are kept. torchao: imported if installed, otherwise from a
carried wheel (``.whl/**/torchao-0.18.0-*.whl``: ``pip install --no-deps --no-index
--target`` a temporary directory, else the wheel itself on the child's path; nothing
else touched); without either, the fp8 training rows fail naming it and the rest runs.
``--smoke`` (CPU, tiny GPT, ``aot_eager``) runs every part in this process.

    python benchmarks/_gpu_fp8.py [--smoke]      # the section alone, its table printed
"""

from __future__ import annotations

import argparse
import gc
import glob
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BUDGET_S = 45.0  # the whole section on an H200: start-up, compilation, every row
TORCHAO = "0.18.0"  # the version the wheel must be (zeroshard[fp8]: torchao >= 0.18)

MM_SHAPE = (16384, 4096, 14336)  # Llama-3-8B's MLP up-projection: tokens x d @ d x ffn
GPT_SHAPE: dict[str, Any] = {"d_model": 4096, "n_head": 32, "n_layer": 2, "mlp_ratio": 4}
SMOKE_SHAPE: dict[str, Any] = {"d_model": 64, "n_head": 4, "n_layer": 2, "mlp_ratio": 4}
SEQ, MICRO, VOCAB = 2048, 4, 256
STEPS, WARMUP, LOSS_TAIL = 12, 4, 4
EAGER_NEED_S = 6.0  # a row is started only with this much left (build + 12 steps)
COMPILE_NEED_S = 14.0  # the first compiled row (inductor's cold start); later ones: measured
RECIPES = ("tensorwise", "rowwise")


# (stage, compiled, precision) in the order they run: bf16 and fp8 eager (seconds: some
# fp8 training numbers even if compilation turns out slow), the comparison
# (compiled, where the casts fuse), then rowwise, stage 3
ORDER = [
    (2, False, "bf16"), (2, False, "fp8 tensorwise"),
    (2, True, "bf16"), (2, True, "fp8 tensorwise"),
    (2, False, "fp8 rowwise"), (2, True, "fp8 rowwise"),
    (3, False, "bf16"), (3, False, "fp8 tensorwise"),
    (3, False, "fp8 tensorwise, fp8 all-gather"),
]  # fmt: skip
HEADLINE = {"stage 2, compiled, bf16", "stage 2, compiled, fp8 tensorwise"}


def rows() -> list[dict[str, Any]]:
    """The training rows, in the order they run."""
    out = []
    for stage, compiled, precision in ORDER:
        how = "compiled" if compiled else "eager"
        out.append({"name": f"stage {stage}, {how}, {precision}", "stage": stage,
                    "compiled": compiled, "precision": precision})  # fmt: skip
    return out


class _OverCap(Exception):
    """The section's time cap ran out inside a row."""


# -- the child's parts ----------------------------------------------------------------------
def _timed(fn: Callable[[], Any], dev: torch.device, iters: int) -> float:
    """Seconds per call of ``fn`` (CUDA events on a GPU), after 3 warm-up calls."""
    for _ in range(3):
        fn()
    if dev.type != "cuda":
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t) / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def matmul_part(dev: torch.device, smoke: bool) -> dict[str, Any]:
    """bf16 / fp8 tensorwise / fp8 rowwise matmul seconds at MM_SHAPE, and the plain cast."""
    m, k, n = (64, 64, 64) if smoke else MM_SHAPE
    iters = 2 if smoke else 20
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen)
    e4m3 = torch.float8_e4m3fn
    a8, b8 = a.to(e4m3), b.to(e4m3)  # |randn| < 448: no scaling needed for timing
    one = torch.ones((), device=dev)
    row_a, row_b = torch.ones(m, 1, device=dev), torch.ones(1, n, device=dev)
    top = torch.finfo(e4m3).max

    def cast() -> torch.Tensor:  # torchao's eager dynamic cast, as scaled_mm.py writes it
        scale = top / torch.clamp(a.abs().max().double(), min=1e-12).float()
        return (a.float() * scale).clamp(-top, top).to(e4m3)

    calls: dict[str, Callable[[], Any]] = {
        "bf16": lambda: torch.mm(a, b.t()),
        "fp8 tensorwise": lambda: torch._scaled_mm(
            a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True
        ),
        "fp8 rowwise": lambda: torch._scaled_mm(
            a8, b8.t(), scale_a=row_a, scale_b=row_b, out_dtype=torch.bfloat16, use_fast_accum=True
        ),
        "eager cast of the activation (amax, scale, cast)": cast,
    }
    out: dict[str, Any] = {"shape": [m, k, n], "flops": 2 * m * k * n, "s": {}, "why": {}}
    for name, fn in calls.items():
        try:
            out["s"][name] = _timed(fn, dev, iters)
        except Exception as exc:  # a kernel this card/build lacks: named in the table
            out["why"][name] = f"{type(exc).__name__}: {str(exc)[:160]}"
    return out


def _batches(dev: torch.device, smoke: bool, seq: int, micro: int) -> list[tuple]:
    import stdlib_gpt

    try:
        data = stdlib_gpt.corpus("train", limit=200_000 if smoke else 2_000_000)
    except Exception:  # no standard library sources here: random bytes (the loss says less)
        data = torch.randint(0, VOCAB, (2_000_000,), generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(0)
    it = stdlib_gpt.batches(data, micro, seq, gen)
    return [tuple(t.to(dev) for t in next(it)) for _ in range(3 if smoke else STEPS)]


def train_row(row: dict, dev: torch.device, smoke: bool, batches: list, deadline: float) -> dict:
    """One training row: build, (compile in the warm-up), STEPS steps on ``batches``."""
    import zeroshard
    from zeroshard.models import GPT, GPTConfig

    seq, micro = batches[0][0].shape[1], batches[0][0].shape[0]
    warmup = 1 if smoke else WARMUP
    cfg = GPTConfig(vocab_size=VOCAB, seq_len=seq, **(SMOKE_SHAPE if smoke else GPT_SHAPE))
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(dev):  # built in place: no host copy of the weights
        model = GPT(cfg)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
        "zero_optimization": {"stage": row["stage"]},
        "steps_per_print": 10**9,
    }
    if row["precision"].startswith("fp8"):
        recipe = row["precision"].split()[1].rstrip(",")
        config["fp8"] = {"enabled": True, "recipe_name": recipe}
        if row["precision"].endswith("fp8 all-gather"):  # fp8.enable_fsdp_float8_all_gather
            config["fp8"]["enable_fsdp_float8_all_gather"] = True
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)  # fmt: skip
    try:
        if row["compiled"]:
            torch._dynamo.reset()
            engine.compile(backend="inductor" if dev.type == "cuda" else "aot_eager")
        build = time.perf_counter() - t0
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times, losses = [], []
        t_warm = time.perf_counter()
        for i, (x, y) in enumerate(batches):
            if time.time() > deadline:
                raise _OverCap(f"over the section's {BUDGET_S:.0f} s cap after {i} steps")
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))  # waits for the step's kernels
            if i >= warmup:
                times.append(time.perf_counter() - t)
            if i == warmup - 1:
                warm = time.perf_counter() - t_warm
    finally:
        engine.destroy()
    n = cfg.num_params()
    tokens = micro * seq
    sec = statistics.median(times)
    return {
        "step_s": sec,
        "tokens_s": tokens / sec,
        "flops_s": (6 * n + 12 * cfg.n_layer * cfg.d_model * seq) * tokens / sec,
        "build_s": build,
        "warmup_s": warm,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0,
        "loss_first": losses[0],
        "loss_end": statistics.fmean(losses[-LOSS_TAIL:]),
    }


def run_parts(smoke: bool, deadline: float, emit: Callable[[dict], None]) -> None:
    """Every part in this process, in order, each result handed to ``emit`` as it ends."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        import torchao

        version = torchao.__version__
    except ImportError:
        version = None
    emit({"part": "torchao", "ok": version is not None, "version": version})
    try:
        emit({"part": "matmul", "ok": True, "result": matmul_part(dev, smoke)})
    except Exception as exc:
        emit({"part": "matmul", "ok": False, "why": f"{type(exc).__name__}: {exc}"})
    seq, micro = (32, 2) if smoke else (SEQ, MICRO)
    batches = _batches(dev, smoke, seq, micro)
    compile_need = COMPILE_NEED_S
    for row in rows():
        left = deadline - time.time()
        need = compile_need if row["compiled"] else EAGER_NEED_S
        if row["name"] in HEADLINE:  # tried whenever a few steps fit: the cap cuts it at worst
            need = min(need, EAGER_NEED_S)
        if smoke and version is None and row["precision"].startswith("fp8"):  # CI without it
            emit({"part": row["name"], "ok": False, "why": "not run: torchao is not installed"})  # fmt: skip
            continue
        if smoke and row["compiled"] and row["precision"] != "fp8 tensorwise":
            emit({"part": row["name"], "ok": False, "why": "not run: --smoke compiles one row (aot_eager)"})  # fmt: skip
            continue
        if left < need and not smoke:
            emit({"part": row["name"], "ok": False, "why": f"not run: {left:.0f} s of the {BUDGET_S:.0f} s cap left, it needs ~{need:.0f} s"})  # fmt: skip
            continue
        try:
            res = train_row(row, dev, smoke, batches, deadline if not smoke else float("inf"))
            emit({"part": row["name"], "ok": True, "result": res})
            if row["compiled"]:  # the next compile: as long as this one's warm-up, and slack
                compile_need = res["build_s"] + res["warmup_s"] + EAGER_NEED_S
        except Exception as exc:  # the row fails, the section goes on
            emit({"part": row["name"], "ok": False, "why": f"{type(exc).__name__}: {str(exc)[:240]}"})  # fmt: skip
        finally:
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()


# -- the parent: torchao, the child, the table ----------------------------------------------
def _torchao_path(deadline: float) -> tuple[str | None, str]:
    """A directory to put on the child's path holding torchao (None: importable already,
    or no wheel), and a note on where torchao comes from."""
    if importlib.util.find_spec("torchao") is not None:
        return None, "installed"
    found = sorted(glob.glob(os.path.join(ROOT, ".whl", "**", f"torchao-{TORCHAO}-*.whl"), recursive=True))  # fmt: skip
    if not found:
        return None, f"not installed and no .whl/**/torchao-{TORCHAO}-*.whl to install"
    wheel, name = found[0], os.path.basename(found[0])
    target = tempfile.mkdtemp(prefix="zs-torchao-")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
           "--disable-pip-version-check", "--target", target, wheel]  # fmt: skip
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=min(10, max(deadline - time.time() - 35, 1)))  # fmt: skip
        why = (run.stderr.strip().splitlines() or ["?"])[-1][:120] if run.returncode else ""
    except subprocess.TimeoutExpired:
        why = "pip took too long"
    if not why:
        return (
            target,
            f"pip-installed from {os.path.relpath(wheel, ROOT)} into a temporary directory",
        )
    # no pip: the wheel is a zip of pure Python but for optional kernels float8 does not use
    return wheel, f"imported from the zip {name} ({why})"


def _text(raw: bytes | str | None) -> str:
    """What a timed-out child wrote (bytes, whatever ``text=`` said)."""
    return raw.decode(errors="replace") if isinstance(raw, bytes) else raw or ""


def _spawn(deadline: float, budget_s: float) -> tuple[list[dict], str]:
    """Run the parts in a child process until ``deadline``: the parts it finished and,
    if it did not end cleanly, why."""
    extra, origin = _torchao_path(deadline)
    path = [ROOT, HERE, *([extra] if extra else []), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    cmd = [sys.executable, os.path.abspath(__file__), "_child", "--deadline", repr(deadline)]
    why, out = "", ""
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=max(deadline - time.time(), 1))  # fmt: skip
        out = run.stdout
        if run.returncode != 0:
            sys.stderr.write(run.stdout[-2000:] + run.stderr[-4000:])
            last = (run.stderr.strip().splitlines() or ["no output"])[-1]
            why = f"the child exited {run.returncode}: {last[:200]}"
    except subprocess.TimeoutExpired as exc:
        out, err = (_text(b) for b in (exc.stdout, exc.stderr))
        sys.stderr.write(f"_gpu_fp8: the child's last output before the cap:\n{err[-3000:]}\n")
        why = f"cut off at the section's {budget_s:.0f} s cap"
    parts = [json.loads(ln[5:]) for ln in out.splitlines() if ln.startswith("PART ")]
    parts.insert(0, {"part": "torchao source", "ok": True, "note": origin})
    return parts, why


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.3f} s"


def table(parts: list[dict], peak: float, how: str, why: str = "", smoke: bool = False) -> tuple[bool, str, str]:  # fmt: skip
    """(ok, a one-line note, the markdown). ok: nothing failed and the compiled stage-2
    bf16 and fp8 tensorwise rows ran (the rest may be cut by the cap: named, not failed;
    ``smoke``: whatever ran)."""
    by = {p["part"]: p for p in parts}
    ao = by.get("torchao", {})
    source = by.get("torchao source", {}).get("note", "")
    lines = []
    mm = by.get("matmul")
    if mm and mm["ok"]:
        r = mm["result"]
        m, k, n = r["shape"]
        base = r["s"].get("bf16")
        lines += [f"| matmul {m} x {k} @ {k} x {n} | time | TFLOP/s | x bf16 |", "|---|---|---|---|"]  # fmt: skip
        for name in ("bf16", "fp8 tensorwise", "fp8 rowwise", "eager cast of the activation (amax, scale, cast)"):  # fmt: skip
            if name in r["why"]:
                lines.append(f"| {name} | failed: {r['why'][name]} | | |")
            elif name in r["s"]:
                s = r["s"][name]
                tf = f"{r['flops'] / s / 1e12:,.0f}" if "cast" not in name else ""
                x = f"{base / s:.2f}" if base and "cast" not in name else (f"{s / base:.2f} of the bf16 matmul" if base else "")  # fmt: skip
                lines.append(f"| {name} | {_fmt_s(s)} | {tf} | {x} |")
    else:
        lines.append(f"matmul: failed: {mm['why'] if mm else why or 'not reached'}")
    lines += ["", "| training row | step s | tokens/s | MFU | x bf16 (same stage, mode) | build + warm-up s | GPU peak GiB | loss first -> last 4 | vs bf16 |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    verdicts, failed, ran = [], [], set()
    for row in rows():
        name = row["name"]
        p = by.get(name)
        if p is None:
            p = {"ok": False, "why": f"not reached ({why or 'no result'})"}
        if not p["ok"]:
            lines.append(f"| {name} | {'' if p['why'].startswith('not ') else 'failed: '}{p['why']} | | | | | | | |")  # fmt: skip
            if not p["why"].startswith("not "):
                failed.append(name)
            continue
        ran.add(name)
        r = p["result"]
        twin = by.get(
            f"stage {row['stage']}, {'compiled' if row['compiled'] else 'eager'}, bf16", {}
        )
        base = twin.get("result") if twin.get("ok") and "fp8" in name else None
        speed = f"{base['step_s'] / r['step_s']:.2f}" if base else ""
        dloss = r["loss_end"] / base["loss_end"] - 1 if base else None
        lines.append(
            f"| {name} | {r['step_s']:.3f} | {r['tokens_s']:,.0f} | {r['flops_s'] / peak if peak else 0:.1%} | "
            f"{speed} | {r['build_s']:.1f} + {r['warmup_s']:.1f} | {r['peak_gib']:.1f} | "
            f"{r['loss_first']:.3f} -> {r['loss_end']:.3f} | {'' if dloss is None else f'{dloss:+.2%}'} |"
        )
        if base and dloss is not None:
            fast = base["step_s"] / r["step_s"] >= 1.3
            verdicts.append(f"{name}: {base['step_s'] / r['step_s']:.2f}x bf16 ({'meets' if fast else 'MISSES'} the issue's 1.3x); loss {'within' if abs(dloss) <= 0.02 else 'NOT within'} 2% of bf16's ({dloss:+.2%})")  # fmt: skip
    shape = GPT_SHAPE
    head = (
        f"fp8 (issue 33, `benchmarks/_gpu_fp8.py`, {BUDGET_S:.0f} s cap): torchao "
        f"{ao.get('version') or ('missing' if ao else 'not reported')} ({source}). Training: zeroshard's GPT, d_model "
        f"{shape['d_model']} (Llama-3-8B's width), {shape['n_head']} heads, GELU MLP "
        f"{shape['mlp_ratio']} x d, {shape['n_layer']} layers, vocab {VOCAB} (stdlib bytes), "
        f"seq {SEQ}, micro-batch {MICRO}, bf16 compute, AdamW 3e-4, clip 1.0; {STEPS} steps "
        f"on the same batches for every row, step time the median of the last "
        f"{STEPS - WARMUP} (the first {WARMUP} hold compilation), loss the mean of the last "
        f"{LOSS_TAIL}. compiled: engine.compile() (inductor), where torchao's casts fuse; "
        f"eager pays each as kernels of its own. MFU against the {how} peak "
        f"({peak / 1e12:.0f} TFLOP/s) for every precision."
    )
    if smoke:
        head = (
            "--smoke, so none of the shapes below: GPT d_model 64 on the CPU, seq 32, 3 steps, "
            "compiled with aot_eager (the code paths, not their speed). " + head
        )
    text = head + "\n\n" + "\n".join(lines)
    if verdicts:
        text += "\n\n" + "\n".join(f"- {v}" for v in verdicts)
    if why:
        text += f"\n\nThe section's child: {why}."
    key = set() if smoke else HEADLINE
    ok = not failed and key <= ran and bool(mm and mm["ok"])
    tw = by.get("stage 2, compiled, fp8 tensorwise", {})
    bf = by.get("stage 2, compiled, bf16", {})
    if tw.get("ok") and bf.get("ok"):
        note = f"compiled stage 2: fp8 tensorwise {bf['result']['step_s'] / tw['result']['step_s']:.2f}x bf16"  # fmt: skip
    else:
        note = f"{len(failed)} row(s) failed, {len(ran)} ran" + (f"; {why}" if why else "")
    return ok, note, text


def section(smoke: bool, peak: float, how: str, budget_s: float = BUDGET_S) -> dict[str, Any]:
    """gpu_check's entry: ``{"ok", "note", "table"}``; never raises. On a GPU the parts
    run in a child process cut off at ``budget_s``; with ``smoke``, in this process."""
    deadline = time.time() + budget_s
    try:
        if smoke:
            parts: list[dict] = [{"part": "torchao source", "ok": True, "note": "this process"}]
            run_parts(True, deadline, parts.append)
            why = ""
        else:
            parts, why = _spawn(deadline, budget_s)
        ok, note, text = table(parts, peak, how, why, smoke)
        return {"ok": ok, "note": note, "table": text}
    except Exception as exc:  # never crash gpu_check: the section is one failed row
        msg = f"{type(exc).__name__}: {exc}"
        return {"ok": False, "note": msg, "table": f"fp8 (issue 33): the section failed: {msg}"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", nargs="?", default="", help=argparse.SUPPRESS)  # "_child"
    p.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny GPT, in this process")
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the section")
    args = p.parse_args()
    if args.mode == "_child":
        torch.backends.cuda.matmul.allow_tf32 = True

        def emit(part: dict) -> None:
            print("PART " + json.dumps(part), flush=True)

        run_parts(False, args.deadline, emit)
        return 0
    if not args.smoke and not torch.cuda.is_available():
        print("_gpu_fp8: no CUDA device; use --smoke on a CPU", file=sys.stderr)
        return 2
    sys.path[:0] = [ROOT, HERE]
    peak = 989e12 if torch.cuda.is_available() else 1e12
    res = section(args.smoke, peak, "spec dense bf16 (H100/H200)", args.budget)
    print(res["table"] + f"\n\nok: {res['ok']} ({res['note']})")
    return 0 if res["ok"] or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
