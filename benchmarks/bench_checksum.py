"""What checkpoint integrity costs: the hashes the standard library offers (MB/s on one
core), and save / load times of a one-rank checkpoint with and without the checks.

    python benchmarks/bench_checksum.py [--layers 12] [--width 1024] [--rounds 3]

Prints one table; the numbers in RESULTS.md came from it. The checkpoint files are read
from the page cache (written just before), so load times are CPU cost, not disk speed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
import zlib

import _smoke
import torch


def _best(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def hashes(rounds: int, mib: int = 64) -> None:
    data = memoryview(os.urandom(mib << 20))
    rows = {
        "zlib.crc32 (chosen)": lambda: zlib.crc32(data),
        "zlib.adler32": lambda: zlib.adler32(data),
        "hashlib.sha1": lambda: hashlib.sha1(data).digest(),
        "hashlib.sha256": lambda: hashlib.sha256(data).digest(),
        "hashlib.blake2b (8 bytes)": lambda: hashlib.blake2b(data, digest_size=8).digest(),
        "hashlib.md5": lambda: hashlib.md5(data).digest(),
    }
    print("| hash | MB/s (one core) |\n|---|---|")
    for name, fn in rows.items():
        print(f"| {name} | {len(data) / _best(fn, rounds) / 1e6:,.0f} |")


def checkpoint(layers: int, width: int, rounds: int) -> None:
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        os.environ.pop(k, None)
    import zeroshard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    cfg = {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
    }
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    engine.backward(engine(torch.randn(2, width)).sum())
    engine.step()
    with tempfile.TemporaryDirectory() as root:
        save = _best(lambda: engine.save_checkpoint(root, tag="t"), rounds)
        path = os.path.join(root, "t", "zs_rank00000.safetensors")
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = memoryview(f.read())
        crc = _best(lambda data=raw: zlib.crc32(data), rounds)
        raw.release()
        loads = {
            "load, verify + non-finite scan (default)": {},
            "load, verify only (allow_nonfinite=True)": {"allow_nonfinite": True},
            "load, non-finite scan only (verify=False)": {"verify": False},
            "load, no checks": {"verify": False, "allow_nonfinite": True},
        }
        times = {
            k: _best(lambda kw=kw: engine.load_checkpoint(root, **kw), rounds)
            for k, kw in loads.items()
        }
    mb = size / 1e6
    params = sum(p.numel() for p in model.parameters())
    print(f"\n{params / 1e6:.1f}M parameters, fp32 AdamW, 1 rank: one {mb:.0f} MB file\n")
    print("| operation | seconds | of which checks |\n|---|---|---|")
    print(
        f"| save_checkpoint (CRC-32 of every tensor included) | {save:.3f} | ~{crc:.3f} ({crc / save:.0%}) |"
    )
    base = times["load, no checks"]
    for name, t in times.items():
        extra = t - base
        print(
            f"| {name} | {t:.3f} | {extra:+.3f} ({mb / extra:,.0f} MB/s) |"
            if extra > 0.001
            else f"| {name} | {t:.3f} | - |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    _smoke.add_flag(ap)
    args = ap.parse_args()
    if args.smoke:  # (the checkpoint goes to a temporary directory either way)
        args.layers, args.width, args.rounds = 2, 64, 1
    torch.set_num_threads(1)
    hashes(args.rounds, mib=1 if args.smoke else 64)
    checkpoint(args.layers, args.width, args.rounds)


if __name__ == "__main__":
    main()
