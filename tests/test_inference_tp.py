"""Tensor-parallel inference (zeroshard/inference/tensor_parallel.py): on 2 gloo ranks,
greedy tokens of the TP2 model equal the unsplit model's (fp32), for transformers Llama
and GPT-2 through their own ``generate()`` (KV cache on) and for the built-in GPT; the
weights per rank shrink by the TP size; bad layouts and differing weights are refused.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import multirank
import pytest
import torch
from tp_parity import tiny_llama

from zeroshard.distributed.comm import Comm
from zeroshard.inference.tensor_parallel import check_same_weights, shard_for_inference
from zeroshard.models import GPT, GPTConfig

NEW = 12  # new tokens per prompt


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    cfg: dict[str, Any] = dict(vocab_size=64, seq_len=32, n_layer=2, n_head=4, d_model=32)
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
    comm, out = Comm(), dict[str, Any]()
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
    out.update(_engine_cases(rank, comm))
    # differing weights are refused on every rank, naming the parameter and the rank
    model = _gpt()
    if rank == 1:
        with torch.no_grad():
            model.blocks[1].mlp.fc.weight[0, 0] += 1  # type: ignore[index, operator, union-attr]
    try:
        check_same_weights(model, comm)
        out["differ"] = None
    except ValueError as exc:
        out["differ"] = str(exc)
    return out


def _engine_cases(rank, comm):
    """Through ``init_inference``: the built-in GPT generating with its KV cache (TP2 vs
    the unsplit model), Llama through the engine, int8/int4 after sharding, streaming."""
    import tempfile

    import zeroshard

    out: dict[str, Any] = {}
    ids = _prompts(64)
    tp2 = {"tensor_parallel": {"tp_size": 2}}
    ref = zeroshard.init_inference(_gpt(), {})
    want = ref.generate(ids, max_new_tokens=NEW)
    out["gpt_no_cache"] = torch.equal(want, _greedy_no_cache(_gpt(), ids, NEW))
    eng = zeroshard.init_inference(_gpt(), tp2)
    out["gpt_cache"] = torch.equal(eng.generate(ids, max_new_tokens=NEW), want)
    out["gpt_cache_heads"] = eng.module.blocks[0].attn.n_head  # type: ignore[index, union-attr]
    try:  # the captured/compiled decode step is refused with tensor parallelism, by name
        eng.compile(backend="eager")
        out["tp_compile"] = None
    except ValueError as exc:
        out["tp_compile"] = str(exc)
    torch.manual_seed(rank)  # ranks' own generators differ: sampling must still agree
    out["gpt_sampled"] = eng.generate(ids, max_new_tokens=NEW, do_sample=True).tolist()
    llama = zeroshard.init_inference(_llama(), tp2)
    out["llama_engine"] = torch.equal(
        llama.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW), _hf_generate(_llama(), ids)
    )
    # weight-only quantization of each rank's slice (after sharding)
    big = dict(d_model=64, n_head=4)
    for bits, group in ((8, 128), (4, 32)):
        q = {"quant": {"enabled": True, "weight": {"num_bits": bits, "group_size": group}}}
        one = zeroshard.init_inference(_gpt(**big), q)
        two = zeroshard.init_inference(_gpt(**big), {**q, **tp2})
        x = _prompts(64)
        l1, l2 = one(x), two(x)
        out[f"int{bits}"] = {
            "logit_diff": (l1 - l2).abs().max().item(),
            "logit_scale": l1.abs().max().item(),
            "quantized": len(two.quantized),
            "bytes": (one.weight_bytes()[0], two.weight_bytes()[0]),
            "tokens_equal": torch.equal(
                one.generate(x, max_new_tokens=NEW), two.generate(x, max_new_tokens=NEW)
            ),
        }
    # GPT-2's Conv1D layers (weights stored transposed) quantized after sharding
    q = {"quant": {"enabled": True, "weight": {"num_bits": 8}}}
    one, two = zeroshard.init_inference(_gpt2(), q), zeroshard.init_inference(_gpt2(), {**q, **tp2})
    l1, l2 = one(ids).logits, two(ids).logits
    out["gpt2_int8"] = {"quantized": len(two.quantized), "logit_diff": (l1 - l2).abs().max().item(),
                        "logit_scale": l1.abs().max().item()}  # fmt: skip
    # int4 group 64 over a row-parallel slice of 32 inputs: that layer takes 32
    q = {"quant": {"enabled": True, "weight": {"num_bits": 4, "group_size": 64}}}
    eng = zeroshard.init_inference(_gpt(**big), {**q, **tp2})
    layers = {n: eng.module.get_submodule(n) for n in eng.quantized}
    out["int4_refit"] = {n: getattr(m, "weight_only", m).group_size for n, m in layers.items()}
    # TP2 with each rank's slices streamed from its own NVMe swap file
    with tempfile.TemporaryDirectory() as d:
        zero = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": d}}
        eng = zeroshard.init_inference(_gpt(), {**tp2, "zero": zero})
        out["tp_streamed"] = torch.equal(eng.generate(ids, max_new_tokens=NEW), want)
        assert eng.streaming is not None
        eng.streaming.remove()
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


def test_static_decode_refused_with_tp(tp2):
    for r in tp2:
        assert (
            r["tp_compile"].startswith("compile: ") and "tensor_parallel.tp_size" in r["tp_compile"]
        )


def test_engine_tp2_gpt_with_kv_cache_and_llama(tp2):
    for r in tp2:
        assert r["gpt_no_cache"]  # the cache path itself equals recomputing (TP1)
        assert r["gpt_cache"], "TP2 + KV cache tokens differ from TP1's"
        assert r["gpt_cache_heads"] == 2  # each rank attends over its 2 of the 4 heads
        assert r["llama_engine"]
        assert r["tp_streamed"], "TP2 with streamed weights differs from TP1"
    # sampling without a seed: the seed is drawn on rank 0 and broadcast
    assert tp2[0]["gpt_sampled"] == tp2[1]["gpt_sampled"]


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_after_sharding(tp2, bits):
    for r in tp2:
        q = r[f"int{bits}"]
        assert q["quantized"] >= 8  # qkv, attn.proj, fc, mlp.proj of 2 blocks (head tied)
        # per-rank scales differ from the whole layer's only where a row is split
        # (row-parallel int8 scales; int4 groups never straddle ranks), so logits match
        # the TP1 quantized model's to within quantization error
        assert q["logit_diff"] <= 0.02 * q["logit_scale"], q
        whole, local = q["bytes"]
        assert local < 0.6 * whole
    assert tp2[0]["int4"]["tokens_equal"]  # int4 groups: identical weights, same tokens
    for r in tp2:
        g = r["gpt2_int8"]
        assert g["quantized"] == 8  # c_attn, c_proj, c_fc, mlp.c_proj of 2 blocks
        assert g["logit_diff"] <= 0.02 * g["logit_scale"], g


def test_int4_group_not_dividing_the_local_slice_picks_the_next(tp2):
    for r in tp2:
        groups = r["int4_refit"]
        assert groups["blocks.0.attn.proj"] == 32 and groups["blocks.0.mlp.fc"] == 64, groups


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


def test_generate_cli_nproc2_and_offload_print_the_same_text(tmp_path):
    """`zeroshard generate` on one rank, on two (--nproc 2: tensor parallel through
    `zeroshard run`) and with the weights streamed from NVMe files (--offload nvme)."""
    import os
    import subprocess
    import sys

    import zeroshard

    engine = zeroshard.init_inference(_gpt(vocab_size=256), {})
    path = engine.save_quantized(str(tmp_path / "gpt.safetensors"))
    prompts = ["def f(", "import"]
    ids = [list(p.encode()) for p in prompts]
    rows = engine.generate(ids, max_new_tokens=12).tolist()
    width = max(len(i) for i in ids)
    want = "".join(
        p + bytes(r[width:]).decode("utf-8", errors="replace") + "\n" + "-" * 40 + "\n"
        for p, r in zip(prompts, rows, strict=True)
    )
    base = [sys.executable, "-m", "zeroshard.tools.cli", "generate", "--checkpoint", path,
            "--prompt", prompts[0], "--prompt", prompts[1], "--max-new-tokens", "12"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ZEROSHARD_PROGRESS": "0"}
    runs = {
        "tp2": [*base, "--nproc", "2"],
        "nvme": [*base, "--offload", "nvme", "--nvme-path", str(tmp_path / "swap")],
        "bad": [*base, "--offload", "nvme"],
    }
    out = {}
    for key, cmd in runs.items():
        out[key] = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    for key in ("tp2", "nvme"):  # rank 0 alone prints, the same text as in this process
        assert out[key].returncode == 0, (key, out[key].stdout, out[key].stderr)
        assert out[key].stdout == want, key
    assert out["bad"].returncode == 2 and "nvme_path: needed" in out["bad"].stderr


def test_tp_size_without_ranks_says_how_to_launch(monkeypatch):
    import zeroshard

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(
        ValueError, match=r"tensor_parallel\.tp_size: .*zeroshard generate --nproc 2"
    ):
        zeroshard.init_inference(_gpt(), {"tensor_parallel": {"tp_size": 2}})
