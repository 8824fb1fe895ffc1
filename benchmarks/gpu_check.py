"""``make gpu-check``: the CUDA path on one H100/H200, in under 8 minutes.

    python benchmarks/gpu_check.py                # on a GPU host (make gpu-check)
    python benchmarks/gpu_check.py --smoke        # CI, no GPU: every piece on CPU, tiny

1. ``pytest tests/test_cuda.py`` (parity on one and two ranks sharing the GPU, the pinned
   stream path, exact resume).
2. Training rows, one fresh process each: the GPT ``--preset`` (1B), seq 1024,
   micro-batch 8, bf16, AdamW, clip 1.0: plain torch (fp32 parameters, ``autocast``
   bf16, fused AdamW) and zeroshard stages 0-3, with step time, tokens/s and MFU
   (6 N + 12 L d s FLOPs per token against the card's dense bf16 peak); CPU optimizer
   offload at stage 2, exact and with the delayed update, as ratios to the all-GPU
   stage-2 step, at gradient accumulation 1 and 8; at accumulation 1 also ZeRO-Offload++
   Twin-Flow (``offload_optimizer.ratio``) with the ratio ``zeroshard plan`` proposes at
   stage 2 for a device that holds ``--twin-fit`` (0.85) of what the all-GPU stage-2
   step needs by the estimator (the model nearly fits); with ``--compiled-rows`` also stages 0
   and 3 with ``engine.compile()`` against their eager rows (off by default: inductor's
   compile of the 1B model has not been timed on a GPU, its rows' budget is a guess).
3. Batch-1 decode of the same GPT, ``benchmarks/_gpu_decode.py``'s section (one call:
   ``decode_rows(args)`` in a process of its own, ``decode_table`` for its lines): 128
   new tokens after a 32-token prompt, bf16, int8 and int4, each eager and captured (a
   CUDA graph per token), tokens/s against the HBM roof, and Hugging Face ``generate()``
   on the same weights. At most ~45 s; rows it had no time for, or that raised, are
   reported as failed; the rows done before a kill at its budget are kept.
4. fp8 (issue 33, ``benchmarks/_gpu_fp8.py``, capped at 45 s): bf16 against fp8 matmuls at
   Llama-3-8B's MLP shape, and training steps of a d_model 4096 GPT in bf16, fp8
   tensorwise and rowwise at stage 2 (eager and compiled) and stage 3 (with and without
   ``fp8.enable_fsdp_float8_all_gather``, the fp8 all-gather of weights); needs torchao
   (installed, or its wheel carried in ``.whl/``). Reported, not counted toward green
   until it has run on a GPU once.
5. Mixture of experts (issue 34, ``benchmarks/_gpu_moe.py``'s ``moe_section``, in a
   process of its own killed at ``MOE_BUDGET_S``): a Mixtral-shaped experts module in
   bf16 by ``torch._grouped_mm``, padded ``bmm`` and the loop, and DeepSpeed-style
   experts under ``vmap`` against their loop, forward + backward: tokens/s, x loop, the
   largest difference from the loop. Reported, not counted toward green until it has
   run on a GPU once.

It prints one table (progress per row as it goes), appends it to ``benchmarks/RESULTS.md``
with the card, torch/CUDA versions and commit, and, when every test and row passed,
writes that commit and card to ``benchmarks/GPU_LAST_GREEN.json`` (CI prints it with the
device-touching files changed since: ``benchmarks/_gpu_green.py``). ``--also-to DIR``
copies both there too. Without a CUDA device it stops at once with one line, exit 2.
Each row has a time budget (``ROW_BUDGET_S``) sized so the whole fits 8 minutes; a row
over it is killed and reported as such (the run is then not green). The rows' processes
talk to nobody but the GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import _gpu_fp8  # noqa: E402
import _gpu_green  # noqa: E402
from _gpu_decode import decode_rows, decode_table, partial_result  # noqa: E402
from _gpu_moe import moe_section  # noqa: E402

TESTS_BUDGET_S = 210  # tests/test_cuda.py
ROW_BUDGET_S = 40  # each training row's process (1B: ~15 s start + build, timed steps)
COMPILE_ROW_BUDGET_S = 120  # --compiled-rows: inductor's compile in the warm-up (a guess)
DECODE_BUDGET_S = 60  # the section caps itself at ~45 s with its process's start
MOE_BUDGET_S = 60  # the MoE section's process: start, build, six ways of <= 6 s each
MOE_WAY_S = 6.0  # each way's timed calls in the MoE section
TOTAL_BUDGET_S = 480
# dense bf16 tensor-core peaks (spec sheets); other cards: the measured matmul peak
PEAK_BF16 = {"H100 80GB HBM3": 989e12, "H100 SXM": 989e12, "H200": 989e12, "H100 PCIe": 756e12}


# -- the rows -------------------------------------------------------------------------------
def planned_ratio(args) -> tuple[float, float]:
    """Twin-Flow's ratio as ``zeroshard plan`` chooses it (its smallest ratio that fits,
    ``tools/plan.smallest_ratio``) for the GPT preset at stage 2, bf16, on one device
    holding ``args.twin_fit`` of the all-GPU stage-2 step's estimated bytes; and those
    bytes in GiB. 1.0 (plain offload) when no ratio below 1 fits."""
    from zeroshard.monitor.memory import estimate
    from zeroshard.tools.estimate import activations, facts_from_args
    from zeroshard.tools.plan import smallest_ratio

    ns = argparse.Namespace(model=args.preset, params=None, seq=args.seq, micro_batch=args.micro, checkpointing="none", tp=1, sp=1, megatron_sp=False)  # fmt: skip
    facts = facts_from_args(ns)
    act, _ = activations(facts, ns, "bf16")

    def at(offload: str, ratio: float = 1.0):
        return estimate(facts["params"], 1, stage=2, precision="bf16", offload=offload, bucket_numel=args.bucket, activations=act, offload_ratio=ratio)  # fmt: skip

    room = args.twin_fit * at("none").device
    twin = smallest_ratio(lambda r: at("cpu", r), int(room))
    return (twin.offload_ratio if twin is not None else 1.0), room / 2**30


def rows(gas_big: int, compiled: bool = False, twin: tuple[float, float] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Every training row: name, system, stage, offload, delayed, accumulation; ``twin``:
    the Twin-Flow row's ratio and the device GiB the plan was given."""
    out: list[dict[str, Any]] = [{"name": "torch (autocast + fused AdamW)", "system": "torch", "gas": 1}]  # fmt: skip
    out += [{"name": f"zeroshard stage {s}", "system": "zeroshard", "stage": s, "gas": 1} for s in range(4)]  # fmt: skip
    # engine.compile() (inductor; stage 3: one compiled region per block), against the eager rows
    if compiled:
        out += [{"name": f"zeroshard stage {s}, compiled", "system": "zeroshard", "stage": s, "gas": 1, "compile": True} for s in (0, 3)]  # fmt: skip
    for gas in (1, gas_big):
        if gas != 1:
            out.append({"name": f"stage 2, gas {gas}", "system": "zeroshard", "stage": 2, "gas": gas})  # fmt: skip
        out.append({"name": f"stage 2 + CPU offload, gas {gas}", "system": "zeroshard", "stage": 2, "offload": True, "gas": gas})  # fmt: skip
        out.append({"name": f"stage 2 + CPU offload, delayed, gas {gas}", "system": "zeroshard", "stage": 2, "offload": True, "delayed": True, "gas": gas})  # fmt: skip
        if gas == 1 and twin is not None:
            ratio, room = twin
            out.append({"name": f"stage 2 + CPU offload, Twin-Flow ratio {ratio:g} (plan for {room:.1f} GiB), gas 1", "system": "zeroshard", "stage": 2, "offload": True, "ratio": ratio, "gas": 1})  # fmt: skip
    return out


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _step_fn(row: dict, model, args, dev: torch.device):
    """A function that runs one optimizer step (``gas`` micro-batches) and returns the
    last micro-batch's loss and the seconds until every forward and backward was done
    (the device synchronized there: the rest of the step is the optimizer's)."""
    gas = row["gas"]
    if row["system"] == "torch":
        model.to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)

        def torch_step(batches) -> tuple[torch.Tensor, float]:
            t = time.perf_counter()
            for x, y in batches:
                with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
                    loss = model(x, y)
                (loss / gas).backward()
            _sync(dev)
            fwd_bwd = time.perf_counter() - t
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss, fwd_bwd

        return torch_step
    import zeroshard

    zero: dict[str, Any] = {
        "stage": row["stage"],
        "reduce_bucket_size": args.bucket,
        "allgather_bucket_size": args.bucket,
    }
    if row.get("offload"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": dev.type == "cuda"}
        if row.get("delayed"):
            zero["offload_optimizer"] |= {"delayed_update": True, "delayed_update_after": 0}
        if row.get("ratio") is not None:  # Twin-Flow
            zero["offload_optimizer"]["ratio"] = row["ratio"]
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if row.get("compile"):
        engine.compile(backend=args.compile_backend)  # compiles during the warm-up steps

    def zeroshard_step(batches) -> tuple[torch.Tensor, float]:
        t = time.perf_counter()
        for i, (x, y) in enumerate(batches):
            loss = engine(x, y)
            engine.backward(loss)
            if i == len(batches) - 1:  # the boundary: what follows is the optimizer's
                _sync(dev)
                fwd_bwd = time.perf_counter() - t
            engine.step()  # steps at the accumulation boundary
        return loss, fwd_bwd

    return zeroshard_step


def train_row(row: dict, args) -> dict:
    """Time ``row`` (one process): median step seconds over the timed steps, and more."""
    from bench_offload_gpu import _batch

    from zeroshard.models import GPT, GPTConfig

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = GPTConfig.preset(args.preset, vocab_size=args.vocab, seq_len=args.seq)
    t0 = time.perf_counter()
    with torch.device(dev):  # built in place: no host copy of the weights
        model = GPT(cfg)
    step = _step_fn(row, model, args, dev)
    setup = time.perf_counter() - t0
    warmup, steps = (args.warmup, args.steps) if row["gas"] == 1 else (1, args.steps_big)
    times, fwd_bwd, losses = [], [], []
    for i in range(warmup + steps):
        batches = [_batch(i * row["gas"] + j, args.micro, args.seq, args.vocab, dev) for j in range(row["gas"])]  # fmt: skip
        _sync(dev)
        t = time.perf_counter()
        loss, fb = step(batches)
        _sync(dev)
        if i >= warmup:
            times.append(time.perf_counter() - t)
            fwd_bwd.append(fb)
        losses.append(float(loss.detach()))
    n = cfg.num_params()
    tokens = args.micro * args.seq * row["gas"]
    sec = statistics.median(times)
    fb = statistics.median(fwd_bwd)
    flops = (6 * n + 12 * cfg.n_layer * cfg.d_model * args.seq) * tokens
    return {
        "step_s": sec,
        # every forward and backward of the step, and the rest (the optimizer's part:
        # with the delayed update, its wait for the last CPU step and its launch)
        "fwd_bwd_s": fb,
        "opt_s": sec - fb,
        "tokens_s": tokens / sec,
        "flops_s": flops / sec,
        "params": n,
        "setup_s": setup,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0,
        "losses": [losses[0], losses[-1]],
    }


# -- the driver -----------------------------------------------------------------------------
def _section(kind: str, spec: dict, args) -> dict:
    """What a child process of ``kind`` (train / decode / moe) computes."""
    if kind == "train":
        return train_row(spec, args)
    if kind == "moe":
        return {"table": moe_section(args.smoke, MOE_WAY_S)}
    return decode_rows(args)


def _child(kind: str, spec: dict, args, argv: list[str], budget: float) -> dict:
    """Run ``kind`` (train / decode / moe) in a fresh process (in this one with --smoke)."""
    if args.smoke:
        try:
            res = _section(kind, spec, args)
            return {"ok": True, "result": res}
        except Exception as exc:  # a failed row is reported in the table, the run goes on
            return {"ok": False, "why": f"{type(exc).__name__}: {exc}"}
    cmd = [sys.executable, os.path.abspath(__file__), "_child", kind, json.dumps(spec), *argv]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=budget)
    except subprocess.TimeoutExpired as exc:
        why = f"over its {budget:.0f} s budget"
        if kind == "decode":  # the rows it finished before the kill
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
            return {"ok": False, "why": why, "result": partial_result(out, why, args)}
        return {"ok": False, "why": why}
    for line in run.stdout.splitlines():
        if line.startswith("RESULT "):
            return {"ok": True, "result": json.loads(line[7:])}
    sys.stderr.write(run.stdout[-2000:] + run.stderr[-4000:])
    last = (run.stderr.strip().splitlines() or ["no output"])[-1]
    why = f"exit {run.returncode}: {last[:200]}"
    if kind == "decode":  # the rows it finished before it died
        return {"ok": False, "why": why, "result": partial_result(run.stdout, why, args)}
    return {"ok": False, "why": why}


def run_tests(args) -> tuple[bool, str]:
    """``pytest tests/test_cuda.py``: (passed, its summary line)."""
    if args.skip_tests:
        return False, "not run (--skip-tests)"
    cmd = [sys.executable, "-m", "pytest", "tests/test_cuda.py", "-p", "no:cacheprovider"]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=TESTS_BUDGET_S)  # fmt: skip
    except subprocess.TimeoutExpired:
        return False, f"over its {TESTS_BUDGET_S} s budget"
    lines = [ln for ln in run.stdout.strip().splitlines() if ln.strip()]
    summary = lines[-1].strip("= ") if lines else f"exit {run.returncode}, no output"
    if run.returncode != 0:
        sys.stderr.write(run.stdout[-6000:] + run.stderr[-2000:])
    # on a CPU-only host (--smoke) every test skips: that is not a GPU pass
    passed = run.returncode == 0 and "passed" in summary and "skipped" not in summary
    return passed, summary


def peak(dev_name: str) -> tuple[float, str]:
    for key, value in PEAK_BF16.items():
        if key in dev_name:
            return value, "spec dense bf16"
    from zeroshard.monitor.flops import peak_flops

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return peak_flops(dev, "bf16"), "measured matmul"


def table(results: dict[str, dict], decode: dict, args, card: str) -> str:
    by = {r: v["result"] for r, v in results.items() if v["ok"]}
    torch_s = by.get("torch (autocast + fused AdamW)", {}).get("step_s")
    top, how = peak(card)
    lines = [
        "| row | step s | fwd+bwd s | step() s | tokens/s | MFU | x torch | x all-GPU (stage 2, same gas) | fwd+bwd x all-GPU | compiled vs eager | GPU peak GiB | loss first -> last |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, v in results.items():
        if not v["ok"]:
            lines.append(f"| {name} | failed: {v['why']} | | | | | | | | | | |")
            continue
        r = v["result"]
        gas = name.rsplit("gas ", 1)[1] if "gas " in name else "1"
        ref = by.get("zeroshard stage 2" if gas == "1" else f"stage 2, gas {gas}", {})
        base, base_fb = ref.get("step_s"), ref.get("fwd_bwd_s")
        x_torch = f"{r['step_s'] / torch_s:.2f}" if torch_s and gas == "1" else ""
        x_gpu = f"{r['step_s'] / base:.2f}" if base and "offload" in name else ""
        x_fb = f"{r['fwd_bwd_s'] / base_fb:.2f}" if base_fb and "offload" in name else ""
        eager = by.get(name.removesuffix(", compiled"), {}).get("step_s")
        x_eager = f"{eager / r['step_s']:.2f}x faster" if eager and name.endswith("compiled") else ""  # fmt: skip
        lines.append(
            f"| {name} | {r['step_s']:.3f} | {r['fwd_bwd_s']:.3f} | {r['opt_s']:.3f} | "
            f"{r['tokens_s']:,.0f} | {r['flops_s'] / top:.1%} | {x_torch} | {x_gpu} | {x_fb} | {x_eager} | "
            f"{r['peak_gib']:.1f} | {r['losses'][0]:.3f} -> {r['losses'][1]:.3f} |"
        )
    lines.append("")
    if "result" in decode:
        lines += decode_table(decode["result"], card)
    else:
        lines += ["| decode | failed |", "|---|---|", f"| all | {decode['why']} |"]
    head = (
        f"GPT {args.preset}, vocab {args.vocab}, seq {args.seq}, micro-batch {args.micro}, bf16, "
        f"AdamW, clip 1.0, bucket {args.bucket:,}; {args.steps} timed steps after {args.warmup} "
        f"warm-up at gas 1, {args.steps_big} after 1 at gas {args.gas}; MFU against the "
        f"{how} peak ({top / 1e12:.0f} TFLOP/s); fwd+bwd: every forward and backward of a "
        "step, the device synchronized after the last; step(): the rest of the step. "
        f"Decode: GPT {args.decode_preset}, a 32-token prompt, {args.new} new tokens."
    )
    return head + "\n\n" + "\n".join(lines)


def moe_part(run: dict) -> dict[str, Any]:
    """The MoE section's ``{"ok", "note", "table"}`` from its child's result: ok when
    every way gave a row; a killed or crashed child is one failed line."""
    if not run["ok"]:
        why = run["why"]
        return {"ok": False, "note": why, "table": f"MoE experts (issue 34): the section failed: {why}"}  # fmt: skip
    text = run["result"]["table"]
    failed = [ln.split(" | ")[0][2:] for ln in text.splitlines() if "| failed" in ln]
    note = f"failed: {', '.join(failed)}" if failed else "every way ran"
    return {"ok": not failed, "note": note, "table": f"MoE (issue 34, `benchmarks/_gpu_moe.py`, {MOE_BUDGET_S} s cap): {text}"}  # fmt: skip


def _commit(given: str | None) -> str:
    if given:
        return given
    head = _gpu_green._git("rev-parse", "HEAD")
    if head is None:
        return "unknown"
    dirty = _gpu_green._git("status", "--porcelain", "--untracked-files=no")
    return head + ("+dirty" if dirty else "")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="1B")
    p.add_argument("--decode-preset", default="1B")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--gas", type=int, default=8, help="the large gradient accumulation")
    p.add_argument("--bucket", type=int, default=50_000_000)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--steps-big", type=int, default=2, help="timed steps at --gas")
    p.add_argument("--twin-fit", type=float, default=0.85, help="the Twin-Flow row: the share of the all-GPU stage-2 step's estimated device bytes the plan is given")  # fmt: skip
    p.add_argument("--new", type=int, default=128, help="decode: new tokens")
    p.add_argument("--compiled-rows", action="store_true", help="training rows with engine.compile()")  # fmt: skip
    p.add_argument("--compile-backend", default="inductor", help="the compiled training rows'")
    p.add_argument("--decode-compile", action="store_true", help="decode rows with engine.compile() (not timed on a GPU yet)")  # fmt: skip
    p.add_argument("--commit", default=None, help="the commit to record (default: git's HEAD)")
    p.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    p.add_argument("--green", default=_gpu_green.GREEN)
    p.add_argument("--also-to", default=None, help="copy the table and the green record here")
    p.add_argument("--skip-tests", action="store_true", help="rows only (never green)")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CI, no GPU: GPT tiny on the CPU, every row in this process; RESULTS.md and "
        "the green record go to a temporary directory",
    )
    return p


def main() -> int:
    if len(sys.argv) > 3 and sys.argv[1] == "_child":
        kind, spec, args = sys.argv[2], json.loads(sys.argv[3]), _parser().parse_args(sys.argv[4:])
        res = _section(kind, spec, args)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    argv = sys.argv[1:]
    args = _parser().parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA device (torch {torch.__version__}, CUDA {torch.version.cuda}): "
            "run it on a host with an NVIDIA GPU and a CUDA build of torch",
            file=sys.stderr,
        )
        return 2
    if args.smoke:
        tmp = tempfile.mkdtemp(prefix="zs-smoke-gpu-check-")
        args.results, args.green = os.path.join(tmp, "RESULTS.md"), os.path.join(tmp, "green.json")
        args.preset, args.decode_preset = "tiny", "small"  # d 128: int4's group of 128 fits
        args.vocab, args.seq, args.micro, args.gas, args.bucket = 256, 16, 2, 2, 4096
        args.warmup, args.steps, args.steps_big, args.new = 1, 1, 1, 4
        args.compile_backend = "aot_eager"  # no C++ compiler wait on the CPU
        args.compiled_rows = args.decode_compile = True  # every code path, tiny
        if not torch.cuda.is_available():
            os.environ["ZEROSHARD_STAGE_ON_CPU"] = "1"  # offload rows: the GPU code path
    child_argv = [a for a in argv if a != "--smoke"]
    start = time.perf_counter()
    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (smoke)"
    cuda = torch.version.cuda or "none"
    print(f"gpu-check on {card}, torch {torch.__version__}, CUDA {cuda}", flush=True)

    def progress(what: str, ok: bool, note: str) -> None:
        mark = "ok" if ok else "FAILED"
        print(f"[{time.perf_counter() - start:5.0f} s] {what}: {mark} {note}", flush=True)

    tests_ok, summary = run_tests(args)
    progress("tests/test_cuda.py", tests_ok, summary)
    results: dict[str, dict] = {}
    for row in rows(args.gas, args.compiled_rows, planned_ratio(args)):
        left = TOTAL_BUDGET_S - DECODE_BUDGET_S - (time.perf_counter() - start)
        if left < 10 and not args.smoke:
            results[row["name"]] = {"ok": False, "why": "not run: the 8-minute budget is spent"}
        else:
            budget = COMPILE_ROW_BUDGET_S if row.get("compile") else ROW_BUDGET_S
            results[row["name"]] = _child("train", row, args, child_argv, min(budget, max(left, 10)))  # fmt: skip
        v = results[row["name"]]
        progress(row["name"], v["ok"], f"{v['result']['step_s']:.3f} s/step" if v["ok"] else v["why"])  # fmt: skip
    decode = _child("decode", {}, args, child_argv, DECODE_BUDGET_S)
    progress("decode", decode["ok"], "" if decode["ok"] else decode["why"])
    fp8 = _gpu_fp8.section(args.smoke, *peak(card))  # never raises; at most 45 s
    progress("fp8 (issue 33)", fp8["ok"], fp8["note"])
    moe = moe_part(_child("moe", {}, args, child_argv, MOE_BUDGET_S))
    progress("moe (issue 34)", moe["ok"], moe["note"])
    body = table(results, decode, args, card) + "\n\n" + fp8["table"] + "\n\n" + moe["table"]
    wall = time.perf_counter() - start
    commit = _commit(args.commit)
    # a decode row the section had no time for (skipped) does not make the run red
    decode_ok = decode["ok"] and all(r["ok"] or r.get("skipped") for r in decode["result"]["rows"].values())  # fmt: skip
    rows_ok = decode_ok and all(v["ok"] for v in results.values())
    # the fp8 (issue 33) and MoE (issue 34) sections, new and not yet run on a GPU, are
    # reported, not counted
    green = tests_ok and rows_ok
    verdict = "green" if green else "NOT green"
    body += f"\n\n`tests/test_cuda.py`: {summary}. {verdict}, {wall:.0f} s in all."
    print("\n" + body, flush=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    section = (
        f"\n## {stamp} gpu-check: {card}, torch {torch.__version__}, CUDA {cuda}, commit "
        f"{commit[:12]}\n\n`make gpu-check` (`python benchmarks/gpu_check.py "
        f"{' '.join(argv)}`)\n\n{body}\n"
    )
    with open(args.results, "a") as f:
        f.write(section)
    record = {"commit": commit, "card": card, "torch": torch.__version__, "cuda": cuda,
              "date": stamp, "tests": summary, "wall_s": round(wall)}  # fmt: skip
    if green and not commit.endswith("+dirty") and commit != "unknown":
        with open(args.green, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        print(f"gpu-check: green; recorded in {os.path.relpath(args.green, ROOT)}")
    elif green:
        print(f"gpu-check: green, but commit {commit} is not a clean one: not recorded")
    if args.also_to:
        os.makedirs(args.also_to, exist_ok=True)
        with open(os.path.join(args.also_to, "gpu_check.md"), "w") as f:
            f.write(section)
        if os.path.exists(args.green):
            shutil.copy(args.green, os.path.join(args.also_to, "GPU_LAST_GREEN.json"))
    whole = TOTAL_BUDGET_S + _gpu_fp8.BUDGET_S + MOE_BUDGET_S
    if wall > whole and not args.smoke:
        print(f"gpu-check: took {wall:.0f} s, over the {whole:.0f} s budget", file=sys.stderr)
    return 0 if green or (args.smoke and rows_ok) else 1


if __name__ == "__main__":
    sys.exit(main())
