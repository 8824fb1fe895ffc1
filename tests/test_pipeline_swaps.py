"""A PipelineModule runs the layers it holds *now*: a layer swapped in place after
construction (fp8's Float8Linear, AutoTP's parallel layers, peft's LoRA layers,
inference quantization: each assigns the new module under the old name) is the one its
forward calls, for plain layers and tied ones; ``checkpointable_layers`` keeps naming
the classes the layers were built with; a layer removed from the module is an error
naming it. And the fp8 swap keeps in bf16 (named) a Linear whose swap would drop what it
carries. One process, tiny fp32 layers (the multi-rank fp8 pipeline runs at ZeRO 1 and
3 are in tests/test_fp8_engine.py)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from torch import nn

from zeroshard.pipe import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec

needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None,
    reason="torchao is not installed (optional: pip install 'zeroshard[fp8]')",
)


class Counted(nn.Module):
    """Another module in a layer's place (as a swap puts it), counting its calls."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(x)


def _weight(m: nn.Module) -> torch.Tensor:
    w = m.weight
    assert isinstance(w, torch.Tensor)
    return w


def _project(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x @ _weight(m).t()


def _pipe(**kwargs: Any) -> PipelineModule:
    torch.manual_seed(0)
    layers = [
        nn.Linear(4, 4),
        torch.tanh,
        TiedLayerSpec("t", nn.Linear, 4, 4, bias=False),
        LayerSpec(nn.Linear, 4, 4),
        TiedLayerSpec("t", nn.Linear, 4, 4, bias=False, forward_fn=_project),
    ]
    return PipelineModule(layers, num_stages=1, stage_id=0, **kwargs)


def test_layers_swapped_in_place_are_the_ones_that_run() -> None:
    pm = _pipe()
    plain = Counted(nn.Linear(4, 4))
    tied = Counted(nn.Linear(4, 4, bias=False))
    tied.weight = tied.inner.weight  # the tied occurrence with forward_fn reads .weight
    setattr(pm, "0", plain)
    pm.tied_modules["t"] = tied
    x = torch.randn(3, 4)
    h = tied(torch.tanh(plain(x)))
    want = pm.get_submodule("3")(h) @ _weight(tied.inner).t()
    plain.calls = tied.calls = 0
    torch.testing.assert_close(pm(x), want, rtol=0, atol=0)
    assert (plain.calls, tied.calls) == (1, 1)
    assert pm.layer(0) is plain and pm.layer(2) is tied
    # the tied parameters and their global names follow the swapped module too
    assert pm.tied_parameters("t") == [("tied_modules.t.weight", tied.weight)]


def test_checkpointable_layers_name_the_built_classes_after_a_swap() -> None:
    runs: list[int] = []

    def checkpoint(fn, *args):
        runs.append(1)
        return fn(*args)

    pm = _pipe(
        activation_checkpoint_interval=1,
        activation_checkpoint_func=checkpoint,
        checkpointable_layers=["Linear"],
    )
    setattr(pm, "3", Counted(pm.get_submodule("3")))  # built as a Linear, now a Counted
    pm(torch.randn(2, 4))
    assert len(runs) == 4  # layers 0, 2, 3 and 4 (Linear; not tanh)


def test_a_removed_layer_is_an_error_naming_it() -> None:
    pm = _pipe()
    delattr(pm, "3")
    with pytest.raises(PipelineError, match=r"layer 3 \('3'\) was removed"):
        pm(torch.randn(2, 4))
    with pytest.raises(PipelineError, match="layer 7 is not on stage 0"):
        pm.layer(7)


@needs_torchao
def test_fp8_conversion_of_a_pipeline_runs_float8_linear_layers() -> None:
    """The fp8 section's swap on a PipelineModule whose layers are nn.Linear: the
    pipeline's forward calls the Float8Linear layers (their fp8 matmul), the tied one
    too; undo() puts the bf16 layers back and the pipeline runs those."""
    from zeroshard.config import load_config
    from zeroshard.fp8 import convert_to_fp8

    torch.manual_seed(0)
    pm = PipelineModule(
        [
            LayerSpec(nn.Linear, 16, 32),
            torch.tanh,
            TiedLayerSpec("t", nn.Linear, 32, 32, bias=False),
            TiedLayerSpec("t", nn.Linear, 32, 32, bias=False, forward_fn=_project),
        ],
        num_stages=1,
        stage_id=0,
    )
    cfg = load_config({"train_batch_size": 4, "bf16": {"enabled": True}, "fp8": {"enabled": True}})
    report = convert_to_fp8(pm, cfg.fp8)
    assert sorted(report.torchao) == ["0", "tied_modules.t"]
    calls = {"0": 0, "tied_modules.t": 0}
    for name in calls:
        m = pm.get_submodule(name)
        assert type(m).__name__ == "Float8Linear"

        def count(_m, _a, name: str = name) -> None:
            calls[name] += 1

        m.register_forward_pre_hook(count)
    x = torch.randn(2, 16, requires_grad=True)
    y = pm(x)
    y.sum().backward()  # the fp8 backward runs too
    assert calls == {"0": 1, "tied_modules.t": 1}  # the forward_fn occurrence reads .weight
    fp8 = pm.get_submodule("0")
    torch.testing.assert_close(
        y, _project(pm.tied_modules["t"], pm.tied_modules["t"](torch.tanh(fp8(x))))
    )
    report.undo()
    assert type(pm.layer(0)) is nn.Linear and type(pm.layer(2)) is nn.Linear


@needs_torchao
def test_fp8_keeps_in_bf16_a_linear_whose_swap_would_drop_what_it_carries() -> None:
    """torchao builds a new module: a forward set on the instance (activation
    checkpointing's wrapper) and hooks would stay on the old one. Such layers stay
    bf16, each named with the reason, and keep working."""
    from zeroshard.activation.checkpointing import apply_activation_checkpointing
    from zeroshard.config import load_config
    from zeroshard.fp8 import convert_to_fp8

    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16))
    apply_activation_checkpointing(model, lambda name, m: name == "1")
    seen: list[int] = []
    model[2].register_forward_hook(lambda m, a, out: seen.append(1))
    cfg = load_config({"train_batch_size": 4, "bf16": {"enabled": True}, "fp8": {"enabled": True}})
    report = convert_to_fp8(model, cfg.fp8)
    assert report.torchao == ["0"]
    kept = dict(report.kept)
    assert "forward was replaced on the instance" in kept["1"]
    assert "hooks" in kept["2"]
    assert type(model[1]) is nn.Linear and type(model[2]) is nn.Linear
    model(torch.randn(2, 16)).sum().backward()
    assert seen == [1]
    assert "kept in bf16: 1 (its forward was replaced" in report.summary()
