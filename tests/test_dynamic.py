"""ZeRO on models as people write them (issue 14): parameters that get no gradient in a
step, on some ranks or on all, against single-process torch, at stages 0-3 with and
without CPU offload (on the GPU code path), on 2 gloo ranks. One spawn runs every case.

Rules (torch's and DDP's): a parameter with no gradient on any rank in a whole
accumulation window is not stepped (torch skips ``grad=None``: no moment update, no
weight decay); one used on some ranks only is stepped with its gradient averaged with
zeros from the others.
"""

from __future__ import annotations

import functools
from typing import Any

import cases
import multirank
import pytest
import torch
import torch.nn.functional as F
from torch import nn

TOL = 2e-5
# Hugging Face models (test_zero3's bound): Adam divides each gradient by its own running
# magnitude, so the float-order noise of a reduction over ranks is amplified in elements
# whose gradient is near zero (measured up to 2.0e-5 on the tiny Mixtral at lr 1e-3)
HF_TOL = 5e-5
STEPS = 6
MICRO = 2


class Net(nn.Module):
    """``extra`` is used only on the rows ``rows`` names; ``maybe`` only when ``use``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.maybe = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 4)
        self.extra = nn.Parameter(torch.randn(16) * 0.1)

    def forward(self, x, y, rows: slice | None = None, use: bool = True):
        h = torch.tanh(self.fc1(x))
        if rows is not None:
            h = torch.cat([h[: rows.start], h[rows] + self.extra, h[rows.stop :]])
        if use:
            h = h + torch.tanh(self.maybe(h))
        return F.mse_loss(self.fc2(h), y)


def _data(step: int, rows: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)


def _uses(step: int) -> bool:
    return step % 3 != 1  # ``maybe`` idles every third step, after building up momentum


def _opt(params, kind: str):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.1)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _reference(world: int, kind: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    opt = _opt(model.parameters(), kind)
    for step in range(STEPS):
        x, y = _data(step, MICRO * world)
        # rank 0's rows see ``extra``; every row sees ``maybe`` on the steps that use it
        model(x, y, rows=slice(0, MICRO), use=_uses(step)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _config(stage: int, kind: str, offload: bool) -> dict:
    zc: dict = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload:
        zc["offload_optimizer"] = {"device": "cpu"}
    params = {"lr": 0.05, "momentum": 0.9} if kind == "sgd" else {"lr": 1e-2}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {
            "type": "SGD" if kind == "sgd" else "AdamW",
            "params": {**params, "weight_decay": 0.1},
        },
        "zero_optimization": zc,
        "steps_per_print": 10**6,
    }


def _train(rank: int, world: int, stage: int, kind: str, offload: bool):
    import os

    import zeroshard
    from zeroshard.offload.staging import STAGE_ON_CPU_ENV
    from zeroshard.zero import GatheredParameters

    os.environ[STAGE_ON_CPU_ENV] = "1" if offload else "0"
    torch.manual_seed(0)
    model = Net()
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=_config(stage, kind, offload)
    )
    os.environ.pop(STAGE_ON_CPU_ENV)
    for step in range(STEPS):
        x, y = _data(step, MICRO * world)
        lo = rank * MICRO
        rows = slice(0, MICRO) if rank == 0 else None  # extra: rank 0 only
        loss = engine(x[lo : lo + MICRO], y[lo : lo + MICRO], rows=rows, use=_uses(step))
        engine.backward(loss)
        engine.step()
    with GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _diffs(rank: int, world: int, stage: int, kind: str, offload: bool) -> dict[str, float]:
    ref = _reference(world, kind)
    got = _train(rank, world, stage, kind, offload)
    return {n: (got[n] - ref[n]).abs().max().item() for n in ref}


def _name(case: tuple) -> str:
    stage, kind, offload = case
    return f"stage={stage} {kind} offload={offload}"


def _worker(rank: int, world: int, case_list: list) -> dict:
    torch.set_num_threads(1)
    return cases.run_named(
        (_name(c), functools.partial(_diffs, rank, world, *c)) for c in case_list
    )


CASES = [
    (stage, kind, offload)
    for stage in (0, 1, 2, 3)
    for kind in ("adamw", "sgd")
    for offload in ((False, True) if stage else (False,))
]


@pytest.fixture(scope="module")
def results():
    return multirank.run(_worker, 2, CASES, timeout=600)


def _check_no_gradient(name: str, per_rank: list) -> None:
    failures = []
    for rank, diffs in enumerate(per_rank):
        worst = max(diffs.values())
        if worst > TOL:
            failures.append(f"rank {rank} {name}: {diffs}")
    assert not failures, "\n".join(failures)


def test_no_gradient_parameters_follow_torch(results, subtests):
    """``maybe`` (no gradient anywhere every third step) and ``extra`` (rank 0 only)
    end where single-process torch leaves them, with momentum and weight decay."""
    cases.check_each(subtests, results, _check_no_gradient, names=[_name(c) for c in CASES])


# -- data-dependent control flow, generate(), frozen parameters, edits outside forward ------
class MoE(nn.Module):
    """A mixture of experts as people write it: experts in a ModuleList, an expert
    that gets no token is skipped (so ranks run different modules)."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(8, n)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))

    def forward(self, h):
        choice = self.router(h).argmax(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            hit = choice == e
            if hit.any():
                out = out + hit.unsqueeze(-1) * torch.tanh(expert(h))
        return h + out


class MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.moe = MoE()
        self.out = nn.Linear(8, 4)

    def forward(self, x, y):
        return F.mse_loss(self.out(self.moe(self.inp(x))), y)


class LoRA(nn.Module):
    """A frozen base Linear plus a trainable low-rank update (hand-written LoRA)."""

    def __init__(self, n: int, r: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(n, n)
        self.base.requires_grad_(False)
        self.a = nn.Linear(n, r, bias=False)
        self.b = nn.Linear(r, n, bias=False)

    def forward(self, h):
        return self.base(h) + self.b(self.a(h))


class LoRANet(nn.Module):
    """Every frozen layer's input needs a gradient (a trainable layer comes first), so
    every unit is gathered in forward and again in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 32)
        self.layers = nn.ModuleList(LoRA(32) for _ in range(3))
        self.last = nn.Linear(32, 4)
        self.last.requires_grad_(False)

    def forward(self, x, y):
        h = self.first(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return F.mse_loss(self.last(h), y)


class PeftBase(nn.Module):
    """LoRANet's shape as plain Linears, for ``peft`` to inject its adapters into."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 32)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
        self.last = nn.Linear(32, 4)

    def forward(self, x, y):
        h = self.first(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return F.mse_loss(self.last(h), y)


def peft_net() -> nn.Module:
    """A LoRA model made by ``peft``: adapters on the three inner layers, their bases and
    ``last`` frozen by peft, ``first`` trained whole (as ``modules_to_save`` would)."""
    from peft import LoraConfig, inject_adapter_in_model

    model = inject_adapter_in_model(
        LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["0", "1", "2"]),
        PeftBase(),
    )
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name or name.startswith("first."))
    return model


def _z3_config(stage: int = 3, **zero) -> dict:
    zc = {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_scatter": True, **zero}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": zc,
        "steps_per_print": 10**6,
    }


def _fit(
    build, rank, world, stage=3, steps=3, before_init=None, after_init=None, penalty=0.0, **zero
):
    """(max param diff against torch, engine): AdamW on ``build()``, this rank's rows."""
    import zeroshard
    from zeroshard.zero import GatheredParameters

    torch.manual_seed(0)
    ref = build()
    opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1
    )
    torch.manual_seed(0)
    model = build()
    if before_init is not None:
        before_init(model)
    engine, *_ = zeroshard.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=_z3_config(stage, **zero),
    )
    if after_init is not None:  # on both: e.g. freezing a parameter after initialize
        after_init(model)
        after_init(ref)
    for step in range(steps):
        x, y = _data(step, MICRO * world)
        loss = ref(x, y)
        if penalty:
            loss = loss + penalty * sum(p.pow(2).sum() for p in ref.parameters())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        lo = rank * MICRO
        loss = engine(x[lo : lo + MICRO], y[lo : lo + MICRO])
        if penalty:  # the penalty is the whole batch's: each rank adds its share
            loss = loss + penalty * sum(p.pow(2).sum() for p in model.parameters())
        engine.backward(loss)
        engine.step()
    with GatheredParameters(list(model.parameters())):
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
    diff = max((got[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    return diff, engine


def _errors(fn) -> str:
    try:
        fn()
    except Exception as exc:  # the error the test expects, by message
        return f"{type(exc).__name__}: {exc}"
    return ""


def _hf_moe(kind: str):
    if kind == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        mixtral = MixtralConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_local_experts=4,
            num_experts_per_tok=1,
            max_position_embeddings=32,
        )
        return MixtralForCausalLM(mixtral)
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=16,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=1,
        max_position_embeddings=32,
    )
    return Qwen2MoeForCausalLM(cfg)


def _hf_moe_case(rank, world, kind, offload):
    import zeroshard
    from zeroshard.zero import GatheredParameters

    torch.manual_seed(0)
    ref = _hf_moe(kind)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    torch.manual_seed(0)
    model = _hf_moe(kind)
    zc: dict[str, Any] = {"offload_optimizer": {"device": "cpu"}} if offload else {}
    cfg = {**_z3_config(**zc), "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    routed: set[int] = set()  # the experts this rank's tokens went to, in layer 0
    experts = model.model.layers[0].mlp.experts

    def record(module, args):
        routed.update(args[1].flatten().tolist())

    experts.register_forward_pre_hook(record)
    for step in range(2):
        ids = torch.randint(0, 64, (world, 3), generator=torch.Generator().manual_seed(step))
        ref(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        mine = ids[rank : rank + 1]
        engine.backward(engine(input_ids=mine, labels=mine).loss)
        engine.step()
    with GatheredParameters(list(model.parameters())):
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
    diff = max((got[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    return diff, sorted(routed)


def _generate(rank, world):
    """Stage-3 generate() with a different output length on each rank, no synced_gpus."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import zeroshard

    cfg = GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(cfg)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=_z3_config()
    )
    prompt = torch.tensor([[1, 2, 3]])
    new = 3 if rank == 0 else 7
    ours = engine.module.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)  # type: ignore[operator]
    theirs = ref.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)
    return {"same": torch.equal(ours, theirs), "length": ours.shape[1]}


def _ledger_lora(rank, world, build=LoRANet, offloads=(False, True)):
    """One step of a LoRA model at stage 3: every unit all-gathered twice (reuse distance
    0: freed after its forward), only the trainable units reduce-scattered; no gradient
    storage for frozen weights."""
    out = {}
    for offload in offloads:
        zc: dict[str, Any] = {"offload_optimizer": {"device": "cpu"}} if offload else {}
        zc["stage3_max_reuse_distance"] = 0
        diff, engine = _fit(build, rank, world, **zc)
        engine.reset_comm_stats()
        x, y = _data(50, MICRO * world)
        engine.backward(
            engine(x[rank * MICRO : (rank + 1) * MICRO], y[rank * MICRO : (rank + 1) * MICRO])
        )
        engine.step()
        layout, group_of = engine.flat.layout, engine.flat.group_of
        trainable = sum(s.numel for s in layout.segments if any(group_of[p] >= 0 for p in s.params))
        out[str(offload)] = {
            "diff": diff,
            "stats": engine.comm_stats(),
            "total": layout.total_numel,
            "trainable": trainable,
            "flags": 2 * (sum(g >= 0 for g in group_of) + 1),
            "grads": engine.memory_stats()["grads"],
            "largest": max(s.numel for s in layout.segments),
        }
    return out


def _edits(rank, world, stage):
    """Parameters used or changed outside forward."""
    import zeroshard
    from zeroshard.zero import GatheredParameters

    out = {}
    # an L2 penalty over model.parameters(): works at stages 0-2, a clear error at 3
    if stage < 3:
        out["penalty"] = _fit(Net, rank, world, stage=stage, penalty=1e-3)[0]
    else:
        out["penalty"] = _errors(lambda: _fit(Net, rank, world, stage=3, penalty=1e-3))
    # clamp_() after step(): persists (separate fp32 masters on the GPU code path)
    import os

    from zeroshard.offload.staging import STAGE_ON_CPU_ENV

    os.environ[STAGE_ON_CPU_ENV] = "1"
    torch.manual_seed(0)
    ref = Net()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    torch.manual_seed(0)
    model = Net()
    zc = {"offload_optimizer": {"device": "cpu"}} if stage else {}
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=_z3_config(stage, **zc)
    )
    os.environ.pop(STAGE_ON_CPU_ENV)
    outside = ""
    for step in range(3):
        x, y = _data(step, MICRO * world)
        ref(x, y).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            ref.fc1.weight.clamp_(-0.05, 0.05)
        lo = rank * MICRO
        engine.backward(engine(x[lo : lo + MICRO], y[lo : lo + MICRO]))
        engine.step()
        if stage == 3:
            outside = outside or _errors(lambda: model.fc1.weight.data.clamp_(-0.05, 0.05))
            outside = outside or _errors(lambda: model.fc1.weight.clamp_(-0.05, 0.05))
            with GatheredParameters([model.fc1.weight], modifier_rank=0), torch.no_grad():
                model.fc1.weight.clamp_(-0.05, 0.05)
        else:
            with torch.no_grad():
                model.fc1.weight.clamp_(-0.05, 0.05)
    with GatheredParameters(list(model.parameters())):
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["clamp"] = max((got[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    out["outside"] = outside

    # unfreezing after initialize: the next backward names the parameter
    def unfreeze():
        torch.manual_seed(0)
        m = Net()
        m.maybe.weight.requires_grad_(False)
        eng, *_ = zeroshard.initialize(
            model=m,
            model_parameters=[p for p in m.parameters() if p.requires_grad],
            config=_z3_config(stage),
        )
        m.maybe.weight.requires_grad_(True)
        x, y = _data(0, MICRO)
        eng.backward(eng(x, y))

    out["unfreeze"] = _errors(unfreeze)

    # freezing after initialize: that parameter is not stepped, as in torch
    def freeze(model):
        model.maybe.bias.requires_grad_(False)

    out["freeze"] = _fit(Net, rank, world, stage=stage, after_init=freeze)[0]
    return out


def _peft_ledger(rank: int, world: int) -> dict | None:
    try:
        import peft  # noqa: F401
    except ImportError:
        return None
    return _ledger_lora(rank, world, peft_net, offloads=(False,))


def _moe_leaf(rank: int, world: int, offload: bool) -> float:
    import zeroshard

    zc: dict[str, Any] = {"offload_optimizer": {"device": "cpu"}} if offload else {}
    leaf = lambda m: zeroshard.utils.set_z3_leaf_modules(m, [MoE])  # noqa: E731
    return _fit(MoENet, rank, world, before_init=leaf, **zc)[0]


MOE_PARITY = ("moe_leaf_False", "moe_leaf_True", "moe_config_leaf", "moe_stage2")
HF_MOE = ("mixtral_False", "mixtral_True", "qwen2_moe_False", "qwen2_moe_True")


def _second(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return cases.run_named(
        [
            # a hand-written MoE: without a leaf, a clear error on every rank; as a leaf, parity
            ("moe_no_leaf", lambda: _errors(lambda: _fit(MoENet, rank, world, steps=2))),
            *(
                (f"moe_leaf_{offload}", functools.partial(_moe_leaf, rank, world, offload))
                for offload in (False, True)
            ),
            (
                "moe_config_leaf",
                lambda: _fit(MoENet, rank, world, leaf_module={"classes": ["MoE"]})[0],
            ),
            # no gathers at stages 0-2
            ("moe_stage2", lambda: _fit(MoENet, rank, world, stage=2)[0]),
            *(
                (f"{kind}_{offload}", functools.partial(_hf_moe_case, rank, world, kind, offload))
                for kind in ("mixtral", "qwen2_moe")
                for offload in (False, True)
            ),
            ("generate", lambda: _generate(rank, world)),
            ("lora", lambda: _ledger_lora(rank, world)),
            ("peft", lambda: _peft_ledger(rank, world)),
            *(
                (f"edits stage{stage}", functools.partial(_edits, rank, world, stage))
                for stage in (0, 1, 2, 3)
            ),
        ]
    )


@pytest.fixture(scope="module")
def second():
    pytest.importorskip("transformers")
    return multirank.run(_second, 2, timeout=900)


def _check_no_leaf(per_rank: list) -> None:
    for error in per_rank:
        assert "GatherMismatchError" in error, error
        assert "set_z3_leaf_modules" in error and "moe" in error


def test_moe_routing_diverges_without_a_leaf_and_trains_as_one(second, subtests):
    cases.check(subtests, second, "moe_no_leaf", _check_no_leaf)

    def check(key: str, per_rank: list) -> None:
        for diff in per_rank:
            assert diff <= TOL, (key, diff)

    cases.check_each(subtests, second, check, names=MOE_PARITY)


def test_hf_moe_with_an_expert_skipped_on_one_rank(second, subtests):
    def check(key: str, per_rank: list) -> None:
        if key == "mixtral_False":
            routed = [r[1] for r in per_rank]
            assert routed[0] != routed[1]  # the ranks' tokens go to different experts
        for r in per_rank:
            assert r[0] <= HF_TOL, (key, r[0])

    cases.check_each(subtests, second, check, names=HF_MOE)


def test_generate_with_different_lengths_needs_no_synced_gpus(second):
    generated = cases.values(second, "generate")
    lengths = [r["length"] for r in generated]
    assert lengths == [6, 10]
    assert all(r["same"] for r in generated)


@pytest.mark.parametrize("made_by", ["hand", "peft"])
def test_lora_ledger_and_no_frozen_gradients(second, made_by):
    for lora in cases.values(second, "lora" if made_by == "hand" else "peft"):
        if lora is None:
            pytest.skip("peft is not installed")
        for offload, led in lora.items():
            stats = led["stats"]
            assert led["diff"] <= TOL, (offload, led["diff"])
            assert stats["all_gather"]["bytes"] == 2 * 4 * led["total"], (offload, stats)
            assert stats["reduce_scatter"]["bytes"] == 4 * led["trainable"], (offload, stats)
            assert stats["all_reduce"]["bytes"] == led["flags"], (offload, stats)
            # the gradient shard covers trainable units only (plus the staging buffers)
            assert led["grads"] <= 4 * led["trainable"] / 2 + 2 * 4 * led["largest"], led


def _check_edits(name: str, per_rank: list) -> None:
    stage = int(name.removeprefix("edits stage"))
    for e in per_rank:
        if stage < 3:
            assert e["penalty"] <= TOL, (stage, e)
        else:
            assert "PartitionedParameterError" in e["penalty"], e
            assert "GatheredParameters" in e["penalty"], e
            assert "fc1.weight" in e["outside"] and "GatheredParameters" in e["outside"], e
        assert e["clamp"] <= TOL, (stage, e)
        assert "maybe.weight" in e["unfreeze"] and "destroy" in e["unfreeze"], (stage, e)
        assert e["freeze"] <= TOL, (stage, e)


def test_parameters_touched_outside_forward(second, subtests):
    names = [f"edits stage{stage}" for stage in (0, 1, 2, 3)]
    cases.check_each(subtests, second, _check_edits, names=names)


# -- a leaf whose inside runs on some ranks only (issue 26) ----------------------------------
VOCAB, WIDTH = 64, 32


class Gate(nn.Module):
    """A leaf whose inner Linear runs only when ``take``: on one rank in a step."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(WIDTH, WIDTH)

    def forward(self, h, take: bool):
        return h + torch.tanh(self.extra(h)) if take else h


class GatedLM(nn.Module):
    """``first`` -> [``before``] -> Gate -> [``after``] -> ``head``: an Embedding and a
    LayerNorm (the issue's model) or Linears; ``deep`` puts two Linears before the gate
    and one after it, so that the gate's bucket is reduced early in backward."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.first = nn.Embedding(VOCAB, WIDTH) if kind == "embedding" else nn.Linear(8, WIDTH)
        self.before = nn.ModuleList(
            nn.Linear(WIDTH, WIDTH) for _ in range(2 if kind == "deep" else 0)
        )
        self.gate = Gate()
        self.after = nn.LayerNorm(WIDTH) if kind == "embedding" else nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x, y, take: bool):
        h = self.first(x)
        for layer in self.before:
            h = torch.tanh(layer(h))
        h = self.head(self.after(self.gate(h, take)))
        return F.cross_entropy(h.reshape(-1, VOCAB), y.reshape(-1))


def _gated_data(kind: str, rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    y = torch.randint(0, VOCAB, (2, 4), generator=g)
    if kind == "embedding":
        return torch.randint(0, VOCAB, (2, 4), generator=g), y
    return torch.randn(2, 4, 8, generator=g), y


def _gated_leaf(rank: int, world: int, kind: str, stage: int, zc: dict, steps: int = 3) -> float:
    """Max parameter difference against torch after ``steps`` steps, the gate's Linear
    running on rank ``step % world`` only; the reference averages the ranks' losses (the
    gradients data parallelism averages)."""
    import zeroshard
    from zeroshard.zero import GatheredParameters

    torch.manual_seed(0)
    ref = GatedLM(kind)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    torch.manual_seed(0)
    model = GatedLM(kind)
    zeroshard.utils.set_z3_leaf_modules(model, [Gate])
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zc},
        "steps_per_print": 10**6,
    }
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for step in range(steps):
        losses = [ref(*_gated_data(kind, r, step), take=r == step % world) for r in range(world)]
        (sum(losses) / world).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        x, y = _gated_data(kind, rank, step)
        engine.backward(engine(x, y, take=rank == step % world))
        engine.step()
    with GatheredParameters(list(model.parameters())):
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.destroy()
    return max((got[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())


GATED: list[tuple[str, int, dict[str, Any]]] = [
    *((kind, 3, {}) for kind in ("embedding", "linear", "deep")),
    ("embedding", 3, {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}),
    ("linear", 3, {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}),
    ("deep", 3, {"offload_optimizer": {"device": "cpu"}}),
    ("deep", 3, {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}),
    ("deep", 0, {}),
    *(
        ("deep", stage, zc)
        for stage in (1, 2)
        for zc in ({}, {"offload_optimizer": {"device": "cpu"}})
    ),
]


def _gated_name(kind: str, stage: int, zc: dict) -> str:
    return f"{kind} stage={stage} {cases.label(zc)}".strip()


def _gated_cases(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return cases.run_named(
        (_gated_name(*c), functools.partial(_gated_leaf, rank, world, *c)) for c in GATED
    )


@pytest.fixture(scope="module")
def gated():
    return multirank.run(_gated_cases, 2, timeout=600)


def test_leaf_running_on_one_rank_trains_as_torch(gated, subtests):
    """The leaf remedy GatherMismatchError names: a leaf whose inner Linear runs on one
    rank only trains as torch does, at every stage (stage 3: parameter gathers and
    gradient reductions no longer meet in one group in a different order per rank)."""

    def check(name: str, per_rank: list) -> None:
        for rank, diff in enumerate(per_rank):
            assert diff <= TOL, (rank, name, diff)

    cases.check_each(subtests, gated, check, names=[_gated_name(*c) for c in GATED])


# -- whole parameters edited outside forward; released ones read (issue 26) -----------------
WRITES = (
    "clamp",
    "data_clamp",
    "data_assign",
    "load_state_dict",
    "gathered_modifier",
    "gathered_modifier_data_assign",
    "gathered",
)


def _write(model, ref, how: str) -> None:
    """Clip ``fc1.weight`` to +-0.05 (WGAN-style) by ``how``; ``load_state_dict`` loads
    ``ref``'s values, clipped the same way."""
    from zeroshard.zero import GatheredParameters

    p = model.fc1.weight
    if how == "clamp":
        with torch.no_grad():
            p.clamp_(-0.05, 0.05)
    elif how == "data_clamp":
        p.data.clamp_(-0.05, 0.05)
    elif how == "data_assign":
        p.data = p.data.clamp(-0.05, 0.05)
    elif how == "load_state_dict":
        model.load_state_dict({k: v.detach().clone() for k, v in ref.state_dict().items()})
    elif how == "gathered_modifier_data_assign":
        with GatheredParameters([p], modifier_rank=0):
            p.data = p.data.clamp(-0.05, 0.05)
    else:
        rank = 0 if how == "gathered_modifier" else None
        with GatheredParameters([p], modifier_rank=rank), torch.no_grad():
            p.clamp_(-0.05, 0.05)


def _clipped(rank: int, world: int, stage: int, zc: dict, how: str) -> float | str:
    """Max parameter difference against torch clipping ``fc1.weight`` after each step but
    the last, or the error the write raised."""
    import os

    import zeroshard
    from zeroshard.offload.staging import STAGE_ON_CPU_ENV
    from zeroshard.zero import GatheredParameters

    os.environ[STAGE_ON_CPU_ENV] = "1"  # separate fp32 masters, as on a GPU
    torch.manual_seed(0)
    ref = Net()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    torch.manual_seed(0)
    model = Net()
    cfg = {**_z3_config(stage), "zero_optimization": {"stage": stage, **zc}}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    os.environ.pop(STAGE_ON_CPU_ENV)
    try:
        for step in range(3):
            x, y = _data(step, MICRO * world)
            ref(x, y).backward()
            opt.step()
            opt.zero_grad()
            lo = rank * MICRO
            engine.backward(engine(x[lo : lo + MICRO], y[lo : lo + MICRO]))
            engine.step()
            if step < 2:
                with torch.no_grad():
                    ref.fc1.weight.clamp_(-0.05, 0.05)
                _write(model, ref, how)
        with GatheredParameters(list(model.parameters())):
            got = {n: p.detach().clone() for n, p in model.named_parameters()}
        return max((got[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    except Exception as exc:  # the error the test expects, by message
        return f"{type(exc).__name__}: {exc}"
    finally:
        engine.destroy()


def _clip_configs(nvme: str) -> dict[str, tuple[int, dict]]:
    cpu, disk = {"device": "cpu"}, {"device": "nvme", "nvme_path": nvme}
    return {
        "stage0": (0, {}),
        "stage1": (1, {}),
        "stage2_offload": (2, {"offload_optimizer": cpu}),
        "stage3": (3, {}),  # the default threshold: every parameter of Net is persistent
        "stage3_offload": (3, {"offload_optimizer": cpu}),
        "stage3_offload_both": (3, {"offload_optimizer": cpu, "offload_param": cpu}),
        "stage3_nvme": (3, {"offload_optimizer": disk, "offload_param": disk}),
        "stage3_partitioned": (3, {"stage3_param_persistence_threshold": 0}),
    }


def _master_bits(rank: int, world: int, stage: int) -> dict:
    """bf16 parameters, fp32 masters: an in-place edit that changes nothing leaves the
    next step bit for bit as without it; a clamp reaches the masters of the clamped
    elements only, as their bf16 values."""
    import zeroshard
    from zeroshard.zero import GatheredParameters

    masters = {}
    for edit in ("none", "noop", "clamp"):
        torch.manual_seed(0)
        model = Net()
        cfg = {**_z3_config(stage), "zero_optimization": {"stage": stage}}
        cfg["bf16"] = {"enabled": True}
        engine, *_ = zeroshard.initialize(
            model=model, model_parameters=model.parameters(), config=cfg
        )
        assert engine.optimizer is not None  # the config has an optimizer
        states, numel = engine.optimizer.states, engine.flat.layout.shard_numel
        for step in range(1 if edit == "clamp" else 2):
            x, y = _data(step, MICRO * world)
            lo = rank * MICRO
            engine.backward(engine(x[lo : lo + MICRO], y[lo : lo + MICRO]))
            engine.step()
            if step == 0 and edit == "noop":
                with torch.no_grad():
                    model.fc1.weight.clamp_(-100.0, 100.0)
        if edit == "clamp":
            masters["before"] = states.read("master", 0, numel).clone()
            with torch.no_grad():
                model.fc1.weight.clamp_(-0.05, 0.05)
            with GatheredParameters([model.fc2.bias]):  # leaving it hands edits over
                pass
        masters[edit] = states.read("master", 0, numel).clone()
        engine.destroy()
    changed = masters["clamp"] != masters["before"]
    clamped = masters["clamp"][changed].abs()
    return {
        "noop_same_bits": torch.equal(masters["noop"], masters["none"]),
        "clamped_are_bf16": bool((clamped == torch.tensor(0.05).bfloat16().float()).all()),
        "some_clamped": int(changed.sum()),
    }


def _released_reads(rank: int, world: int, **zero) -> dict:
    """What a released stage-3 parameter (and its ``.data``) answers outside forward."""
    import zeroshard
    from zeroshard.zero.params.hooks import PartitionedParameterError

    torch.manual_seed(0)
    model = Net()
    model.fc1.weight.register_hook(lambda g: g)
    model.fc1.weight.tag = "mine"  # type: ignore[attr-defined]  # a user's attribute on a parameter
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=_z3_config(**zero)
    )
    x, y = _data(0, MICRO)
    engine.backward(engine(x, y))
    engine.step()
    p = model.fc1.weight
    reads = {
        "shape": lambda: tuple(p.shape) == (16, 8),
        "size": lambda: tuple(p.size()) == (16, 8) and p.size(-1) == 8,
        "dim": lambda: p.dim() == 2 == p.ndim == p.ndimension(),
        "numel": lambda: p.numel() == 128 == p.nelement() and p.nbytes == 512,
        "len": lambda: len(p) == 16,
        "stride": lambda: p.stride() == (8, 1) and p.is_contiguous(),
        "dtype": lambda: p.dtype == torch.float32 and p.element_size() == 4 == p.itemsize,
        "device": lambda: p.device.type == "cpu" and p.is_cpu and not p.is_cuda,
        "kind": lambda: p.is_floating_point() and not p.is_complex() and not p.is_sparse,
        "requires_grad": lambda: p.requires_grad and p.is_leaf and p.grad_fn is None,
        "grad": lambda: p.grad is None and p._grad is None,
        "backward_hooks": lambda: len(p._backward_hooks or {}) == 1,
        "post_accumulate_grad_hooks": lambda: len(p._post_accumulate_grad_hooks) >= 1,
        "dict": lambda: p.__dict__["tag"] == "mine" and p.tag == "mine" and "tag" in vars(p),  # type: ignore[attr-defined]
        "hash": lambda: {p: 1}[p] == 1,
        "repr": lambda: "fc1.weight" in repr(p) and "(16, 8)" in repr(p),
        "version": lambda: isinstance(p._version, int),
        "data_shape": lambda: tuple(p.data.shape) == (16, 8) and p.data.dtype == torch.float32,
    }
    refused = {
        "clone": lambda: p.clone(),
        "sum": lambda: p.sum(),
        "index": lambda: p[0],
        "tolist": lambda: p.tolist(),
        "T": lambda: p.T,
        "deepcopy": lambda: __import__("copy").deepcopy(p),
        "data_clone": lambda: p.data.clone(),
        "data_sum": lambda: p.data.sum(),
        "data_clamp": lambda: p.data.clamp_(-1, 1),
        "data_assign": lambda: setattr(p, "data", torch.zeros(16, 8)),
        "detach_copy": lambda: p.detach().copy_(torch.zeros(16, 8)),
    }
    out: dict[str, Any] = {"allowed": {}, "refused": {}}
    for name, read in reads.items():
        try:
            out["allowed"][name] = bool(read())
        except Exception as exc:  # the test names the read that failed
            out["allowed"][name] = f"{type(exc).__name__}: {exc}"
    for name, op in refused.items():
        try:
            op()
            out["refused"][name] = "no error"
        except PartitionedParameterError as exc:
            out["refused"][name] = str(exc)
    x, y = _data(1, MICRO)  # training goes on
    engine.backward(engine(x, y))
    engine.step()
    out["trains_after"] = True
    engine.destroy()
    return out


CLIPPED = [f"clipped {name} {how}" for name in _clip_configs("") for how in WRITES]


def _outside(rank: int, world: int, nvme: str) -> dict:
    torch.set_num_threads(1)
    cpu = {"device": "cpu"}
    return cases.run_named(
        [
            *(
                (f"clipped {name} {how}", functools.partial(_clipped, rank, world, stage, zc, how))
                for name, (stage, zc) in _clip_configs(nvme).items()
                for how in WRITES
            ),
            *(
                (f"master_bits stage{stage}", functools.partial(_master_bits, rank, world, stage))
                for stage in (1, 3)
            ),
            ("released device", lambda: _released_reads(rank, world)),
            (
                "released offloaded",
                lambda: _released_reads(rank, world, offload_param=cpu, offload_optimizer=cpu),
            ),
        ]
    )


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    return multirank.run(_outside, 2, str(tmp_path_factory.mktemp("nvme")), timeout=600)


def test_whole_parameters_edited_outside_forward_reach_the_masters(outside, subtests):
    """WGAN-style clipping of a parameter after each step, by every way of writing it,
    against torch: stages 0-2 and the persistent parameters of stage 3 (below
    stage3_param_persistence_threshold, whole on every rank), with separate fp32 masters
    and offloaded copies (CPU, NVMe), reach the masters; a partitioned parameter refuses
    every write outside GatheredParameters(modifier_rank=...) with the error naming it,
    and an edit inside GatheredParameters without modifier_rank is not kept (DeepSpeed's
    read-only gather)."""
    cases.check_each(subtests, outside, _check_clipped, names=CLIPPED)


def _check_clipped(case: str, per_rank: list) -> None:
    failures = []
    for rank, got in enumerate(per_rank):
        _, name, how = case.split()
        partitioned = name == "stage3_partitioned"
        if partitioned and how in ("clamp", "data_clamp", "data_assign", "load_state_dict"):
            ok = isinstance(got, str) and "fc1.weight" in got and "GatheredParameters" in got
        elif partitioned and how == "gathered":
            ok = not isinstance(got, str) and got > 1e-2  # discarded on leaving
        else:
            ok = not isinstance(got, str) and got <= TOL
        if not ok:
            failures.append(f"rank {rank} {case}: {got}")
    assert not failures, "\n".join(failures)


def test_an_edit_keeps_the_fp32_masters_of_unchanged_elements(outside, subtests):
    """bf16 parameters: the masters take a clamped element as its bf16 value and keep
    the fp32 bits of every other (a whole-segment copy would round them all)."""

    def check(stage: str, bits: list) -> None:
        assert all(b["noop_same_bits"] and b["clamped_are_bf16"] for b in bits), (stage, bits)
        assert sum(b["some_clamped"] for b in bits) > 0, (stage, bits)

    cases.check_each(subtests, outside, check, names=["master_bits stage1", "master_bits stage3"])


def test_released_parameter_answers_metadata_and_refuses_values(outside, subtests):
    """The reads hooks.RELEASED_READS lists answer (for the whole parameter: shape
    (16, 8), not the empty placeholder); reads and writes of values, through the
    parameter or its .data, raise PartitionedParameterError naming it."""

    def check(where: str, per_rank: list) -> None:
        for released in per_rank:
            bad = {k: v for k, v in released["allowed"].items() if v is not True}
            assert not bad, (where, bad)
            for name, msg in released["refused"].items():
                assert "fc1.weight" in msg and "GatheredParameters" in msg, (where, name, msg)
            assert released["trains_after"]

    cases.check_each(subtests, outside, check, names=["released device", "released offloaded"])


def test_graph_walk_names_the_parameters_a_backward_reaches():
    """zero/grads/reached.py: what the stage-3 reducer counts as arrived before backward; a
    reentrant checkpoint hides the parameters inside it, so nothing is ruled out."""
    from torch.utils.checkpoint import checkpoint

    from zeroshard.zero.grads.reached import reached_leaves

    torch.manual_seed(0)
    model = GatedLM("linear")
    x, y = _gated_data("linear", 0, 0)
    skipped = reached_leaves([model(x, y, take=False)])
    assert skipped == {id(p) for n, p in model.named_parameters() if not n.startswith("gate.")}
    taken = reached_leaves([model(x, y, take=True)])
    assert taken == {id(p) for p in model.parameters()}
    h = checkpoint(model.gate, model.first(x), True, use_reentrant=True)
    assert reached_leaves([h.sum()]) is None
    h = checkpoint(model.gate, model.first(x), True, use_reentrant=False)
    assert id(model.gate.extra.weight) in (reached_leaves([h.sum()]) or ())


def test_graph_walk_finds_every_parameter_of_a_deep_graph() -> None:
    """The walk before a stage-3 backward (zero/grads/reached.py) must reach every parameter
    the graph holds: a missed one is counted as arrived and its bucket reduced without
    it. Found on an H200 (torch 2.11), where dropped node objects were freed and their
    ids reused by others: two-rank stage-3 runs raised 'received a gradient after its
    bucket was already reduced'."""
    from zeroshard.zero.grads.reached import reached_leaves

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)) for _ in range(60))
    )
    loss = model(torch.randn(4, 8)).square().sum()
    reached = reached_leaves([loss])
    assert reached is not None
    assert {id(p) for p in model.parameters()} <= reached
