"""`zeroshard plan`: the layout that fits the device memory with the least communication.

    zeroshard plan --device-memory 24GiB --nproc 2 --model 25M --seq 1024 --micro-batch 4

Candidates are every stage x offload (NVMe only at stage 3, with the parameter shard
offloaded too) for the chosen precision, and, at stages 1-3 with CPU offload, the
smallest ZeRO-Offload++ Twin-Flow ratio (``offload_optimizer.ratio``, in steps of
0.05) that fits: the optimizer's share kept and stepped on the device when the model
nearly fits there. Each is judged by the estimator. Among those that fit, the order is:
least inter-rank communication per step, then least offload traffic (none < CPU < NVMe;
among CPU ones the smaller ratio), then most free device memory.

The output starts with what the estimate assumed (precision, optimizer, batch, ranks,
bucket, activations, memory limits: each with the option that changes it) and ends with
the plan as a DeepSpeed config, plain JSON ready to paste into ds_config.json (it loads
with ``zeroshard.config.load_config``, DeepSpeed's and transformers' readers alike).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from zeroshard.monitor.memory import POLICIES, PRECISIONS, Estimate, estimate
from zeroshard.tools.convert import parse_size
from zeroshard.tools.estimate import (
    activations,
    add_parallel_arguments,
    bucket_numel,
    facts_from_args,
    model_help,
    tp_numel,
)
from zeroshard.zero.layout.segments import DEFAULT_BUCKET_BYTES

_OFFLOAD_RANK = {"none": 0, "cpu": 1, "nvme": 2}
RATIO_STEP = 0.05  # Twin-Flow ratios tried: 0.05, 0.10, ..., 0.95


def candidates(
    facts: dict,
    nproc: int,
    nnodes: int,
    precision: str,
    act: int,
    bucket: int,
    *,
    tp: int = 1,
    sp: int = 1,
    tp_numel: int = 0,
    gas: int = 1,
    device_memory: int | None = None,
) -> list[Estimate]:
    """Every layout, estimated; with ``device_memory``, also the Twin-Flow candidates
    (the smallest ratio that fits it, per stage)."""

    def one(stage: int, off: str, ratio: float = 1.0) -> Estimate:
        return estimate(
            facts["params"],
            nproc,
            nnodes,
            stage=stage,
            precision=precision,
            offload=off,
            offload_params=off == "nvme",
            bucket_numel=bucket,
            largest_unit=facts.get("largest_unit", 0),
            activations=act,
            tp=tp,
            sp=sp,
            tp_activation_numel=tp_numel,
            gradient_accumulation=gas,
            offload_ratio=ratio,
        )

    out = []
    for stage in range(4):
        for off in ("none", "cpu", "nvme"):
            if (off != "none" and stage == 0) or (off == "nvme" and stage < 3):
                continue
            out.append(one(stage, off))
            if off == "cpu" and device_memory is not None:
                twin = smallest_ratio(lambda r, st=stage: one(st, "cpu", r), device_memory)
                if twin is not None:
                    out.append(twin)
    return out


def smallest_ratio(at, device_memory: int) -> Estimate | None:
    """The Twin-Flow estimate ``at(ratio)`` of the smallest ratio below 1 (a multiple
    of :data:`RATIO_STEP`) whose device bytes fit ``device_memory``; None if none does.
    The device's bytes fall as the ratio grows, so the first that fits is the one."""
    steps = round(1 / RATIO_STEP)
    for k in range(1, steps):
        e = at(round(k * RATIO_STEP, 2))
        if e.device <= device_memory:
            return e
    return None


def choose(
    cands: list[Estimate], device_memory: int, cpu_memory: int | None = None
) -> list[Estimate]:
    """The candidates that fit, best first."""
    fits = [
        e
        for e in cands
        if e.device <= device_memory
        and (cpu_memory is None or e.by_location.get("cpu", 0) <= cpu_memory)
    ]
    return sorted(
        fits,
        key=lambda e: (
            e.comm_bytes_per_step,
            _OFFLOAD_RANK[e.offload],
            e.offload_ratio,
            e.device,
        ),
    )


def _describe(e: Estimate, device_memory: int) -> str:
    gib = 2**30
    twin = f" (ratio {e.offload_ratio:g}: Twin-Flow)" if e.offload_ratio < 1 else ""
    return (
        f"stage {e.stage}, offload {e.offload}{twin}: {e.device / gib:.2f} GiB on the device of "
        f"{device_memory / gib:.2f} ({e.model_states / gib:.2f} model states, "
        f"{e.activations / gib:.2f} activations), {e.comm_bytes_per_step / gib:.2f} GiB "
        f"exchanged per step"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0]
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=float)
    src.add_argument("--model", help=model_help())
    parser.add_argument("--device-memory", type=parse_size, required=True, help="e.g. 24GiB")
    parser.add_argument("--cpu-memory", type=parse_size, default=None, help="per rank")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--precision", choices=list(PRECISIONS), default="bf16")
    parser.add_argument("--seq", type=int, default=0)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--checkpointing", choices=POLICIES, default="none")
    parser.add_argument(
        "--gas", type=int, default=1, help="gradient_accumulation_steps (offload: see estimate)"
    )
    parser.add_argument(
        "--bucket", type=float, default=None, help="reduce_bucket_size (default: zeroshard's)"
    )
    add_parallel_arguments(parser)


NVME_PATH = "/local_nvme"  # in the pasted config: a placeholder the output names
LR = 3e-4  # likewise


def assumptions(args: argparse.Namespace, facts: dict, act_line: str) -> list[str]:
    """What the estimate took for granted, each with the option that changes it."""
    gib = 2**30
    bucket = (
        f"{int(args.bucket):,} elements (--bucket)"
        if args.bucket is not None
        else f"{DEFAULT_BUCKET_BYTES // 2**20} MiB of gradients, zeroshard's default (--bucket)"
    )
    cpu = (
        f"{args.cpu_memory / gib:.2f} GiB per rank (--cpu-memory)"
        if args.cpu_memory is not None
        else "not limited (--cpu-memory)"
    )
    ranks = args.nproc * args.nnodes
    parallel = f"; tensor parallel {args.tp}, sequence parallel {args.sp}" if args.tp * args.sp > 1 else ""  # fmt: skip
    policy = (
        "none (--checkpointing)"
        if args.checkpointing == "none"
        else f"{args.checkpointing} (--checkpointing): no config key turns it on; call "
        f"zeroshard.checkpointing.apply_activation_checkpointing(model, BlockType, "
        f'policy="{args.checkpointing}") in the script'
    )
    return [
        "assumptions (each option named changes one):",
        f"  precision: {args.precision} (--precision: {', '.join(PRECISIONS)})",
        "  optimizer: Adam/AdamW, fp32 master weights and two fp32 moments per parameter "
        f"(the config's lr, {LR:g}, is a placeholder: set yours)",
        f"  model: {facts['params']:,} parameters (--params / --model)",
        f"  ranks: {ranks} ({args.nnodes} node(s) x {args.nproc}: --nnodes, --nproc{parallel})",
        f"  micro-batch: {args.micro_batch} per rank (--micro-batch), gradient accumulation 1",
        f"  gradient bucket: {bucket}",
        f"  activation checkpointing: {policy}",
        f"  {act_line}",
        f"  memory: device {args.device_memory / gib:.2f} GiB per rank (--device-memory); "
        f"CPU {cpu}",
    ]


def ds_config(e: Estimate, args: argparse.Namespace) -> dict[str, Any]:
    """The plan as a DeepSpeed config (plain JSON values)."""
    zero: dict[str, Any] = {"stage": e.stage}
    if e.offload != "none":
        device: dict[str, Any] = {"device": e.offload}
        if e.offload == "nvme":
            device["nvme_path"] = NVME_PATH
        if e.offload_ratio < 1:
            device["ratio"] = e.offload_ratio
        zero["offload_optimizer"] = device
        if e.offload == "nvme":  # the candidates offload the parameter shard with it
            zero["offload_param"] = dict(device)
    if args.bucket is not None:
        zero["reduce_bucket_size"] = int(args.bucket)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
    }
    if args.precision != "fp32":
        config[args.precision] = {"enabled": True}
    config["zero_optimization"] = zero
    if args.tp > 1:
        config["tensor_parallel"] = {"autotp_size": args.tp}
        if args.megatron_sp:
            config["tensor_parallel"]["sequence_parallel"] = True
    if args.sp > 1:
        config["sequence_parallel_size"] = args.sp
    return config


def main(args: argparse.Namespace) -> int:
    facts = facts_from_args(args)
    act, act_line = activations(facts, args, args.precision)
    for line in assumptions(args, facts, act_line):
        print(line)
    cands = candidates(
        facts,
        args.nproc,
        args.nnodes,
        args.precision,
        act,
        bucket_numel(args.bucket, args.precision),
        tp=args.tp,
        sp=args.sp,
        tp_numel=tp_numel(facts, args),
        gas=args.gas,
        device_memory=args.device_memory,
    )
    ranked = choose(cands, args.device_memory, args.cpu_memory)
    if not ranked:
        print("nothing fits: reduce the micro-batch, turn on --checkpointing full, or add ranks")
        return 1
    best = ranked[0]
    print("plan: " + _describe(best, args.device_memory))
    why = (
        "it fits and no layout that fits exchanges fewer bytes"
        if len(ranked) == 1 or ranked[1].comm_bytes_per_step > best.comm_bytes_per_step
        else "it fits, exchanges as few bytes as any layout that fits, and offloads least"
    )
    print(f"why: {why}")
    if len(ranked) > 1:
        print("runner-up: " + _describe(ranked[1], args.device_memory))
    print("ds_config.json for this plan:")
    print(json.dumps(ds_config(best, args), indent=2))
    if best.offload == "nvme":
        print(f"nvme_path {NVME_PATH} is a placeholder: give a directory on the NVMe drive")
    return 0
