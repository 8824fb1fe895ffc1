"""Tensor-parallel inference: decode tokens/s, weight bytes per rank and the
tensor-parallel traffic per token, TP1 against TP2, on the built-in GPT with its KV cache
(``init_inference(model, {"tensor_parallel": {"tp_size": N}})``), greedy, fp32, one
thread per rank. TP2's tokens must equal TP1's.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_tp_inference.py --preset 25M --new 64
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))


def _rank(argv: list[str]) -> None:
    import torch

    torch.set_num_threads(1)
    import zeroshard
    from zeroshard.models import GPT, GPTConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="25M")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("out")
    a = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(a.preset, seq_len=256)).eval()
    engine = zeroshard.init_inference(model, {"tensor_parallel": {"tp_size": world}})
    ids = torch.randint(0, 256, (a.batch, 16), generator=torch.Generator().manual_seed(1))
    engine.generate(ids, max_new_tokens=4)  # warm-up
    ledger = engine.tp.comm.ledger if engine.tp is not None else None
    if ledger is not None:
        ledger.reset()
    t0 = time.perf_counter()
    out = engine.generate(ids, max_new_tokens=a.new)
    seconds = time.perf_counter() - t0
    comm = {}
    if ledger is not None:
        comm = {
            op: {"calls": s["calls"], "bytes": s["bytes"]} for op, s in ledger.snapshot().items()
        }
    res = {
        "tokens_per_s": a.batch * a.new / seconds,
        "weight_mib": sum(p.numel() * p.element_size() for p in engine.module.parameters()) / 2**20,
        "comm": comm,
        "tokens": out[:, 16:].tolist(),
    }
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{a.out}.{rank}", "w") as f:
        json.dump(res, f)


def main() -> None:
    from _ranks import run_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="25M")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="CI: GPT tiny, 4 new tokens")
    a = ap.parse_args()
    if a.smoke:
        a.preset, a.new = "tiny", 4
    args = [f"--preset={a.preset}", f"--new={a.new}", f"--batch={a.batch}"]
    env = {"OMP_NUM_THREADS": "1"}
    results = {n: run_ranks(__file__, args, nproc=n, env=env, timeout=1200) for n in (1, 2)}
    r1, r2 = results[1][0], results[2]
    print(f"GPT {a.preset}, batch {a.batch}, {a.new} new tokens, KV cache, fp32")
    print(f"TP1: {r1['tokens_per_s']:.2f} tokens/s, weights {r1['weight_mib']:.1f} MiB")
    slow = min(r["tokens_per_s"] for r in r2)
    print(f"TP2: {slow:.2f} tokens/s (slowest rank), weights {r2[0]['weight_mib']:.1f} MiB/rank")
    steps = a.new + 4 - 4  # the ledger was reset after the warm-up
    for op, s in r2[0]["comm"].items():
        print(
            f"  {op}: {s['calls'] / steps:.1f} calls, {s['bytes'] / steps / 1024:.1f} KiB per step"
        )
    same = all(r["tokens"] == r1["tokens"] for r in r2)
    print(f"TP2 tokens equal TP1's: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_rank":
        _rank(sys.argv[2:])
    else:
        main()
