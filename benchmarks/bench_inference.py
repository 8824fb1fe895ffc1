"""Decode speed of zeroshard's inference engine (issue 19), one process, one thread.

Arms, on one GPT (``--preset``, random weights, byte vocabulary, greedy, batch 1, a
32-token prompt, ``--new`` new tokens; no stop token, so every arm makes them all):

* fp32 with the KV cache, fp32 without it (every step recomputes the whole sequence);
* int8 (per channel) and int4 (group 128) weights with the cache;
* Hugging Face ``GPT2LMHeadModel.generate()`` in fp32 on the same weights (the built-in
  GPT is GPT-2's architecture: the weights map one to one, the logits are checked equal).

Decode tokens/s = (new - 1) / (time of a ``new``-token generate - time of a 1-token one):
the prompt's forward is left out. Arms alternate within each round; the best round is
kept (the host is shared). The bandwidth roof is the weight bytes one token reads (every
Linear weight with its scales, the tied head included) divided by a measured triad
bandwidth (a = b + s·c over 3 × 256 MiB, bytes counted as 3 arrays, one thread).
``--quality`` adds held-out perplexity of fp32/int8/int4 on the stdlib-trained GPT
(``stdlib_gpt.py``, cached under the temp directory).

    python benchmarks/bench_inference.py [--preset 25M] [--new 256] [--rounds 3] [--quality]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zeroshard
from zeroshard.models import GPT, GPTConfig


def triad_bandwidth(mib: int = 256, reps: int = 5) -> float:
    """Bytes/s of a = b + s*c (3 arrays counted), best of ``reps``."""
    n = mib * 2**20 // 4
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        best = min(best, time.perf_counter() - t)
    return 3 * n * 4 / best


def to_hf_gpt2(model: GPT):
    """The same weights in transformers' GPT2LMHeadModel (Conv1D weights are [in, out])."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = model.cfg
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=c.vocab_size, n_positions=c.seq_len,
                                    n_embd=c.d_model, n_layer=c.n_layer, n_head=c.n_head,
                                    n_inner=c.mlp_ratio * c.d_model, activation_function="gelu_new",
                                    resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
                                    layer_norm_epsilon=1e-5, tie_word_embeddings=c.tie_embeddings))  # fmt: skip
    sd = {"transformer.wte.weight": model.tok_emb.weight, "transformer.wpe.weight": model.pos_emb.weight,
          "transformer.ln_f.weight": model.ln_f.weight, "transformer.ln_f.bias": model.ln_f.bias,
          "lm_head.weight": model.head.weight}  # fmt: skip
    names = {"ln1": "ln_1", "ln2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
             "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}  # fmt: skip
    for i, block in enumerate(model.blocks):
        for ours, theirs in names.items():
            m = block.get_submodule(ours)
            linear = isinstance(m, torch.nn.Linear)
            sd[f"transformer.h.{i}.{theirs}.weight"] = m.weight.t() if linear else m.weight  # type: ignore[operator, assignment]
            sd[f"transformer.h.{i}.{theirs}.bias"] = m.bias  # type: ignore[assignment]
    missing, unexpected = hf.load_state_dict({k: v.detach().contiguous() for k, v in sd.items()}, strict=False)  # fmt: skip
    assert not unexpected and all("attn.bias" in k or "masked_bias" in k for k in missing), (missing, unexpected)  # fmt: skip
    return hf.eval()


def decode_rate(gen, new: int) -> float:
    t = time.perf_counter()
    gen(1)
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    out = gen(new)
    tn = time.perf_counter() - t
    assert out.shape[1] == 32 + new, out.shape
    return (new - 1) / (tn - t1)


def quality() -> dict[str, float]:
    import stdlib_gpt

    cache = os.path.join(tempfile.gettempdir(), "zeroshard-test-cache")
    held_out = stdlib_gpt.corpus("eval", limit=400_000)
    ppl = {}
    for name, bits in [("fp32", None), ("int8", 8), ("int4", 4)]:
        cfg = {"quant": {"enabled": True, "weight": {"num_bits": bits}}} if bits else {}
        eng = zeroshard.init_inference(stdlib_gpt.trained_model(cache, steps=300), cfg)
        ppl[name] = math.exp(stdlib_gpt.eval_loss(eng.module, held_out, 128))
    return ppl


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="25M")
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quality", action="store_true")
    p.add_argument("--smoke", action="store_true", help="CI: GPT small, 8 tokens, 1 round")
    args = p.parse_args()
    if args.smoke:  # (prints only; --quality, which trains a model, stays off)
        args.preset, args.new, args.rounds, args.quality = "small", 8, 1, False
    torch.set_num_threads(1)
    cfg = GPTConfig.preset(args.preset, seq_len=32 + args.new)
    torch.manual_seed(0)
    base = GPT(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))

    def engine(bits=None):
        model = GPT(cfg)
        model.load_state_dict(base.state_dict())
        quant = {"quant": {"enabled": True, "weight": {"num_bits": bits}}} if bits else {}
        return zeroshard.init_inference(model, {"max_out_tokens": 32 + args.new, **quant})

    engines = {"fp32": engine(), "int8": engine(8), "int4": engine(4)}
    hf = to_hf_gpt2(base)
    with torch.no_grad():
        assert torch.allclose(hf(prompt).logits, base(prompt), atol=1e-4)
    arms = {
        "zeroshard fp32, KV cache": lambda n: engines["fp32"].generate(prompt, max_new_tokens=n),
        "zeroshard int8, KV cache": lambda n: engines["int8"].generate(prompt, max_new_tokens=n),
        "zeroshard int4 (group 128), KV cache": lambda n: engines["int4"].generate(
            prompt, max_new_tokens=n
        ),
        "Hugging Face generate(), fp32": lambda n: hf.generate(
            prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
        ),
    }
    same = torch.equal(arms["zeroshard fp32, KV cache"](args.new)[0], arms["Hugging Face generate(), fp32"](args.new)[0])  # fmt: skip
    best = dict.fromkeys(arms, 0.0)
    for _ in range(args.rounds):
        for name, gen in arms.items():
            best[name] = max(best[name], decode_rate(gen, args.new))
    nocache = decode_rate(lambda n: engines["fp32"].generate(prompt, max_new_tokens=n, use_cache=False), args.new)  # fmt: skip
    bw = triad_bandwidth(16 if args.smoke else 256)
    wbytes = {k: e.weight_bytes()[0] for k, e in engines.items()}
    print(
        f"## {time.strftime('%Y-%m-%d %H:%M')} bench_inference: GPT {args.preset} ({sum(t.numel() for t in base.parameters()) / 1e6:.1f}M parameters), "
        f"1 thread, torch {torch.__version__}, Python {platform.python_version()}\n"
    )
    print(f"`{' '.join(['python', *sys.argv])}`\n")
    print(
        f"Load average at the end: {os.getloadavg()[0]:.1f} (2 shared cores). Triad bandwidth (1 thread): "
        f"{bw / 1e9:.1f} GB/s. fp32 greedy tokens equal Hugging Face's: {same}.\n"
    )
    print("| arm | decode tokens/s | × fp32 cache | weight MiB / token | bandwidth roof tokens/s | % of roof |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    ref = best["zeroshard fp32, KV cache"]
    rows = [(k, v, wbytes["int8" if "int8" in k else "int4" if "int4" in k else "fp32"]) for k, v in best.items()]  # fmt: skip
    rows.insert(1, ("zeroshard fp32, no cache (recompute)", nocache, wbytes["fp32"]))
    for name, rate, wb in rows:
        roof = bw / wb
        print(f"| {name} | {rate:.1f} | {rate / ref:.2f} | {wb / 2**20:.1f} | {roof:.1f} | {100 * rate / roof:.0f}% |")  # fmt: skip
    held = {k: e.weight_bytes() for k, e in engines.items()}
    print("\nLinear-layer weight bytes incl. scales / fp32 (the tied head stays fp32 and is "
          "counted): " + ", ".join(f"{k} {v[0] / v[1]:.3f}" for k, v in held.items()))  # fmt: skip
    q = {k: e.quantized for k, e in engines.items()}
    for k in ("int8", "int4"):
        layers = [m for n, m in engines[k].module.named_modules() if n in q[k]]
        ratio = sum(m.weight_bytes() for m in layers) / sum(4 * m.in_features * m.out_features for m in layers)  # fmt: skip
        print(f"- {k}: quantized layers only {ratio:.3f} of fp32")
    if args.quality:
        ppl = quality()
        print(
            "\nHeld-out perplexity (stdlib-trained GPT small, 300 steps; test files never seen): "
            + ", ".join(f"{k} {v:.4f} ({v / ppl['fp32']:.4f}×)" for k, v in ppl.items())
        )


if __name__ == "__main__":
    main()
