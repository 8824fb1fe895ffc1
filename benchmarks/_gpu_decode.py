"""``make gpu-check``'s decode section (issue 32): batch-1 greedy decode tokens/s of the
GPT preset (1B: 24 layers, d 1856), a 32-token prompt, ``args.new`` new tokens (128),
for bf16, int8 and int4 weights, each

* **eager**: ``init_inference`` as it is: the KV cache grows with the sequence, the
  step is a Python loop of kernel launches;
* **captured**: ``enable_cuda_graph``: the one-token step over a static KV cache
  (preallocated to ``max_out_tokens``; slot, positions and mask in tensors), captured
  once as a CUDA graph (warmed up on a side stream first) and replayed per token
  (``zeroshard/inference/decode_graph.py``);

and Hugging Face ``generate()`` on the same weights (bf16, eager). With
``args.decode_compile`` also "compiled + captured" rows (``engine.compile()``:
inductor's step, captured in turn); off by default: inductor's compile of the 1B step
has not been timed on a GPU and would not fit the section's budget.

gpu_check.py calls one function, :func:`decode_rows` (in a process of its own, with
``--smoke`` in its own), and formats its result with :func:`decode_table`. The section
keeps to ``SECTION_CAP_S`` (the child's start, imports and CUDA init, are the rest of
its 45 s): rows run most important first, a row starts only with ``ROW_MIN_S`` left and
repeats its timed round (up to ``ROUNDS``, the median kept) only while time is left; a
row that raises is reported as failed, the others go on; a row with no time left is
reported as not run (skipped: gpu_check's verdict ignores it, a failure does not). Each finished row is
also printed as a ``DECODE_ROW {json}`` line, so gpu_check keeps the rows done when it
kills the process at its budget (:func:`partial_result`).

Columns: tokens/s (the ``new - 1`` tokens after the first: a generate of one token,
prefill and sampling, timed apart and taken off; the device synchronized around each
timing); the bandwidth roof: the bytes of weights the row's kernels read per token
(:func:`bytes_per_token`: every parameter and buffer once, a quantized layer's operands
of the kernel it runs, embedding tables read one row per token left out unless tied to
the head) times tokens/s, against the card's HBM bandwidth (``HBM``); whether the
captured row's greedy tokens equal the eager row's (bf16 rounding may flip a near tie:
the static step attends over every slot, masked, where eager attends over the filled
ones) and, for bf16 when time is left, the same static step run uncaptured (they must:
a replay runs the same kernels).

Without a GPU (``--smoke``) the captured rows run under the fake device runtime
(``zeroshard/distributed/fake_device.py``: the capture/replay logic, not a GPU's speed).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

#: HBM bandwidth per card, bytes/s (spec sheets); matched as a substring of the name
HBM = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.04e12}
SECTION_CAP_S = 36.0  # from decode_rows()'s start; the child's start is the rest of 45 s
ROW_MIN_S = 6.0  # a row starts only with this much of the cap left (HF: import, build, a round)
ROUNDS = 3  # timed rounds per row at most (median)
PROMPT = 32
#: (dtype, path), the most important first; the table prints them in TABLE_ORDER
RUN_ORDER = [("bf16", "captured"), ("bf16", "eager"), ("int4", "captured"), ("int8", "captured"),
             ("hf", "eager"), ("int4", "eager"), ("int8", "eager")]  # fmt: skip
COMPILED = [("bf16", "compiled + captured"), ("int8", "compiled + captured"),
            ("int4", "compiled + captured")]  # fmt: skip
HF = "Hugging Face generate(), bf16"


def row_name(dtype: str, path: str) -> str:
    return HF if dtype == "hf" else f"{dtype} {path}"


def hbm_bandwidth(card: str) -> float | None:
    return next((v for k, v in HBM.items() if k in card), None)


def bytes_per_token(module: nn.Module) -> int:
    """Bytes of weights a decode step reads (see the module docstring)."""
    from zeroshard.inference.quantize import QuantLinear

    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()

    owners: dict[int, int] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    for m in module.modules():
        if isinstance(m, QuantLinear):
            if m.kernel == "int4pack":
                add(m.__dict__.get("_packed"))
            else:
                add(m.qweight)
            add(m.__dict__.get("_scale_c") if m.bits == 8 else m.__dict__.get("_sz"))
            add(m.bias)
            continue
        for p in m.parameters(recurse=False):
            if isinstance(m, nn.Embedding) and owners[id(p)] == 1:
                continue  # a lookup reads one row per token
            add(p)
        for b in m.buffers(recurse=False):
            add(b)
    return total


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(gen: Callable[[int], torch.Tensor], n: int) -> tuple[float, torch.Tensor]:
    _sync()
    t = time.perf_counter()
    out = gen(n)
    _sync()
    return time.perf_counter() - t, out


def measure(gen: Callable[[int], torch.Tensor], new: int, deadline: float) -> dict[str, Any]:
    """Warm up (captures, kernel caches), then up to ROUNDS timed rounds while time is
    left: {tokens_s (median), rounds, tokens (the last round's)}."""
    _timed(gen, min(new, 4))
    rates: list[float] = []
    tokens = torch.empty(0)
    while len(rates) < ROUNDS:
        t1, _ = _timed(gen, 1)
        tn, tokens = _timed(gen, new)
        rates.append((new - 1) / max(tn - t1, 1e-9))
        if time.perf_counter() + 1.5 * (t1 + tn) > deadline:
            break
    return {"tokens_s": statistics.median(rates), "rounds": len(rates), "tokens": tokens}


def _quant(dtype: str) -> dict[str, Any]:
    # int4: the default group of 128; a layer it does not divide (1856 inputs) takes the
    # largest kernel group size below it that does (64), said once (quantize.py)
    bits = {"int8": 8, "int4": 4}.get(dtype)
    return {"quant": {"enabled": True, "weight": {"num_bits": bits}}} if bits else {}


def _zeroshard_row(base, prompt, dtype: str, path: str, args, deadline: float) -> dict[str, Any]:
    import zeroshard
    from zeroshard.distributed import device
    from zeroshard.distributed.fake_device import FakeRuntime

    cuda = torch.cuda.is_available()
    capture = path != "eager"
    fake = device.use(FakeRuntime()) if capture and not cuda else contextlib.nullcontext()
    total = PROMPT + args.new
    with fake:
        model = copy.deepcopy(base)
        conf = {"dtype": "bf16", "max_out_tokens": total, "enable_cuda_graph": capture}
        eng = zeroshard.init_inference(model, {**conf, **_quant(dtype)})
        if path.startswith("compiled"):
            eng.compile(backend="inductor" if cuda else "aot_eager")
        row = measure(lambda n: eng.generate(prompt, max_new_tokens=n), args.new, deadline)
        row["bytes"] = bytes_per_token(eng.module)
        if eng.kernel_choices:
            row["kernels"] = "; ".join(c.row() for c in eng.kernel_choices)
        groups = {m.group_size for m in eng.module.modules() if getattr(m, "bits", 0) == 4}
        if groups:
            row["int4_groups"] = sorted(groups)
        if capture and dtype == "bf16" and time.perf_counter() + 5 < deadline:
            row["static_tokens"] = _static_uncaptured(eng.module, prompt, total, args.new).tolist()
    return row


def _static_uncaptured(module, prompt, total: int, new: int) -> torch.Tensor:
    """The captured path's step, run without the graph: what each replay must equal."""
    from zeroshard.inference.decode_graph import StaticDecoder
    from zeroshard.inference.generate import Sampling, generate_tokens

    static = StaticDecoder(module, 1, total, capture=False)
    return generate_tokens(module, prompt, None, max_new_tokens=new, sampling=Sampling(), decoder=static)  # fmt: skip


def _hf_row(base, prompt, args, deadline: float) -> dict[str, Any]:
    from bench_inference import to_hf_gpt2

    with torch.device(prompt.device):  # built on the device: a CPU init of 1B takes long
        hf = to_hf_gpt2(base).to(torch.bfloat16).eval()

    def gen(n: int) -> torch.Tensor:
        with torch.no_grad():
            return hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)  # fmt: skip

    row = measure(gen, args.new, deadline)
    row["bytes"] = bytes_per_token(hf)
    return row


def decode_rows(args) -> dict[str, Any]:
    """Every row of the section (see the module docstring):
    {"rows": {name: {"ok", "tokens_s", "bytes", ...} or {"ok": False, "why"}}}."""
    from zeroshard.models import GPT, GPTConfig

    start = time.perf_counter()
    deadline = start + SECTION_CAP_S
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = GPTConfig.preset(args.decode_preset, vocab_size=args.vocab, seq_len=PROMPT + args.new)
    torch.manual_seed(0)
    with torch.device(dev):
        base = GPT(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (1, PROMPT), generator=gen).to(dev)
    order = RUN_ORDER + (COMPILED if getattr(args, "decode_compile", False) else [])
    rows: dict[str, dict[str, Any]] = {}
    for dtype, path in order:
        name = row_name(dtype, path)
        left = deadline - time.perf_counter()
        if left < ROW_MIN_S and not args.smoke:
            # not a failure of the code (gpu_check's verdict ignores it): the time was short
            row: dict[str, Any] = {"ok": False, "skipped": True, "why": f"not run: the section's {SECTION_CAP_S:.0f} s cap is spent"}  # fmt: skip
        else:
            try:
                if dtype == "hf":
                    row = {"ok": True, **_hf_row(base, prompt, args, deadline)}
                else:
                    row = {"ok": True, **_zeroshard_row(base, prompt, dtype, path, args, deadline)}
            except Exception as exc:  # a failed row is reported, the section goes on
                row = {"ok": False, "why": f"{type(exc).__name__}: {str(exc)[:300]}"}
            gc.collect()  # the row's engine and graph (cycles hold them), before the next
            with contextlib.suppress(Exception):  # a sticky CUDA error: the next rows say it
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
        if row.get("tokens") is not None:
            row["tokens"] = row["tokens"].tolist()
        row["after_s"] = round(time.perf_counter() - start, 1)
        rows[name] = row
        print("DECODE_ROW " + json.dumps({name: row}), flush=True)
        note = (
            f"{row['tokens_s']:.1f} tokens/s, {row['rounds']} rounds" if row["ok"] else row["why"]
        )
        print(f"  decode {name}: {note} ({row['after_s']} s)", flush=True)
    return {"rows": _compare(rows), "new": args.new}


def _compare(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each captured row says whether its tokens equal the eager row's (and the static
    step's, uncaptured); the token lists are dropped."""
    for name, r in rows.items():
        if r.get("ok") and " " in name and not name.startswith("Hugging"):
            dtype, path = name.split(" ", 1)
            eager = rows.get(f"{dtype} eager", {})
            if path != "eager" and eager.get("ok"):
                r["same_as_eager"] = r["tokens"] == eager["tokens"]
            if "static_tokens" in r:
                r["same_as_uncaptured"] = r["tokens"] == r.pop("static_tokens")
    for r in rows.values():
        r.pop("tokens", None)
    return rows


def partial_result(stdout: str, why: str, args) -> dict[str, Any]:
    """The rows a killed section printed (``DECODE_ROW`` lines); the rest failed, ``why``."""
    rows: dict[str, dict[str, Any]] = {}
    for line in stdout.splitlines():
        if line.startswith("DECODE_ROW "):
            rows.update(json.loads(line[len("DECODE_ROW ") :]))
    order = RUN_ORDER + (COMPILED if getattr(args, "decode_compile", False) else [])
    for dtype, path in order:
        rows.setdefault(row_name(dtype, path), {"ok": False, "why": why})
    return {"rows": _compare(rows), "new": args.new}


TABLE_ORDER = [("bf16", "eager"), ("bf16", "captured"), ("bf16", "compiled + captured"),
               ("int8", "eager"), ("int8", "captured"), ("int8", "compiled + captured"),
               ("int4", "eager"), ("int4", "captured"), ("int4", "compiled + captured"),
               ("hf", "eager")]  # fmt: skip


def decode_table(result: dict[str, Any], card: str) -> list[str]:
    """The section as markdown lines."""
    rows, bw = result["rows"], hbm_bandwidth(card)
    head = "| decode, batch 1, greedy | tokens/s | rounds | weights read per token | of the HBM roof | x bf16 (same path) | x HF | tokens = eager / uncaptured |"  # fmt: skip
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    hf = rows.get(HF, {}).get("tokens_s")
    for dtype, path in TABLE_ORDER:
        name = row_name(dtype, path)
        r = rows.get(name)
        if r is None:
            continue
        if not r.get("ok"):
            lines.append(f"| {name} | failed: {r.get('why', '?')} | | | | | | |")
            continue
        rate = r["tokens_s"]
        roof = f"{rate * r['bytes'] / bw:.1%}" if bw else "(card's bandwidth unknown)"
        same_path = rows.get(row_name("bf16", path), {})
        x_bf16 = f"{rate / same_path['tokens_s']:.2f}" if dtype in ("int8", "int4") and same_path.get("ok") else ""  # fmt: skip
        x_hf = f"{rate / hf:.2f}" if hf and dtype != "hf" else ""
        same = " / ".join(str(r.get(k, "-")) for k in ("same_as_eager", "same_as_uncaptured"))
        same = same if path != "eager" else ""
        lines.append(f"| {name} | {rate:.1f} | {r['rounds']} | {r['bytes'] / 1e9:.3f} GB | {roof} | {x_bf16} | {x_hf} | {same} |")  # fmt: skip
    if bw:
        lines.append(f"\nHBM roof: {bw / 1e12:.2f} TB/s ({card}); weights read per token: each row's own (bytes_per_token in benchmarks/_gpu_decode.py).")  # fmt: skip
    else:
        lines.append(f"\nHBM bandwidth of {card!r} not known (benchmarks/_gpu_decode.py HBM): no roof.")  # fmt: skip
    notes = [f"- {n}: {r['kernels']}" for n, r in rows.items() if r.get("kernels")]
    notes += [f"- {n}: int4 group sizes {r['int4_groups']}" for n, r in rows.items() if r.get("int4_groups")]  # fmt: skip
    if notes:
        lines.append("\nQuantized layers (kernels picked per layer shape: inference/kernels.py):\n" + "\n".join(notes))  # fmt: skip
    return lines
