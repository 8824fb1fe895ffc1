"""ZeRO-Inference on this host: decode tokens/s and peak RSS with the weights streamed from
NVMe swap files (``zeroshard/inference/streaming.py``) against the same model in memory.

The model is the built-in GPT (d_model 512, 32 layers, vocab 256, untied head: ~386 MiB
of fp32 weights), built on the meta device. The streamed arm fills it unit by unit with
a seeded init straight into the swap files (never whole in RAM); the in-memory arm fills
the same weights in memory. Both generate greedily with the KV cache through
``generate_tokens`` (one thread), each arm in a fresh process so its peak RSS is its
own; peak RSS is reported above the process's resident set just before the model is
built. Tokens must agree between arms.

    .venv/bin/python benchmarks/bench_zero_inference.py --batch 1 8 --new 16
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import zlib


def _rss_now_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def init_unit(name, module) -> None:
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    for pname, p in module.named_parameters():
        if p.dim() < 2:
            p.copy_(torch.zeros_like(p) if pname.endswith("bias") else torch.ones_like(p))
        else:
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def arm(kind: str, batch: int, new: int, nvme: str, buffer_count: int, layers: int = 32) -> dict:
    import torch

    torch.set_num_threads(1)
    from zeroshard.inference.generate import Sampling, generate_tokens
    from zeroshard.inference.streaming import StreamConfig, plan_units, stream_weights
    from zeroshard.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=256, seq_len=128, n_layer=layers, n_head=8, d_model=512,
                    tie_embeddings=False)  # fmt: skip
    with torch.device("meta"):  # load what building on meta imports before the baseline
        GPT(GPTConfig(n_layer=1))
    small = GPT(GPTConfig(n_layer=1))
    generate_tokens(small, torch.zeros(1, 2, dtype=torch.long), None, max_new_tokens=2,
                    sampling=Sampling())  # fmt: skip
    base = _rss_now_mib()
    with torch.device("meta"):
        model = GPT(cfg).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    t0 = time.perf_counter()
    sw = None
    if kind == "nvme":
        sc = StreamConfig(device="nvme", nvme_path=nvme, buffer_count=buffer_count)
        sw = stream_weights(model, sc, init=init_unit)
    elif kind in ("nvme-int8", "nvme-int4"):  # quantized in memory first, then streamed
        import zeroshard

        model.to_empty(device="cpu")
        with torch.no_grad():
            for name, m in plan_units(model):
                init_unit(name, m)
        bits = 8 if kind.endswith("int8") else 4
        zero = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme,
                                              "buffer_count": buffer_count}}  # fmt: skip
        quant = {"enabled": True, "weight": {"num_bits": bits, "group_size": 128}}
        sw = zeroshard.init_inference(model, {"quant": quant, "zero": zero}).streaming
    else:
        model.to_empty(device="cpu")
        with torch.no_grad():
            for name, m in plan_units(model):
                init_unit(name, m)
    build_s = time.perf_counter() - t0
    ids = torch.randint(0, 256, (batch, 16), generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    out = generate_tokens(model, ids, None, max_new_tokens=new, sampling=Sampling())
    seconds = time.perf_counter() - t0
    res = {
        "arm": kind,
        "batch": batch,
        "new": new,
        "weight_mib": weight_bytes / 2**20,
        "build_s": build_s,
        "generate_s": seconds,
        "tokens_per_s": batch * new / seconds,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base,
        "tokens": out[:, 16:].tolist(),
    }
    if sw is not None:
        res.update(
            read_gib=sw.stats.bytes_read / 2**30,
            read_gib_s=sw.stats.bytes_read / 2**30 / seconds,
            waited_s=sw.stats.waited_s,
            buffers_mib=sw.resident_bytes() / 2**20,
            direct_io=sw.source.space.direct,
        )
        sw.remove()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--buffer-count", type=int, default=4)
    ap.add_argument("--nvme", default="/tmp/zs-bench-nvme")
    ap.add_argument("--quant", nargs="*", default=[], choices=["int8", "int4"],
                    help="also stream int8/int4 weights (quantized in memory first: their "
                    "peak RSS counts the whole fp32 model)")  # fmt: skip
    ap.add_argument("--_arm", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=32, help="GPT blocks (d 512)")
    ap.add_argument(
        "--smoke", action="store_true", help="CI: 2 blocks, batch 1, 2 tokens, in this process"
    )
    a = ap.parse_args()
    if a.smoke:
        a.batch, a.new, a.layers, a.quant = [1], 2, 2, ["int8"]
        a.nvme = tempfile.mkdtemp(prefix="zs-smoke-zero-inference-")
    if a._arm:
        kind, batch = a._arm[0], int(a._arm[1])
        print(json.dumps(arm(kind, batch, a.new, a.nvme, a.buffer_count, a.layers)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    rows = []
    for batch in a.batch:
        for kind in ["memory", "nvme", *(f"nvme-{q}" for q in a.quant)]:
            if a.smoke:  # the arms' code in this process (one interpreter, not three)
                rows.append(arm(kind, batch, a.new, a.nvme, a.buffer_count, a.layers))
            else:
                cmd = [sys.executable, __file__, "--_arm", kind, str(batch), "--new", str(a.new),
                       "--nvme", a.nvme, "--buffer-count", str(a.buffer_count),
                       "--layers", str(a.layers)]  # fmt: skip
                line = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
                rows.append(json.loads(line.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            extra = ""
            if kind.startswith("nvme"):
                extra = (f", read {r['read_gib_s']:.2f} GiB/s, waited {r['waited_s']:.2f} s, "
                         f"buffers {r['buffers_mib']:.0f} MiB, O_DIRECT {r['direct_io']}")  # fmt: skip
            print(f"batch {batch} {kind:6s}: {r['tokens_per_s']:.2f} tokens/s, peak RSS "
                  f"{r['peak_rss_mib']:.0f} MiB ({r['peak_rss_mib'] / r['weight_mib']:.0%} of "
                  f"{r['weight_mib']:.0f} MiB weights), build {r['build_s']:.1f} s{extra}",
                  flush=True)  # fmt: skip
        mem, nvme = rows[-2 - len(a.quant)], rows[-1 - len(a.quant)]
        same = mem["tokens"] == nvme["tokens"]
        print(f"batch {batch}: tokens equal: {same}", flush=True)
        if not same:
            sys.exit("streamed tokens differ from the in-memory model's")


if __name__ == "__main__":
    main()
