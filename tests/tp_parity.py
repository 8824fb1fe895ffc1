"""Helpers for tensor/sequence-parallel parity tests: tiny models, whole gradients
re-assembled from every rank's shards, ledger deltas.

Verification traffic goes through its own Comm (its own ledger), so the ledger under
test counts only the model's collectives.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from zeroshard.distributed.comm import Comm
from zeroshard.parallel.tensor.slices import assemble, tp_slice_of

TOL = 2e-5
F32 = 4


def whole(t: torch.Tensor, p: torch.nn.Parameter, vcomm: Comm) -> torch.Tensor:
    """The whole tensor behind this rank's ``t`` (a slice of ``p``'s layout, or replicated)."""
    spec = tp_slice_of(p)
    if spec is None:
        return t
    pieces = vcomm.all_gather_object(t.detach().clone())
    return assemble(pieces, spec)


def grad_diffs(ref: torch.nn.Module, model: torch.nn.Module, vcomm: Comm) -> dict[str, float]:
    """Max |grad - reference grad| per parameter, shards re-assembled (every rank calls)."""
    ref_params = dict(ref.named_parameters())
    out = {}
    for name, p in model.named_parameters():
        r = ref_params[name]
        if r.grad is None and p.grad is None:
            continue
        assert p.grad is not None, f"{name}: no gradient"
        g = whole(p.grad, p, vcomm)
        assert r.grad is not None, name
        assert g.shape == r.grad.shape, f"{name}: {tuple(g.shape)} vs {tuple(r.grad.shape)}"
        out[name] = (g - r.grad).abs().max().item()
    assert set(out) == {n for n, r in ref_params.items() if r.grad is not None}
    return out


def param_diffs(ref: torch.nn.Module, model: torch.nn.Module, vcomm: Comm) -> float:
    ref_params = dict(ref.named_parameters())
    return max(
        (whole(p.detach(), p, vcomm) - ref_params[n].detach()).abs().max().item()
        for n, p in model.named_parameters()
    )


def local_param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def ops(snapshot: dict) -> dict[str, tuple[int, int]]:
    """{op: (calls, bytes)} from a ledger snapshot."""
    return {op: (s["calls"], s["bytes"]) for op, s in snapshot.items() if s["calls"]}


def run_fwd_bwd(model, comm: Comm, fn):
    """Run ``loss = fn(model)`` then backward, returning (loss, forward ops, backward ops)."""
    comm.ledger.reset()
    loss = fn(model)
    fwd = ops(comm.ledger.snapshot())
    comm.ledger.reset()
    loss.backward()
    bwd = ops(comm.ledger.snapshot())
    return loss, fwd, bwd


def twin(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def tiny_llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    cfg: dict[str, Any] = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               bos_token_id=0, eos_token_id=1, pad_token_id=None, use_cache=False)  # fmt: skip
    cfg.update(kw)
    return LlamaForCausalLM(LlamaConfig(**cfg)).float()


def whole_params(engine) -> dict[str, torch.Tensor]:
    """Every parameter, whole: ZeRO-gathered, then the tensor-parallel slices assembled
    (through a Comm of its own, so the engine's ledger is untouched)."""
    from zeroshard.zero import GatheredParameters

    verify = Comm(engine.mesh.comm("tp").group)
    out = {}
    model = engine.module
    with GatheredParameters(list(model.parameters())):
        for name, p in model.named_parameters():
            t = p.detach().float().clone()
            spec = tp_slice_of(p)
            if spec is not None:
                t = assemble(verify.all_gather_object(t), spec)
            out[name] = t
    return out
