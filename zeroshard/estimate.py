"""`zeroshard estimate`: per-rank bytes for every stage x offload x precision.

    zeroshard estimate --params 7e9 --nproc 4
    zeroshard estimate --model 25M --nproc 2 --seq 1024 --micro-batch 4 --checkpointing full
    zeroshard estimate --model mypkg.models:build --nproc 8 --nnodes 2

``--model`` is a built-in GPT preset (``tiny``, ``small``, ``25M``, ``100M``, ...) or a
``module:function`` returning an ``nn.Module`` (built on the meta device, so nothing
is allocated).
"""

from __future__ import annotations

import argparse
import importlib

import torch

from zeroshard.memory import OFFLOADS, POLICIES, PRECISIONS, activation_bytes, estimate


def _model_facts(spec: str) -> dict:
    from zeroshard.models import _PRESETS, GPT, GPTConfig

    if spec in _PRESETS:
        cfg = GPTConfig.preset(spec)
        with torch.device("meta"):
            model = GPT(cfg)
        facts = {"layers": cfg.n_layer, "hidden": cfg.d_model, "vocab": cfg.vocab_size}
    else:
        if ":" not in spec:
            raise SystemExit(f"--model {spec!r}: expected a preset or module:function")
        mod, fn = spec.split(":", 1)
        with torch.device("meta"):
            model = getattr(importlib.import_module(mod), fn)()
        facts = {}
    numels = [p.numel() for p in model.parameters()]
    facts["params"] = sum(numels)
    own = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()]
    facts["largest_unit"] = max(own)
    return facts


def gib(n: int) -> str:
    return f"{n / 2**30:8.2f}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0]
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=float, help="parameter count, e.g. 7e9")
    src.add_argument("--model", help="GPT preset or module:function")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per node")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--precision", choices=[*PRECISIONS, "all"], default="all")
    parser.add_argument("--seq", type=int, default=0, help="sequence length (activations)")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--checkpointing", choices=POLICIES, default="none")
    parser.add_argument("--bucket", type=float, default=5e8, help="reduce_bucket_size")


def main(args: argparse.Namespace) -> int:
    facts = _model_facts(args.model) if args.model else {"params": int(args.params)}
    psi, n = facts["params"], args.nproc * args.nnodes
    precisions = list(PRECISIONS) if args.precision == "all" else [args.precision]
    print(
        f"{psi:,} parameters on {n} data-parallel ranks ({args.nnodes} node(s) x {args.nproc}); GiB per rank"
    )
    act = 0
    if args.seq and "layers" in facts:
        act = activation_bytes(
            layers=facts["layers"],
            hidden=facts["hidden"],
            seq=args.seq,
            micro_batch=args.micro_batch,
            vocab=facts["vocab"],
            policy=args.checkpointing,
            dtype_bytes=4,
        )
        print(
            f"activations (fp32, seq {args.seq}, micro-batch {args.micro_batch}, "
            f"checkpointing {args.checkpointing}): {act / 2**30:.2f} GiB"
        )
    print(
        f"{'precision':9} {'stage':>5} {'offload':>7} | {'params':>8} {'grads':>8} {'optim':>8} "
        f"{'states':>8} {'+buffers':>8} | {'device':>8} {'cpu':>8} {'nvme':>8}"
    )
    for prec in precisions:
        for stage in range(4):
            for off in OFFLOADS:
                if off != "none" and stage == 0:
                    continue
                e = estimate(
                    psi,
                    args.nproc,
                    args.nnodes,
                    stage=stage,
                    precision=prec,
                    offload=off,
                    offload_params=off != "none",
                    bucket_numel=int(args.bucket),
                    largest_unit=facts.get("largest_unit", 0),
                    activations=act,
                )
                loc = e.by_location
                print(
                    f"{prec:9} {stage:>5} {off:>7} | {gib(e.params)} {gib(e.grads)} "
                    f"{gib(e.optimizer_states)} {gib(e.model_states)} {gib(e.buffers)} | "
                    f"{gib(e.device)} {gib(loc.get('cpu', 0))} {gib(loc.get('nvme', 0))}"
                )
    print(
        "states: the ZeRO paper's model-state bytes; +buffers: zeroshard's gradient staging "
        "(stages 2-3) and always-gathered small parameters"
    )
    return 0
