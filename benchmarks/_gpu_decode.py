"""``make gpu-check``'s decode rows (``gpu_check.py`` runs them in a process of their own):
batch-1 greedy decode tokens/s of the GPT preset for bf16, int8 and int4 weights, each

* eager (the KV cache grows with the sequence; a Python loop of kernels per token),
* captured (``enable_cuda_graph``: the one-token step over a static cache, captured once
  and replayed per token; ``zeroshard/inference/decode_graph.py``),
* compiled and captured (``engine.compile()``: inductor's fused step, captured),

and Hugging Face ``generate()`` on the same weights (bf16, eager). Each captured row
also says whether its greedy tokens equal the same static step run uncaptured (they
must: a replay runs the same kernels) and the eager loop's. The bandwidth roof is the
prepared model's bytes read once per token at the card's HBM bandwidth.

Without a GPU (``--smoke``) the captured rows run under the fake device runtime
(``zeroshard/distributed/fake_device.py``: the capture/replay logic, not a GPU's speed) and compile
with ``aot_eager`` (no C++ compiler wait).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

# HBM bandwidth per card, bytes/s (spec sheets)
HBM = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12}


def decode_rate(gen, new: int) -> tuple[float, torch.Tensor]:
    """Tokens/s of the ``new - 1`` tokens after the first (the prompt's prefill and one
    step timed apart and taken off), and the tokens."""
    gen(new)  # warm-up: captures, compiles, kernel choices
    t = time.perf_counter()
    gen(1)
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    out = gen(new)
    tn = time.perf_counter() - t
    return (new - 1) / max(tn - t1, 1e-9), out


def _bytes(module: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    for m in module.modules():  # quantized layers keep their kernel form apart
        for name in ("_packed", "_sz", "_scale_c"):
            t = m.__dict__.get(name)
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total


def decode_rows(args) -> dict[str, Any]:
    """{"rows": {name: {...}}, "bf16_bytes": int}: see the module docstring."""
    from bench_inference import to_hf_gpt2

    import zeroshard
    from zeroshard.distributed import device
    from zeroshard.distributed.fake_device import FakeRuntime
    from zeroshard.inference.decode_graph import StaticDecoder
    from zeroshard.inference.generate import Sampling, generate_tokens
    from zeroshard.models import GPT, GPTConfig

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    total = 32 + args.new
    cfg = GPTConfig.preset(args.decode_preset, vocab_size=args.vocab, seq_len=total)
    torch.manual_seed(0)
    with torch.device(dev):
        base = GPT(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(dev)
    backend = "inductor" if cuda else "aot_eager"
    rows: dict[str, dict[str, Any]] = {}
    roof_bytes = 0
    for label, bits in (("bf16", None), ("int8", 8), ("int4", 4)):
        quant = {"quant": {"enabled": True, "weight": {"num_bits": bits}}} if bits else {}
        eager_tokens = None
        for how in ("eager", "captured", "compiled + captured"):
            with torch.device(dev):
                model = GPT(cfg)
            model.load_state_dict(base.state_dict())
            capture = how != "eager"
            conf = {"dtype": "bf16", "max_out_tokens": total, **quant}
            fake = contextlib.nullcontext() if cuda or not capture else device.use(FakeRuntime())
            with fake:
                eng = zeroshard.init_inference(model, {**conf, "enable_cuda_graph": capture})
                if how.startswith("compiled"):
                    eng.compile(backend=backend)
                rate, tokens = decode_rate(
                    lambda n, e=eng: e.generate(prompt, max_new_tokens=n), args.new
                )
            row: dict[str, Any] = {"tokens_s": rate}
            if how == "eager":
                eager_tokens = tokens
                if bits is None:
                    roof_bytes = _bytes(eng.module)
                # the same static step, uncaptured: what a replay must reproduce
                static = StaticDecoder(eng.module, 1, total, capture=False)
                row["static_tokens"] = generate_tokens(
                    eng.module, prompt, None, max_new_tokens=args.new, sampling=Sampling(), decoder=static
                ).tolist()  # fmt: skip
            else:
                assert eager_tokens is not None
                ref = rows[f"{label} eager"]["static_tokens"]
                row["same_as_static"] = tokens.tolist() == ref
                row["same_as_eager"] = torch.equal(tokens, eager_tokens)
            if eng.kernel_choices:
                row["kernels"] = "; ".join(c.row() for c in eng.kernel_choices)
            rows[f"{label} {how}"] = row
            note = (
                "" if how == "eager" else f" (same tokens as uncaptured: {row['same_as_static']})"
            )
            print(f"  decode {label} {how}: {rate:.1f} tokens/s{note}", flush=True)
            del eng, model
    with torch.device(dev):
        hf = to_hf_gpt2(base).to(torch.bfloat16)  # the same weights in GPT2LMHeadModel
    rate, _ = decode_rate(
        lambda n: hf.generate(
            prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
        ),
        args.new,
    )
    rows["Hugging Face generate(), bf16"] = {"tokens_s": rate}
    print(f"  decode HF generate(): {rate:.1f} tokens/s", flush=True)
    for r in rows.values():
        r.pop("static_tokens", None)
    return {"rows": rows, "bf16_bytes": roof_bytes}


def decode_table(result: dict[str, Any], card: str) -> list[str]:
    """The decode rows as markdown lines."""
    rows, bw = result["rows"], next((v for k, v in HBM.items() if k in card), None)
    roof = bw / result["bf16_bytes"] if bw and result["bf16_bytes"] else None
    bf16 = rows.get("bf16 compiled + captured", {}).get("tokens_s")
    hf = rows.get("Hugging Face generate(), bf16", {}).get("tokens_s")
    lines = [
        "| decode, batch 1, greedy | tokens/s | of the bf16 roof | x bf16 (same path) | x HF | same tokens as uncaptured / eager |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        rate = r["tokens_s"]
        path = name.split(" ", 1)[1] if " " in name else ""
        same_path_bf16 = rows.get(f"bf16 {path}", {}).get("tokens_s")
        x_bf16 = f"{rate / same_path_bf16:.2f}" if same_path_bf16 and not name.startswith("bf16") and "Face" not in name else ""  # fmt: skip
        of_roof = f"{rate / roof:.1%}" if roof else "(card's bandwidth unknown)"
        same = f"{r['same_as_static']} / {r['same_as_eager']}" if "same_as_static" in r else ""
        x_hf = f"{rate / hf:.2f}" if hf and "Face" not in name else ""
        lines.append(f"| {name} | {rate:.1f} | {of_roof} | {x_bf16} | {x_hf} | {same} |")
    if roof:
        lines.append(f"\nbf16 roof: {result['bf16_bytes'] / 1e9:.2f} GB per token at {bw / 1e12:.2f} TB/s = {roof:,.0f} tokens/s.")  # fmt: skip
    if bf16 and hf:
        lines.append(
            f"bf16 compiled + captured is {bf16 / hf:.2f}x Hugging Face's eager generate()."
        )
    kernels = [f"{n}: {r['kernels']}" for n, r in rows.items() if r.get("kernels")]
    if kernels:
        lines.append("\nQuantized kernels picked (kernels.py, per layer shape):\n" + "\n".join(f"- {k}" for k in kernels))  # fmt: skip
    return lines
