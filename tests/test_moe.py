"""Mixture-of-experts in one process (no expert parallelism): DeepSpeed's gating rules,
the MoE layer against a per-token reference, the grouped expert compute against the
loop, argument refusals, DeepSpeed's helpers and dense gating forms, and the Hugging
Face sparse blocks converted in place against the stock ones.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import moe_cases as mc
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zeroshard import NotBuiltError, UsageError
from zeroshard.moe import gating
from zeroshard.moe.dispatch import run_experts
from zeroshard.moe.errors import ExpertParallelError
from zeroshard.moe.grouped import WAYS, grouped_linear
from zeroshard.moe.layer import MoE
from zeroshard.moe.sharded_moe import top1gating, top2gating, topkgating
from zeroshard.moe.utils import (
    has_moe_layers,
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
)


def _expert(h: int = mc.H) -> nn.Module:
    return nn.Sequential(nn.Linear(h, 2 * h), nn.GELU(), nn.Linear(2 * h, h))


def _distinct(moe: MoE) -> None:
    with torch.no_grad():
        for i, e in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            g = torch.Generator().manual_seed(i)
            for p in e.parameters():
                p.copy_(torch.randn(p.shape, generator=g))


def _by_token(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer's output computed token by token from its routes (the reference)."""
    tokens = x.reshape(-1, x.shape[-1])
    routes = moe.deepspeed_moe.gate(tokens)
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    out = torch.zeros_like(tokens)
    for s in range(tokens.shape[0]):
        for j in range(routes.experts.shape[1]):
            e = int(routes.experts[s, j])
            if e >= 0:
                out[s] += routes.weights[s, j] * experts[e](tokens[s : s + 1])[0]
    return out.reshape(x.shape)


# -- gating ------------------------------------------------------------------------------
def test_top1_follows_deepspeed() -> None:
    """argmax expert, gate value as weight, l_aux = E * sum(mean gates * fraction routed),
    exp_counts before drops; over capacity each expert keeps ``capacity`` tokens."""
    logits = torch.tensor([[2.0, 0.0], [1.5, 0.0], [1.0, 0.0], [0.0, 3.0]])
    r = gating.top1(logits, 1.0, 0, drop_tokens=False)
    gates = F.softmax(logits, 1)
    assert r.experts.squeeze(1).tolist() == [0, 0, 0, 1]
    assert torch.allclose(r.weights.squeeze(1), gates.max(1).values)
    want = 2 * (gates.mean(0) * torch.tensor([0.75, 0.25])).sum()
    assert torch.allclose(r.l_aux, want) and r.exp_counts.tolist() == [3, 1]
    assert r.capacity is None
    # capacity ceil(4 / 2 * 0.5) = 1: expert 0 keeps one of its three tokens
    dropped = gating.top1(logits, 0.5, 0, drop_tokens=True, use_rts=True)
    assert dropped.capacity == 1 and (dropped.experts[:3] >= 0).sum() == 1
    assert dropped.experts[3].item() == 1 and dropped.exp_counts.tolist() == [3, 1]
    assert (dropped.weights[dropped.experts < 0] == 0).all()
    with pytest.raises(ExpertParallelError, match="min_capacity"):
        gating.top1(logits, 1.0, 8)


def test_top2_drops_by_position_and_normalizes() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.0, 0.0, 2.0], [3.0, 2.0, 0.0], [0.0, 3.0, 2.0]])
    r = gating.top2(logits, 1.0, 0, drop_tokens=False, second_sampling=False)
    assert r.experts.tolist() == [[0, 1], [0, 2], [0, 1], [1, 2]]
    assert torch.allclose(r.weights.sum(1), torch.ones(4))
    gates = F.softmax(logits, 1)
    want = torch.mean(gates.mean(0) * torch.tensor([0.75, 0.25, 0.0])) * 9
    assert torch.allclose(r.l_aux, want) and r.exp_counts.tolist() == [3, 3, 2]
    # capacity ceil(4 / 3 * 2 * 0.5) = 2: expert 0 keeps its first two first choices;
    # expert 1's second choices queue after its one first choice (token 3)
    d = gating.top2(logits, 0.5, 0, drop_tokens=True, second_sampling=False)
    assert d.capacity == 2
    assert d.experts.tolist() == [[0, 1], [0, 2], [-1, -1], [1, 2]]
    assert torch.allclose(d.weights[0].sum(), torch.tensor(1.0))
    assert d.weights[2].tolist() == [0.0, 0.0]


# DeepSpeed's TestTopkGate logits for 4 tokens over 6 experts (its top-3 case)
TOPK_LOGITS = torch.tensor(
    [[0.5858, 0.4801, 0.6269, 0.5397, 0.9722, 0.7034],
     [0.5445, 0.6332, 0.4519, 0.6308, 0.0519, 0.6450],
     [0.4874, 0.8110, 0.7467, 0.8474, 0.0277, 0.3068],
     [0.8570, 0.6714, 0.5310, 0.3274, 0.4836, 0.9892]]
)  # fmt: skip


def test_topk_keeps_largest_gates() -> None:
    """k > 2: normalized over kept routes; 'probs' drops the smallest gate values per
    expert (DeepSpeed after its top-k fix: by probability), 'position' the latest."""
    logits = TOPK_LOGITS.clone()
    gates = F.softmax(logits, 1)
    r = gating.topk(logits, 3, 1.0, 1, drop_tokens=True, drop_policy="probs")
    assert r.capacity == 2 and torch.allclose(r.l_aux, gating.topk(logits, 3, 1.0, 1).l_aux)
    for e in range(6):  # kept tokens of expert e: the 2 largest gates among those routed
        routed = [s for s in range(4) if e in torch.topk(gates[s], 3).indices.tolist()]
        best = sorted(routed, key=lambda s: -gates[s, e].item())[:2]
        kept = [s for s in range(4) if e in r.experts[s].tolist()]
        assert sorted(kept) == sorted(best), e
    for s in range(4):  # each token's kept weights are normalized (none kept: zeros)
        total = r.weights[s][r.experts[s] >= 0].sum().item()
        assert math.isclose(total, 1.0, rel_tol=1e-6) or (r.experts[s] < 0).all()
    p = gating.topk(logits, 3, 1.0, 1, drop_tokens=True, drop_policy="position")
    for e in range(6):
        routed = [s for s in range(4) if e in torch.topk(gates[s], 3).indices.tolist()]
        assert [s for s in range(4) if e in p.experts[s].tolist()] == routed[:2]


def test_dense_forms_match_deepspeeds_tests() -> None:
    """``sharded_moe``'s dispatch masks for DeepSpeed's own TestTopkGate cases (top-2:
    both drop policies; top-3: by position, the policy that fix left unchanged)."""

    def mask(sparse, m: int, n: int, cap: int) -> torch.Tensor:
        t = torch.zeros(m, n, cap, dtype=torch.bool)
        t[tuple(torch.tensor(sparse).t())] = True
        return t

    for rank in (0, 1):
        logits = torch.tensor(
            [[0.11, 0.2, 0.1, 0.3], [0.3, 0.4, 0.11, 0.1], [0.11, 0.1, 0.6, 0.5], [0.1, 0.11, 0.7, 0.8]]
        ) * (rank + 1)  # fmt: skip
        got = topkgating(logits, 2, 1, min_capacity=1, drop_policy="probs")[2]
        want = [[0, 1, 0], [1, 0, 0], [1, 1, 1], [2, 2, 0], [2, 3, 0], [3, 2, 1], [3, 3, 1]]
        assert torch.equal(got, mask(want, 4, 4, 2))
        got = topkgating(logits, 2, 1, min_capacity=1, drop_policy="position")[2]
        want = [[0, 1, 0], [0, 3, 0], [1, 0, 0], [1, 1, 1], [2, 2, 0], [2, 3, 1], [3, 2, 1]]
        assert torch.equal(got, mask(want, 4, 4, 2))
    logits = TOPK_LOGITS.clone()
    got = topkgating(logits, 3, 1, min_capacity=1, drop_policy="position")[2]
    want = [[0, 2, 0], [0, 4, 0], [0, 5, 0], [1, 1, 0], [1, 3, 0], [1, 5, 1], [2, 1, 1],
            [2, 2, 1], [2, 3, 1], [3, 0, 0]]  # fmt: skip
    assert torch.equal(got, mask(want, 4, 6, 2))
    # top-1 / top-2 without drops: capacity = the largest count; combine = weights
    _, combine, dispatch, counts = top1gating(torch.rand(10, 3), 1, 0, drop_tokens=False)
    assert combine.shape == (10, 3, int(counts.max())) and dispatch.sum() == 10
    _, combine, dispatch, counts = top2gating(torch.rand(6, 3), 1, 0, drop_tokens=False)
    assert dispatch.sum() == 12 and torch.allclose(combine.sum((1, 2)), torch.ones(6))


# -- the layer -------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3])
def test_layer_matches_per_token_reference(k: int) -> None:
    torch.manual_seed(0)
    moe = MoE(mc.H, _expert(), num_experts=4, k=k, drop_tokens=False, min_capacity=0,
              top2_2nd_expert_sampling=False)  # fmt: skip
    _distinct(moe)
    x = torch.randn(3, 5, mc.H, requires_grad=True)
    out, l_aux, counts = moe(x)
    assert out.shape == x.shape and counts.sum() == 15 * k and l_aux.dim() == 0
    ref = _by_token(moe, x)
    assert (out - ref).abs().max() < 1e-5
    # grouped (vmap) and one-by-one give the same values and gradients
    grads = torch.autograd.grad(out.square().sum(), [x, *moe.parameters()])
    moe.deepspeed_moe.experts.grouped = False
    out2, _, _ = moe(x)
    grads2 = torch.autograd.grad(out2.square().sum(), [x, *moe.parameters()])
    assert (out - out2).abs().max() < 1e-5
    assert all((a - b).abs().max() < 1e-4 for a, b in zip(grads, grads2, strict=True))


def test_dropped_tokens_give_zeros_and_residual_mixes() -> None:
    torch.manual_seed(1)
    moe = MoE(mc.H, _expert(), num_experts=2, k=1, capacity_factor=0.25, min_capacity=1,
              use_rts=False)  # fmt: skip
    x = torch.randn(1, 8, mc.H)
    out, _, _ = moe(x)
    assert moe.deepspeed_moe.capacity == 1
    assert (out.reshape(8, -1).abs().sum(1) > 0).sum() <= 2  # one token per expert kept
    res = MoE(mc.H, _expert(), num_experts=2, k=1, drop_tokens=False, use_residual=True)
    y = torch.randn(2, 3, mc.H)
    out, _, _ = res(y)
    moe_out = res.deepspeed_moe(y)
    coef = F.softmax(res.coefficient(y), -1)
    assert torch.allclose(out, moe_out * coef[..., :1] + res.mlp(y) * coef[..., 1:], atol=1e-6)
    assert {n.split(".")[0] for n, _ in res.named_parameters()} == {
        "deepspeed_moe", "mlp", "coefficient"
    }  # fmt: skip


def test_noisy_policies_act_in_training_only() -> None:
    torch.manual_seed(2)
    for policy in ("Jitter", "RSample"):
        moe = MoE(mc.H, _expert(), num_experts=4, k=1, drop_tokens=False,
                  noisy_gate_policy=policy)  # fmt: skip
        x = torch.randn(4, 16, mc.H)
        moe.eval()
        a, _, _ = moe(x)
        b, _, _ = moe(x)
        assert torch.equal(a, b)
        moe.train()
        outs = [moe(x)[0] for _ in range(4)]
        assert any(not torch.equal(outs[0], o) for o in outs[1:]), policy


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_experts": 3, "ep_size": 2}, "divisible by ep_size"),
        ({"k": 5}, "more experts per token"),
        ({"use_tutel": True}, "use_tutel"),
        ({"enable_expert_tensor_parallelism": True}, "enable_expert_tensor_parallelism"),
        ({"noisy_gate_policy": "Gumbel"}, "noisy_gate_policy"),
        ({"noisy_gate_policy": "RSample", "k": 2}, "RSample"),
        ({"capacity_factor": 0}, "capacity_factor"),
        ({"min_capacity": -1}, "min_capacity"),
    ],
)
def test_arguments_refused_by_name(kwargs: dict, match: str) -> None:
    args = {"num_experts": 4, **kwargs}
    with pytest.raises((ExpertParallelError, NotBuiltError), match=match):
        MoE(mc.H, _expert(), **args)


def test_unbound_expert_parallel_layer_and_used_token() -> None:
    moe = MoE(mc.H, _expert(), num_experts=4, ep_size=2)
    assert len(moe.deepspeed_moe.experts.deepspeed_experts) == 2
    with pytest.raises(UsageError, match=r"zeroshard\.initialize"):
        moe(torch.randn(2, 4, mc.H))
    with pytest.raises(UsageError, match="initialize"):
        moe.set_deepspeed_parallelism()
    two = MoE(mc.H, _expert(), num_experts=4, k=2)
    with pytest.raises(ExpertParallelError, match="used_token"):
        two(torch.randn(2, 4, mc.H), torch.ones(8))
    one = MoE(mc.H, _expert(), num_experts=4, k=1, drop_tokens=False, min_capacity=0)
    used = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    out, _, counts = one(torch.randn(2, 4, mc.H), used)
    assert counts.sum() == 6 and out.reshape(8, -1)[1].abs().sum() == 0


def test_grouped_linear_ways_agree() -> None:
    torch.manual_seed(3)
    counts = [3, 0, 5, 1]
    for inner in (8, 6):  # 6 x 4 bytes is not a 16-byte row: grouped_mm falls back
        x = torch.randn(9, inner, requires_grad=True)
        w = torch.randn(4, 12, inner, requires_grad=True)
        outs = []
        for way in WAYS:
            y = grouped_linear(x, w, counts, way)
            gx, gw = torch.autograd.grad(y.square().sum(), [x, w])
            outs.append((y, gx, gw))
        for other in outs[1:]:
            assert all((a - b).abs().max() < 1e-4 for a, b in zip(outs[0], other, strict=True))
    with pytest.raises(ExpertParallelError, match="way"):
        grouped_linear(x, w, counts, "einsum")


def test_experts_with_no_rows() -> None:
    """A rank whose local experts got no token (every route went to another rank's
    experts, or no token at all): each way returns no rows, and the experts' gradients
    are zeros, not an error."""
    from zeroshard.moe.layer import Experts

    x = torch.randn(0, 8, requires_grad=True)
    w = torch.randn(2, 12, 8, requires_grad=True)
    for way in WAYS:
        y = grouped_linear(x, w, [0, 0], way)
        assert y.shape == (0, 12), way
        (gw,) = torch.autograd.grad(y.sum(), [w], allow_unused=True)
        assert gw is None or not gw.any(), way
    experts = Experts(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), 2)
    for grouped in (True, False):
        experts.grouped = grouped
        out = experts.rows(x, [0, 0])
        assert out.shape == (0, 8), grouped
        out.sum().backward()
    routes = torch.zeros(0, 2, dtype=torch.long)
    out, _ = run_experts(torch.randn(0, 8), routes, 2, None, experts.rows)
    assert out.shape == (0, 2, 8)


# -- DeepSpeed's helpers -----------------------------------------------------------------
def test_deepspeed_utils() -> None:
    model = mc.DSMoEModel()
    assert has_moe_layers(model) == (True, mc.EXPERTS)
    experts = [p for p in model.parameters() if is_moe_param(p)]
    assert experts and all(p.group_name == "ep_size_1" for p in experts)  # type: ignore[attr-defined]
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense", "lr": 0.5}, max_group_size=100
    )
    assert groups[0]["name"] == "dense" and not any(is_moe_param(p) for p in groups[0]["params"])
    moe_groups = groups[1:]
    assert all(g["moe"] and g["name"] == "ep_size_1" and g["lr"] == 0.5 for g in moe_groups)
    assert sum(len(g["params"]) for g in moe_groups) == len(experts)
    assert all(
        sum(p.numel() for p in g["params"]) <= 100 for g in moe_groups if len(g["params"]) > 1
    )
    with pytest.raises(KeyError, match="name"):
        split_params_into_different_moe_groups_for_optimizer([{"params": experts}])


def test_deepspeed_simple_moe_model_imports_under_the_alias(tmp_path) -> None:
    """DeepSpeed's own tests/unit/simple_model.py (v0.16.5, from the local mirror) imports
    ``deepspeed.moe.layer.MoE`` and builds SimpleMoEModel under ``import deepspeed``, and
    every one-line ``deepspeed.moe`` import of its unit tests at that tag runs."""
    git_dir = "/work/.mirror/deepspeedai+DeepSpeed/repo"
    if not os.path.isdir(git_dir):
        pytest.skip("no DeepSpeed source mirror on this machine")
    unit = tmp_path / "unit"
    unit.mkdir()
    text = subprocess.run(
        ["git", f"--git-dir={git_dir}", "show", "v0.16.5:tests/unit/simple_model.py"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    (unit / "simple_model.py").write_text(text)
    (unit / "__init__.py").write_text("")
    (unit / "common.py").write_text("import torch\npreferred_dtype = lambda: torch.float32\n")
    # every one-line deepspeed.moe import of DeepSpeed's unit tests at that tag
    found = subprocess.run(
        ["git", f"--git-dir={git_dir}", "grep", "-h", "-E", r"^\s*(from|import) deepspeed\.moe",
         "v0.16.5", "--", "tests/unit"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    lines = sorted({ln.strip() for ln in found.splitlines() if not ln.rstrip().endswith("(")})
    assert len(lines) >= 4, lines
    script = (
        "import zeroshard.as_deepspeed, torch\n"
        + "".join(f"{ln}\n" for ln in lines)
        + "from unit.simple_model import SimpleMoEModel, SimplePRMoEModel\n"
        "m = SimpleMoEModel(hidden_dim=8, num_experts=4)\n"
        "x, y = torch.randn(2, 3, 8), torch.randint(0, 8, (2,))\n"
        "print(float(m(x, y)) > 0, len(m.moe_1.deepspeed_moe.experts.deepspeed_experts))\n"
        "SimplePRMoEModel(hidden_dim=8, num_experts=2)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{os.getcwd()}"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "4"]


# -- Hugging Face sparse blocks ------------------------------------------------------------
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_hf_blocks_converted_in_place_match_stock(family: str) -> None:
    """With one expert-parallel rank the converted model computes what the stock one
    does (logits, loss with the router aux loss, gradients), by every expert way, and its
    state_dict has the stock names and shapes."""
    from zeroshard.moe.hf import PRESETS, convert_sparse_blocks

    stock = mc.tiny_mixtral(qwen=None if family == "mixtral" else family)
    batch = mc.lm_batch(0, 0)
    ref = stock(**batch)
    ref_grads = torch.autograd.grad(ref.loss, list(stock.parameters()))
    for way in WAYS:
        model = mc.tiny_mixtral(qwen=None if family == "mixtral" else family)
        names = convert_sparse_blocks(model, None, family, way)
        assert names and all(
            type(model.get_submodule(n)).__name__ == "ExpertParallelExperts" for n in names
        )
        assert {k: v.shape for k, v in model.state_dict().items()} == {
            k: v.shape for k, v in stock.state_dict().items()
        }
        out = model(**batch)
        assert (out.logits - ref.logits).abs().max() < 1e-5
        assert abs(out.loss.item() - ref.loss.item()) < 1e-6
        assert out.aux_loss is not None and abs(out.aux_loss.item() - ref.aux_loss.item()) < 1e-6
        grads = torch.autograd.grad(out.loss, list(model.parameters()))
        worst = max((a - b).abs().max().item() for a, b in zip(grads, ref_grads, strict=True))
        assert worst < 1e-5, (way, worst)
    assert set(PRESETS) == {"mixtral", "qwen2_moe", "qwen3_moe"}
    with pytest.raises(ExpertParallelError, match="preset_model"):
        convert_sparse_blocks(mc.tiny_mixtral(), None, "deepseek_v3")
    with pytest.raises(ExpertParallelError, match="no MoE experts module"):
        convert_sparse_blocks(nn.Sequential(nn.Linear(2, 2)), None)


def test_config_presets_are_hf_plans() -> None:
    from zeroshard.config.parallel import EP_PRESETS
    from zeroshard.moe.hf import PRESETS

    assert set(EP_PRESETS) == set(PRESETS)


def test_gpu_section_runs_every_way_on_cpu() -> None:
    """gpu_check's MoE section (benchmarks/_gpu_moe.py) at its smoke size: every way
    gives a row with a rate and agrees with the loop."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import _gpu_moe

    rows = [r for r in _gpu_moe.moe_section(smoke=True).splitlines() if r.startswith("| ")]
    names = [r.split(" | ")[0][2:] for r in rows[1:]]
    assert names == [w for w in WAYS if w != "loop"] + [
        "loop",
        "MoE Experts, vmap",
        "MoE Experts, loop",
    ]
    assert not [r for r in rows if "failed" in r]
    for r in rows[1:]:
        out, grad = (float(v) for v in r.split(" | ")[3].rstrip(" |").split(" / "))
        assert out < 1e-5 and grad < 1e-5, r
