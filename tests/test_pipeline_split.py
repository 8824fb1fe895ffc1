"""The pipeline splitter for Hugging Face decoders, in one process: the split layers run in
sequence give the model's logits, loss and gradients exactly (no processes spawned here)."""

from typing import Any

import pytest
import torch
from torch import nn

from zeroshard.parallel.pipeline.split import (
    PipelineSplit,
    TiedLayer,
    causal_lm_loss,
    split_for_pipeline,
)

transformers = pytest.importorskip("transformers")


def tiny_llama(tied: bool = False, attn: str = "sdpa", kv_heads: int = 2):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
        attn_implementation=attn,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def tiny_gpt2(attn: str = "sdpa", dropout: float = 0.1):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=3, n_head=4, n_positions=32, attn_implementation=attn,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg).eval()


def _parity_model(case: dict):
    if case["model"] == "gpt2":
        return tiny_gpt2(dropout=0.0).train()
    return tiny_llama(tied=case["tied"]).train()


def _batch(padded: bool):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    labels = ids.clone()
    if not padded:
        return ids, labels, ids
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding in the second row
    labels[1, :4] = -100
    return ids, labels, (ids, mask)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _no_cache(model):
    model.config.use_cache = False
    return model


# The eager cases without grouped KV heads (GPT-2, Llama with kv_heads == heads) check that each
# block runs its layer through the empty cache the model makes (use_cache): the cache hands
# attention contiguous keys and values, and on some CPUs matmul's backward rounds differently
# on the transposed views a layer gets without it.
CASES = [
    ("llama", lambda: tiny_llama(), False),
    ("llama-padded", lambda: tiny_llama(), True),
    ("llama-tied-eager", lambda: tiny_llama(tied=True, attn="eager"), True),
    ("llama-mha-eager", lambda: tiny_llama(attn="eager", kv_heads=4), True),
    ("gpt2", lambda: tiny_gpt2(), False),
    ("gpt2-padded-eager", lambda: tiny_gpt2(attn="eager"), True),
    ("gpt2-eager-no-cache", lambda: _no_cache(tiny_gpt2(attn="eager")), False),
]


@pytest.mark.parametrize("name,make,padded", CASES, ids=[c[0] for c in CASES])
def test_split_layers_equal_model(name, make, padded):
    model = make()
    ids, labels, inputs = _batch(padded)
    kwargs = {"attention_mask": inputs[1]} if padded else {}
    out = model(ids, labels=labels, **kwargs)
    out.loss.backward()
    ref_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    split = split_for_pipeline(model)
    assert split.loss_fn is causal_lm_loss
    logits = split.run(inputs)
    assert torch.equal(logits, out.logits)
    loss = split.loss_fn(logits, labels)
    assert torch.equal(loss, out.loss)
    loss.backward()
    grads = _grads(model)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        assert torch.equal(grads[n], ref_grads[n]), n


def test_layer_list_shape_and_ties():
    llama = split_for_pipeline(tiny_llama())
    kinds = [type(x).__name__ for x in llama.layers]
    assert kinds == ["Embedding", "LlamaBlock", "LlamaBlock", "LlamaBlock", "FinalNorm", "LMHead"]
    assert llama.tied_keys == ()

    tied = split_for_pipeline(tiny_llama(tied=True))
    first, last = tied.layers[0], tied.layers[-1]
    assert isinstance(first, TiedLayer) and isinstance(last, TiedLayer)
    assert first.key == last.key == "embed_tokens" and first.module is last.module
    assert tied.tied_keys == ("embed_tokens",)

    gpt2 = split_for_pipeline(tiny_gpt2())
    assert [type(x).__name__ for x in gpt2.layers][:2] == ["TiedLayer", "GPT2Positions"]
    assert gpt2.tied_keys == ("wte",)
    # every parameter of the model is in exactly one layer (tied ones in the shared module)
    seen = set()
    for layer in gpt2.layers:
        mod = layer.module if isinstance(layer, TiedLayer) else layer
        seen |= {id(p) for p in mod.parameters()}
    assert (
        seen
        == {id(p) for p in gpt2.layers[0].module.parameters()}  # type: ignore[union-attr]
        | {
            id(p)
            for layer in gpt2.layers[1:-1]
            for p in layer.parameters()  # type: ignore[union-attr]
        }
    )
    assert len(seen) == len(list(tiny_gpt2().parameters()))


def test_activations_between_layers_are_tensors():
    split = split_for_pipeline(tiny_llama())
    _, _, inputs = _batch(padded=True)
    x = inputs
    for layer in split.layers:
        x = layer(x)
        items = x if isinstance(x, tuple) else (x,)
        assert all(isinstance(t, torch.Tensor) for t in items)


def test_sequential_and_refusals():
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    split = split_for_pipeline(seq)
    assert isinstance(split, PipelineSplit) and split.loss_fn is None and len(split.layers) == 3

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x) + x

    with pytest.raises(
        ValueError, match=r"cannot split Branchy \(not a Hugging Face model\).*PipelineModule"
    ):
        split_for_pipeline(Branchy())

    bert = transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=32,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=16,
        )
    )
    with pytest.raises(ValueError, match=r"BertForMaskedLM \(model_type 'bert'\).*llama, gpt2"):
        split_for_pipeline(bert)

    base = tiny_llama().model  # LlamaModel: no lm_head
    with pytest.raises(ValueError, match=r"lacks model\.embed_tokens"):
        split_for_pipeline(base)


def test_causal_lm_loss_ignores_and_shifts():
    logits = torch.randn(1, 3, 5)
    labels = torch.tensor([[1, 2, -100]])
    # position 0 predicts 2, position 1 predicts -100 (ignored), position 2 predicts padding
    ref = torch.nn.functional.cross_entropy(logits[0, :1], torch.tensor([2]))
    assert torch.allclose(causal_lm_loss(logits, labels), ref)


@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_module_stages_in_sequence_equal_model(tied):
    from zeroshard.parallel.pipeline.split import pipeline_module

    model = tiny_llama(tied=tied)
    ids, labels, inputs = _batch(padded=True)
    out = model(ids, attention_mask=inputs[1], labels=labels)
    stages = [pipeline_module(model, 3, stage_id=s) for s in range(3)]
    assert stages[0].chunk_ranges[0][0] == 0 and stages[-1].chunk_ranges[0][1] == 6  # type: ignore[index]
    if tied:
        assert stages[0].tied_stages == {"embed_tokens": [0, 2]}
    x = inputs
    for st in stages:
        x = st(x)
    assert torch.equal(x, out.logits)
    assert torch.equal(stages[-1].loss_fn(x, labels), out.loss)  # type: ignore[operator]


# -- through the pipeline engine: 2 stages against the whole model in one process ----------
PARITY_STEPS, MICRO, ROWS = 3, 2, 2
# eps 1e-6, not 1e-8: GPT-2's key bias (c_attn.bias[n_embd:2 * n_embd]) has a gradient that is
# exactly zero in exact arithmetic (softmax ignores a shift common to a query's row) and ~1e-11
# of rounding noise in practice; AdamW moves it by about lr * noise / eps, which at eps 1e-8 is
# ~1e-5 of noise (2.2e-5 with a 1-thread reference, 1.5e-5 with 2: the tolerance measured the
# thread count). At 1e-6 every case stays under 7e-7, whatever the threads.
ADAMW: dict[str, Any] = {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}


def _parity_batches(step: int, padded: bool):
    g = torch.Generator().manual_seed(100 + step)
    out: list[tuple[Any, torch.Tensor]] = []
    for _ in range(MICRO):
        ids = torch.randint(0, 64, (ROWS, 12), generator=g)
        labels = ids.clone()
        if padded:
            mask = torch.ones_like(ids)
            mask[0, :3] = 0
            labels[0, :3] = -100
            out.append(((ids, mask), labels))
        else:
            out.append((ids, labels))
    return out


def _parity_reference(case: dict) -> tuple[list[float], dict]:
    model = _parity_model(case)
    opt = torch.optim.AdamW(model.parameters(), **{**ADAMW, "betas": tuple(ADAMW["betas"])})
    losses = []
    for step in range(PARITY_STEPS):
        total = 0.0
        for inputs, labels in _parity_batches(step, case["padded"]):
            ids, mask = inputs if isinstance(inputs, tuple) else (inputs, None)
            loss = model(ids, attention_mask=mask, labels=labels).loss / MICRO
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _parity_rank(rank: int, world: int, cases: list[dict]) -> list:
    import zeroshard
    from zeroshard.parallel.pipeline.engine import PipelineEngine

    results = []
    for case in cases:
        model = _parity_model(case)
        config = {
            "train_micro_batch_size_per_gpu": ROWS,
            "gradient_accumulation_steps": MICRO,
            "optimizer": {"type": "AdamW", "params": ADAMW},
            "pipeline": {"stages": 2, "schedule": case["schedule"]},
        }
        engine, *_ = zeroshard.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        assert isinstance(engine, PipelineEngine)
        losses = [
            float(engine.train_batch(iter(_parity_batches(s, case["padded"]))))
            for s in range(PARITY_STEPS)
        ]
        mine = {id(p) for p in engine.module.parameters()}
        params = {n: p.detach().tolist() for n, p in model.named_parameters() if id(p) in mine}
        results.append({"losses": losses, "params": params})
        engine.destroy()
    return results


PARITY_CASES: list[dict[str, Any]] = [
    {"model": "llama", "tied": False, "padded": False, "schedule": "1f1b"},
    {"model": "llama", "tied": True, "padded": True, "schedule": "zb_h1"},
    {"model": "gpt2", "tied": True, "padded": True, "schedule": "gpipe"},
]


def test_two_stage_hf_models_match_single_process():
    """`"pipeline": {"stages": 2}` on unmodified transformers Llama (untied; tied with a
    padding mask) and GPT-2 (tied wte across the stages): losses and every parameter after
    3 AdamW steps equal the single-process model's (<= 2e-5)."""
    from multirank import run

    ranks = run(_parity_rank, 2, PARITY_CASES, timeout=240)
    for i, case in enumerate(PARITY_CASES):
        ref_losses, ref_params = _parity_reference(case)
        seen = set()
        for rank in ranks:
            got = rank[i]
            assert (
                max(abs(a - b) for a, b in zip(got["losses"], ref_losses, strict=True)) <= 2e-5
            ), case
            for name, value in got["params"].items():
                diff = (torch.tensor(value) - ref_params[name]).abs().max().item()
                assert diff <= 2e-5, (case, name, diff)
                seen.add(name)
        assert seen == set(ref_params), (case, set(ref_params) - seen)
