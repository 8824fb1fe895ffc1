"""What fp8 costs in accuracy: the stdlib GPT (benchmarks/stdlib_gpt.py) trained in bf16,
fp8 tensorwise and fp8 rowwise on the same batches; the loss logged every 25 steps (mean
since the last log), each fp8 run's deviation from bf16 in percent, and the held-out
perplexity (the engine's own precision). One rank, the CPU (fp8 matmuls through
``torch._scaled_mm``: numerics, not speed; the GPU speed row is gpu_check.py's).

    python benchmarks/bench_fp8_quality.py [--record]     # ~10-20 min on 2 cores
    python benchmarks/bench_fp8_quality.py --smoke

``--record`` appends the table to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _record  # noqa: E402
import _smoke  # noqa: E402
import stdlib_gpt  # noqa: E402

RUNS = ("bf16", "fp8", "fp8-rowwise")


def table(curves: dict[str, dict]) -> str:
    base = curves["bf16"]
    others = [p for p in curves if p != "bf16"]
    head = "| step | bf16 loss | " + " | ".join(f"{p} loss | vs bf16" for p in others) + " |"
    lines = [head, "|---" * (2 + 2 * len(others)) + "|"]
    for i, step in enumerate(base["steps"]):
        cells = [f"{step}", f"{base['losses'][i]:.4f}"]
        for p in others:
            loss = curves[p]["losses"][i]
            cells += [f"{loss:.4f}", f"{100 * (loss - base['losses'][i]) / base['losses'][i]:+.2f}%"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| run | held-out loss (nats/byte) | perplexity | vs bf16 | worst logged step vs bf16 | train s |", "|---|---|---|---|---|---|"]  # fmt: skip
    for p, c in curves.items():
        ppl = math.exp(c["heldout"])
        worst = max(abs(a - b) / b for a, b in zip(c["losses"], base["losses"], strict=True))
        vs = f"{100 * (ppl / math.exp(base['heldout']) - 1):+.2f}%" if p != "bf16" else ""
        lines.append(f"| {p} | {c['heldout']:.4f} | {ppl:.3f} | {vs} | {100 * worst:.2f}% | {c['seconds']:.0f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="append to benchmarks/RESULTS.md")
    _smoke.add_flag(parser)
    args = parser.parse_args()
    if importlib.util.find_spec("torchao") is None:  # the optional extra zeroshard[fp8]
        print("bench_fp8_quality: torchao is not installed (pip install 'zeroshard[fp8]'): no fp8 run")  # fmt: skip
        sys.exit(0 if args.smoke else 1)
    torch.set_num_threads(1)
    check = dict(stdlib_gpt.FP8_CHECK)
    steps, preset = check.pop("steps"), check.pop("preset")
    log_every, eval_bytes = 25, stdlib_gpt.CORPUS_BYTES
    if args.smoke:
        steps, check, log_every, eval_bytes = 4, {}, 2, 20_000
    curves = {}
    for precision in RUNS:
        curves[precision] = stdlib_gpt.loss_curve(
            steps, preset, precision, log_every=log_every, eval_bytes=eval_bytes, **check
        )
        print(f"{precision}: {curves[precision]['seconds']:.0f} s", flush=True)
    body = table(curves)
    print(body)
    if args.record and not args.smoke:
        shape = ", ".join(f"{k} {v}" for k, v in check.items())
        _record.append_section(
            os.path.join(HERE, "RESULTS.md"),
            f"bench_fp8_quality (issue 33): GPT {preset} ({shape}), {steps} steps of 16 x 128 "
            "bytes, AdamW 3e-3 cosine, clip 1.0; fp8 on the CPU via torch._scaled_mm",
            "python benchmarks/bench_fp8_quality.py --record",
            body,
        )


if __name__ == "__main__":
    main()
