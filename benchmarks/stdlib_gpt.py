"""A small GPT trained with zeroshard on real text every machine has: Python's standard
library sources, byte-level (vocabulary 256). Files are split by name (a stable hash), so
the held-out text comes from files the model never saw.

    python benchmarks/stdlib_gpt.py --out /tmp/stdlib-gpt [--steps 300] [--preset small]
    python benchmarks/stdlib_gpt.py --curve --precision fp8 [--steps 300] [--preset tiny]

trains on one rank (zeroshard.initialize, ZeRO stage 0, AdamW), saves a zeroshard
checkpoint under OUT (it records the model config) and prints the held-out loss.
:func:`trained_model` caches it: a second call with the same settings loads the
checkpoint instead of training. Used by tests/test_inference_quality.py and
benchmarks/bench_inference.py.

:func:`loss_curve` (``--curve``) trains in one of :data:`PRECISIONS` (fp32, bf16, or fp8
matmuls over bf16) and returns the loss logged every ``log_every`` steps (the mean over
those steps: every precision sees the same batches) and the held-out loss computed by
the engine in its own precision; tests/test_fp8_quality.py and
benchmarks/bench_fp8_quality.py compare fp8 with bf16 this way.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sysconfig
import tempfile
import time

import torch

CORPUS_BYTES = 4_000_000  # enough text for a few hundred steps, read in a second


def corpus(split: str, limit: int = CORPUS_BYTES) -> torch.Tensor:
    """Bytes of the standard library's .py files: 'train' (~90% of the files) or 'eval'."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for d, _, names in os.walk(root):
        if "site-packages" in d or "test" in os.path.relpath(d, root).split(os.sep)[0]:
            continue
        files += [os.path.join(d, n) for n in names if n.endswith(".py")]
    files.sort()
    chosen = []
    for f in files:
        h = int(hashlib.md5(os.path.relpath(f, root).encode()).hexdigest(), 16) % 10
        if (h == 0) == (split == "eval"):
            chosen.append(f)
    data, total = [], 0
    for f in chosen:
        with open(f, "rb") as fh:
            b = fh.read()
        data.append(b)
        total += len(b)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(data)[:limit]), dtype=torch.uint8).long()


def batches(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s : s + seq] for s in starts])
        y = torch.stack([data[s + 1 : s + seq + 1] for s in starts])
        yield x, y


@torch.no_grad()
def eval_loss(model, data: torch.Tensor, seq: int, windows: int = 64) -> float:
    """Mean next-byte cross-entropy (nats) over ``windows`` fixed, evenly spaced windows."""
    step = (len(data) - seq - 1) // windows
    losses = []
    for i in range(windows):
        chunk = data[i * step : i * step + seq + 1][None]
        losses.append(float(model(chunk[:, :-1], chunk[:, 1:])))
    return sum(losses) / len(losses)


# the config sections of each precision: fp8 is bf16 with the Linear layers' matmuls in fp8
_BF16 = {"bf16": {"enabled": True}}
PRECISIONS: dict[str, dict] = {
    "fp32": {},
    "bf16": _BF16,
    "fp8": {**_BF16, "fp8": {"enabled": True, "recipe_name": "tensorwise"}},
    "fp8-rowwise": {**_BF16, "fp8": {"enabled": True, "recipe_name": "rowwise"}},
}


# the fp8-against-bf16 comparison (tests/test_fp8_quality.py, benchmarks/bench_fp8_quality.py):
# GPT "tiny" widened to d_model 64 (2 layers, 4 heads, ~0.2M parameters), 300 steps of
# 16 x 128 bytes: minutes on 2 CPU cores (fp8 matmuls run on the CPU through torch._scaled_mm)
FP8_CHECK: dict = {"steps": 300, "preset": "tiny", "d_model": 64, "n_head": 4}


def _engine(steps: int, preset: str, batch: int, precision: str = "fp32", **shape):
    """The GPT (``preset``, ``shape`` overrides) under zeroshard, as this script trains it."""
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        os.environ.pop(k, None)
    import zeroshard
    from zeroshard.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset, seq_len=256, tie_embeddings=False, **shape))
    cfg = {
        "train_batch_size": batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}},
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": steps, "warmup_num_steps": 20},
        },
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 0},
        **PRECISIONS[precision],
    }
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def train(out: str, steps: int, preset: str, seq: int = 128, batch: int = 16) -> str:
    """Train on one rank and save a checkpoint under ``out``; returns the checkpoint dir."""
    engine = _engine(steps, preset, batch)
    gen = torch.Generator().manual_seed(0)
    data = corpus("train")
    t0 = time.perf_counter()
    for step, (x, y) in zip(range(steps), batches(data, batch, seq, gen), strict=False):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if step % 50 == 0 or step == steps - 1:
            print(
                f"step {step} loss {float(loss):.3f} ({time.perf_counter() - t0:.0f} s)", flush=True
            )
    engine.save_checkpoint(out, tag="final")
    engine.destroy()
    return os.path.join(out, "final")


@torch.no_grad()
def _heldout(engine, data: torch.Tensor, seq: int, windows: int = 64) -> float:
    """:func:`eval_loss`'s windows, through the engine (its precision), 16 at a time."""
    engine.eval()
    step = (len(data) - seq - 1) // windows
    chunks = torch.stack([data[i * step : i * step + seq + 1] for i in range(windows)])
    losses = [float(engine(c[:, :-1], c[:, 1:])) for c in chunks.split(16)]
    engine.train()
    return sum(losses) / len(losses)


def loss_curve(
    steps: int,
    preset: str,
    precision: str,
    *,
    seq: int = 128,
    batch: int = 16,
    log_every: int = 25,
    eval_bytes: int = CORPUS_BYTES,
    **shape,
) -> dict:
    """Train in ``precision``; returns ``{"steps", "losses"}`` (each logged step and the
    mean training loss of the steps since the previous one), ``"heldout"`` (nats/byte)
    and ``"seconds"`` (training only)."""
    engine = _engine(steps, preset, batch, precision, **shape)
    gen = torch.Generator().manual_seed(0)
    data = corpus("train")
    logged, window, losses = [], [], []
    t0 = time.perf_counter()
    for step, (x, y) in zip(range(steps), batches(data, batch, seq, gen), strict=False):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        window.append(loss.item())
        if (step + 1) % log_every == 0 or step == steps - 1:
            logged.append(step + 1)
            losses.append(sum(window) / len(window))
            window = []
    seconds = time.perf_counter() - t0
    heldout = _heldout(engine, corpus("eval", limit=eval_bytes), seq)
    engine.destroy()
    return {"steps": logged, "losses": losses, "heldout": heldout, "seconds": seconds}


def trained_model(cache_dir: str, steps: int = 300, preset: str = "small"):
    """The trained GPT (eval mode), from ``cache_dir`` if a run with these settings saved
    it there, else trained now (in a subprocess, so no process group stays behind)."""
    import subprocess
    import sys

    from zeroshard.inference.weights import model_from

    out = os.path.join(cache_dir, f"stdlib-gpt-{preset}-{steps}")
    if not os.path.exists(os.path.join(out, "latest")):
        cmd = [sys.executable, os.path.abspath(__file__), "--out", out, "--steps", str(steps),
               "--preset", preset]  # fmt: skip
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return model_from(out).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="checkpoint directory (required)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--preset", default="small")
    parser.add_argument(
        "--smoke", action="store_true", help="CI: GPT tiny, 2 steps, into a temp dir, 20 kB eval"
    )
    parser.add_argument(
        "--curve", action="store_true", help="print the loss curve and held-out loss, save nothing"
    )
    parser.add_argument("--precision", default="fp32", choices=list(PRECISIONS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.curve:
        if args.smoke:
            args.steps, args.preset = 4, "tiny"
        r = loss_curve(args.steps, args.preset, args.precision, log_every=2 if args.smoke else 25,
                       eval_bytes=20_000 if args.smoke else CORPUS_BYTES)  # fmt: skip
        for step, loss in zip(r["steps"], r["losses"], strict=True):
            print(f"step {step} mean loss {loss:.4f}")
        print(f"held-out loss {r['heldout']:.4f} nats/byte, perplexity {math.exp(r['heldout']):.3f} ({args.precision}, {r['seconds']:.0f} s)")  # fmt: skip
        return
    if args.smoke:
        args.out, args.steps, args.preset = tempfile.mkdtemp(prefix="zs-smoke-stdlib-"), 2, "tiny"
    if args.out is None:
        parser.error("--out is required")
    path = train(args.out, args.steps, args.preset)
    from zeroshard.inference.weights import model_from

    model = model_from(path).eval()
    loss = eval_loss(model, corpus("eval", limit=20_000 if args.smoke else CORPUS_BYTES), 128)
    print(f"held-out loss {loss:.4f} nats/byte, perplexity {math.exp(loss):.3f}")


if __name__ == "__main__":
    main()
