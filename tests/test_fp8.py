"""fp8 training (the config's ``fp8`` section, zeroshard/fp8): the numerics of one fp8
Linear against the bounds of its formats (``fp8_bounds.py``), the hand-written matmul
against torchao's, the config's refusals, which layers convert and which stay bf16,
and the engine with fp8 on (compositions with ZeRO, offload, accumulation, clipping,
activation and model checkpoints, tensor and sequence parallelism: tests/test_fp8_engine.py;
the stdlib GPT's loss curve: tests/test_fp8_quality.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from fp8_bounds import BF16_REL, rms_model, worst_case
from torch import nn

import zeroshard
from zeroshard.config import ConfigError, load_config
from zeroshard.fp8 import (
    RECIPES,
    Fp8Error,
    check_fp8_device,
    convert_to_fp8,
    fp8_linear,
    torchao_float8,
)
from zeroshard.models import GPT, GPTConfig

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the tests that run torchao's Float8Linear; the rest (config, refusals, the hand-written
# matmul's device check, zeroshard without torchao) run without it
needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None,
    reason="torchao is not installed (optional: pip install 'zeroshard[fp8]')",
)


def _torchao_linear(weight: torch.Tensor, recipe: str, bias: torch.Tensor | None = None):
    f8 = torchao_float8()
    cfg = f8.Float8LinearConfig.from_recipe_name(recipe)
    cfg = dataclasses.replace(cfg, pad_inner_dim=True)
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    m = f8.convert_to_float8_training(nn.Sequential(lin), config=cfg)[0]
    m.weight = nn.Parameter(weight.clone())
    if bias is not None:
        m.bias = nn.Parameter(bias.clone())
    return m


def _operands(seed: int = 0, m: int = 50, k: int = 128, n: int = 96):
    """bf16 activations with columns of very different sizes (rowwise and tensorwise
    scales differ), weights, and an output gradient of a typical (small) size; 50 tokens:
    not a multiple of 16 (the weight gradient's inner dimension gets padded)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.exp(torch.randn(k, generator=g))).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    go = (torch.randn(m, n, generator=g) * 1e-3).bfloat16()
    return x, w, go


# -- numerics ------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", [pytest.param("torchao", marks=needs_torchao), "hand-written"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fp8_linear_error_is_what_e4m3_and_e5m2_allow(recipe: str, impl: str) -> None:
    """torchao's Float8Linear (and the hand-written fp8_linear of the tensor-parallel and
    Conv1D layers, which runs without torchao) on the CPU, forward and both gradients, against the exact
    (float64) product of the same bf16 operands and against the bf16 matmul: every
    element within the worst-case bound of its formats (fp8_bounds.worst_case), and the
    RMS error within 20% of the model of independent roundings (fp8_bounds.rms_model:
    a cast to e5m2 where e4m3 belongs, or the reverse, is off by 2x)."""
    r = RECIPES[recipe]
    x, w, go = _operands()
    xg = x.clone().requires_grad_()
    if impl == "torchao":
        layer = _torchao_linear(w, recipe)
        y = layer(xg)
    else:
        layer = nn.Linear(w.shape[1], w.shape[0], bias=False)
        layer.weight = nn.Parameter(w.clone())
        y = fp8_linear(xg, layer.weight, r)
    y.backward(go)
    checks = [
        ("forward", y, x, w.t(), E4, E4),
        ("grad_input", xg.grad, go, w, r.grad_dtype, E4),
        ("grad_weight", layer.weight.grad, go.t(), x, r.grad_dtype, E4),
    ]
    for what, out, a, b, fa, fb in checks:
        exact = a.double() @ b.double()
        bf16 = (a @ b).double()
        abs_ab = a.double().abs() @ b.double().abs()
        assert ((bf16 - exact).abs() <= (BF16_REL + a.shape[1] * 2.0**-24) * abs_ab).all()
        if what == "grad_weight" and r.grad_weight_hp:  # the bf16 product itself
            assert torch.equal(out, a @ b), what
            continue
        err = out.double() - exact
        bound = worst_case(a, b, fa, fb, r.pow2, out_rel=2 * BF16_REL)
        assert (err.abs() <= bound).all(), f"{what}: {(err.abs() / bound).max():.3f} of the bound"
        against_bf16 = (out.double() - bf16).abs()
        assert (against_bf16 <= bound + (BF16_REL + a.shape[1] * 2.0**-24) * abs_ab).all(), what
        ratio = err.square().mean().sqrt().item() / rms_model(a, b, fa, fb)
        assert 0.8 <= ratio <= 1.25, f"{what}: RMS error {ratio:.2f} x the model's"
        # fp8 is coarser than bf16: the error is far above bf16's, or the cast did nothing
        assert err.square().mean() > 100 * (bf16 - exact).square().mean(), what


@needs_torchao
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hand_written_matmul_is_torchaos(recipe: str, dtype: torch.dtype) -> None:
    """fp8_linear (tensor-parallel and Conv1D layers) computes what torchao's
    Float8Linear computes, bit for bit: output, input and weight gradients; with a
    transposed weight (Conv1D's layout) and a token count that is not a multiple of 16."""
    x, w, go = (t.to(dtype) for t in _operands(seed=3, m=3 * 10))
    bias = torch.randn(w.shape[0]).to(dtype)
    ref = _torchao_linear(w, recipe, bias)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    stored = w.t().contiguous().requires_grad_()  # (in, out), as Conv1D keeps it
    b2 = bias.clone().requires_grad_()
    y1 = ref(x1.view(3, 10, -1))
    y2 = fp8_linear(x2.view(3, 10, -1), stored.t(), RECIPES[recipe]) + b2
    g = go.to(dtype).view(3, 10, -1)
    y1.backward(g)
    y2.backward(g)
    assert torch.equal(y1, y2)
    assert x1.grad is not None and x2.grad is not None
    assert stored.grad is not None and b2.grad is not None
    assert torch.equal(x1.grad, x2.grad)
    assert torch.equal(ref.weight.grad, stored.grad.t())
    assert torch.equal(ref.bias.grad, b2.grad)


# -- the config ----------------------------------------------------------------------------


def _cfg(**fp8) -> dict:
    return {"train_batch_size": 4, "bf16": {"enabled": True}, "fp8": {"enabled": True, **fp8}}


Z3 = {"zero_optimization": {"stage": 3}}


def test_config_names_and_refusals() -> None:
    cfg = load_config(_cfg(recipe="ROWWISE", skip=["head"]))
    assert load_config({**_cfg(enable_fsdp_float8_all_gather=True), **Z3}).fp8.enable_fsdp_float8_all_gather  # fmt: skip
    assert cfg.fp8.recipe_name == "rowwise" and cfg.fp8.filter_fqns == ["head"]
    assert load_config({"train_batch_size": 4}).fp8.enabled is False
    for bad, where, what in [
        ({"train_batch_size": 4, "fp8": {"enabled": True}}, "fp8.enabled", "fp32"),
        (
            {"train_batch_size": 4, "fp16": {"enabled": True}, "fp8": {"enabled": True}},
            "fp8.enabled",
            "fp16",
        ),
        (_cfg(recipe="rowwize"), "fp8.recipe", "did you mean 'rowwise'"),
        (_cfg(recipe="rowwise", recipe_name="rowwise"), "fp8.recipe", "name the same setting"),
        # the fp8 all-gather of ZeRO-3 weights, where it cannot work (tests/test_fp8_gather.py)
        (
            _cfg(enable_fsdp_float8_all_gather=True),
            "fp8.enable_fsdp_float8_all_gather",
            "stage is 0",
        ),
        (
            {**_cfg(enable_fsdp_float8_all_gather=True), "zero_optimization": {"stage": 2}},
            "fp8.enable_fsdp_float8_all_gather",
            "stage is 2",
        ),
        (
            {**_cfg(enable_fsdp_float8_all_gather=True, recipe="rowwise"), **Z3},
            "fp8.enable_fsdp_float8_all_gather",
            "tensorwise recipe",
        ),
        (
            {**_cfg(enabled=False, enable_fsdp_float8_all_gather=True), **Z3},
            "fp8.enable_fsdp_float8_all_gather",
            "set fp8.enabled true",
        ),
        (
            {
                **_cfg(enable_fsdp_float8_all_gather=True),
                **Z3,
                "tensor_parallel": {"autotp_size": 2},
            },
            "fp8.enable_fsdp_float8_all_gather",
            "tensor parallelism",
        ),
        (
            {**_cfg(precompute_float8_dynamic_scale_for_fsdp=True), **Z3},
            "fp8.precompute_float8_dynamic_scale_for_fsdp",
            "not built",
        ),
        (_cfg(filter_fqns=[""]), "fp8.filter_fqns[0]", "non-empty"),
        (_cfg(filter_fqn=["head"]), "fp8.filter_fqn", "did you mean 'filter_fqns'"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_config(bad)
        assert str(err.value).startswith(where) and what in str(err.value), str(err.value)


def test_core_imports_and_trains_without_torchao_and_fp8_says_how_to_install() -> None:
    """torchao is optional (zeroshard[fp8]): with it unimportable, zeroshard imports and
    trains in bf16, and a config with fp8 enabled fails naming the key and the extra."""
    code = (
        "import sys; sys.modules['torchao'] = None\n"  # `import torchao` raises ImportError
        "import torch, zeroshard\n"
        "from zeroshard.models import GPT, GPTConfig\n"
        "cfg = {'train_batch_size': 2, 'bf16': {'enabled': True}, "
        "'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}}}\n"
        "m = GPT(GPTConfig()); e, *_ = zeroshard.initialize(model=m, config=cfg)\n"
        "x = torch.randint(0, 256, (2, 9)); e.backward(e(x[:, :-1], x[:, 1:])); e.step()\n"
        "e.destroy(); cfg['fp8'] = {'enabled': True}\n"
        "try:\n    zeroshard.initialize(model=GPT(GPTConfig()), config=cfg)\n"
        "except ValueError as err:\n    print('REFUSED', err)\n"
        "assert 'torchao' not in sys.modules or sys.modules['torchao'] is None\n"
    )
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    line = run.stdout.strip().splitlines()[-1]
    assert line.startswith("REFUSED fp8.enabled: fp8 training needs torchao"), line
    assert "pip install 'zeroshard[fp8]'" in line


# -- which layers ----------------------------------------------------------------------------


class _Mixed(nn.Module):
    """A GPT-like stack with one layer of each kind."""

    class Own(nn.Linear):
        def forward(self, x):  # a subclass with its own forward: not swapped
            return super().forward(x) * 2

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.odd = nn.Linear(64, 40)  # 40 outputs: not a multiple of 16
        self.own = _Mixed.Own(40, 32)
        self.head = nn.Linear(32, 16, bias=False)

    def forward(self, x):
        return self.head(self.own(self.odd(F.gelu(self.up(x)))))


@needs_torchao
def test_which_layers_convert_and_which_stay_bf16(caplog) -> None:
    """nn.Linear layers become torchao's Float8Linear keeping their Parameters (tied
    weights stay tied); a layer with a dimension not divisible by 16, one named by
    filter_fqns and an nn.Linear subclass stay bf16, each named once at start-up;
    destroy() restores the layers."""
    model = _Mixed()
    ids = {n: id(p) for n, p in model.named_parameters()}
    cfg = _cfg(filter_fqns=["head"]) | {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with caplog.at_level(logging.INFO, logger="zeroshard"):
        engine, *_ = zeroshard.initialize(model=model, config=cfg)
    assert type(model.up).__name__ == "Float8Linear"
    assert type(model.odd) is nn.Linear and type(model.head) is nn.Linear
    assert {n: id(p) for n, p in model.named_parameters()} == ids
    lines = [r.getMessage() for r in caplog.records if "fp8 (tensorwise)" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "1 Linear layer(s) run fp8" in lines[0]
    assert "odd (matmul 64 -> 40: fp8 kernels need dimensions divisible by 16)" in lines[0]
    assert "own (Own, a subclass of nn.Linear with its own forward)" in lines[0]
    assert "head (fp8.filter_fqns 'head')" in lines[0]
    x = torch.randn(4, 32)
    engine.backward(engine(x).float().sum())
    engine.step()
    engine.destroy()
    assert type(model.up) is nn.Linear and {n: id(p) for n, p in model.named_parameters()} == ids

    gpt = GPT(GPTConfig(vocab_size=64, d_model=32))  # tied: head.weight is tok_emb.weight
    report = convert_to_fp8(gpt, load_config(_cfg()).fp8)
    assert gpt.head.weight is gpt.tok_emb.weight and "head" in report.torchao
    report.undo()
    assert type(gpt.head) is nn.Linear and gpt.head.weight is gpt.tok_emb.weight


def test_refusals_at_initialize() -> None:
    """A filter_fqns entry that names no Linear layer, and a model where no layer can
    run fp8, are errors naming the key (never a silent bf16 run)."""
    for model, fp8, match in [
        (
            _Mixed(),
            {"filter_fqns": ["hed"]},
            r"fp8\.filter_fqns\[0\]: 'hed' is in the name of no Linear",
        ),
        (
            nn.Sequential(nn.Linear(30, 20)),
            {},
            "fp8.enabled: no Linear layer of the model can run fp8 matmuls: 0",
        ),
        (nn.Linear(32, 32), {}, r"the model is one nn\.Linear"),
    ]:
        cfg = _cfg(**fp8) | {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        with pytest.raises(Fp8Error, match=match):
            zeroshard.initialize(model=model, config=cfg)
        assert not any(type(m).__name__ == "Float8Linear" for m in model.modules())


def _reports(cap: tuple[int, int]) -> Callable[[torch.device], tuple[int, int]]:
    return lambda device: cap


def test_fp8_needs_a_gpu_with_fp8_tensor_cores(monkeypatch) -> None:
    """A CUDA device below compute capability 8.9 (A100, A6000) is refused naming the key
    and the device, before any layer is converted; 8.9 (Ada), 9.0 (Hopper) and 10.0 pass;
    the CPU runs fp8 (no capability asked). initialize() checks the engine's device."""
    cuda = torch.device("cuda", 0)
    with pytest.raises(Fp8Error, match=r"^fp8\.enabled: cuda:0 has compute capability 8\.0; fp8 matmuls need 8\.9"):  # fmt: skip
        check_fp8_device(cuda, capability=_reports((8, 0)))
    for cap in [(8, 9), (9, 0), (10, 0)]:
        check_fp8_device(cuda, capability=_reports(cap))
    check_fp8_device(torch.device("cpu"), capability=_reports((0, 0)))
    import zeroshard.runtime.prepare as prepare

    asked = []

    def refuse(device: torch.device) -> None:
        asked.append(device)
        raise Fp8Error("refused by the test")

    monkeypatch.setattr(prepare, "check_fp8_device", refuse)
    model = _Mixed()
    cfg = _cfg() | {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with pytest.raises(Fp8Error, match="refused by the test"):
        zeroshard.initialize(model=model, config=cfg)
    assert asked == [torch.device("cpu")]
    assert not any(type(m).__name__ == "Float8Linear" for m in model.modules())


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))  # fmt: skip


def _losses(model: nn.Module, cfg: dict, steps: int = 4) -> list[float]:
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        loss = engine(torch.randn(4, 32, generator=g)).float().square().mean()
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    engine.destroy()
    return out


@needs_torchao
@pytest.mark.parametrize("stage", [0, 3])
def test_a_model_converted_before_initialize_trains_as_the_fp8_section(stage: int) -> None:
    """accelerate's mixed_precision="fp8" converts the model with torchao before
    initialize() (all Linear layers but the first and last, weights wrapped for FSDP2's
    fp8 all-gather): the engine trains it exactly as the config's fp8 section converting
    the same layers (the wrapped weights become plain Parameters first); without bf16
    it is refused by name."""
    f8 = torchao_float8()
    base = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage}}  # fmt: skip
    base["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    ours = _losses(_mlp(), {**base, "fp8": {"enabled": True, "filter_fqns": ["0", "4"]}})
    converted = _mlp()
    cfg = f8.Float8LinearConfig(pad_inner_dim=True, enable_fsdp_float8_all_gather=True)
    f8.convert_to_float8_training(converted, config=cfg, module_filter_fn=lambda m, fqn: fqn == "2")
    assert type(converted[2].weight) is not nn.Parameter  # wrapped, as accelerate leaves it
    assert _losses(converted, base) == ours
    assert (
        type(converted[2].weight) is nn.Parameter and type(converted[2]).__name__ == "Float8Linear"
    )
    plain = _losses(_mlp(), base)
    assert plain != ours  # the fp8 layer made a difference
    again = _mlp()
    f8.convert_to_float8_training(again, config=cfg)
    with pytest.raises(Fp8Error, match=r"bf16\.enabled: the model holds torchao Float8Linear"):
        zeroshard.initialize(model=again, model_parameters=again.parameters(), config={**base, "bf16": {"enabled": False}})  # fmt: skip
