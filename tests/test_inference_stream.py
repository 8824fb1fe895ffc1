"""ZeRO-Inference (zeroshard/inference/streaming.py): weights in NVMe files or CPU memory,
streamed per layer with read-ahead, generate the same tokens as the in-memory model
(built-in GPT, transformers Llama and GPT-2 through their own ``generate()``); a model
built on the meta device goes straight into the files unit by unit; and, measured in a
subprocess, peak RSS while generating stays under 30% of the model's weight bytes.
"""

from __future__ import annotations

import copy
import os
import zlib
from typing import Any

import multirank
import pytest
import rss
import torch
from torch import nn
from tp_parity import tiny_llama

from zeroshard.inference.streaming import StreamConfig, plan_units, stream_weights
from zeroshard.models import GPT, GPTConfig

NEW = 10


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    cfg: dict[str, Any] = dict(vocab_size=64, seq_len=32, n_layer=3, n_head=4, d_model=32)
    cfg.update(kw)
    return GPT(GPTConfig(**cfg)).eval()


def _greedy(model, ids: torch.Tensor, new: int = NEW) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(new):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def _ids(vocab=64, b=2, s=5) -> torch.Tensor:
    return torch.randint(2, vocab, (b, s), generator=torch.Generator().manual_seed(3))


def test_units_are_layers_and_the_other_owners():
    assert [n for n, _ in plan_units(_gpt())] == [
        "tok_emb", "pos_emb", "blocks.0", "blocks.1", "blocks.2", "ln_f", "head",
    ]  # fmt: skip
    names = [n for n, _ in plan_units(tiny_llama())]
    assert names == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm",
                     "lm_head"]  # fmt: skip
    t5 = [n for n, _ in plan_units(_t5())]  # two stacks of layers (encoder, decoder)
    assert "encoder.block.1" in t5 and "decoder.block.1" in t5
    assert not any(n.startswith("decoder.block.0.") for n in t5)


@pytest.mark.parametrize(
    ("device", "upload"), [("nvme", False), ("nvme", True), ("cpu", True)]
)  # upload: the host->device copy path of a GPU, run on the CPU
def test_streamed_gpt_tokens_equal_in_memory(tmp_path, device, upload):
    ref = _gpt()
    want = _greedy(ref, _ids())
    model = copy.deepcopy(ref)
    cfg = StreamConfig(device=device, nvme_path=str(tmp_path), buffer_count=3)
    sw = stream_weights(model, cfg, force_upload=upload)
    assert sw is not None
    assert sum(p.untyped_storage().nbytes() for p in model.parameters()) <= 4 * 64  # placeholders
    assert torch.equal(_greedy(model, _ids()), want)
    n_units = len(sw.units)
    assert sw.stats.units_read >= NEW * n_units  # every weight read once per token
    assert sw.stats.prefetched >= NEW * n_units - 2  # all but the first reads ahead
    assert sw.resident_bytes() <= 3 * max(u.nbytes for u in sw.units)
    sw.remove()  # whole weights back, hooks gone, swap files deleted
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 ref.state_dict().values(), strict=True))  # fmt: skip
    assert not any(n.startswith("zeroshard-swap-") for n in os.listdir(tmp_path))
    assert torch.equal(_greedy(model, _ids()), want)


def test_a_forward_that_raises_does_not_leak_buffers(tmp_path):
    model = _gpt()
    want = _greedy(copy.deepcopy(model), _ids())
    sw = stream_weights(model, StreamConfig(device="nvme", nvme_path=str(tmp_path), buffer_count=2))
    assert sw is not None
    for i in (1, 2):  # each raise leaves block i "in use": without recovery, two of
        # them hold both buffers of the pool and the next forward has none
        boom = model.blocks[i].register_forward_pre_hook(lambda *a: 1 / 0)  # after acquire
        with pytest.raises(ZeroDivisionError):
            model(_ids())
        boom.remove()
    assert torch.equal(_greedy(model, _ids()), want)
    sw.remove()


def test_cpu_storage_on_cpu_compute_moves_nothing(tmp_path):
    model = _gpt()
    before = [p.data_ptr() for p in model.parameters()]
    assert stream_weights(model, StreamConfig(device="cpu")) is None
    assert [p.data_ptr() for p in model.parameters()] == before


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


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(5)
    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   num_decoder_layers=2, decoder_start_token_id=0, pad_token_id=0,  # type: ignore[call-arg]
                   eos_token_id=1)  # fmt: skip
    return T5ForConditionalGeneration(cfg).eval()


@pytest.mark.parametrize("build", [_llama, _gpt2, _t5], ids=["llama", "gpt2", "t5"])
def test_streamed_hf_generate_equals_in_memory(tmp_path, build):
    ref = build()
    ids = _ids()
    kw: dict[str, Any] = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    with torch.no_grad():
        want = ref.generate(ids, **kw)
    model = copy.deepcopy(ref)
    sw = stream_weights(model, StreamConfig(device="nvme", nvme_path=str(tmp_path)))
    assert sw is not None
    with torch.no_grad():
        got = model.generate(ids, **kw)
    assert torch.equal(got, want)
    assert sw.stats.units_read >= NEW * (len(sw.units) if build is not _t5 else 5)
    # the order is learned (T5: the encoder once, then the decoder per token): read-ahead
    # serves nearly every layer
    assert sw.stats.prefetched >= 0.85 * (sw.stats.prefetched + sw.stats.on_demand), sw.stats
    sw.remove()


# -- built on the meta device, unit by unit ----------------------------------------------


def init_unit(name: str, module: nn.Module) -> None:
    """Deterministic per-unit init (seeded by the unit's name): what a checkpoint loader
    would do, one unit at a time."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    for pname, p in module.named_parameters():
        if p.dim() < 2:
            p.copy_(torch.zeros_like(p) if pname.endswith("bias") else torch.ones_like(p))
        else:
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def materialize(model: nn.Module) -> nn.Module:
    """The in-memory reference of a meta-built model: each unit filled by ``init_unit``
    in order, a parameter shared by two units keeping the first one's values."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}  # to_empty unties: tie again
    for m in model.modules():
        for attr, p in m._parameters.items():
            holders.setdefault(id(p), []).append((m, attr))
    model.to_empty(device="cpu")
    for group in holders.values():
        first = getattr(*group[0])
        for m, attr in group[1:]:
            setattr(m, attr, first)
    seen: set[int] = set()
    for name, m in plan_units(model):
        tmp = copy.deepcopy(m)
        with torch.no_grad():
            init_unit(name, tmp)
        for (_, p), (_, q) in zip(m.named_parameters(), tmp.named_parameters(), strict=True):
            if id(p) not in seen:
                with torch.no_grad():
                    p.copy_(q)
                seen.add(id(p))
    return model


def test_meta_model_built_into_files_unit_by_unit(tmp_path):
    cfg = GPTConfig(vocab_size=64, seq_len=32, n_layer=3, n_head=4, d_model=32)  # tied head
    with torch.device("meta"):
        meta, ref = GPT(cfg).eval(), GPT(cfg).eval()
    want = _greedy(materialize(ref), _ids())
    sw = stream_weights(meta, StreamConfig(device="nvme", nvme_path=str(tmp_path)), init=init_unit)
    assert sw is not None
    assert torch.equal(_greedy(meta, _ids()), want)
    sw.remove()
    with pytest.raises(ValueError, match="pass init"), torch.device("meta"):
        stream_weights(GPT(cfg), StreamConfig(device="nvme", nvme_path=str(tmp_path)))


# -- peak RSS, in a subprocess ------------------------------------------------------------

BIG = GPTConfig(
    vocab_size=256, seq_len=64, n_layer=32, n_head=8, d_model=512, tie_embeddings=False
)  # fmt: skip  ~403 MB of fp32 weights


def _big_run(rank, world, nvme: str | None, new: int):
    """Generate ``new`` tokens from BIG: streamed from NVMe (``nvme`` set) or in memory.
    Returns tokens, weight bytes and peak RSS above the baseline (MiB)."""
    import time

    # the baseline comes after torch has loaded what building on meta and a forward
    # import (~75 MB of modules and kernels), not part of the model's memory
    with torch.device("meta"):
        GPT(GPTConfig(n_layer=1))
    _greedy(_gpt(), _ids(), 1)
    base = rss.current_mib()
    with torch.device("meta"):
        model = GPT(BIG).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if nvme:
        cfg = StreamConfig(device="nvme", nvme_path=nvme, buffer_count=4)
        sw = stream_weights(model, cfg, init=init_unit)
        assert sw is not None
    else:
        materialize(model)
    ids = _ids(256, b=1, s=8)
    t0 = time.perf_counter()
    out = _greedy(model, ids, new)
    seconds = time.perf_counter() - t0
    return {
        "tokens": out.tolist(),
        "weight_bytes": weight_bytes,
        "peak_mib": rss.peak_mib() - base,
        "tokens_per_s": new * ids.shape[0] / seconds,
        "read_bytes": sw.stats.bytes_read if nvme and sw is not None else 0,
    }


def test_nvme_streamed_peak_rss_under_30_percent_of_weights(tmp_path, monkeypatch):
    monkeypatch.setitem(os.environ, "MALLOC_MMAP_THRESHOLD_", "65536")  # RSS follows frees
    new = 4
    (streamed,) = multirank.run(_big_run, 1, str(tmp_path), new, timeout=400, start="spawn")
    (memory,) = multirank.run(_big_run, 1, None, new, timeout=400, start="spawn")
    weights_mib = streamed["weight_bytes"] / 2**20
    assert weights_mib > 350
    assert streamed["tokens"] == memory["tokens"]
    assert streamed["peak_mib"] <= 0.30 * weights_mib, (streamed["peak_mib"], weights_mib)
    assert memory["peak_mib"] >= 0.9 * weights_mib  # the in-memory run really holds them
    print(
        f"weights {weights_mib:.0f} MiB: peak RSS streamed {streamed['peak_mib']:.0f} MiB, "
        f"in memory {memory['peak_mib']:.0f} MiB; tokens/s streamed "
        f"{streamed['tokens_per_s']:.2f}, in memory {memory['tokens_per_s']:.2f}"
    )


# -- through init_inference ----------------------------------------------------------------


def test_init_inference_zero_section_streams_with_kv_cache(tmp_path, capsys):
    import zeroshard

    ids = _ids()
    want = zeroshard.init_inference(_gpt(), {}).generate(ids, max_new_tokens=NEW)
    zero = {
        "stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 3},
        "stage3_prefetch_bucket_size": 1000,
    }
    eng = zeroshard.init_inference(_gpt(), {"zero": zero})
    assert eng.streaming is not None
    assert "stage3_prefetch_bucket_size means nothing" in capsys.readouterr().out
    assert torch.equal(eng.generate(ids, max_new_tokens=NEW), want)
    # with the cache, each new token runs every unit once on one position
    assert eng.streaming.stats.units_read >= NEW * len(eng.streaming.units)
    eng.streaming.remove()


@pytest.mark.parametrize(
    ("zero", "match"),
    [
        ({"stage": 2, "offload_param": {"device": "cpu"}}, r"zero\.stage: .* stage 3"),
        ({"stage": 3}, r"zero\.offload_param: say where"),
        ({"stage": 3, "offload_param": {"device": "nvme"}}, r"nvme_path: needed"),
        ({"stage": 3, "offload_param": {"device": "disk"}}, r"offload_param\.device: 'disk'"),
        ({"stage": 3, "offload_param": {"device": "cpu", "bufer_count": 2}}, "bufer_count"),
        ({"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 1}}, "at least 2"),
        ({"stage": 3, "reduce_scatter": True, "offload_param": {"device": "cpu"}}, "zero.reduce"),
    ],
)
def test_bad_zero_sections_name_the_key(zero, match):
    import zeroshard

    with pytest.raises(ValueError, match=match):
        zeroshard.init_inference(_gpt(), {"zero": zero})


@pytest.mark.parametrize(("bits", "group"), [(8, 128), (4, 32)])
def test_streamed_quantized_layers(tmp_path, bits, group):
    """ZeRO-Inference of an int8/int4 model (DeepSpeed's ZeRO-Inference with 4-bit
    weights): the quantized layers' kernel tensors are streamed like parameters."""
    import zeroshard

    q = {"quant": {"enabled": True, "weight": {"num_bits": bits, "group_size": group}}}
    build = dict(d_model=64, n_head=4)
    want = zeroshard.init_inference(_gpt(**build), q).generate(_ids(), max_new_tokens=NEW)
    zero = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}
    eng = zeroshard.init_inference(_gpt(**build), {**q, "zero": zero})
    assert eng.streaming is not None
    tensors = [t for m in eng.module.modules() for t in vars(m).values() if torch.is_tensor(t)]
    tensors += list(eng.module.parameters()) + list(eng.module.buffers())
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    assert sum(held.values()) < 4096  # placeholders only: everything is in the swap file
    assert torch.equal(eng.generate(_ids(), max_new_tokens=NEW), want)
    eng.streaming.remove()
    assert torch.equal(eng.generate(_ids(), max_new_tokens=NEW), want)


def test_meta_model_streams_from_a_safetensors_export(tmp_path):
    """init_inference(meta_model, checkpoint=export, zero=...): the weights go from the
    file to the swap file one layer at a time (built-in GPT, tied head stored once)."""
    from safetensors.torch import save_file

    import zeroshard

    ref = _gpt()
    state = {k: v.clone() for k, v in ref.state_dict().items() if k != "head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    want = zeroshard.init_inference(ref, {}).generate(_ids(), max_new_tokens=NEW)
    zero = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}
    with torch.device("meta"):
        meta = GPT(ref.cfg)
    eng = zeroshard.init_inference(meta, {"checkpoint": str(tmp_path), "zero": zero})
    assert eng.streaming is not None
    assert torch.equal(eng.generate(_ids(), max_new_tokens=NEW), want)
    eng.streaming.remove()
    # a transformers model saved by save_pretrained (its tied lm_head not in the file)
    gpt2 = _gpt2()
    gpt2.save_pretrained(tmp_path / "gpt2")
    kw: dict[str, Any] = dict(max_new_tokens=NEW, min_new_tokens=NEW)
    want = zeroshard.init_inference(gpt2, {}).generate(_ids(), **kw)
    with torch.device("meta"):
        meta = type(gpt2)(gpt2.config)
    eng = zeroshard.init_inference(meta, {"checkpoint": str(tmp_path / "gpt2"), "zero": zero})
    assert eng.streaming is not None
    assert torch.equal(eng.generate(_ids(), **kw), want)
    # Llama's rotary buffer must be real: parameters only on meta (accelerate)
    init_empty_weights = pytest.importorskip("accelerate").init_empty_weights

    llama = _llama()
    llama.save_pretrained(tmp_path / "llama")
    want = zeroshard.init_inference(llama, {}).generate(_ids(), **kw)
    with init_empty_weights():
        meta = type(llama)(llama.config)
    meta.generation_config.pad_token_id = 1
    eng = zeroshard.init_inference(meta, {"checkpoint": str(tmp_path / "llama"), "zero": zero})
    assert eng.streaming is not None
    assert torch.equal(eng.generate(_ids(), **kw), want)
    with torch.device("meta"), pytest.raises(ValueError, match="init_empty_weights"):
        zeroshard.init_inference(type(llama)(llama.config), {"checkpoint": str(tmp_path / "llama"), "zero": zero})  # fmt: skip
    # what cannot work says so, naming the key or the tensor
    with torch.device("meta"):
        meta = GPT(ref.cfg)
    with pytest.raises(ValueError, match="checkpoint: the model is on the meta device"):
        zeroshard.init_inference(meta, {"zero": zero})
    with pytest.raises(ValueError, match="quant: a model on the meta device"):
        zeroshard.init_inference(meta, {"checkpoint": str(tmp_path), "zero": zero,
                                        "quant": {"enabled": True}})  # fmt: skip
    with torch.device("meta"):
        other = GPT(GPTConfig(vocab_size=64, seq_len=32, n_layer=4, n_head=4, d_model=32))
    with pytest.raises(KeyError, match=r"no tensor 'blocks\.3\.ln1\.weight'"):
        zeroshard.init_inference(other, {"checkpoint": str(tmp_path), "zero": zero})
