"""`zeroshard plan`: the layout that fits the device memory with the least communication.

    zeroshard plan --device-memory 24GiB --nproc 2 --model 25M --seq 1024 --micro-batch 4
    zeroshard plan --cpu-only --host-memory 15GiB --disk 70GB --model 3B --precision fp32
    zeroshard plan --this-host --host-memory 15GiB --model 3B --precision fp32

With ``--host-memory`` (what the run may hold in RAM on a node, all its ranks together)
and ``--disk`` (free space where the swap files go), a layout must also fit the host: the
ranks' peak RSS (``monitor/host_memory.py``: model states and buffers kept on the host,
NVMe offload's buffers, zero.Init's slices while building) and their swap files. With
``--cpu-only`` the device is the host (RAM holds what the device would). ``--this-host``
reads this machine: its RAM (unless ``--host-memory``), the free space under
``--nvme-path`` (unless ``--disk``), a CUDA device's memory or else CPU-only. An NVMe
plan comes with the buffer sizes the host estimate assumed (``sub_group_size``,
pipelined reads and writes, ``offload_param`` buffers as large as the largest unit);
when the host is tight, stage 3 frees each unit after its forward
(``stage3_max_reuse_distance: 0``) instead of keeping the model's first 5e8 elements.

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
import os
import shutil
from typing import Any

from zeroshard.monitor.host_memory import HostPeak, SwapTuning, host_peak
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

    def one(stage: int, off: str, ratio: float = 1.0, reuse: int = 10**9) -> Estimate:
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
            reuse_numel=reuse,
            gradient_accumulation=gas,
            offload_ratio=ratio,
        )

    out = []
    for stage in range(4):
        for off in ("none", "cpu", "nvme"):
            if (off != "none" and stage == 0) or (off == "nvme" and stage < 3):
                continue
            # stage 3: DeepSpeed's default reuse distance, then each unit freed after
            # its forward (0), which the host-tight plans need
            for reuse in (10**9, 0) if stage == 3 else (10**9,):
                out.append(one(stage, off, reuse=reuse))
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


#: the NVMe buffers a plan proposes (and the host estimate assumes): sub-groups of 2e7
#: elements (80 MB per state), read and written while the neighbour steps
PLAN_SWAP = SwapTuning(sub_group_numel=20_000_000, pipelined=True)


def host_of(e: Estimate, facts: dict, nproc: int, cpu_only: bool) -> HostPeak:
    """The host side of candidate ``e`` (one node's ranks), with the plan's buffers."""
    unit = facts.get("largest_unit", 0)
    return host_peak(
        e,
        params=facts["params"],
        ranks=nproc,
        cpu_only=cpu_only,
        largest_unit=unit,
        largest_param=facts.get("largest_param", unit),
        swap=PLAN_SWAP,
    )


def choose(
    cands: list[Estimate],
    device_memory: int | None,
    cpu_memory: int | None = None,
    *,
    host: dict[int, HostPeak] | None = None,
    host_memory: int | None = None,
    disk: int | None = None,
) -> list[Estimate]:
    """The candidates that fit, best first. ``host``: each candidate's host peak (by
    ``id``), checked against ``host_memory`` (all the node's ranks) and ``disk``;
    ``device_memory`` None: the device is the host (CPU-only)."""

    def fits(e: Estimate) -> bool:
        if device_memory is not None and e.device > device_memory:
            return False
        if cpu_memory is not None and e.by_location.get("cpu", 0) > cpu_memory:
            return False
        peak = (host or {}).get(id(e))
        if peak is not None and host_memory is not None and peak.total_rss > host_memory:
            return False
        return peak is None or disk is None or peak.total_disk <= disk

    def rss(e: Estimate) -> int:
        peak = (host or {}).get(id(e))
        return peak.rss if peak is not None else 0

    return sorted(
        filter(fits, cands),
        key=lambda e: (
            e.comm_bytes_per_step,
            _OFFLOAD_RANK[e.offload],
            e.offload_ratio,
            e.device,
            rss(e),
        ),
    )


def _describe(e: Estimate, device_memory: int | None, host: HostPeak | None = None) -> str:
    gib = 2**30
    reuse = ", each unit freed after its forward" if e.stage == 3 and not e.gathered else ""
    twin = f" (ratio {e.offload_ratio:g}: Twin-Flow)" if e.offload_ratio < 1 else ""
    where = (
        f"{e.device / gib:.2f} GiB on the device of {device_memory / gib:.2f}"
        if device_memory is not None
        else "CPU-only"
    )
    text = (
        f"stage {e.stage}, offload {e.offload}{twin}{reuse}: {where} ({e.model_states / gib:.2f} "
        f"model states, {e.activations / gib:.2f} activations), "
        f"{e.comm_bytes_per_step / gib:.2f} GiB exchanged per step"
    )
    if host is not None:
        text += (
            f"; host: peak RSS {host.rss / gib:.2f} GiB per rank, {host.total_rss / gib:.2f} "
            f"for the node's {host.ranks}, swap files {host.total_disk / gib:.2f} GiB"
        )
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0]
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=float)
    src.add_argument("--model", help=model_help())
    parser.add_argument("--device-memory", type=parse_size, default=None, help="e.g. 24GiB")
    parser.add_argument("--cpu-memory", type=parse_size, default=None, help="per rank")
    parser.add_argument(
        "--host-memory", type=parse_size, default=None, help="RAM the node's ranks may hold"
    )
    parser.add_argument("--disk", type=parse_size, default=None, help="free swap-file space")
    parser.add_argument("--cpu-only", action="store_true", help="no accelerator: RAM is all")
    parser.add_argument(
        "--this-host", action="store_true", help="RAM, disk, device and cores of this machine"
    )
    parser.add_argument(
        "--nvme-path", default=None, help="where swap files go (in the config; --this-host's disk)"
    )
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
    cores = getattr(args, "cores", None) or os.cpu_count() or 1
    device = (
        "CPU-only, the device is the host (--cpu-only)"
        if args.cpu_only
        else f"device {args.device_memory / gib:.2f} GiB per rank (--device-memory)"
    )
    host = (
        f"{args.host_memory / gib:.2f} GiB for the node's {args.nproc} rank(s)"
        if args.host_memory is not None
        else "not limited"
    )
    disk = f"{args.disk / gib:.2f} GiB" if args.disk is not None else "not limited"
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
        *(
            [
                f"  threads: {max(1, cores // args.nproc)} per rank (the node's {cores} cores "
                "over its ranks: torch.set_num_threads; on a CPU-only host one rank "
                "holds least: nothing gathered twice, nothing exchanged)"
            ]
            if args.cpu_only
            else []
        ),
        f"  micro-batch: {args.micro_batch} per rank (--micro-batch), gradient accumulation 1",
        f"  gradient bucket: {bucket}",
        f"  activation checkpointing: {policy}",
        f"  {act_line}",
        f"  memory: {device}; CPU {cpu}; host {host} (--host-memory); swap-file space "
        f"{disk} (--disk)",
    ]


def ds_config(e: Estimate, args: argparse.Namespace) -> dict[str, Any]:
    """The plan as a DeepSpeed config (plain JSON values)."""
    zero: dict[str, Any] = {"stage": e.stage}
    path = getattr(args, "nvme_path", None) or NVME_PATH
    if e.offload != "none":
        device: dict[str, Any] = {"device": e.offload}
        if e.offload == "nvme":
            device["nvme_path"] = path
        if e.offload_ratio < 1:
            device["ratio"] = e.offload_ratio
        zero["offload_optimizer"] = device
        if e.offload == "nvme":  # the candidates offload the parameter shard with it
            zero["offload_param"] = dict(device)
            swap = PLAN_SWAP
            device.update(pipeline_read=swap.pipelined, pipeline_write=swap.pipelined)
            device["buffer_count"] = 6 if swap.pipelined else 3
            zero["offload_param"]["buffer_count"] = swap.param_buffers
            unit = -(-getattr(args, "largest_unit", 0) // e.zero_ranks)
            if unit > 100_000_000:  # DeepSpeed's default buffer_size is too small for it
                zero["offload_param"]["buffer_size"] = unit
            zero["sub_group_size"] = swap.sub_group_numel
    if e.stage == 3 and not e.gathered:
        zero["stage3_max_reuse_distance"] = 0
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


def this_host(args: argparse.Namespace) -> None:
    """``--this-host``: fill in what was not given from this machine."""
    import torch

    if args.host_memory is None:
        args.host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if args.disk is None:
        where = args.nvme_path or os.getcwd()
        while not os.path.exists(where):
            where = os.path.dirname(where)
        args.disk = shutil.disk_usage(where).free
    if args.device_memory is None and not args.cpu_only:
        if torch.cuda.is_available():
            args.device_memory = torch.cuda.get_device_properties(0).total_memory
        else:
            args.cpu_only = True
    args.cores = os.cpu_count() or 1


def propose(
    args: argparse.Namespace, facts: dict, act: int
) -> tuple[list[Estimate], dict[int, HostPeak]]:
    """The candidates that fit, best first, and each candidate's host peak."""
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
    on_host = args.cpu_only or args.host_memory is not None or args.disk is not None
    host = {id(e): host_of(e, facts, args.nproc, args.cpu_only) for e in cands} if on_host else {}
    device = None if args.cpu_only else args.device_memory
    ranked = choose(
        cands, device, args.cpu_memory, host=host, host_memory=args.host_memory, disk=args.disk
    )
    return ranked, host


def main(args: argparse.Namespace) -> int:
    if args.this_host:
        this_host(args)
    if args.device_memory is None and not args.cpu_only:
        raise SystemExit("--device-memory: required (or --cpu-only, or --this-host)")
    facts = facts_from_args(args)
    args.largest_unit = facts.get("largest_unit", 0)
    act, act_line = activations(facts, args, args.precision)
    for line in assumptions(args, facts, act_line):
        print(line)
    ranked, host = propose(args, facts, act)
    device = None if args.cpu_only else args.device_memory
    if not ranked:
        print("nothing fits: reduce the micro-batch, turn on --checkpointing full, or add ranks")
        return 1
    best = ranked[0]
    print("plan: " + _describe(best, device, host.get(id(best))))
    why = (
        "it fits and no layout that fits exchanges fewer bytes"
        if len(ranked) == 1 or ranked[1].comm_bytes_per_step > best.comm_bytes_per_step
        else "it fits, exchanges as few bytes as any layout that fits, and offloads least"
    )
    print(f"why: {why}")
    if len(ranked) > 1:
        print("runner-up: " + _describe(ranked[1], device, host.get(id(ranked[1]))))
    print("ds_config.json for this plan:")
    print(json.dumps(ds_config(best, args), indent=2))
    if best.offload == "nvme" and not args.nvme_path:
        print(f"nvme_path {NVME_PATH} is a placeholder: give a directory on the NVMe drive")
    return 0
