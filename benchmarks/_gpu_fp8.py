"""gpu_check.py's fp8 rows (issue 33): bf16 against fp8 on a Llama-shaped model with
d_model 4096 (8 layers of Llama-3-8B's shape: 32 heads, 8 key/value heads, MLP 14336),
seq 2048, on one GPU, at ZeRO stage 0 (``engine.compile()``: torch.compile fuses fp8's
amax/scale/cast into the neighbouring kernels, without which most of the gain goes to
them) and at stage 3 (eager: engine.compile() is not built at stage 3).

Data: the bytes of Python's standard library (benchmarks/stdlib_gpt.py, vocabulary 256),
so the loss after 50 steps means something; every row trains the same batches. Each row
reports the median step time over the steps after the warm-up (compilation included in
the warm-up), tokens/s, MFU against the bf16 dense peak (6 N + 12 L d s FLOPs per token,
N the parameters of the matmuls: all but the embedding), and the mean loss of the last
10 of 50 steps. The rows talk to nobody but the GPU.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

# Llama-3-8B's layer shape; 8 layers (about 1.75B parameters in the layers)
SHAPE = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
         "num_key_value_heads": 8, "num_hidden_layers": 8}  # fmt: skip
SMOKE_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
               "num_key_value_heads": 2, "num_hidden_layers": 2}  # fmt: skip
VOCAB = 256  # bytes
STEPS, WARMUP, LOSS_TAIL = 50, 5, 10


def rows() -> list[dict[str, Any]]:
    """bf16 and fp8 (tensorwise) at stage 0 (compiled) and stage 3 (eager)."""
    out = []
    for stage in (0, 3):
        for precision in ("bf16", "fp8"):
            how = "compiled" if stage == 0 else "eager"
            out.append({"name": f"llama d4096 x8, {precision}, stage {stage} ({how})",
                        "system": "fp8", "precision": precision, "stage": stage,
                        "compile": stage == 0})  # fmt: skip
    return out


def _model(smoke: bool, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = SMOKE_SHAPE if smoke else SHAPE
    cfg = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=4096, use_cache=False,
                      tie_word_embeddings=False, **shape)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(cfg), cfg


def train_row(row: dict, args) -> dict:
    """One row in this process: build, (compile), 50 steps; step time, MFU inputs, loss."""
    import stdlib_gpt

    import zeroshard

    smoke = args.smoke
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    seq, micro = (32, 2) if smoke else (2048, args.fp8_micro)
    steps, warmup = (4, 1) if smoke else (STEPS, WARMUP)
    t0 = time.perf_counter()
    model, cfg = _model(smoke, dev)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
        "zero_optimization": {"stage": row["stage"]},
        "steps_per_print": 10**9,
    }
    if row["precision"] == "fp8":
        config["fp8"] = {"enabled": True, "recipe_name": "tensorwise"}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)  # fmt: skip
    compiled = row["compile"] and not (smoke and dev.type == "cpu")
    if compiled:
        engine.compile()
    setup = time.perf_counter() - t0
    data = stdlib_gpt.corpus("train", limit=200_000 if smoke else stdlib_gpt.CORPUS_BYTES)
    gen = torch.Generator().manual_seed(0)
    times, losses = [], []
    for i, (x, y) in zip(range(steps), stdlib_gpt.batches(data, micro, seq, gen), strict=False):
        x, y = x.to(dev), y.to(dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss = _loss(engine, x, y)
        engine.backward(loss)
        engine.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t)
        losses.append(loss.item())
    engine.destroy()
    embed = cfg.vocab_size * cfg.hidden_size  # a lookup, not a matmul
    n = sum(p.numel() for p in model.parameters()) - embed
    tokens = micro * seq
    sec = statistics.median(times)
    flops = (6 * n + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq) * tokens
    return {
        "step_s": sec,
        "tokens_s": tokens / sec,
        "flops_s": flops / sec,
        "params": n,
        "setup_s": setup,
        "compiled": compiled,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0,
        "losses": [losses[0], sum(losses[-LOSS_TAIL:]) / len(losses[-LOSS_TAIL:])],
    }


def _loss(engine, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-byte cross-entropy (the model's logits, our shift: y is x moved by one)."""
    logits = engine(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))  # fmt: skip


def table(results: dict[str, dict], peak: float, how: str) -> str:
    """The fp8 rows' table and the issue's acceptance lines (fp8 >= 1.3x bf16 per step,
    the loss after 50 steps within 2% of bf16's)."""
    lines = [
        "| fp8 row | step s | tokens/s | MFU (bf16 peak) | fp8 speed-up | GPU peak GiB | loss first -> last 10 of 50 | vs bf16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for name, v in results.items():
        if not v["ok"]:
            lines.append(f"| {name} | failed: {v['why']} | | | | | | |")
            continue
        r = v["result"]
        twin = results.get(name.replace(", fp8,", ", bf16,"), {})
        base = twin.get("result") if twin.get("ok") and ", fp8," in name else None
        speed = f"{base['step_s'] / r['step_s']:.2f}x" if base else ""
        vs = f"{100 * (r['losses'][1] / base['losses'][1] - 1):+.2f}%" if base else ""
        lines.append(
            f"| {name} | {r['step_s']:.3f} | {r['tokens_s']:,.0f} | {r['flops_s'] / peak:.1%} | "
            f"{speed} | {r['peak_gib']:.1f} | {r['losses'][0]:.3f} -> {r['losses'][1]:.3f} | {vs} |"
        )
        if base:
            fast = base["step_s"] / r["step_s"] >= 1.3
            close = abs(r["losses"][1] / base["losses"][1] - 1) <= 0.02
            verdicts.append(f"{name}: {'meets' if fast else 'MISSES'} >= 1.3x; loss {'within' if close else 'NOT within'} 2% of bf16")  # fmt: skip
    head = (
        f"fp8 (issue 33): Llama-3-8B layer shape x {SHAPE['num_hidden_layers']} (d_model 4096), "
        f"vocab {VOCAB} (stdlib bytes), seq 2048, bf16 compute, AdamW, clip 1.0, {STEPS} steps "
        f"({WARMUP} warm-up, compilation included); MFU against the {how} peak "
        f"({peak / 1e12:.0f} TFLOP/s) for both precisions."
    )
    return head + "\n\n" + "\n".join(lines + [""] + [f"- {v}" for v in verdicts])
