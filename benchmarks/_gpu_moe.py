"""gpu_check's MoE section (issue 34): a rank's experts by each way of
``zeroshard/moe/grouped.py`` on the GPU, bf16, forward + backward.

A Mixtral-shaped experts module (transformers' fused ``gate_up_proj`` / ``down_proj``,
top-2 of random routing) converted to ``ExpertParallelExperts`` (one rank: no
communication), run by ``grouped_mm`` (``torch._grouped_mm``: the path the CPU tests
cannot reach), ``bmm`` (padded batched matmul) and ``loop`` (one matmul per expert).
Each row: tokens per second (median of the timed calls, CUDA-synchronized), the ratio to
the loop, and the largest difference of the output and of the input gradient from the
loop's (bf16 round-off expected; a wrong grouped kernel shows as a large one). Then
DeepSpeed's per-expert modules (``MoE(expert=Sequential(Linear, SiLU, Linear))``'s
``Experts``, top-1 rows) under ``torch.func.vmap`` against one call per expert: on the
CPU the loop wins (benchmarks/RESULTS.md, bench_moe), and this row says whether vmap
earns its place as the default on a GPU. A way that fails is reported as a failed row;
the section never raises.

    python benchmarks/_gpu_moe.py [--smoke]      # alone; gpu_check calls moe_section()

``--smoke``: tiny sizes on the CPU in fp32 (no GPU needed), seconds.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
import traceback
from collections.abc import Callable

import torch
from torch import nn

# (experts, hidden, intermediate, tokens): Mixtral-8x7B's expert count and shape ratio,
# a quarter as wide (built in seconds on the host)
FULL = (8, 1024, 2816, 16384)
SMOKE = (4, 32, 64, 64)


def _experts(num: int, hidden: int, inter: int):
    import transformers

    cfg = transformers.MixtralConfig(
        vocab_size=128, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=8, num_local_experts=num,
        num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg).model.layers[0].mlp.experts


def moe_section(smoke: bool = False, seconds: float = 5.0) -> str:
    """The section's markdown table; ``seconds`` bounds each way's timed calls (five
    ways: about 30 s in all on an H100/H200)."""
    from zeroshard.moe.grouped import WAYS
    from zeroshard.moe.hf import ExpertParallelExperts
    from zeroshard.moe.layer import Experts

    cuda = torch.cuda.is_available() and not smoke
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    num, hidden, inter, tokens = SMOKE if smoke else FULL
    head = [
        f"MoE experts ({dev.type}, {dtype}): {num} experts, hidden {hidden}, intermediate "
        f"{inter}, top-2 of random routing, {tokens} tokens, forward + backward",
        "",
        "| way | tokens/s | x loop | max diff out / grad vs loop |",
        "|---|---|---|---|",
    ]
    try:
        stock = _experts(num, hidden, inter).to(dev, dtype)
        g = torch.Generator().manual_seed(0)
        x0 = torch.randn(tokens, hidden, generator=g).to(dev, dtype)
        scores = torch.rand(tokens, num, generator=g).softmax(-1)
        weights, index = torch.topk(scores, 2, dim=-1)
        weights, index = weights.to(dev, dtype), index.to(dev)
        converted = {w: ExpertParallelExperts(stock, None, w) for w in WAYS}
        torch.manual_seed(0)
        mlp = nn.Sequential(nn.Linear(hidden, inter), nn.SiLU(), nn.Linear(inter, hidden))
        ds = Experts(mlp, num).to(dev, dtype)
        counts = torch.bincount(index[:, 0], minlength=num).tolist()
        order = torch.argsort(index[:, 0], stable=True)
    except Exception as exc:  # a section never crashes gpu_check
        return "\n".join([*head, f"| all | failed: {type(exc).__name__}: {exc} | | |"])

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def mixtral(way: str, x: torch.Tensor) -> torch.Tensor:
        return converted[way](x, index, weights)

    def deepspeed(grouped: bool, x: torch.Tensor) -> torch.Tensor:
        ds.grouped = grouped
        return ds.rows(x[order], counts)

    cases: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = [
        (w, functools.partial(mixtral, w)) for w in (*[w for w in WAYS if w != "loop"], "loop")
    ]
    cases += [("MoE Experts, vmap", functools.partial(deepspeed, True))]
    cases += [("MoE Experts, loop", functools.partial(deepspeed, False))]
    results: dict[str, tuple[float, torch.Tensor, torch.Tensor] | str] = {}
    for way, fn in cases:
        try:
            x = x0.clone().requires_grad_()

            def call(fn=fn, x=x) -> torch.Tensor:
                x.grad = None
                y = fn(x)
                y.float().square().mean().backward()
                return y

            y = call()  # warm-up (and the values compared)
            sync()
            times: list[float] = []
            start = time.perf_counter()
            while len(times) < (1 if smoke else 20) and time.perf_counter() - start < seconds:
                t0 = time.perf_counter()
                call()
                sync()
                times.append(time.perf_counter() - t0)
            assert x.grad is not None
            results[way] = (tokens / statistics.median(times), y.detach(), x.grad.detach())
        except Exception as exc:
            results[way] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            traceback.print_exc()
    lines = list(head)
    for way, r in results.items():
        if isinstance(r, str):
            lines.append(f"| {way} | failed: {r} | | |")
            continue
        tps, y, gx = r
        loop = results.get("MoE Experts, loop" if way.startswith("MoE") else "loop")
        if isinstance(loop, tuple):
            dy = (y.float() - loop[1].float()).abs().max().item()
            dg = (gx.float() - loop[2].float()).abs().max().item()
            lines.append(f"| {way} | {tps:,.0f} | {tps / loop[0]:.2f} | {dy:.2e} / {dg:.2e} |")
        else:
            lines.append(f"| {way} | {tps:,.0f} | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="tiny, on the CPU, fp32")
    print(moe_section(smoke=p.parse_args().smoke))
