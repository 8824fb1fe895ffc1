"""What stage 3's walk of the autograd graph before each backward costs
(``zeroshard/zero/grads/reached.py``: the parameters the backward reaches), against the
backward it precedes, on GPT-2 shapes from transformers (random weights).

    python benchmarks/bench_graph_walk.py [--layers 12 24 48] [--width 256] [--rounds 5]

Prints one table (one process, one thread); the numbers in RESULTS.md came from it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from zeroshard.zero.grads.reached import reached_leaves


def _median(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[12, 24, 48])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="CI: 2 layers of width 32, 1 round")
    args = ap.parse_args()
    if args.smoke:  # (prints only)
        args.layers, args.width, args.seq, args.rounds = [2], 32, 16, 1
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(1)
    print("| layers | parameters reached | graph walk ms | backward ms | walk / backward |")
    print("|---|---|---|---|---|")
    for layers in args.layers:
        cfg = GPT2Config(n_layer=layers, n_embd=args.width, n_head=4, vocab_size=1024)
        model = GPT2LMHeadModel(cfg)
        ids = torch.randint(0, 1024, (1, args.seq))
        walks, backs = [], []
        for _ in range(args.rounds):
            loss = model(input_ids=ids, labels=ids).loss
            walks.append(_median(lambda loss=loss: reached_leaves([loss]), 1))
            t0 = time.perf_counter()
            loss.backward()
            backs.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        leaves = reached_leaves([model(input_ids=ids, labels=ids).loss])
        assert leaves is not None  # no reentrant checkpointing here
        n = len(leaves)
        walk, back = statistics.median(walks), statistics.median(backs)
        print(f"| {layers} | {n} | {walk * 1e3:.2f} | {back * 1e3:.1f} | {walk / back:.1%} |")


if __name__ == "__main__":
    main()
