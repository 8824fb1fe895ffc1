"""Activation memory and step time of activation checkpointing, measured.

    .venv/bin/python benchmarks/bench_activations.py --rounds 3

The ~25M reference GPT at seq 1024 (micro-batch 1, fp32, one process, one thread),
with no checkpointing, selective checkpointing and full checkpointing (and full with
the kept inputs offloaded to CPU, which on a CPU-only machine moves nothing). Each run
is a fresh process. Reported per policy: activation bytes alive at the end of forward
(every tensor created in forward that is still referenced, storages counted once,
parameters excluded), the estimator's number, peak RSS above the process's baseline
(with a fixed glibc mmap threshold so freed blocks go back to the OS), and the median
step time; the ratio columns compare to no checkpointing within the same round.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

import _smoke

POLICIES = ["none", "selective", "full", "full+offload"]


def run_one(policy: str, seq: int, steps: int, preset: str = "25M") -> dict:
    import resource
    import time
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from zeroshard.checkpointing import apply_activation_checkpointing
    from zeroshard.models import GPT, Block, GPTConfig
    from zeroshard.monitor.memory import activation_bytes

    torch.set_num_threads(1)
    cfg = GPTConfig.preset(preset, seq_len=seq)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if policy != "none":
        apply_activation_checkpointing(
            model, Block, policy.split("+")[0], offload="offload" in policy
        )
    ids = torch.randint(0, 256, (1, seq + 1))
    # warm-up step, then the baseline: model states exist, activations do not
    model(ids[:, :-1], ids[:, 1:]).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    refs: list = []

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            refs.extend(weakref.ref(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
            return out

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with Track():
        loss = model(ids[:, :-1], ids[:, 1:])
    alive = {}
    for r in refs:
        t = r()
        if t is not None and t.untyped_storage().data_ptr() not in params:
            alive[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        model(ids[:, :-1], ids[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - t0)
    est = activation_bytes(
        layers=cfg.n_layer,
        hidden=cfg.d_model,
        seq=seq,
        micro_batch=1,
        vocab=cfg.vocab_size,
        policy=policy.split("+")[0],
        peak=False,  # what is kept for backward when forward ends: what "alive" measures
    )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "policy": policy,
        "activation_bytes": sum(alive.values()),
        "estimate_bytes": est,
        "peak_rss_delta_mib": peak - base,
        "step_s": statistics.median(times),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--worker", default=None)
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--preset", default="25M")
    _smoke.add_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.seq, args.steps, args.preset, args.no_record = 1, 32, 1, "tiny", True
    if args.worker:
        print(json.dumps(run_one(args.worker, args.seq, args.steps, args.preset)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    rows: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for r in range(args.rounds):
        order = POLICIES[r % len(POLICIES) :] + POLICIES[: r % len(POLICIES)]
        for policy in order:
            if args.smoke:  # in this process: the policies' code, without 4 interpreters
                rows[policy].append(run_one(policy, args.seq, args.steps, args.preset))
                continue
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--worker",
                    policy,
                    "--seq",
                    str(args.seq),
                    "--steps",
                    str(args.steps),
                    "--preset",
                    args.preset,
                ],
                capture_output=True,
                text=True,
                env=env,
                check=True,
            )
            rows[policy].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {policy:13} {rows[policy][-1]}", flush=True)
    base = rows["none"]
    lines = [
        f"\n## {datetime.datetime.now():%Y-%m-%d %H:%M} activation checkpointing: GPT {args.preset}, seq {args.seq}, micro-batch 1, fp32, 1 process",
        "",
        f"`.venv/bin/python benchmarks/bench_activations.py --rounds {args.rounds} --seq {args.seq}`",
        "",
        "| policy | activations (MiB) | estimate (MiB) | ÷ none | peak RSS over baseline (MiB) | step (s) | × none |",
        "|---|---|---|---|---|---|---|",
    ]
    for policy in POLICIES:
        rs = rows[policy]
        act = statistics.median(r["activation_bytes"] for r in rs) / 2**20
        est = rs[0]["estimate_bytes"] / 2**20
        div = statistics.median(
            b["activation_bytes"] / r["activation_bytes"] for b, r in zip(base, rs, strict=True)
        )
        rss = statistics.median(r["peak_rss_delta_mib"] for r in rs)
        step = statistics.median(r["step_s"] for r in rs)
        slow = statistics.median(r["step_s"] / b["step_s"] for b, r in zip(base, rs, strict=True))
        lines.append(
            f"| {policy} | {act:.0f} | {est:.0f} | {div:.1f} | {rss:.0f} | {step:.2f} | {slow:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_record:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"), "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
