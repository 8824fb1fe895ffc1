"""Issue 19 (inference core): init_inference's config, int8/int4 weight-only quantization
(bytes, kernels against the dequantized weight, save/load), KV-cache generation (exact
against recomputation, padding, sampling, stop tokens), Hugging Face generate() with
quantized layers, model configs in checkpoints, bad input. One process, small models."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import pytest
import torch

import zeroshard
from zeroshard.config import ConfigError
from zeroshard.inference import QuantizationError, QuantLinear, init_inference
from zeroshard.models import GPT, GPTConfig

torch.set_num_threads(1)


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{"n_layer": 2, "n_head": 2, "d_model": 64, "seq_len": 96, **kw}))


def test_config_keys(capsys) -> None:
    eng = init_inference(_gpt(), {"replace_with_kernel_inject": True, "max_out_tokens": 64})
    assert "no kernels to inject" in capsys.readouterr().out
    assert eng.config.max_out_tokens == 64 and eng.quantized == []
    eng = init_inference(_gpt(tie_embeddings=False), dtype=torch.int8)
    assert all(isinstance(eng.module.get_submodule(n), QuantLinear) for n in eng.quantized)
    assert "head" in eng.quantized
    for dtype in (torch.bfloat16, "fp16"):  # compute dtypes, with quantized layers too
        eng = init_inference(_gpt(), dtype=dtype, quant={"enabled": True, "weight": {"num_bits": 4, "group_size": 32}})  # fmt: skip
        out = eng.generate([[1, 2, 3]], max_new_tokens=4)
        assert out.shape == (1, 7) and eng.module.tok_emb.weight.dtype != torch.float32  # type: ignore[union-attr]
    cfg = zeroshard.inference.load_inference_config({"mp_size": 2})[0]
    assert cfg.tp_size == 2
    with pytest.raises(ConfigError, match="max_out_tokenz"):
        init_inference(_gpt(), {"max_out_tokenz": 3})
    with pytest.raises(ConfigError, match=r"enable_cuda_graph: the model is on cpu"):
        init_inference(_gpt(), enable_cuda_graph=True)  # (tests/test_decode_graph.py)
    with pytest.raises(ConfigError, match=r"quant\.weight\.num_bits"):
        init_inference(_gpt(), quant={"enabled": True, "weight": {"num_bits": 3}})
    with pytest.raises(ConfigError, match="dtype"):
        init_inference(_gpt(), dtype=torch.int32)


@pytest.mark.parametrize("bits,group,sym", [(8, 128, True), (8, 128, False), (4, 32, True), (4, 128, False)])  # fmt: skip
def test_quant_linear_kernel_and_round_trip(bits, group, sym) -> None:
    torch.manual_seed(1)
    lin = torch.nn.Linear(256, 96)
    q = QuantLinear.from_float(lin.weight, lin.bias, bits=bits, group_size=group, symmetric=sym)
    assert q.kernel == f"int{bits}pack"  # torch's int8 / int4 kernel runs for this shape
    x = torch.randn(2, 5, 256)
    y = q(x)
    deq = torch.nn.functional.linear(x, q.dequantize(), lin.bias)
    assert (y - deq).norm() / deq.norm() < 5e-3  # bf16 activations in the kernel
    err = (q.dequantize() - lin.weight).abs().max()
    assert err < (0.01 if bits == 8 else 0.1) * lin.weight.abs().max()
    q2 = QuantLinear(256, 96, bits=bits, group_size=group, symmetric=sym)
    q2.load_state_dict(q.state_dict())
    assert torch.equal(q2(x), y)
    # a shape the kernel does not take falls back to the dequantized weight
    odd = torch.nn.Linear(24 if bits == 8 else 64, 20)
    qo = QuantLinear.from_float(odd.weight, odd.bias, bits=bits, group_size=32, symmetric=sym)
    assert qo.kernel == "dequant" and qo.kernels() == ("dequant",)
    xo = torch.randn(3, odd.in_features)
    assert torch.allclose(qo(xo), odd(xo), atol=0.05 if bits == 8 else 0.3)
    # the dequantize-per-call form computes what the kernel does (kernels.py picks on a GPU)
    q.set_kernel("dequant")
    assert (q(x) - y).norm() / y.norm() < 5e-3
    with pytest.raises(QuantizationError, match="kernel 'int8pack' cannot compute"):
        qo.set_kernel("int8pack")


def test_weight_bytes() -> None:
    """Measured bytes held by the quantized Linear weights, scales included."""
    ratios = {}
    for bits in (8, 4):
        model = GPT(GPTConfig(n_layer=2, n_head=4, d_model=256, tie_embeddings=False))
        held, fp32 = init_inference(model, dtype=None, quant={"enabled": True, "weight": {"num_bits": bits}}).weight_bytes()  # fmt: skip
        ratios[bits] = held / fp32
    assert ratios[8] <= 0.27 and ratios[4] <= 0.15, ratios


def test_group_size_not_dividing_picks_the_next_and_says_so_once(tmp_path, caplog) -> None:
    """int4 group 64 over layers of 96 and 384 inputs: the 96-input layers take 32 (the
    next kernel group size that divides), the others keep 64; one warning names them.
    The export records each layer's group size and loads back to the same tokens."""
    from zeroshard.inference.quantize import fit_group_size

    assert [fit_group_size(1856, 128), fit_group_size(96, 64), fit_group_size(384, 64)] == [64, 32, 64]  # fmt: skip
    assert [fit_group_size(48, 32), fit_group_size(7, 32)] == [24, 7]  # no kernel size divides
    q = {"enabled": True, "weight": {"num_bits": 4, "group_size": 64}}
    with caplog.at_level(logging.WARNING, logger="zeroshard"):
        eng = init_inference(_gpt(d_model=96, tie_embeddings=False), quant=q)
    warned = [r.getMessage() for r in caplog.records if "group_size 64" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "7 layer(s)" in warned[0] and "blocks.0.attn.qkv (96 inputs: 32)" in warned[0]
    groups = {n: eng.module.get_submodule(n).group_size for n in eng.quantized}
    assert groups["blocks.1.attn.qkv"] == 32 and groups["blocks.1.mlp.proj"] == 64, groups
    assert groups["head"] == 32 and len(eng.quantized) == 9
    plain = init_inference(_gpt(d_model=96, tie_embeddings=False))
    ids = torch.tensor([[1, 2, 3, 4]])
    q32 = {"enabled": True, "weight": {"num_bits": 4, "group_size": 32}}
    all32 = init_inference(_gpt(d_model=96, tie_embeddings=False), quant=q32)
    err, err32 = ((e(ids) - plain(ids)).abs().mean().item() for e in (eng, all32))
    assert err <= 1.5 * err32, (err, err32)  # int4's own error, not garbage
    path = eng.save_quantized(str(tmp_path / "q4.safetensors"))
    back = init_inference(_gpt(d_model=96, tie_embeddings=False), checkpoint=path)
    assert torch.equal(back.generate(ids, max_new_tokens=6), eng.generate(ids, max_new_tokens=6))


def test_cache_exact_and_padding() -> None:
    eng = init_inference(_gpt(), dtype=torch.float32)
    ids = torch.randint(0, 256, (3, 9), generator=torch.Generator().manual_seed(0))
    cached = eng.generate(ids, max_new_tokens=40)
    assert torch.equal(cached, eng.generate(ids, max_new_tokens=40, use_cache=False))
    # a left-padded batch gives each prompt the tokens it gets alone
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]]
    batch = eng.generate(prompts, max_new_tokens=12, pad_token_id=0)
    for row, p in zip(batch, prompts, strict=True):
        alone = eng.generate([p], max_new_tokens=12)[0]
        assert row[6 - len(p) :].tolist() == alone.tolist()
    assert torch.equal(batch, eng.generate(prompts, max_new_tokens=12, use_cache=False))


def test_sampling_and_stop_tokens() -> None:
    eng = init_inference(_gpt())
    ids = torch.tensor([[1, 2, 3]])
    kw: dict[str, Any] = dict(
        max_new_tokens=20, do_sample=True, temperature=0.9, top_k=20, top_p=0.9
    )
    a, b = eng.generate(ids, seed=3, **kw), eng.generate(ids, seed=3, **kw)
    assert torch.equal(a, b) and not torch.equal(a, eng.generate(ids, seed=4, **kw))
    k1 = eng.generate(ids, seed=5, **{**kw, "top_k": 1})  # top-k 1 is greedy
    assert torch.equal(k1, eng.generate(ids, max_new_tokens=20))
    greedy = eng.generate(ids, max_new_tokens=20)[0, 3:].tolist()
    stop = greedy[4]
    out = eng.generate(ids, max_new_tokens=20, eos_token_id=stop, pad_token_id=255)[0, 3:].tolist()
    assert out == greedy[: greedy.index(stop) + 1]  # ended at the first stop token
    two = eng.generate([[1, 2, 3], [9, 9, 9]], max_new_tokens=20, eos_token_id=stop, pad_token_id=255)  # fmt: skip
    row = two[0, 3:].tolist()
    assert row[: len(out)] == out and set(row[len(out) :]) <= {255}
    with pytest.raises(ValueError, match="max_out_tokens=16"):
        init_inference(_gpt(), max_out_tokens=16).generate(ids, max_new_tokens=14)
    with pytest.raises(ValueError, match="pad prompts on the left"):
        eng.generate(ids, attention_mask=torch.tensor([[1, 1, 0]]), max_new_tokens=2)


def test_quantized_generation_and_save_load(tmp_path) -> None:
    model = _gpt()
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(2))
    for bits in (8, 4):
        eng = init_inference(_gpt(), quant={"enabled": True, "weight": {"num_bits": bits, "group_size": 32}})  # fmt: skip
        out = eng.generate(ids, max_new_tokens=16)
        assert torch.equal(out, eng.generate(ids, max_new_tokens=16, use_cache=False))
        path = eng.save_quantized(str(tmp_path / f"q{bits}.safetensors"))
        again = init_inference(_gpt(seq_len=96), checkpoint=path)  # shells filled from the file
        assert len([m for m in again.module.modules() if isinstance(m, QuantLinear)]) == 8
        assert torch.equal(again(ids), eng(ids))
        from zeroshard.inference.weights import model_from

        assert torch.equal(model_from(path)(ids), eng(ids))  # the file records the model
    assert model is not None


def test_hf_generate_with_quantized_layers(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfgs = [
        transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=128, n_positions=64),
        transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
        ),
    ]
    ids = torch.randint(0, 128, (2, 6))
    for cfg in cfgs:
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        ref = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        eng = init_inference(model)
        assert torch.equal(eng.generate(ids, max_new_tokens=8, pad_token_id=0), ref)
        q = init_inference(transformers.AutoModelForCausalLM.from_config(cfg).eval(), dtype=torch.int8)  # fmt: skip
        assert len(q.quantized) >= 8  # GPT-2's Conv1D layers and Llama's Linear ones
        out = q.generate(ids, max_new_tokens=8, pad_token_id=0)
        assert out.shape == (2, 14)
        ragged = q.generate([[5, 6, 7], [8]], max_new_tokens=4, pad_token_id=0)  # left-padded
        assert ragged.shape == (2, 7)
        alone = q.generate([[8]], max_new_tokens=4, pad_token_id=0)
        assert ragged[1, 2:].tolist() == alone[0].tolist()
        from zeroshard.inference.weights import model_from  # the file records the HF config

        rebuilt = model_from(q.save_quantized(str(tmp_path / f"{cfg.model_type}.safetensors")))
        assert type(rebuilt) is type(model)
        assert torch.equal(rebuilt.eval()(ids).logits, q(ids).logits)


def _save_gpt_checkpoint(rank: int, world: int, root: str, with_config: bool) -> str:
    model = _gpt(seq_len=32)
    cfg = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    engine.save_checkpoint(root, tag="t")
    if not with_config:  # as a checkpoint saved before model configs were recorded
        path = os.path.join(root, "t", "manifest.json")
        with open(path) as f:
            manifest = json.load(f)
        manifest.pop("model")
        with open(path, "w") as f:
            json.dump(manifest, f)
    return os.path.join(root, "t")


def test_checkpoint_records_model_config(tmp_path) -> None:
    from multirank import run

    from zeroshard.checkpoint.model_config import ModelConfigError
    from zeroshard.inference.weights import model_from

    good = run(_save_gpt_checkpoint, 1, str(tmp_path / "a"), True, timeout=120)[0]
    model = model_from(good)
    assert model.cfg == _gpt(seq_len=32).cfg
    assert torch.equal(model.tok_emb.weight, _gpt(seq_len=32).tok_emb.weight)  # type: ignore[arg-type, union-attr]  # no step taken
    # quantized straight from the checkpoint, and from its safetensors export
    from zeroshard.checkpoint.export import export_checkpoint

    export = export_checkpoint(good, str(tmp_path / "export"))[0]
    ids = torch.tensor([[1, 2, 3, 4]])
    live = init_inference(_gpt(seq_len=32), dtype=torch.int8)
    for source in (good, export):
        eng = init_inference(GPT(_gpt(seq_len=32).cfg), checkpoint=source, dtype=torch.int8)
        assert torch.equal(eng(ids), live(ids))
        assert torch.equal(model_from(source).tok_emb.weight, model.tok_emb.weight)  # type: ignore[arg-type, union-attr]
    bad = run(_save_gpt_checkpoint, 1, str(tmp_path / "b"), False, timeout=120)[0]
    with pytest.raises(ModelConfigError, match="no model config"):
        model_from(bad)


def test_generate_command(tmp_path, capsys) -> None:
    """`zeroshard generate` on a quantized export, and its exit status on bad input."""
    from zeroshard.tools.cli import main

    eng = init_inference(_gpt(tie_embeddings=False), dtype=torch.int8)
    path = eng.save_quantized(str(tmp_path / "q.safetensors"))
    assert main(["generate", "--checkpoint", path, "--prompt", "def f(", "--max-new-tokens", "5"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    expected = eng.generate([list(b"def f(")], max_new_tokens=5)[0].tolist()
    assert text.startswith(bytes(expected).decode("utf-8", errors="replace"))
    plain = init_inference(_gpt(d_model=96)).save_quantized(str(tmp_path / "f.safetensors"))
    argv = ["generate", "--checkpoint", plain, "--prompt", "x", "--quant", "int4", "--group-size", "64"]  # fmt: skip
    assert main(argv) == 0  # the 96-input layers take group size 32 (and a warning says so)
    capsys.readouterr()
    torch.save({}, tmp_path / "w.pt")
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err  # loose files, no model.safetensors: which to take is named
    assert "has no weights zeroshard reads" in err and "give one of its .safetensors files" in err


@pytest.mark.slow
def test_generate_command_tensor_parallel(tmp_path) -> None:
    """`zeroshard generate --nproc 2` relaunches through `zeroshard run`: TP2's greedy text
    equals one process's."""
    import subprocess
    import sys

    path = init_inference(_gpt()).save_quantized(str(tmp_path / "m.safetensors"))
    cmd = [sys.executable, "-m", "zeroshard.tools.cli", "generate", "--checkpoint", path,
           "--prompt", "abc", "--max-new-tokens", "8"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    two = subprocess.run([*cmd, "--nproc", "2"], capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    assert one.stdout.strip() and one.stdout.strip() in two.stdout


def test_kernels_are_measured_per_shape_and_the_fastest_kept() -> None:
    """kernels.py (on a GPU at init_inference; here with a given timer): each layer shape
    is timed once per kernel, the fastest goes on every layer of that shape, a kernel that
    fails on the device is left out; the outputs stay the layer's."""
    from zeroshard.inference.kernels import device_timer, pick_kernels

    eng = init_inference(_gpt(tie_embeddings=False), dtype=torch.int8)
    ids = torch.tensor([[1, 2, 3, 4]])
    before = eng(ids)
    assert eng.kernel_choices == []  # the CPU keeps its kernels, untimed
    timed: list[str] = []

    def dequant_faster(kernel: str, fn) -> float:
        timed.append(kernel)
        fn()
        return {"int8pack": 2.0, "dequant": 1.0}[kernel]

    choices = pick_kernels(eng.module, timer=dequant_faster)
    shapes = {(c.out_features, c.in_features) for c in choices}
    assert shapes == {(192, 64), (64, 64), (256, 64), (64, 256)}  # fc and head share one
    assert sum(c.layers for c in choices) == len(eng.quantized) == 9
    assert len(timed) == 2 * len(choices) and all(c.kernel == "dequant" for c in choices)
    assert all(eng.module.get_submodule(n).kernel == "dequant" for n in eng.quantized)
    assert (eng(ids) - before).abs().max() <= 0.02 * before.abs().max()

    def int8_not_built(kernel: str, fn) -> float:
        if kernel == "int8pack":
            raise RuntimeError("not implemented for this device")
        return 1.0

    assert {c.kernel for c in pick_kernels(eng.module, timer=int8_not_built)} == {"dequant"}
    seconds = device_timer(torch.device("cpu"), rounds=2, warmup=1)("x", lambda: eng(ids))
    assert 0 < seconds < 10
