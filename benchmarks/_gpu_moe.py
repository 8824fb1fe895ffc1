"""gpu_check's MoE section (issue 34): a rank's experts by each way of
``zeroshard/moe/grouped.py`` on the GPU, bf16, forward + backward.

A Mixtral-shaped experts module (transformers' fused ``gate_up_proj`` / ``down_proj``,
top-2 of random routing) converted to ``ExpertParallelExperts`` (one rank: no
communication), run by ``grouped_mm`` (``torch._grouped_mm``: the path the CPU tests
cannot reach), ``bmm`` (padded batched matmul) and ``loop`` (one matmul per expert).
Each row: tokens per second (median of the timed calls, CUDA-synchronized), the ratio to
the loop, and the largest difference of the output and of the input gradient from the
loop's (bf16 round-off expected; a wrong grouped kernel shows as a large one). A way that
fails is reported as a failed row; the section never raises.

    python benchmarks/_gpu_moe.py [--smoke]      # alone; gpu_check calls moe_section()

``--smoke``: tiny sizes on the CPU in fp32 (no GPU needed), seconds.
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback

import torch

# (experts, hidden, intermediate, tokens): Mixtral-8x7B's expert count, narrower
FULL = (8, 2048, 5632, 16384)
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


def moe_section(smoke: bool = False, seconds: float = 8.0) -> str:
    """The section's markdown table; ``seconds`` bounds each way's timed calls."""
    from zeroshard.moe.grouped import WAYS
    from zeroshard.moe.hf import ExpertParallelExperts

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
    except Exception as exc:  # a section never crashes gpu_check
        return "\n".join([*head, f"| all | failed: {type(exc).__name__}: {exc} | | |"])

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    results: dict[str, tuple[float, torch.Tensor, torch.Tensor] | str] = {}
    for way in (*[w for w in WAYS if w != "loop"], "loop"):
        try:
            experts = ExpertParallelExperts(stock, None, way)
            x = x0.clone().requires_grad_()

            def call(experts=experts, x=x) -> torch.Tensor:
                x.grad = None
                y = experts(x, index, weights)
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
    loop = results.get("loop")
    lines = list(head)
    for way, r in results.items():
        if isinstance(r, str):
            lines.append(f"| {way} | failed: {r} | | |")
            continue
        tps, y, gx = r
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
