"""`zeroshard estimate`: per-rank bytes for every stage x offload x precision.

    zeroshard estimate --params 7e9 --nproc 4
    zeroshard estimate --model 25M --nproc 2 --seq 1024 --micro-batch 4 --checkpointing full
    zeroshard estimate --model mypkg.models:build --nproc 8 --nnodes 2

``--model`` is a built-in GPT preset (``tiny``, ``small``, ``25M``, ``100M``, ...) or a
``module:function`` returning an ``nn.Module`` (built on the meta device, so nothing
is allocated). Activations (``--seq``) are estimated for the built-in GPT only — a
preset, or a ``module:function`` that returns a ``zeroshard.models.GPT`` — because the
formula needs its layer shapes; for anything else (and for ``--params``) the output
says that activations are not included.

Every figure is in GiB (2^30 bytes). The second line of the output is the ZeRO
paper's model-state formula for mixed-precision Adam: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N,
16Ψ/N bytes. For 7e9 parameters on 4 ranks that is 104.31 / 45.63 / 35.86 / 26.08 GiB
(the paper's unit, 10^9-byte GB: 112 / 49 / 38.5 / 28), and the bf16/fp16 rows of the
table ("states") are the same bytes at stages 0-2; at stage 3 zeroshard keeps the
parameter shard in fp32 as the master, 14 bytes per parameter: 22.82 GiB (24.5 GB).

``--tp`` / ``--sp`` (``--megatron-sp``) place tensor- and sequence-parallel ranks among
the ranks: parameters are divided by tp, ZeRO shards over the rest, activations follow
``memory.activation_bytes``.

seeds/004's table for the same case says 98 / 56 / 35 / 24.5 GB per GPU (91.27 / 52.15 /
32.60 / 22.82 GiB). It counts
2-byte parameters, 4-byte (fp32) gradients and 8 bytes of optimizer state (Adam's two
moments), 14 bytes per parameter, where the paper and zeroshard count 2 + 2 + 12:
gradients are kept in the 2-byte compute dtype, and the optimizer state includes the
fp32 master weights (4 bytes), which the seed leaves out. The seed's stage columns
follow from that: 14Ψ, 6Ψ + 8Ψ/N, 2Ψ + 12Ψ/N, 14Ψ/N. Per rank it differs from the
paper by +2 bytes of gradient and -4 bytes of master per parameter, each whole or
divided by N as the stage shards it: stage 0 +2Ψ - 4Ψ = -14 GB (98 vs 112), stage 1
+2Ψ - 4Ψ/N = +7 GB (56 vs 49), stages 2 and 3 (+2 - 4)Ψ/N = -3.5 GB (35 vs 38.5,
24.5 vs 28). Its "total" row is the per-GPU figure times 4. zeroshard's fp32 training
(no separate masters: the parameters are the masters) is 4 + 4 + 8 = 16 bytes too.
"""

from __future__ import annotations

import argparse
import importlib
import math
import re

import torch

from zeroshard.monitor.host_memory import SwapTuning, host_peak
from zeroshard.monitor.memory import (
    OFFLOADS,
    POLICIES,
    PRECISIONS,
    activation_bytes,
    estimate,
    paper_bytes,
)
from zeroshard.zero.layout.segments import DEFAULT_BUCKET_BYTES


def _model_facts(spec: str, seq: int = 0) -> dict:
    """Parameter count, largest module's own parameters and, for the built-in GPT, the
    shapes the activation formula needs (else ``activations_unknown`` says why)."""
    from zeroshard.models import GPT, GPTConfig, preset_names

    if spec in preset_names():
        cfg = GPTConfig.preset(spec, seq_len=max(seq, GPTConfig.seq_len))
        with torch.device("meta"):
            model: torch.nn.Module = GPT(cfg)
    else:
        model = _user_model(spec)
    facts: dict = {}
    if isinstance(model, GPT):
        cfg = model.cfg
        facts = {
            "layers": cfg.n_layer,
            "hidden": cfg.d_model,
            "vocab": cfg.vocab_size,
            "mlp_ratio": cfg.mlp_ratio,
            "tied_embeddings": cfg.tie_embeddings,
        }
    else:
        facts["activations_unknown"] = (
            f"{spec} builds a {type(model).__name__}, not zeroshard.models.GPT, and the "
            "activation formula needs the GPT's layer shapes"
        )
    numels = [p.numel() for p in model.parameters()]
    facts["params"] = sum(numels)
    facts["largest_param"] = max(numels, default=0)
    own = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()]
    facts["largest_unit"] = max(own)
    return facts


def _count(text: str) -> float | None:
    """``7B``, ``1.3b``, ``350M``, ``7e9`` as a number of parameters, else None."""
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)([kmbt]?)", text.strip().lower())
    if not m:
        return None
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2)]


def _sci(value: float) -> str:
    """7e9 as ``7e9``, 1.3e9 as ``1.3e9`` (what ``--params`` takes)."""
    exp = math.floor(math.log10(value))
    return f"{value / 10**exp:g}e{exp}"


def _user_model(spec: str) -> torch.nn.Module:
    """The ``nn.Module`` a ``module:function`` spec builds, on the meta device."""
    from zeroshard.models import preset_names

    if ":" not in spec:
        presets = ", ".join(preset_names())
        count = _count(spec)
        hint = f"; for a parameter count use --params {_sci(count)}" if count else ""
        raise SystemExit(
            f"--model {spec!r}: not a GPT preset ({presets}) nor a module:function{hint}"
        )
    mod, fn = spec.split(":", 1)
    try:
        build = getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"--model {spec!r}: cannot import it: {exc}") from None
    with torch.device("meta"):
        model = build()
    if not isinstance(model, torch.nn.Module):
        raise SystemExit(f"--model {spec!r}: returned {type(model).__name__}, not an nn.Module")
    return model


def facts_from_args(args: argparse.Namespace) -> dict:
    if args.model:
        return _model_facts(args.model, args.seq)
    return {
        "params": int(args.params),
        "activations_unknown": "a parameter count gives no layer shapes (use --model)",
    }


def activations(facts: dict, args: argparse.Namespace, precision: str) -> tuple[int, str]:
    """Peak activation bytes for ``precision`` and a line saying what was included."""
    if "layers" not in facts:
        return 0, f"activations: not included: {facts['activations_unknown']}"
    if not args.seq:
        return 0, "activations: not included (give --seq and --micro-batch)"
    act = activation_bytes(
        layers=facts["layers"],
        hidden=facts["hidden"],
        seq=args.seq,
        micro_batch=args.micro_batch,
        vocab=facts["vocab"],
        policy=args.checkpointing,
        dtype_bytes=4 if precision == "fp32" else 2,
        mlp_ratio=facts["mlp_ratio"],
        tied_embeddings=facts["tied_embeddings"],
        tp=args.tp,
        sequence_parallel=args.megatron_sp,
        sp=args.sp,
    )
    return act, (
        f"activations ({precision}, peak, seq {args.seq}, micro-batch {args.micro_batch}, "
        f"checkpointing {args.checkpointing}"
        + (f", tp {args.tp}, sp {args.sp}" if args.tp * args.sp > 1 else "")
        + f"): {act / 2**30:.2f} GiB"
    )


def tp_numel(facts: dict, args: argparse.Namespace) -> int:
    """b·s·h x layers: what each tensor-parallel all-reduce moves, per layer (0: unknown)."""
    if "layers" not in facts or not args.seq:
        return 0
    return args.micro_batch * args.seq * facts["hidden"] * facts["layers"]


def gib(n: int) -> str:
    return f"{n / 2**30:8.2f}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0]
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=float, help="parameter count, e.g. 7e9")
    src.add_argument("--model", help=model_help())
    parser.add_argument("--nproc", type=int, default=1, help="ranks per node")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--precision", choices=[*PRECISIONS, "all"], default="all")
    parser.add_argument("--seq", type=int, default=0, help="sequence length (activations)")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--checkpointing", choices=POLICIES, default="none")
    parser.add_argument(
        "--gas",
        type=int,
        default=1,
        help="gradient_accumulation_steps (above 1, CPU/NVMe offload at stages 2-3 sums "
        "micro-steps on the device: an fp32 gradient shard there)",
    )
    parser.add_argument(
        "--bucket",
        type=float,
        default=None,
        help="reduce_bucket_size (default: zeroshard's, 25 MiB of gradients)",
    )
    parser.add_argument(
        "--offload-ratio",
        type=float,
        default=1.0,
        help="offload_optimizer.ratio (Twin-Flow): the cpu rows keep 1 - ratio of the "
        "optimizer side on the device, and the parameter shard there (default 1: all "
        "offloaded, stage 3's parameter shard with it)",
    )
    parser.add_argument(
        "--reuse-distance",
        type=float,
        default=1e9,
        help="stage3_max_reuse_distance (0: each unit freed after its forward)",
    )
    host = parser.add_argument_group("host (peak RSS per rank process, swap files)")
    host.add_argument("--host", action="store_true", help="add the host columns")
    host.add_argument("--cpu-only", action="store_true", help="no accelerator: RAM holds it all")
    host.add_argument("--sub-group-size", type=float, default=1e9, help="sub_group_size (NVMe)")
    host.add_argument("--pipeline", action="store_true", help="pipeline_read/write (NVMe)")
    host.add_argument("--param-buffers", type=int, default=5, help="offload_param.buffer_count")
    add_parallel_arguments(parser)


def model_help() -> str:
    from zeroshard.models import preset_names

    return f"a GPT preset ({', '.join(preset_names())}) or module:function"


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (AutoTP)")
    parser.add_argument("--sp", type=int, default=1, help="sequence-parallel ranks (Ulysses)")
    parser.add_argument(
        "--megatron-sp", action="store_true", help="Megatron sequence parallelism inside tp"
    )


def main(args: argparse.Namespace) -> int:
    facts = facts_from_args(args)
    psi, n = facts["params"], args.nproc * args.nnodes
    precisions = list(PRECISIONS) if args.precision == "all" else [args.precision]
    ratio = args.offload_ratio
    if not 0 <= ratio <= 1:
        raise SystemExit(f"--offload-ratio {ratio}: expected a share between 0 and 1")
    if n % (args.tp * args.sp):
        raise SystemExit(f"--tp {args.tp} x --sp {args.sp} must divide the {n} ranks")
    split = (
        f"; tensor parallel {args.tp}, sequence parallel {args.sp}" if args.tp * args.sp > 1 else ""
    )
    print(
        f"{psi:,} parameters on {n // (args.tp * args.sp)} data-parallel ranks "
        f"({args.nnodes} node(s) x {args.nproc}{split}); GiB per rank"
    )
    formulas = ("16Ψ", "4Ψ+12Ψ/N", "2Ψ+14Ψ/N", "16Ψ/N")
    print(
        "ZeRO paper, mixed-precision Adam (2+2+12 bytes per parameter), GiB per rank: "
        + ", ".join(
            f"stage {st} {f} = {paper_bytes(psi, n, st) / 2**30:.2f}"
            for st, f in enumerate(formulas)
        )
    )
    acts = {}
    for prec in precisions:
        acts[prec], line = activations(facts, args, prec)
        if prec == precisions[0] or acts[prec]:
            print(line)
    on_host = args.host or args.cpu_only
    swap = SwapTuning(
        sub_group_numel=int(args.sub_group_size),
        pipelined=args.pipeline,
        param_buffers=args.param_buffers,
    )
    print(
        f"{'precision':9} {'stage':>5} {'offload':>7} | {'params':>8} {'grads':>8} {'optim':>8} "
        f"{'states':>8} {'+buffers':>8} | {'device':>8} {'cpu':>8} {'nvme':>8}"
        + (f" | {'rss/rank':>8} {'rss/node':>8} {'swap':>8}" if on_host else "")
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
                    offload_params=off == "nvme" or (off == "cpu" and ratio == 1),
                    offload_ratio=ratio if off == "cpu" else 1.0,
                    bucket_numel=bucket_numel(args.bucket, prec),
                    largest_unit=facts.get("largest_unit", 0),
                    activations=acts[prec],
                    tp=args.tp,
                    sp=args.sp,
                    tp_activation_numel=tp_numel(facts, args),
                    gradient_accumulation=args.gas,
                    reuse_numel=int(args.reuse_distance),
                )
                loc = e.by_location
                label = f"cpu{ratio:g}" if off == "cpu" and ratio < 1 else off
                row = (
                    f"{prec:9} {stage:>5} {label:>7} | {gib(e.params)} {gib(e.grads)} "
                    f"{gib(e.optimizer_states)} {gib(e.model_states)} {gib(e.buffers)} | "
                    f"{gib(e.device)} {gib(loc.get('cpu', 0))} {gib(loc.get('nvme', 0))}"
                )
                if on_host:
                    h = host_peak(
                        e,
                        params=psi,
                        ranks=args.nproc,
                        cpu_only=args.cpu_only,
                        largest_unit=facts.get("largest_unit", 0),
                        largest_param=facts.get("largest_param", 0),
                        swap=swap,
                    )
                    row += f" | {gib(h.rss)} {gib(h.total_rss)} {gib(h.total_disk)}"
                print(row)
    print(
        "states: the ZeRO paper's model-state bytes; +buffers: zeroshard's gradient staging "
        "(stages 2-3) and always-gathered small parameters; device: what stays on the "
        "device, buffers and activations included, and at stage 3 the parameters kept "
        "gathered from forward to backward (DeepSpeed's default stage3_max_reuse_distance "
        "and stage3_max_live_parameters, 1e9: min(params, 5e8) elements)"
        + (
            f"; cpu{ratio:g}: offload_optimizer.ratio {ratio:g} (Twin-Flow), "
            f"{1 - ratio:g} of the optimizer side and the parameter shard on the device"
            if ratio < 1
            else ""
        )
    )
    if on_host:
        print(
            "host: rss/rank is a rank process's peak resident set (building under zero.Init "
            "or training, the larger), rss/node the node's --nproc ranks together, swap "
            "their swap files; "
            + ("CPU-only: the device's bytes are in RAM too" if args.cpu_only else "")
        )
    return 0


def bucket_numel(given: float | None, precision: str) -> int:
    """Elements per gradient bucket: as given, else zeroshard's default (25 MiB of
    gradients in ``precision``'s gradient dtype)."""
    if given is not None:
        return int(given)
    return DEFAULT_BUCKET_BYTES // PRECISIONS[precision][1]
