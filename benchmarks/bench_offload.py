"""Offload benchmarks (ZeRO-Offload / ZeRO-Infinity tiers), three parts, one run:

    .venv/bin/python benchmarks/bench_offload.py adam      # CPU optimizer step, params/s
    .venv/bin/python benchmarks/bench_offload.py nvme      # swap-file GB/s against dd
    .venv/bin/python benchmarks/bench_offload.py largest   # biggest GPT per layout, 2 ranks
    .venv/bin/python benchmarks/bench_offload.py all

*adam*: one fp32 tensor of ``--numel`` elements with a gradient, stepped by (a) torch's
fused AdamW directly (``torch.optim.AdamW(fused=True)``), (b) zeroshard's step with
``offload_optimizer: cpu`` (the engine's sharded optimizer on one rank: the inner fused
AdamW on the CPU master copy, then the write-back of the updated values into the
parameters, which on a GPU is the host-to-device copy), (c) zeroshard's inner kernel
alone, and (d) DeepSpeed's ``DeepSpeedCPUAdam`` (C++ AVX kernel, JIT-built) in the
``.venv-bench`` interpreter. Systems alternate within each round; the table gives the
median over rounds. The roof is the machine's memory bandwidth from an in-place triad
(``a += s*c``, 12 bytes of traffic per element) divided by the 28 bytes an fp32 AdamW
step must move per parameter (read p, g, m, v; write p, m, v).

*nvme*: zeroshard's :class:`~zeroshard.offload.nvme.SwapSpace` writes then reads a
``--gib`` file in ``--block-mib`` blocks with O_DIRECT on its I/O threads (the way
NVMe offload swaps sub-groups), against ``dd`` with ``oflag=direct`` / ``iflag=direct``
on the same directory, interleaved.

*largest*: for each layout (stage 3; stage 3 + CPU optimizer and parameter offload;
stage 3 + NVMe optimizer and parameter offload), 2 ranks (gloo, 1 thread each) build
the GPT preset under ``zeroshard.zero.Init`` (never whole on a rank) and train 3 steps
(seq 32, micro-batch 1, fp32 AdamW). Reports per-rank peak RSS, ``memory_stats()``, and
step times. Without ``--models`` each layout tries presets largest-first and records the
first that trains.

Results are printed and appended to ``benchmarks/RESULTS.md`` unless ``--no-record``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time

import _smoke
import torch
from _ranks import RanksFailed, run_ranks
from _record import append_section

from zeroshard.monitor.memory import estimate
from zeroshard.tools.convert import parse_size

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GiB = 2**30
ADAM_BYTES = 28  # fp32 AdamW: read param, grad, exp_avg, exp_avg_sq; write param, m, v

LAYOUTS = {
    "s3": {},
    "s3+cpu": {
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
    },
    "s3+nvme": {
        "offload_optimizer": {
            "device": "nvme",
            "pipeline_read": True,
            "pipeline_write": True,
            "buffer_count": 6,
        },
        "offload_param": {"device": "nvme"},
        "sub_group_size": 20_000_000,  # 3 x 2 buffer sets of 80 MB per rank
    },
}


# -- part 1: CPU Adam -------------------------------------------------------------------
def _median_time(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _triad_gbs(numel: int, steps: int) -> float:
    # in place, like the optimizer (a += s*c: read a and c, write a; 12 B of real
    # traffic per element, no write-allocate reads to leave uncounted)
    a, c = torch.rand(numel), torch.rand(numel) * 1e-6
    a.add_(c, alpha=3.0)
    t = _median_time(lambda: a.add_(c, alpha=3.0), steps)
    return 3 * 4 * numel / t / 1e9


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _raw_fused(numel: int, steps: int, clip: float = 0.0) -> float:
    """torch's fused AdamW; with ``clip``, clipped by hand first (``clip_grad_norm_``:
    a norm pass and a multiply pass over the gradient), as a hand-written loop does."""
    p = torch.nn.Parameter(torch.rand(numel))
    p.grad = torch.rand(numel) * 1e-3
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1, fused=True)

    def step() -> None:
        if clip:
            torch.nn.utils.clip_grad_norm_([p], clip)
        opt.step()

    step()
    return _median_time(step, steps)


class _Flat(torch.nn.Module):
    def __init__(self, numel: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(numel))

    def forward(self, x):
        return (self.w * x).sum()


def _zeroshard(
    numel: int, steps: int, staged: bool = False, clip: float = 0.0
) -> tuple[float, float]:
    """(whole sharded-optimizer step, inner kernel alone) with offload_optimizer cpu.
    ``staged``: on a CPU-only host, the GPU code path (separate fp32 masters, write-back
    into the params); on a GPU host that path is taken anyway, with the host-to-device
    copies of the write-back counted (the step ends when they have landed)."""
    import zeroshard
    from zeroshard.offload.staging import STAGE_ON_CPU_ENV
    from zeroshard.zero.optim.memory_store import MemoryStates

    os.environ[STAGE_ON_CPU_ENV] = "1" if staged else "0"

    model = _Flat(numel)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
        },
    }
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    os.environ.pop(STAGE_ON_CPU_ENV)
    x = torch.full((numel,), 1e-3, device=engine.device)
    engine.backward(engine(x))
    opt = engine.optimizer  # the engine's step at a boundary calls its apply_step
    assert opt is not None

    def step() -> None:
        # norm and flags (with clipping), the store's step and its write-back; the
        # reduced gradients stay until the next window, so the step can be repeated
        assert opt.apply_step(engine.reducer.finalize()), "the step was skipped"
        _sync()

    step()
    if staged:  # as in training: a backward (untimed) before each step, whose landing
        # took the squares the clipping norm adds up (the fused kernel rescales the
        # gradients in place, so a repeated step would take them again)
        times = []
        for _ in range(steps):
            engine.backward(engine(x))
            _sync()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        whole = statistics.median(times)
    else:
        whole = _median_time(step, steps)
    states = opt.states
    assert isinstance(states, MemoryStates)  # CPU offload: the memory store
    states.prepare_step(states.inner, engine.reducer.grad_chunks, 1.0)  # masters' .grad
    inner_t = _median_time(states.inner.step, steps)
    states.clear_grads(states.inner)
    return whole, inner_t


_DS_SNIPPET = r"""
import statistics, sys, time, torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
torch.set_num_threads(int(sys.argv[3]))
n, steps, clip = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[4])
p = torch.nn.Parameter(torch.rand(n)); p.grad = torch.rand(n) * 1e-3
opt = DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=0.1, adamw_mode=True)
def step():
    if clip:  # DeepSpeed's offload step: global norm, then grad.mul_ by the clip factor
        torch.nn.utils.clip_grad_norm_([p], clip)
    opt.step()
step()
ts = []
for _ in range(steps):
    t0 = time.perf_counter(); step(); ts.append(time.perf_counter() - t0)
print("RESULT", statistics.median(ts))
"""


def _deepspeed_cpu_adam(
    py: str, numel: int, steps: int, threads: int, clip: float = 0.0
) -> float | None:
    if not os.path.exists(py) and not shutil.which(py):
        return None
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run(
        [py, "-c", _DS_SNIPPET, str(numel), str(steps), str(threads), str(clip)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    m = re.search(r"RESULT (\S+)", out.stdout)
    if not m:
        print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
        return None
    return float(m.group(1))


def part_adam(args) -> str:
    torch.set_num_threads(args.threads)
    n, steps, clip = args.numel, args.steps, args.clip
    gpu = torch.cuda.is_available()
    keys = ["torch", "zs", "zs_inner", "ds", "torch_clip", "zs_clip", "ds_clip"]
    if not gpu:
        keys += ["zs_gpu", "zs_gpu_clip"]
    rows: dict[str, list[float]] = {k: [] for k in ["triad", *keys]}

    def run(key: str) -> None:
        if key == "torch":
            rows[key].append(_raw_fused(n, steps))
        elif key == "torch_clip":
            rows[key].append(_raw_fused(n, steps, clip))
        elif key == "zs":
            whole, inner = _zeroshard(n, steps)
            rows["zs"].append(whole)
            rows["zs_inner"].append(inner)
        elif key == "zs_clip":
            rows[key].append(_zeroshard(n, steps, clip=clip)[0])
        elif key == "zs_gpu":
            rows[key].append(_zeroshard(n, steps, staged=True)[0])
        elif key == "zs_gpu_clip":
            rows[key].append(_zeroshard(n, steps, staged=True, clip=clip)[0])
        elif key in ("ds", "ds_clip"):
            c = clip if key == "ds_clip" else 0.0
            t = _deepspeed_cpu_adam(args.ds_python, n, steps, args.threads, c)
            if t is not None:
                rows[key].append(t)

    # DeepSpeed's first run JIT-builds its kernel; do it before timing anything.
    _deepspeed_cpu_adam(args.ds_python, 1024, 1, args.threads)
    order = [k for k in keys if k != "zs_inner"]
    for r in range(args.rounds):
        rows["triad"].append(_triad_gbs(n, steps))
        for key in order if r % 2 == 0 else order[::-1]:
            run(key)
        print(f"round {r}: " + ", ".join(f"{k}={v[-1]:.4g}" for k, v in rows.items() if v))
    bw = statistics.median(rows["triad"])
    roof = bw * 1e9 / ADAM_BYTES
    base = statistics.median(rows["torch"])

    def line(name: str, key: str, note: str) -> str:
        if not rows[key]:
            return f"| {name} | not run | | | | {note} |"
        t = statistics.median(rows[key])
        rng = f"[{min(rows[key]):.4f}-{max(rows[key]):.4f}]"
        return (
            f"| {name} | {t:.4f} {rng} | {n / t / 1e6:.0f} | {t / base:.2f} | "
            f"{n / t / roof * 100:.0f}% | {note} |"
        )

    where = (
        f"GPU host ({torch.cuda.get_device_name(0)}): the whole step includes the write-back's "
        "host-to-device copies (pinned masters)"
        if gpu
        else "CPU-only host"
    )
    whole_note = (
        "fused AdamW on pinned CPU masters, each segment's H2D copy overlapping the next "
        "segment's step"
        if gpu
        else "CPU-only run: fused AdamW on the masters, which are the parameters"
    )
    lines = [
        f"{n / 1e6:.0f}M fp32 parameters, {args.threads} thread(s), {args.rounds} rounds x "
        f"{steps} steps (median); {where}; triad bandwidth {bw:.1f} GB/s "
        f"[{min(rows['triad']):.1f}-{max(rows['triad']):.1f}] -> AdamW roof "
        f"{roof / 1e6:.0f} M params/s ({ADAM_BYTES} B/param)",
        "",
        "| optimizer step | seconds, median [min-max] | M params/s | x torch fused | "
        "of roof | what it does |",
        "|---|---|---|---|---|---|",
        line("torch AdamW(fused=True)", "torch", "the kernel, nothing else"),
        line("zeroshard inner kernel", "zs_inner", "the fused AdamW on the CPU master only"),
        line("DeepSpeedCPUAdam", "ds", "DeepSpeed 0.19.8's C++ kernel (adamw_mode)"),
        line("zeroshard offload_optimizer cpu (whole step)", "zs", whole_note),
    ]
    if not gpu:
        lines.append(
            line(
                "zeroshard, GPU code path (whole step)",
                "zs_gpu",
                "fused AdamW on separate CPU masters + write-back into the params "
                "(on a GPU host: the H2D copy)",
            )
        )
        lines.append(
            line(
                f"zeroshard, GPU code path, gradient_clipping {clip}",
                "zs_gpu_clip",
                "as above; the norm adds the squares the host took as each gradient "
                "chunk landed (during backward), the clip factor folded into the kernel",
            )
        )
    lines += [
        line(
            f"torch fused AdamW + clip_grad_norm_({clip})",
            "torch_clip",
            "by hand: norm pass, multiply pass, kernel",
        ),
        line(
            f"DeepSpeedCPUAdam + clip {clip}",
            "ds_clip",
            "as DeepSpeed's offload step does it: norm pass, grad.mul_, kernel",
        ),
        line(
            f"zeroshard whole step, gradient_clipping {clip}",
            "zs_clip",
            "norm pass, then the clip factor folded into the fused kernel (grad_scale)",
        ),
    ]
    lines += ["", "Per-round ratios (median over rounds; each round runs both, adjacent):", ""]
    for a, b, what in (
        ("zs", "ds", "zeroshard whole step / DeepSpeedCPUAdam, no clipping"),
        ("zs_clip", "ds_clip", f"zeroshard whole step / DeepSpeedCPUAdam, clip {clip}"),
        ("zs_clip", "torch_clip", f"zeroshard whole step / torch by hand, clip {clip}"),
        ("zs_gpu", "torch", "zeroshard GPU code path / torch fused AdamW alone"),
        ("zs_gpu_clip", "torch", f"zeroshard GPU code path, clip {clip} / torch fused AdamW alone"),
    ):
        if rows[a] and len(rows[a]) == len(rows[b]):
            ratios = [x / y for x, y in zip(rows[a], rows[b], strict=True)]
            wins = sum(r < 1 for r in ratios)
            lines.append(
                f"- {what}: {statistics.median(ratios):.2f} "
                f"[{min(ratios):.2f}-{max(ratios):.2f}], faster in {wins} of {len(ratios)} rounds"
            )
    return "\n".join(lines)


# -- part 2: NVMe swap I/O ------------------------------------------------------------
def _swap_rates(path: str, nbytes: int, block: int) -> tuple[float, float, bool]:
    from zeroshard.offload.nvme import SwapSpace, aligned_empty

    space = SwapSpace(path, "bench", threads=2)
    try:
        f = space.file("bench", nbytes)
        bufs = [aligned_empty(block) for _ in range(4)]
        for b in bufs:
            b.fill_(7)
        offsets = list(range(0, nbytes, block))

        def run(op) -> float:
            t0 = time.perf_counter()
            pending: list = []
            for i, off in enumerate(offsets):
                if len(pending) == len(bufs):
                    pending.pop(0).result()
                pending.append(op(f, bufs[i % len(bufs)], off))
            for p in pending:
                p.result()
            os.fsync(f.fd)
            return nbytes / (time.perf_counter() - t0) / 1e9

        write = run(space.write_async)
        read = run(space.read_async)
        return write, read, space.direct
    finally:
        space.close()


def _dd_rates(path: str, nbytes: int, block: int) -> tuple[float, float]:
    target = os.path.join(path, "dd-bench")
    bs, count = f"{block // 2**20}M", nbytes // block
    try:
        t0 = time.perf_counter()
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={target}", f"bs={bs}", f"count={count}", "oflag=direct"],
            check=True,
            capture_output=True,
        )
        write = nbytes / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        subprocess.run(
            ["dd", f"if={target}", "of=/dev/null", f"bs={bs}", "iflag=direct"],
            check=True,
            capture_output=True,
        )
        read = nbytes / (time.perf_counter() - t0) / 1e9
        return write, read
    finally:
        if os.path.exists(target):
            os.remove(target)


def part_nvme(args) -> str:
    os.makedirs(args.nvme_path, exist_ok=True)
    nbytes, block = int(args.gib * GiB), args.block_mib * 2**20
    zs_w, zs_r, dd_w, dd_r = [], [], [], []
    direct = False
    for r in range(args.rounds):
        order = ["zs", "dd"] if r % 2 == 0 else ["dd", "zs"]
        for who in order:
            if who == "zs":
                w, rd, direct = _swap_rates(args.nvme_path, nbytes, block)
                zs_w.append(w)
                zs_r.append(rd)
            else:
                w, rd = _dd_rates(args.nvme_path, nbytes, block)
                dd_w.append(w)
                dd_r.append(rd)
        print(f"round {r}: zs w/r {zs_w[-1]:.2f}/{zs_r[-1]:.2f}  dd {dd_w[-1]:.2f}/{dd_r[-1]:.2f}")

    def cell(v: list[float]) -> str:
        return f"{statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]"

    med = statistics.median
    return "\n".join(
        [
            f"{args.gib:g} GiB file in {args.block_mib} MiB blocks under `{args.nvme_path}`, "
            f"{args.rounds} rounds interleaved (median [min-max]); O_DIRECT: {direct}",
            "",
            "| | write GB/s | read GB/s |",
            "|---|---|---|",
            f"| zeroshard SwapSpace (2 I/O threads, 4 buffers) | {cell(zs_w)} | {cell(zs_r)} |",
            f"| dd oflag/iflag=direct | {cell(dd_w)} | {cell(dd_r)} |",
            f"| ratio | {med(zs_w) / med(dd_w):.2f} | {med(zs_r) / med(dd_r):.2f} |",
        ]
    )


# -- part 3: the largest GPT per layout -----------------------------------------------
def _swap_bytes(path: str) -> int:
    """Bytes the files under ``path`` occupy on disk (allocated blocks)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(FileNotFoundError):  # another rank's, just removed
                total += os.stat(os.path.join(root, f)).st_blocks * 512
    return total


def rank_main(argv: list[str]) -> None:
    """One rank of a 'largest' run (started by ``zeroshard run --nproc N``)."""
    p = argparse.ArgumentParser()
    p.add_argument("--preset", required=True)
    p.add_argument("--layout", required=True)
    p.add_argument("--config", default="", help="the zero_optimization section (JSON)")
    p.add_argument("--nvme-path", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    import zeroshard
    from zeroshard.models import GPT, GPTConfig

    torch.set_num_threads(a.threads)
    zc = json.loads(a.config) if a.config else json.loads(json.dumps(LAYOUTS[a.layout]))
    for key in ("offload_optimizer", "offload_param"):
        if zc.get(key, {}).get("device") == "nvme":
            zc[key]["nvme_path"] = a.nvme_path
    if not a.config:  # the fixed layouts; a plan's config is run as it is
        zc.setdefault("stage3_param_persistence_threshold", 0)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "weight_decay": 0.1}},
        # a short linear warm-up: the first steps of a large random model at full lr
        # overshoot; the steps measured are all there is
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": a.lr / 10,
                "warmup_max_lr": a.lr,
                "warmup_num_steps": max(a.steps - 1, 1),
                "warmup_type": "linear",
            },
        },
        "zero_optimization": {"stage": 3, **zc},
    }
    t0 = time.perf_counter()
    torch.manual_seed(0)
    gcfg = GPTConfig.preset(a.preset, vocab_size=256, seq_len=32)
    with zeroshard.zero.Init(config=cfg):
        model = GPT(gcfg)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    init_s = time.perf_counter() - t0
    rank = engine.global_rank
    # one batch, repeated: a few steps can only show training as a falling loss on it
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 256, (1, 33), generator=g)
    times, losses = [], []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss = engine(ids[:, :-1], ids[:, 1:])
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    result = {
        "rank": rank,
        "params": gcfg.num_params(),
        "init_s": init_s,
        "step_s": times,
        "losses": losses,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "memory": engine.memory_stats(),
        "disk": _swap_bytes(a.nvme_path),
    }
    with open(f"{a.out}.{rank}", "w") as f:
        json.dump(result, f)


def _planned(args, preset: str):
    """``zeroshard plan``'s proposal for this host (RAM it may use: ``--host-memory``;
    disk: free space under ``--nvme-path``) and the preset, with its host estimate."""
    from zeroshard.tools import plan

    ns = argparse.Namespace(
        model=preset, params=None, nproc=args.nproc, nnodes=1, precision="fp32", seq=32,
        micro_batch=1, checkpointing="none", gas=1, bucket=None, tp=1, sp=1,
        megatron_sp=False, device_memory=None, cpu_memory=None, host_memory=args.host_memory,
        disk=None, cpu_only=True, this_host=True, nvme_path=args.nvme_path,
    )  # fmt: skip
    plan.this_host(ns)
    facts = plan.facts_from_args(ns)
    ns.largest_unit = facts.get("largest_unit", 0)
    act, _ = plan.activations(facts, ns, "fp32")
    ranked, host = plan.propose(ns, facts, act)
    if not ranked:
        return None
    best = ranked[0]
    return plan.ds_config(best, ns)["zero_optimization"], best, host[id(best)]


def _estimated(preset: str, zc: dict, nproc: int):
    """The host estimate of a fixed layout (``LAYOUTS``) for the preset."""
    from zeroshard.monitor.host_memory import SwapTuning, host_peak
    from zeroshard.tools.estimate import facts_from_args

    facts = facts_from_args(argparse.Namespace(model=preset, params=None, seq=32))
    opt = zc.get("offload_optimizer", {})
    e = estimate(
        facts["params"],
        nproc,
        stage=3,
        precision="fp32",
        offload=opt.get("device", "none"),
        offload_params="offload_param" in zc,
        largest_unit=facts["largest_unit"],
        reuse_numel=zc.get("stage3_max_reuse_distance", 10**9),
    )
    swap = SwapTuning(
        sub_group_numel=zc.get("sub_group_size", 10**9),
        pipelined=opt.get("pipeline_read", False) or opt.get("pipeline_write", False),
        param_buffers=zc.get("offload_param", {}).get("buffer_count", 5),
    )
    return e, host_peak(
        e,
        params=facts["params"],
        ranks=nproc,
        cpu_only=True,
        largest_unit=facts["largest_unit"],
        largest_param=facts.get("largest_param", 0),
        swap=swap,
    )


def _run_largest(args, layout: str, preset: str, zc: dict) -> dict:
    argv = ["--preset", preset, "--layout", layout, "--config", json.dumps(zc)]
    argv += ["--nvme-path", args.nvme_path, "--steps", str(args.train_steps)]
    argv += ["--lr", str(args.lr), "--threads", str(args.rank_threads), "--out"]
    t0 = time.perf_counter()
    try:
        ranks = run_ranks(
            __file__,
            argv,
            nproc=args.nproc,
            env={"OMP_NUM_THREADS": str(args.rank_threads)},
            timeout=args.timeout,
            prefix="zs-largest-",
        )
    except RanksFailed as exc:
        wall = time.perf_counter() - t0
        tail = exc.output[-1500:]
        print(f"{layout} {preset}: failed (exit {exc.returncode})\n{tail}", file=sys.stderr)
        return {"ok": False, "why": f"exit {exc.returncode}", "wall": wall}
    finally:
        leftover = _swap_bytes(args.nvme_path)
        if leftover:
            print(
                f"swap files left under {args.nvme_path}: {leftover / GiB:.2f} GiB", file=sys.stderr
            )
    return {"ok": True, "ranks": ranks, "wall": time.perf_counter() - t0}


def _vs(measured: float, predicted: float) -> str:
    return (
        f"{measured / GiB:.2f} / {predicted / GiB:.2f} ({(predicted / measured - 1) * 100:+.0f}%)"
    )


def part_largest(args) -> str:
    from zeroshard.models import GPTConfig

    total_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    threads = args.rank_threads
    lines = [
        f"{args.nproc} rank(s) (gloo, {threads} thread(s) each), seq 32, micro-batch 1, fp32 "
        f"AdamW (lr {args.lr:g}, linear warm-up from lr/10 over the first "
        f"{max(args.train_steps - 1, 1)} steps), one batch repeated, {args.train_steps} steps; "
        f"machine RAM {total_ram / GiB:.1f} GiB, {os.cpu_count()} cores; NVMe path "
        f"`{args.nvme_path}`; layout `plan`: what `zeroshard plan --this-host --cpu-only "
        f"--host-memory {args.host_memory / GiB:g}GiB --precision fp32 --seq 32 --nproc "
        f"{args.nproc}` proposes. Peak RSS: each rank's ru_maxrss (building included); disk: "
        "the swap files' allocated bytes while training. Measured / estimated (estimate's "
        "error).",
        "",
        "| layout | GPT | params | step s | loss per step | peak RSS per rank, GiB | "
        "peak RSS all ranks, GiB | swap files, GiB | init s | result |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for layout in args.layouts.split(","):
        for preset in args.models.split(","):
            n = GPTConfig.preset(preset, vocab_size=256, seq_len=32).num_params()
            if layout == "plan":
                planned = _planned(args, preset)
                if planned is None:
                    lines.append(f"| plan | {preset} | {n / 1e9:.2f}B | | | | | | | nothing fits |")
                    print(lines[-1])
                    continue
                zc, _, peak = planned
            else:
                zc = json.loads(json.dumps(LAYOUTS[layout]))
                zc.setdefault("stage3_param_persistence_threshold", 0)
                _, peak = _estimated(preset, zc, args.nproc)
            print(f"{layout} {preset}: zero_optimization {json.dumps(zc)}; estimate: peak RSS "
                  f"{peak.rss / GiB:.2f} GiB per rank ({peak.parts}), swap {peak.disk / GiB:.2f} GiB")  # fmt: skip
            if args.max_rss and peak.total_rss > args.max_rss:
                lines.append(
                    f"| {layout} | {preset} | {n / 1e9:.2f}B | | | | estimate "
                    f"{peak.total_rss / GiB:.2f} | | | not run: over --max-rss |"
                )
                print(lines[-1])
                continue
            res = _run_largest(args, layout, preset, zc)
            if not res["ok"]:
                lines.append(
                    f"| {layout} | {preset} | {n / 1e9:.2f}B | | | | | | | "
                    f"failed ({res['why']}, {res['wall']:.0f} s) |"
                )
                print(lines[-1])
                continue
            ranks = res["ranks"]
            steps = " / ".join(
                f"{max(t):.1f}" for t in zip(*(r["step_s"] for r in ranks), strict=True)
            )
            losses = " / ".join(f"{x:.3f}" for x in ranks[0]["losses"])
            per_rank = max(r["peak_rss"] for r in ranks)
            total = sum(r["peak_rss"] for r in ranks)
            disk = max(r["disk"] for r in ranks)  # every rank sees every rank's files
            falling = all(
                b < a for a, b in zip(ranks[0]["losses"], ranks[0]["losses"][1:], strict=False)
            )
            lines.append(
                f"| {layout} | {preset} | {n / 1e9:.2f}B | {steps} | {losses} | "
                f"{_vs(per_rank, peak.rss)} | {_vs(total, peak.total_rss)} | "
                f"{_vs(disk, peak.total_disk)} | {max(r['init_s'] for r in ranks):.0f} | "
                f"trained; loss {'falling' if falling else 'NOT falling'} |"
            )
            print(lines[-1])
            print("memory_stats r0:", ranks[0]["memory"])
            if not args.all_models:
                break
    return "\n".join(lines)


# -- driver -----------------------------------------------------------------------------
def _record(path: str, title: str, command: str, body: str) -> None:
    append_section(path, f"bench_offload {title}", command, body)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_rank":
        rank_main(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=["adam", "nvme", "largest", "all"])
    p.add_argument("--numel", type=int, default=50_000_000)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--clip", type=float, default=1.0, help="gradient_clipping of the clip rows")
    p.add_argument(
        "--ds-python", default=os.path.join(ROOT, ".venv-bench", "bin", "python"), help="for DS"
    )
    p.add_argument("--nvme-path", default=os.path.join(ROOT, "runs", "nvme"))
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--block-mib", type=int, default=64)
    p.add_argument("--layouts", default="s3,s3+cpu,s3+nvme", help="or plan: zeroshard plan's")
    p.add_argument("--models", default="1.6B,1B,350M", help="presets, tried in this order")
    p.add_argument("--nproc", type=int, default=2, help="ranks of the largest runs")
    p.add_argument("--rank-threads", type=int, default=0, help="per rank (0: cores / nproc)")
    p.add_argument("--train-steps", type=int, default=3, help="steps of the largest runs")
    p.add_argument("--lr", type=float, default=1e-4, help="peak lr of the largest runs")
    p.add_argument(
        "--host-memory", type=parse_size, default=15 * GiB, help="RAM the plan may use (all ranks)"
    )
    p.add_argument(
        "--max-rss", type=parse_size, default=0, help="skip a run whose estimate is above this"
    )
    p.add_argument("--all-models", action="store_true", help="run every preset, not the first fit")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    p.add_argument("--no-record", action="store_true")
    _smoke.add_flag(p)
    args = p.parse_args()
    args.rank_threads = args.rank_threads or max(1, (os.cpu_count() or 1) // args.nproc)
    if args.smoke:  # every part, tiny: 4096 elements, a 16 MiB swap file, GPT tiny on NVMe
        args.numel, args.steps, args.rounds, args.threads = 4096, 1, 1, 1
        args.nvme_path, args.gib, args.block_mib = _smoke.scratch("offload"), 1 / 64, 1
        args.layouts, args.models, args.timeout, args.no_record = "s3+nvme", "tiny", 600, True
        if not os.path.exists(args.ds_python):
            _smoke.skip("DeepSpeedCPUAdam rows", f"no {args.ds_python} (make .venv-bench)")
    command = ".venv/bin/python benchmarks/bench_offload.py " + shlex.join(sys.argv[1:])
    parts = ["adam", "nvme", "largest"] if args.part == "all" else [args.part]
    for part in parts:
        body = {"adam": part_adam, "nvme": part_nvme, "largest": part_largest}[part](args)
        print(body)
        if not args.no_record:
            _record(args.results, part, command, body)


if __name__ == "__main__":
    main()
