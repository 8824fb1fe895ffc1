"""Tensor parallelism on 2 ranks: zeroshard's AutoTP against torch's own tensor
parallelism (``parallelize_module`` with DTensor) and DeepSpeed's AutoTP training
(``tensor_parallel.autotp_size``, DeepSpeed from ``--ds-python``, CPU accelerator, gloo),
on the same transformers Llama, the same data, in the same run (rounds interleaved).
DeepSpeed's AutoTP chooses its own split (it also splits ``lm_head``): its parameter bytes
per rank are reported as measured.

Both split the decoder layers the Megatron way (q, k, v, gate and up column-parallel;
o and down row-parallel) and keep the embedding, norms and head replicated; both step
AdamW in fp32 (zeroshard: torch's fused AdamW on the local shards; DTensor: foreach
AdamW on the DTensor parameters, which fused AdamW does not take, fused on the rest). Reported per system: the median step
time (slowest rank) over the timed steps of each round, and the median over rounds;
parameter bytes per rank; peak RSS per rank; the tensor-parallel bytes per step from
zeroshard's ledger; the losses (both must match).

    .venv/bin/python benchmarks/bench_tp.py --rounds 5 [--ds-python .venv-bench/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

LAYER_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def _model(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
        max_position_embeddings=args.seq, use_cache=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def _data(args, step):
    import torch

    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 1024, (args.micro, args.seq), generator=g)


def _zeroshard(args, model):
    import zeroshard

    plan = {f"model.layers.*.{k}": v for k, v in LAYER_PLAN.items()}
    plan |= {"model.embed_tokens": "replicate", "lm_head": "replicate"}
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "tensor_parallel": {"autotp_size": 2, "tp_plan": plan},
        "steps_per_print": 10**9,
    }
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def step(ids):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    return step, engine


def _dtensor(args, model):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2,))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {k: styles[v]() for k, v in LAYER_PLAN.items()})
        # heads are split: the attention reshapes by head_dim (-1 heads), nothing else
    # DTensor parameters step with foreach AdamW (fused takes no DTensor), the
    # replicated plain ones with fused AdamW, as zeroshard steps everything
    dt = [p for p in model.parameters() if hasattr(p, "to_local")]
    plain = [p for p in model.parameters() if not hasattr(p, "to_local")]
    opts = [
        torch.optim.AdamW(dt, lr=1e-4, foreach=True),
        torch.optim.AdamW(plain, lr=1e-4, fused=True),
    ]

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        return loss.item()

    return step, None


def _deepspeed(args, model):
    import deepspeed

    cfg = {
        "train_micro_batch_size_per_gpu": args.micro,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "tensor_parallel": {"autotp_size": 2},
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def step(ids):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    return step, None


def _rank(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist

    args = _parser().parse_args(argv[:-1])
    out = argv[-1]
    torch.set_num_threads(1)
    if args.system == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        import zeroshard

        zeroshard.init_distributed()
    model = _model(args)
    build = {"zeroshard": _zeroshard, "dtensor": _dtensor, "deepspeed": _deepspeed}
    step, engine = build[args.system](args, model)
    param_bytes = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in model.parameters()
    )
    losses, times = [], []
    for s in range(args.warmup + args.steps):
        if engine is not None and s == args.warmup:
            engine.reset_comm_stats()
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(step(_data(args, s)))
        times.append(time.perf_counter() - t0)
    tp_bytes = 0
    if engine is not None:
        tp_bytes = (
            engine.comm_stats(by_axis=True).get("tp", {}).get("all_reduce", {}).get("bytes", 0)
        )
    result = {
        "times": times[args.warmup :],
        "losses": losses,
        "param_bytes": param_bytes,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "tp_bytes_per_step": tp_bytes / args.steps,
    }
    with open(f"{out}.{dist.get_rank()}", "w") as f:
        json.dump(result, f)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--system", default="zeroshard", choices=("zeroshard", "dtensor", "deepspeed"))
    p.add_argument(
        "--ds-python",
        default=".venv-bench/bin/python",
        help="an interpreter with DeepSpeed; '' to skip it",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="CI: 1 layer x 64, seq 16, 2 steps")
    return p


def main() -> None:
    from _ranks import run_ranks, run_ranks_each

    args = _parser().parse_args()
    if args.smoke:
        args.rounds, args.layers, args.hidden, args.seq, args.micro = 1, 1, 64, 16, 1
        args.warmup, args.steps = 1, 1
        if args.ds_python and os.path.exists(args.ds_python):
            print("smoke: deepspeed skipped: a smoke run leaves .venv-bench alone")
        else:
            print(f"smoke: deepspeed skipped: no {args.ds_python} (make .venv-bench)")
        args.ds_python = ""
    base = [
        f"--layers={args.layers}", f"--hidden={args.hidden}", f"--seq={args.seq}",
        f"--micro={args.micro}", f"--warmup={args.warmup}", f"--steps={args.steps}",
    ]  # fmt: skip
    per_round: dict[str, list] = {"zeroshard": [], "dtensor": []}
    if args.ds_python and os.path.exists(args.ds_python):
        per_round["deepspeed"] = []

    def launch(system: str) -> list[dict]:
        ds = system == "deepspeed"
        return run_ranks(
            __file__, [f"--system={system}", *base], nproc=2,
            python=os.path.abspath(args.ds_python) if ds else None,
            env={"DS_ACCELERATOR": "cpu"} if ds else None,
        )  # fmt: skip

    for _ in range(args.rounds):
        if args.smoke:  # the code paths, not a measurement: every system in one launch
            launched = run_ranks_each(__file__, [[f"--system={s}", *base] for s in per_round])
        else:  # a fresh launch per system, interleaved: A B C A B C ...
            launched = [launch(system) for system in per_round]
        for system, ranks in zip(per_round, launched, strict=True):
            slowest = [max(t) for t in zip(*(r["times"] for r in ranks), strict=True)]
            per_round[system].append({"step": statistics.median(slowest), "ranks": ranks})
    print(f"Llama {args.layers} x {args.hidden}, seq {args.seq}, micro-batch {args.micro}, fp32, "
          f"2 ranks (gloo, 1 thread each), {args.rounds} rounds x {args.steps} timed steps")  # fmt: skip
    print("| system | step (s), median [min-max] | x DTensor | param bytes/rank | peak RSS r0/r1 (MiB) | TP all-reduce bytes/step | loss first -> last |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for system, rounds in per_round.items():
        steps = [r["step"] for r in rounds]
        last = rounds[-1]["ranks"]
        ratios = [r["step"] / d["step"] for r, d in zip(rounds, per_round["dtensor"], strict=True)]
        ratio = f"{statistics.median(ratios):.2f}"
        tp = (
            f"{last[0]['tp_bytes_per_step'] / 2**20:.1f} MiB"
            if system == "zeroshard"
            else "(not in a ledger)"
        )
        print(
            f"| {system} | {statistics.median(steps):.3f} [{min(steps):.3f}-{max(steps):.3f}] | "
            f"{ratio} | {last[0]['param_bytes'] / 2**20:.1f} MiB | "
            f"{last[0]['peak_rss_mib']:.0f} / {last[1]['peak_rss_mib']:.0f} | {tp} | "
            f"{last[0]['losses'][0]:.5f} -> {last[0]['losses'][-1]:.5f} |"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_rank":
        _rank(sys.argv[2:])
    else:
        main()
