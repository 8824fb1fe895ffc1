"""Tensor-parallel inference (zeroshard/inference/tensor_parallel.py): on 2 gloo ranks,
greedy tokens of the TP2 model equal the unsplit model's (fp32), for transformers Llama
and GPT-2 through their own ``generate()`` (KV cache on) and for the built-in GPT; the
weights per rank shrink by the TP size; bad layouts and differing weights are refused.
"""

from __future__ import annotations

import copy
import types

import multirank
import pytest
import torch
from tp_parity import tiny_llama

from zeroshard.comm import Comm
from zeroshard.inference.tensor_parallel import check_same_weights, shard_for_inference
from zeroshard.models import GPT, GPTConfig

NEW = 12  # new tokens per prompt


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, seq_len=32, n_layer=2, n_head=4, d_model=32)
    cfg.update(kw)
    return GPT(GPTConfig(**cfg)).eval()


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(5)
    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                     bos_token_id=0, eos_token_id=1)  # fmt: skip
    return GPT2LMHeadModel(cfg).float().eval()


def _llama():
    m = tiny_llama(use_cache=True)
    m.generation_config.pad_token_id = 1
    return m.eval()


def _prompts(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randint(2, vocab, (2, 5), generator=g)


def _greedy_no_cache(model, ids: torch.Tensor, new: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(new):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def _hf_generate(model, ids):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)


def _bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _tp_cases(rank, world):
    comm, out = Comm(), {}
    builds = {
        "llama": (_llama, _hf_generate),
        "gpt2": (_gpt2, _hf_generate),
        "gpt": (_gpt, lambda m, ids: _greedy_no_cache(m, ids, NEW)),
    }
    for key, (build, gen) in builds.items():
        ref = build()
        model = copy.deepcopy(ref)
        ids = _prompts(64)
        want = gen(ref, ids)
        shard_for_inference(model, comm)
        got = gen(model, ids)
        out[key] = {
            "same": torch.equal(got, want),
            "tokens": got.tolist(),
            "bytes": (_bytes(ref), _bytes(model)),
        }
    # differing weights are refused on every rank, naming the parameter and the rank
    model = _gpt()
    if rank == 1:
        with torch.no_grad():
            model.blocks[1].mlp.fc.weight[0, 0] += 1
    try:
        check_same_weights(model, comm)
        out["differ"] = None
    except ValueError as exc:
        out["differ"] = str(exc)
    return out


@pytest.fixture(scope="module")
def tp2():
    return multirank.run(_tp_cases, 2, timeout=240)


@pytest.mark.parametrize("key", ["llama", "gpt2", "gpt"])
def test_tp2_greedy_tokens_equal_tp1(tp2, key):
    for rank_out in tp2:
        r = rank_out[key]
        assert r["same"], f"{key}: TP2 tokens differ from the unsplit model's"
        whole, local = r["bytes"]
        assert local < 0.6 * whole  # every matrix split (norms and positions replicated)
    assert tp2[0][key]["tokens"] == tp2[1][key]["tokens"]


def test_differing_weights_refused_on_every_rank(tp2):
    for r in tp2:
        assert r["differ"] is not None
        assert "rank 1" in r["differ"] and "blocks.1.mlp.fc.weight" in r["differ"]


def _fake_comm(t: int):
    return types.SimpleNamespace(world_size=t, rank=0)


@pytest.mark.parametrize(
    ("build", "t", "match"),
    [
        (lambda: _gpt(n_head=3, d_model=24), 2, r"blocks\.0\.attn\.qkv: 3 attention heads.*"),
        (lambda: tiny_llama(num_key_value_heads=1), 2, r"k_proj: 1 key/value heads"),
        (_gpt2, 8, r"c_attn: 4 attention heads .* use a tensor_parallel.tp_size that divides 4"),
    ],
)
def test_tp_not_dividing_heads_is_refused_by_name(build, t, match):
    with pytest.raises(ValueError, match=match):
        shard_for_inference(build(), _fake_comm(t), check_weights=False)
