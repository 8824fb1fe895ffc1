"""ZeRO-Offload on a GPU host: one GPU, one rank, a bf16 GPT, AdamW.

    python benchmarks/bench_offload_gpu.py --preset 1B --rounds 3

Systems, each in a fresh process, interleaved round by round:

* ``gpu``: stage 2 without offload (masters and Adam states in GPU memory: the speed a
  model that fits reaches);
* ``offload``: stage 2 + ``offload_optimizer: {device: cpu, pin_memory: true}``:
  gradient chunks leave the GPU during backward through pinned double buffers on a side
  stream; the CPU steps the fp32 masters segment by segment, each segment's upload and
  cast back into the bf16 parameters overlapping the next segment's step;
* ``offload-serial``: the same with the per-segment pipeline turned off (step every
  segment, then upload every segment): what the overlap saves;
* ``offload-dpu``: ``offload`` with ``delayed_update`` (ZeRO-Offload's one-step delayed
  parameter update, ``delayed_update_after: 0`` so every timed step is delayed): the
  CPU step of step t runs in a thread during step t+1's forward and backward. Not the
  same update rule: its losses differ from the others' after the first step;
* ``offload-twin``: ``offload`` with ZeRO-Offload++ Twin-Flow (``ratio``: ``--ratio``,
  default 0.35, what ``zeroshard plan`` proposes for the 1B GPT at stage 2 on a device
  holding 0.85 of its all-GPU need, as ``gpu_check.py``'s row): the leading segments'
  masters, moments and gradients stay on the GPU and step there while the CPU steps the
  rest;
* ``naive``: a hand-written CPU-AdamW hybrid (seeds/004 without ZeRO): after backward,
  the bf16 gradients go to the CPU (``.float().cpu()``), torch's fused AdamW steps fp32
  masters there, and the result is copied back into the parameters.

Reported: median step time (forward + backward + step, synchronized), tokens/s, the
GPU memory peak, and the losses of the first and last step (all systems run the same
data and the same update rule, except ``offload-dpu``, so those losses must agree to
bf16 noise).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

import torch
from _record import append_section

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SYSTEMS = ("gpu", "offload", "offload-dpu", "offload-twin", "offload-serial", "naive")
PHASES = {"fwd+bwd": 0.0, "step": 0.0, "norm": 0.0}  # seconds summed over timed steps


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _batch(step: int, micro: int, seq: int, vocab: int, device) -> tuple:
    g = torch.Generator().manual_seed(step)
    data = torch.randint(0, vocab, (micro, seq + 1), generator=g).to(device)
    return data[:, :-1], data[:, 1:]


def _zeroshard_step_fn(model, system: str, args):
    import zeroshard
    from zeroshard.zero.optim.memory_store import MemoryStates

    zero = {"stage": 2, "reduce_bucket_size": args.bucket, "allgather_bucket_size": args.bucket}
    if system != "gpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if system == "offload-dpu":
        zero["offload_optimizer"] |= {"delayed_update": True, "delayed_update_after": 0}
    if system == "offload-twin":
        zero["offload_optimizer"] |= {"ratio": args.ratio}
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    assert engine.optimizer is not None  # the config has an optimizer
    if system == "offload-serial":
        states = engine.optimizer.states
        assert isinstance(states, MemoryStates)  # CPU offload: the memory store
        states.pipelined = False

    opt = engine.optimizer
    norm_fn = opt._global_norm

    def timed_norm(local) -> float:
        t0 = time.perf_counter()
        out = norm_fn(local)
        PHASES["norm"] += time.perf_counter() - t0
        return out

    opt._global_norm = timed_norm  # type: ignore[method-assign]  # timing instrumentation

    def step(x, y) -> float:
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        _sync()
        t1 = time.perf_counter()
        engine.step()
        _sync()
        PHASES["fwd+bwd"] += t1 - t0
        PHASES["step"] += time.perf_counter() - t1
        return loss

    return step, engine.device


def _naive_step_fn(model, args):
    gpu = torch.cuda.is_available()  # (--smoke on a CPU host: the same code, nothing pinned)
    dev = torch.device("cuda" if gpu else "cpu")
    model.to(dev, torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().cpu() for p in params]
    masters = [(m.pin_memory() if gpu else m).requires_grad_(True) for m in masters]
    opt = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.1, fused=True)

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        for m, p in zip(masters, params, strict=True):
            m.grad = p.grad.float().cpu()
            p.grad = None
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, params, strict=True):
                p.copy_(m)
        return loss

    return step, dev


def child(system: str, args) -> dict:
    from zeroshard.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig.preset(args.preset, vocab_size=args.vocab, seq_len=args.seq)
    model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    if system == "naive":
        step, dev = _naive_step_fn(model, args)
    else:
        step, dev = _zeroshard_step_fn(model, system, args)
    init = time.perf_counter() - t0
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        x, y = _batch(i, args.micro, args.seq, args.vocab, dev)
        _sync()
        t0 = time.perf_counter()
        loss = step(x, y)
        _sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        else:
            PHASES.update(dict.fromkeys(PHASES, 0.0))
        losses.append(float(loss))
    return {
        "params": n,
        "step": statistics.median(times),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0,
        "init": init,
        "phases": {k: v / args.steps for k, v in PHASES.items()},
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }


def _run_child(system: str, argv: list[str]) -> dict | None:
    cmd = [sys.executable, os.path.abspath(__file__), "_child", system, *argv]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    print(f"{system} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}", file=sys.stderr)
    return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="1B")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--bucket", type=int, default=50_000_000)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--ratio", type=float, default=0.35, help="offload-twin's offload_optimizer.ratio")  # fmt: skip
    p.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    p.add_argument("--no-record", action="store_true")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CI, no GPU: GPT tiny, every system once in this process, the offload systems "
        "on the GPU code path (ZEROSHARD_STAGE_ON_CPU=1); records nothing",
    )
    return p


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "_child":
        system, args = sys.argv[2], _parser().parse_args(sys.argv[3:])
        print("RESULT " + json.dumps(child(system, args)), flush=True)
        return
    args = _parser().parse_args()
    argv = sys.argv[1:]
    if args.smoke:
        args.preset, args.vocab, args.seq, args.micro, args.bucket = "tiny", 256, 16, 2, 4096
        args.steps, args.warmup, args.rounds, args.no_record = 1, 1, 1, True
        if not torch.cuda.is_available():
            os.environ["ZEROSHARD_STAGE_ON_CPU"] = "1"
    child_argv = [a for a in argv if a not in ("--no-record",)]
    systems = args.systems.split(",")
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for r in range(args.rounds):
        for s in systems if r % 2 == 0 else systems[::-1]:
            # smoke: in this process (one interpreter instead of one per system)
            res = child(s, args) if args.smoke else _run_child(s, child_argv)
            if res is not None:
                runs[s].append(res)
                print(f"round {r} {s}: {res}", flush=True)
    tokens = args.micro * args.seq
    base = statistics.median(x["step"] for x in runs["gpu"]) if runs.get("gpu") else None
    any_run = next(v[0] for v in runs.values() if v)
    lines = [
        f"GPT {args.preset} ({any_run['params'] / 1e9:.2f}B params, vocab {args.vocab}), bf16, "
        f"seq {args.seq}, micro-batch {args.micro}, AdamW, clip 1.0, bucket {args.bucket:,}; "
        f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}, "
        f"{os.cpu_count()} CPU cores; {args.rounds} rounds "
        f"x {args.steps} timed steps after {args.warmup} warm-up (median [min-max] of rounds)",
        "",
        "| system | step s | x gpu | tokens/s | fwd+bwd / step / norm s | GPU peak GiB "
        "| loss first -> last |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in systems:
        v = runs[s]
        if not v:
            lines.append(f"| {s} | failed | | | | | |")
            continue
        st = [x["step"] for x in v]
        med = statistics.median(st)
        ph = v[len(v) // 2]["phases"]
        phases = (
            f"{ph['fwd+bwd']:.3f} / {ph['step']:.3f} / {ph['norm']:.3f}" if ph["step"] else "n/a"
        )
        ratio = f"{med / base:.2f}" if base else ""
        lines.append(
            f"| {s} | {med:.3f} [{min(st):.3f}-{max(st):.3f}] | {ratio} | {tokens / med:,.0f} | "
            f"{phases} | {max(x['peak_gib'] for x in v):.1f} | {v[0]['first_loss']:.4f} -> "
            f"{v[0]['last_loss']:.4f} |"
        )
    body = "\n".join(lines)
    print(body)
    if not args.no_record:
        command = "python3 benchmarks/bench_offload_gpu.py " + shlex.join(argv)
        append_section(args.results, "bench_offload_gpu", command, body, cores=False)


if __name__ == "__main__":
    main()
