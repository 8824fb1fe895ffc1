"""The captured / compiled decode step (issue 32.1; ``zeroshard/inference/decode_graph.py``),
on the CPU, in one process:

* with the fake device runtime's graph API (``FakeRuntime``: a capture runs nothing, a
  replay reruns the captured work on whatever the static tensors hold), greedy tokens of
  the captured path equal the eager path's, fp32 and bf16, int8 and int4; one capture per
  batch size, one replay per token after the first, inputs copied into the static
  buffers before each replay (a missed copy replays the previous token: wrong tokens);
* ``torch.compile`` of the step (a real compiler, no fakes): the static cache makes the
  step shape-stable, so dynamo compiles one graph (fullgraph) for every token and every
  call of one batch size, with the eager path's tokens;
* what is refused, by name: CUDA graphs on the CPU, models other than the built-in GPT,
  weight streaming (tensor parallelism: tests/test_inference_tp.py), a full cache.
"""

from __future__ import annotations

import pytest
import torch

import zeroshard
from zeroshard.config import ConfigError
from zeroshard.distributed import device
from zeroshard.distributed.fake_device import FakeRuntime
from zeroshard.inference.decode_graph import StaticDecoder
from zeroshard.inference.generate import Sampling, generate_tokens, pad_prompts
from zeroshard.inference.kv_cache import CacheFullError
from zeroshard.models import GPT, GPTConfig

NEW = 12
PROMPTS = [[5, 9, 2, 7, 1], [3, 8], [4, 4, 6, 1]]  # different lengths: left padding


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    cfg: dict = dict(
        vocab_size=96, seq_len=64, n_layer=2, n_head=2, d_model=64, tie_embeddings=False
    )
    return GPT(GPTConfig(**{**cfg, **kw})).eval()


QUANT: dict[str, dict] = {
    "fp32": {},
    "bf16": {"dtype": "bf16"},
    "int8": {"quant": {"enabled": True, "weight": {"num_bits": 8}}},
    "int4": {"quant": {"enabled": True, "weight": {"num_bits": 4, "group_size": 32}}},
}


@pytest.mark.parametrize("mode", list(QUANT))
def test_captured_tokens_equal_eager(mode: str) -> None:
    cfg = {**QUANT[mode], "max_out_tokens": 48}
    eager = zeroshard.init_inference(_gpt(), cfg)
    want = eager.generate(PROMPTS, max_new_tokens=NEW)
    want_two = eager.generate(PROMPTS[:2], max_new_tokens=NEW)
    rt = FakeRuntime()
    with device.use(rt):
        captured = zeroshard.init_inference(_gpt(), {**cfg, "enable_cuda_graph": True})
        got = captured.generate(PROMPTS, max_new_tokens=NEW)
        again = captured.generate(PROMPTS[::-1], max_new_tokens=NEW)  # same batch: no capture
        two = captured.generate(PROMPTS[:2], max_new_tokens=NEW)  # another batch: captured again
    assert torch.equal(got, want), (got, want)
    assert torch.equal(two, want_two)
    assert torch.equal(again, eager.generate(PROMPTS[::-1], max_new_tokens=NEW))
    assert [g.replays for g in rt.graphs_made] == [2 * (NEW - 1), NEW - 1]
    events = [e for e in rt.log if e[0] in ("capture", "replay")]
    assert events[0] == ("capture", "g0") and events[1] == ("replay", "g0")
    assert events.count(("capture", "g0")) == 1 and ("capture", "g1") in events


def test_replay_reads_the_static_inputs() -> None:
    """The decoder copies each token into the static ids before the replay: a decoder
    that does not (replaying the first step's token) gives other tokens, so the test
    above could fail."""
    model = _gpt()
    ids, valid = pad_prompts(PROMPTS, 0)
    greedy = Sampling()
    want = generate_tokens(model, ids, valid, max_new_tokens=NEW, sampling=greedy)

    class Forgetful(StaticDecoder):
        def _load(self, token):
            if self.graph is None:  # after the capture, the token is not copied in
                super()._load(token)

    with device.use(FakeRuntime()):
        d = StaticDecoder(model, 3, 48, capture=True)
        good = generate_tokens(model, ids, valid, max_new_tokens=NEW, sampling=greedy, decoder=d)
        bad = Forgetful(model, 3, 48, capture=True)
        got = generate_tokens(model, ids, valid, max_new_tokens=NEW, sampling=greedy, decoder=bad)
    assert torch.equal(good, want)
    assert d.captures == 1 and d.replays == NEW - 1
    assert not torch.equal(got, want)


@pytest.mark.parametrize("mode", ["fp32", "bf16", "int8"])
def test_compiled_step_compiles_once(mode: str) -> None:
    """torch.compile of the static step, fullgraph: one graph for every token of two
    calls with prompts of other lengths (same batch), the eager tokens."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    cfg = {**QUANT[mode], "max_out_tokens": 48}
    eager = zeroshard.init_inference(_gpt(), cfg)
    torch._dynamo.reset()
    counters.clear()
    compiled = zeroshard.init_inference(_gpt(), cfg)
    compiled.compile(backend="aot_eager", fullgraph=True)
    for prompts in (PROMPTS, [[*p, 2, 3] for p in PROMPTS[::-1]]):
        assert torch.equal(
            compiled.generate(prompts, max_new_tokens=NEW),
            eager.generate(prompts, max_new_tokens=NEW),
        )
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["recompiles"] and not counters["graph_break"]


@pytest.mark.slow
def test_inductor_step_tokens_equal_eager() -> None:
    """The real code generator on the CPU (C++ kernels; minutes to compile)."""
    eager = zeroshard.init_inference(_gpt(), {"max_out_tokens": 48})
    compiled = zeroshard.init_inference(_gpt(), {"max_out_tokens": 48})
    compiled.compile()  # inductor
    assert torch.equal(
        compiled.generate(PROMPTS, max_new_tokens=NEW), eager.generate(PROMPTS, max_new_tokens=NEW)
    )


def test_refused_by_name(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"^enable_cuda_graph: the model is on cpu"):
        zeroshard.init_inference(_gpt(), {"enable_cuda_graph": True})  # no fake: no graphs
    zero = {"stage": 3, "offload_param": {"device": "cpu"}}
    with device.use(FakeRuntime()), pytest.raises(ConfigError, match=r"^enable_cuda_graph: .*weight streaming \(zero\)"):  # fmt: skip
        zeroshard.init_inference(_gpt(), {"enable_cuda_graph": True, "zero": zero})
    streamed = zeroshard.init_inference(_gpt(), {"zero": zero})
    with pytest.raises(ConfigError, match=r"^compile: .*weight streaming"):
        streamed.compile(backend="eager")
    if streamed.streaming is not None:
        streamed.streaming.remove()
    with pytest.raises(ValueError, match=r"unknown torch\.compile backend"):
        zeroshard.init_inference(_gpt(), {}).compile(backend="nope")

    class NotGPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

    with device.use(FakeRuntime()), pytest.raises(ConfigError, match="zeroshard's GPT only"):
        zeroshard.init_inference(NotGPT(), {"enable_cuda_graph": True})


def test_full_static_cache_is_refused() -> None:
    model = _gpt()
    d = StaticDecoder(model, 1, 6, capture=False)
    d.prefill(torch.tensor([[1, 2, 3, 4, 5]]), torch.ones(1, 5, dtype=torch.bool))
    d.step(torch.tensor([7]))
    with pytest.raises(CacheFullError, match="holds 6 tokens"):
        d.step(torch.tensor([8]))
