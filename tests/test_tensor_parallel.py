"""Tensor parallelism (zeroshard/parallel/tensor/collectives.py, tensor/autotp.py): on 2
gloo ranks the split model's loss and every gradient (re-assembled from the shards) equal the unsplit
single-process model's to 2e-5 in fp32; the ledger equals Megatron's formulas; the
parameter bytes per rank are divided by the TP size; bad layouts are refused by name.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import cases
import multirank
import pytest
import torch
import torch.nn.functional as F
from tp_parity import (
    F32,
    TOL,
    grad_diffs,
    local_param_bytes,
    param_diffs,
    run_fwd_bwd,
    tiny_llama,
    twin,
)

from zeroshard.distributed.comm import Comm
from zeroshard.models import GPT, GPTConfig
from zeroshard.parallel.tensor.autotp import apply_tensor_parallel, sync_partial_grads
from zeroshard.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear
from zeroshard.parallel.tensor.slices import TPSlice, assemble
from zeroshard.parallel.tensor.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

B, S = 2, 8


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    cfg: dict[str, Any] = dict(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32)
    cfg.update(kw)
    return GPT(GPTConfig(**cfg))


def _batch(vocab: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (B, S), generator=g)
    return idx, torch.randint(0, vocab, (B, S), generator=g)


# -- no processes ------------------------------------------------------------------------


def test_slices_take_and_assemble_fused_parts():
    full = torch.arange(24.0).view(12, 2)
    specs = [TPSlice(full_shape=(12, 2), dim=0, parts=(4, 4, 4), rank=r, world=2) for r in range(2)]
    locals_ = [s.take(full) for s in specs]
    assert locals_[0][:, 0].tolist() == [0, 2, 8, 10, 16, 18]  # rows 0-1 of q, k and v
    assert specs[1].ranges() == [(2, 4), (6, 8), (10, 12)]
    assert torch.equal(assemble(locals_, specs[0]), full)
    with pytest.raises(ValueError, match="do not divide"):
        TPSlice(full_shape=(6, 2), dim=0, parts=(3, 3), rank=0, world=2)


def _fake_comm(t: int = 2):
    return types.SimpleNamespace(world_size=t, rank=0)


@pytest.mark.parametrize(
    ("build", "t", "match"),
    [
        (lambda: _gpt(n_head=3, d_model=24), 2, r"blocks\.0\.attn\.qkv: 3 attention heads"),
        (lambda: _gpt(vocab_size=63), 2, r"tok_emb: a vocabulary of 63 does not divide"),
        (lambda: tiny_llama(num_key_value_heads=1), 2, r"k_proj: 1 key/value heads .* divides 1"),
        (
            lambda: tiny_llama(num_attention_heads=2, num_key_value_heads=2),
            4,
            r"q_proj: 2 attention heads",
        ),
    ],
)
def test_refuses_indivisible_layouts(build, t, match):
    model = build()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        apply_tensor_parallel(model, _fake_comm(t))
    after = model.state_dict()  # refused before anything changed
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_refuses_unknown_layer_and_names_the_fix():
    model = _gpt()
    model.extra = torch.nn.Linear(32, 32)
    with pytest.raises(
        ValueError, match=r"does not know how to split extra \(Linear.*tp_plan=\{'extra'"
    ):
        apply_tensor_parallel(model, _fake_comm())
    apply_tensor_parallel(model, _fake_comm(1), tp_plan={"extra": "replicate"})
    with pytest.raises(ValueError, match="style 'sideways' is not one"):
        apply_tensor_parallel(_gpt(), _fake_comm(), tp_plan={"head": "sideways"})


def test_user_plan_overrides_the_model_plan():
    model = _gpt()
    apply_tensor_parallel(model, _fake_comm(), tp_plan={"re:blocks\\.1\\.mlp\\..*": "replicate"})
    assert type(model.blocks[1].mlp.fc) is torch.nn.Linear  # type: ignore[union-attr]  # kept whole
    assert type(model.blocks[0].mlp.fc).__name__ == "ColumnParallelLinear"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="Megatron-SP knows the built-in GPT and transformers"):
        apply_tensor_parallel(
            torch.nn.Sequential(torch.nn.Linear(4, 4)),
            _fake_comm(),
            tp_plan={"0": "column"},
            sequence_parallel=True,
        )


def test_refuses_tied_weight_split_two_ways():
    with pytest.raises(ValueError, match=r"head\.weight is the same tensor as tok_emb"):
        apply_tensor_parallel(_gpt(), _fake_comm(), tp_plan={"head": "replicate"})


# -- 2 ranks ---------------------------------------------------------------------------


def _layers_case(rank, world):
    """Column/row/vocab layers built from unsplit ones, and the vocab-parallel loss."""
    comm, out = Comm(), {}
    torch.manual_seed(3)
    fc, proj, emb = torch.nn.Linear(8, 12), torch.nn.Linear(12, 8), torch.nn.Embedding(10, 8)
    ids = torch.randint(0, 10, (3, 5))
    x = emb(ids)
    ref = proj(F.gelu(fc(x)))
    col = ColumnParallelLinear.from_linear(fc, comm)
    row = RowParallelLinear.from_linear(proj, comm)
    vemb = VocabParallelEmbedding.from_embedding(emb, comm)
    got = row(F.gelu(col(vemb(ids))))
    out["layers"] = (got - ref).abs().max().item()
    # vocab-parallel cross-entropy against F.cross_entropy, with ignored targets
    logits = torch.randn(6, 10, requires_grad=True)
    target = torch.tensor([0, 9, 4, -100, 5, 7])
    ref_loss = F.cross_entropy(logits, target)
    ref_loss.backward()
    local = logits.detach()[:, rank * 5 : (rank + 1) * 5].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, comm)
    loss.backward()
    out["ce_loss"] = abs(loss.item() - ref_loss.item())
    assert local.grad is not None and logits.grad is not None
    out["ce_grad"] = (local.grad - logits.grad[:, rank * 5 : (rank + 1) * 5]).abs().max().item()
    return out


def _expected_ledger(sp: bool, b=B, s=S, h=32, v=64, layers=2) -> tuple[dict, dict]:
    """Megatron's counts for a decoder of ``layers`` layers, plus the vocab-parallel
    embedding and a gathered head: (forward, backward) as {op: (calls, bytes)}."""
    one = b * s * h * F32  # one b*s*h activation
    n = 2 * layers + 1  # two per layer, one for the embedding (forward) / head input (backward)
    logits = b * s * v * F32  # the head's gathered output
    if not sp:  # an all-reduce counts twice its buffer
        return {"all_reduce": (n, n * 2 * one), "all_gather": (1, logits)}, {
            "all_reduce": (n, n * 2 * one)
        }
    fwd = {"reduce_scatter": (n, n * one), "all_gather": (n + 1, n * one + logits)}
    return fwd, {"all_gather": (n, n * one), "reduce_scatter": (n, n * one)}


def _bytes(ref, model, sharding, t: int) -> tuple[int, int, int]:
    """(whole model, measured on this rank, expected: split tensors / t + the rest)."""
    ref_p = dict(ref.named_parameters())
    split = sum(p.numel() * F32 for n, p in ref_p.items() if n in sharding.slices)
    whole = sum(p.numel() * F32 for n, p in ref_p.items() if n not in sharding.slices)
    return split + whole, local_param_bytes(model), split // t + whole


def _gpt_case(rank, world, sp: bool) -> dict:
    comm, vcomm = Comm(), Comm()
    idx, tgt = _batch(64)
    ref = _gpt()
    model = twin(ref)
    sharding = apply_tensor_parallel(model, comm, sequence_parallel=sp)
    loss_ref = ref(idx, tgt)
    loss_ref.backward()
    loss, fwd, bwd = run_fwd_bwd(model, comm, lambda m: m(idx, tgt))
    if sp:
        sync_partial_grads(model, comm)
    out = {
        "loss": abs(loss.item() - loss_ref.item()),
        "grads": max(grad_diffs(ref, model, vcomm).values()),
        "fwd": fwd,
        "bwd": bwd,
        "bytes": _bytes(ref, model, sharding, world),
        "sharded": sorted(sharding.slices),
        "partial": sorted(sharding.partial_grad),
    }
    if not sp:  # three AdamW steps on the shards track the unsplit model
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)  # parity.py's rate
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(3):
            if step:
                i, t = _batch(64, seed=10 + step)
                ref.zero_grad()
                model.zero_grad()
                ref(i, t).backward()
                model(i, t).backward()
            opt_ref.step()
            opt.step()
        out["params_after_3_steps"] = param_diffs(ref, model, vcomm)
    return out


HF_KEYS = ("llama", "llama_sp", "gpt2", "mixtral", "bert", "llama_loss_parallel")


def _hf_case(rank, world, key: str) -> dict:
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        GPT2Config,
        GPT2LMHeadModel,
        MixtralConfig,
        MixtralForCausalLM,
    )

    comm, vcomm = Comm(), Comm()
    idx, tgt = _batch(64)

    def causal(m):
        return m(input_ids=idx, labels=idx, use_cache=False).loss

    def build_gpt2():
        torch.manual_seed(5)
        return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                          resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=0,
                                          eos_token_id=1))  # fmt: skip

    def build_mixtral():
        torch.manual_seed(6)
        return MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32,
                                                num_hidden_layers=2, num_attention_heads=4,
                                                num_key_value_heads=2, num_local_experts=4,
                                                num_experts_per_tok=2, max_position_embeddings=64,
                                                use_cache=False, router_jitter_noise=0.0))  # fmt: skip

    def build_bert():
        torch.manual_seed(8)
        return BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, intermediate_size=64,
                                          max_position_embeddings=16, hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0))  # fmt: skip

    mlm_labels = torch.where(tgt % 3 == 0, idx, torch.full_like(idx, -100))
    builds = {
        "llama": (lambda: tiny_llama(), causal, False),
        "llama_sp": (lambda: tiny_llama(), causal, True),
        "gpt2": (build_gpt2, causal, False),
        "mixtral": (build_mixtral, causal, False),
        "bert": (build_bert, lambda m: m(input_ids=idx, labels=mlm_labels).loss, False),
    }
    builds["llama_loss_parallel"] = (lambda: tiny_llama(), causal, False)
    build, fn, sp = builds[key]
    ref = build().train()
    model = twin(ref)
    lp = key.endswith("loss_parallel")
    sharding = apply_tensor_parallel(model, comm, sequence_parallel=sp, loss_parallel=lp)
    loss_ref = fn(ref)
    loss_ref.backward()
    loss, fwd, bwd = run_fwd_bwd(model, comm, fn)
    sync_partial_grads(model, comm)
    return {
        "loss": abs(loss.item() - loss_ref.item()),
        "grads": max(grad_diffs(ref, model, vcomm).values()),
        "fwd": fwd,
        "bwd": bwd,
        "bytes": _bytes(ref, model, sharding, world),
        "n_sharded": len(sharding.slices),
        "logits": list(model(input_ids=idx, use_cache=False).logits.shape) if lp else None,
        "partial": sorted(sharding.partial_grad),
    }


@pytest.fixture(scope="module")
def results():
    return multirank.run(_run_all, 2, timeout=600)


def _run_all(rank, world):
    return cases.run_named(
        [
            ("layers", lambda: _layers_case(rank, world)),
            ("gpt tp", lambda: _gpt_case(rank, world, sp=False)),
            ("gpt sp", lambda: _gpt_case(rank, world, sp=True)),
            *((f"hf {key}", functools.partial(_hf_case, rank, world, key)) for key in HF_KEYS),
        ]
    )


def test_layers_and_vocab_parallel_loss(results):
    for layers in cases.values(results, "layers"):
        assert layers["layers"] <= TOL
        assert layers["ce_loss"] <= TOL and layers["ce_grad"] <= TOL


def test_gpt_tp2_parity_ledger_and_bytes(results):
    for g in cases.values(results, "gpt tp"):
        assert g["loss"] <= TOL and g["grads"] <= TOL and g["params_after_3_steps"] <= TOL
        assert (g["fwd"], g["bwd"]) == _ledger(False)
        assert "blocks.0.attn.qkv.weight" in g["sharded"] and "head.weight" in g["sharded"]


def test_gpt_megatron_sp_parity_and_ledger(results):
    for r in cases.by_rank(results, "gpt sp", "gpt tp"):
        g = r["gpt sp"]
        assert g["loss"] <= TOL and g["grads"] <= TOL
        assert (g["fwd"], g["bwd"]) == _ledger(True)
        assert "blocks.0.ln1.weight" in g["partial"] and "pos_emb.weight" in g["partial"]
        # the same bytes as TP's all-reduces (all-gather + reduce-scatter = one all-reduce)
        tp = r["gpt tp"]
        assert sum(b for _, b in g["fwd"].values()) == sum(b for _, b in tp["fwd"].values())


def _ledger(sp: bool):
    fwd, bwd = _expected_ledger(sp)
    return {k: list(v) for k, v in fwd.items()}, {k: list(v) for k, v in bwd.items()}


@pytest.mark.parametrize(
    "key", ["llama", "llama_sp", "llama_loss_parallel", "gpt2", "mixtral", "bert"]
)
def test_transformers_models_tp2_parity(results, key):
    for c in cases.values(results, f"hf {key}"):
        assert c["loss"] <= TOL, c["loss"]
        assert c["grads"] <= TOL, c["grads"]
        assert c["n_sharded"] > 0
        if key in ("llama", "llama_sp", "gpt2", "bert"):  # q, k, v (gate, up) share one f
            assert (c["fwd"], c["bwd"]) == _ledger(key == "llama_sp")
        if key == "llama_loss_parallel":  # no b*s*V gather: logits stay split, 2 small all-reduces
            assert c["logits"] == [B, S, 32]
            fwd, bwd = _ledger(False)
            n, tokens = fwd["all_reduce"][0], B * S
            small = 2 * (tokens + 2 * tokens) * F32  # max over N, then (sum exp, target) of 2N
            assert c["fwd"] == {"all_reduce": [n + 2, fwd["all_reduce"][1] + small]}
            assert c["bwd"] == bwd


def test_parameter_bytes_divide_by_tp(results):
    """Measured on each rank's sharded model: every split tensor holds 1/t of its bytes;
    only norms, row-layer biases and position tables stay whole."""
    names = ["gpt tp", "gpt sp", *(f"hf {key}" for key in HF_KEYS)]
    per_rank = cases.by_rank(results, *names)
    for r in per_rank:
        for c in r.values():
            full, local, expected = c["bytes"]
            assert local == expected, c["bytes"]
    full, local, _ = per_rank[0]["gpt tp"]["bytes"]
    replicated = (
        16 * 32 + 2 * 6 * 32 + 2 * 32
    ) * F32  # pos_emb; per block 2 norms + 2 row biases; ln_f
    assert local == (full - replicated) // 2 + replicated


def test_parameter_bytes_of_a_larger_gpt():
    """The 'small' preset (4 layers, width 128, 256 positions) split over 2 and 4 ranks
    (sharding needs no communication): a rank holds total / t plus (1 - 1/t) of the
    replicated position table, norms and row-layer biases (4.2% of the model)."""
    cfg = GPTConfig.preset("small")
    full = local_param_bytes(GPT(cfg))
    d = cfg.d_model
    replicated = (cfg.seq_len * d + cfg.n_layer * 6 * d + 2 * d) * F32
    assert replicated / full < 0.045
    for t in (2, 4):
        model = GPT(cfg)
        apply_tensor_parallel(model, _fake_comm(t))
        assert local_param_bytes(model) == (full - replicated) // t + replicated
