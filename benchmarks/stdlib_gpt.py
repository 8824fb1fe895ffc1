"""A small GPT trained with zeroshard on real text every machine has: Python's standard
library sources, byte-level (vocabulary 256). Files are split by name (a stable hash), so
the held-out text comes from files the model never saw.

    python benchmarks/stdlib_gpt.py --out /tmp/stdlib-gpt [--steps 300] [--preset small]

trains on one rank (zeroshard.initialize, ZeRO stage 0, AdamW), saves a zeroshard
checkpoint under OUT (it records the model config) and prints the held-out loss.
:func:`trained_model` caches it: a second call with the same settings loads the
checkpoint instead of training. Used by tests/test_inference_quality.py and
benchmarks/bench_inference.py.
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


def train(out: str, steps: int, preset: str, seq: int = 128, batch: int = 16) -> str:
    """Train on one rank and save a checkpoint under ``out``; returns the checkpoint dir."""
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        os.environ.pop(k, None)
    import zeroshard
    from zeroshard.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset, seq_len=256, tie_embeddings=False))
    cfg = {
        "train_batch_size": batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}},
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": steps, "warmup_num_steps": 20},
        },
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 0},
    }
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
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
    args = parser.parse_args()
    if args.smoke:
        args.out, args.steps, args.preset = tempfile.mkdtemp(prefix="zs-smoke-stdlib-"), 2, "tiny"
    if args.out is None:
        parser.error("--out is required")
    torch.set_num_threads(1)
    path = train(args.out, args.steps, args.preset)
    from zeroshard.inference.weights import model_from

    model = model_from(path).eval()
    loss = eval_loss(model, corpus("eval", limit=20_000 if args.smoke else CORPUS_BYTES), 128)
    print(f"held-out loss {loss:.4f} nats/byte, perplexity {math.exp(loss):.3f}")


if __name__ == "__main__":
    main()
