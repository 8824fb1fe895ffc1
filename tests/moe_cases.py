"""Shared helpers of the mixture-of-experts tests: tiny models (one built with
``deepspeed.moe.layer.MoE``, a transformers Mixtral), their data, the single-process
fp32 reference, and the local-vs-global parameter correspondence under expert
parallelism.

The reference trains one process on the ranks' micro-batches: per step, the mean over
the data-parallel ranks of each micro-batch's loss (the aux losses are per micro-batch
statistics, as every rank computes its own), one backward, one step. With
``drop_tokens=False`` nothing depends on capacity, so the math is the distributed run's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zeroshard.moe.layer import MoE
from zeroshard.moe.marks import expert_shard, global_names
from zeroshard.parallel.tensor.slices import tp_slice_of

H = 8  # hidden size (a multiple of 4: grouped matmul rows are 16-byte multiples)
EXPERTS = 4
TOKENS = 6  # tokens per sample
AUX = 0.01  # weight of the load-balancing losses
LR = 1e-2
TOL = 2e-5  # parity tolerance against the fp32 reference


class DSMoEModel(nn.Module):
    """DeepSpeed's SimpleMoEModel shape: dense, MoE (top-2, no sampling), dense, MoE
    (top-1), dense; loss = cross-entropy of the mean token + AUX x the aux losses.
    Global expert g of each layer is seeded by g, so any ep holds the same experts."""

    def __init__(self, ep_size: int = 1, ep_rank: int = 0, residual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.linear1 = nn.Linear(H, H)
        expert = nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H))
        common: dict[str, Any] = {"drop_tokens": False, "ep_size": ep_size, "num_experts": EXPERTS}
        self.moe_1 = MoE(H, expert, k=2, top2_2nd_expert_sampling=False, **common)
        self.linear2 = nn.Linear(H, H)
        self.moe_2 = MoE(H, expert, k=1, use_residual=residual, **common)
        self.linear3 = nn.Linear(H, H)
        local = EXPERTS // ep_size
        for layer, moe in ((1, self.moe_1), (2, self.moe_2)):
            for i, e in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
                g = torch.Generator().manual_seed(1000 * layer + ep_rank * local + i)
                with torch.no_grad():
                    for p in e.parameters():
                        p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.linear1(x)
        out, aux1, _ = self.moe_1(h)
        out = self.linear2(out)
        out, aux2, _ = self.moe_2(out)
        h = h + self.linear3(out)
        loss = nn.functional.cross_entropy(h.mean(1), y)
        return loss + AUX * (aux1 + aux2)


def tiny_mixtral(experts: int = EXPERTS, layers: int = 2, qwen: str | None = None):
    """A transformers Mixtral (or Qwen2-MoE / Qwen3-MoE) of random weights, fp32."""
    import transformers

    torch.manual_seed(11)
    common: dict[str, Any] = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
        tie_word_embeddings=False,
    )
    cfg: transformers.PretrainedConfig
    model: torch.nn.Module
    if qwen == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(
            num_experts=experts, moe_intermediate_size=8, shared_expert_intermediate_size=12,
            decoder_sparse_step=1, **common,
        )  # fmt: skip
        model = transformers.Qwen2MoeForCausalLM(cfg)
    elif qwen == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            num_experts=experts, moe_intermediate_size=8, decoder_sparse_step=1, head_dim=8,
            **common,
        )  # type: ignore[call-arg]  # fmt: skip
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.MixtralConfig(num_local_experts=experts, **common)
        model = transformers.MixtralForCausalLM(cfg)
    cfg._attn_implementation = "eager"
    return model.float()


def ds_batch(step: int, rank: int, rows: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(rows, TOKENS, H, generator=g), torch.randint(0, H, (rows,), generator=g)


def lm_batch(step: int, rank: int, rows: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, 64, (rows, 8), generator=g)
    return {"input_ids": ids, "labels": ids}


def loss_of(model: nn.Module, kind: str, step: int, rank: int) -> torch.Tensor:
    if kind == "ds":
        return model(*ds_batch(step, rank))
    return model(**lm_batch(step, rank)).loss


def reference(
    kind: str, dp: int, steps: int, clip: float = 0.0, second: int = 0
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Single process, fp32 AdamW: each step the mean of the ``dp`` micro-batch losses
    (with ``second``, plus the mean of those of step ``step + second``: two losses, one
    step); returns the losses, the global gradient norms (before clipping at ``clip``)
    and the final parameters."""
    model = DSMoEModel() if kind == "ds" else tiny_mixtral()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, norms = [], []
    for step in range(steps):
        loss = torch.stack([loss_of(model, kind, step, r) for r in range(dp)]).sum() / dp
        if second:
            more = [loss_of(model, kind, step + second, r) for r in range(dp)]
            loss = loss + torch.stack(more).sum() / dp
        loss.backward()
        if clip > 0:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def as_global(module: nn.Module, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's parameters under their global names (per-expert modules renamed)."""
    names = global_names(module)
    return {names.get(n, n): t for n, t in local.items()}


def diff_to_reference(
    module: nn.Module, local: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]
) -> float:
    """Max |local - reference| over this rank's parameters: experts against the global
    experts it holds (a fused expert tensor against its slice of the whole one),
    tensor-parallel slices against theirs."""
    params = dict(module.named_parameters())
    worst = 0.0
    for name, t in as_global(module, local).items():
        want = ref[name]
        local_name = next((n for n, g in global_names(module).items() if g == name), name)
        shard = expert_shard(params[local_name])
        if shard is not None and shard.fused_dim is not None:
            want = want.narrow(shard.fused_dim, shard.first, shard.local)
        spec = tp_slice_of(params[local_name])
        if spec is not None:  # a tensor-parallel slice
            want = spec.take(want)
        worst = max(worst, (t.float() - want.float()).abs().max().item())
    return worst


class MoEBlock(nn.Module):
    """A residual MoE block for pipelines (top-2, no sampling; its aux loss cannot reach
    a pipeline's loss function, so it is left out)."""

    def __init__(self, ep_size: int, ep_rank: int, layer: int) -> None:
        super().__init__()
        expert = nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H))
        self.moe = MoE(H, expert, num_experts=EXPERTS, ep_size=ep_size, k=2, drop_tokens=False,
                       top2_2nd_expert_sampling=False)  # fmt: skip
        local = EXPERTS // ep_size
        for i, e in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
            g = torch.Generator().manual_seed(1000 * layer + ep_rank * local + i)
            with torch.no_grad():
                for p in e.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(x)[0]


def pipe_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.mean(1), y)


def pipe_model(stages: int, ep_size: int, ep_rank: int):
    """Dense, MoE, dense, MoE, dense as a PipelineModule (layers seeded by position)."""
    from zeroshard.pipe import LayerSpec, PipelineModule

    specs = [
        LayerSpec(nn.Linear, H, H),
        LayerSpec(MoEBlock, ep_size, ep_rank, 1),
        LayerSpec(nn.Linear, H, H),
        LayerSpec(MoEBlock, ep_size, ep_rank, 2),
        LayerSpec(nn.Linear, H, H),
    ]
    return PipelineModule(specs, num_stages=stages, loss_fn=pipe_loss, seed_layers=True)
