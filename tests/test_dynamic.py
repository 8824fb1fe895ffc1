"""ZeRO on models as people write them (issue 14): parameters that get no gradient in a
step, on some ranks or on all, against single-process torch, at stages 0-3 with and
without CPU offload (on the GPU code path), on 2 gloo ranks. One spawn runs every case.

Rules (torch's and DDP's): a parameter with no gradient on any rank in a whole
accumulation window is not stepped (torch skips ``grad=None``: no moment update, no
weight decay); one used on some ranks only is stepped with its gradient averaged with
zeros from the others.
"""

from __future__ import annotations

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


def _worker(rank: int, world: int, cases: list) -> list[dict]:
    torch.set_num_threads(1)
    out = []
    for stage, kind, offload in cases:
        ref = _reference(world, kind)
        got = _train(rank, world, stage, kind, offload)
        out.append({n: (got[n] - ref[n]).abs().max().item() for n in ref})
    return out


CASES = [
    (stage, kind, offload)
    for stage in (0, 1, 2, 3)
    for kind in ("adamw", "sgd")
    for offload in ((False, True) if stage else (False,))
]


@pytest.fixture(scope="module")
def results():
    return multirank.run(_worker, 2, CASES, timeout=600)


def test_no_gradient_parameters_follow_torch(results):
    """``maybe`` (no gradient anywhere every third step) and ``extra`` (rank 0 only)
    end where single-process torch leaves them, with momentum and weight decay."""
    failures = []
    for rank, per_rank in enumerate(results):
        for case, diffs in zip(CASES, per_rank, strict=True):
            worst = max(diffs.values())
            if worst > TOL:
                failures.append(f"rank {rank} {case}: {diffs}")
    assert not failures, "\n".join(failures)


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

        cfg = MixtralConfig(
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
        return MixtralForCausalLM(cfg)
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
    zc = {"offload_optimizer": {"device": "cpu"}} if offload else {}
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
    ours = engine.module.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)
    theirs = ref.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)
    return {"same": torch.equal(ours, theirs), "length": ours.shape[1]}


def _ledger_lora(rank, world, build=LoRANet, offloads=(False, True)):
    """One step of a LoRA model at stage 3: every unit all-gathered twice (reuse distance
    0: freed after its forward), only the trainable units reduce-scattered; no gradient
    storage for frozen weights."""
    out = {}
    for offload in offloads:
        zc = {"offload_optimizer": {"device": "cpu"}} if offload else {}
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


def _second(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    import zeroshard

    out = {}
    # a hand-written MoE: without a leaf, a clear error on every rank; as a leaf, parity
    out["moe_no_leaf"] = _errors(lambda: _fit(MoENet, rank, world, steps=2))
    for offload in (False, True):
        zc = {"offload_optimizer": {"device": "cpu"}} if offload else {}
        leaf = lambda m: zeroshard.utils.set_z3_leaf_modules(m, [MoE])  # noqa: E731
        out[f"moe_leaf_{offload}"] = _fit(MoENet, rank, world, before_init=leaf, **zc)[0]
    out["moe_config_leaf"] = _fit(MoENet, rank, world, leaf_module={"classes": ["MoE"]})[0]
    out["moe_stage2"] = _fit(MoENet, rank, world, stage=2)[0]  # no gathers at stages 0-2
    for kind in ("mixtral", "qwen2_moe"):
        for offload in (False, True):
            out[f"{kind}_{offload}"] = _hf_moe_case(rank, world, kind, offload)
    out["generate"] = _generate(rank, world)
    out["lora"] = _ledger_lora(rank, world)
    try:
        import peft  # noqa: F401
    except ImportError:
        out["peft"] = None
    else:
        out["peft"] = _ledger_lora(rank, world, peft_net, offloads=(False,))
    out["edits"] = {stage: _edits(rank, world, stage) for stage in (0, 1, 2, 3)}
    return out


@pytest.fixture(scope="module")
def second():
    pytest.importorskip("transformers")
    return multirank.run(_second, 2, timeout=900)


def test_moe_routing_diverges_without_a_leaf_and_trains_as_one(second):
    for r in second:
        assert "GatherMismatchError" in r["moe_no_leaf"], r["moe_no_leaf"]
        assert "set_z3_leaf_modules" in r["moe_no_leaf"] and "moe" in r["moe_no_leaf"]
        for key in ("moe_leaf_False", "moe_leaf_True", "moe_config_leaf", "moe_stage2"):
            assert r[key] <= TOL, (key, r[key])


def test_hf_moe_with_an_expert_skipped_on_one_rank(second):
    routed = [second[rank]["mixtral_False"][1] for rank in range(2)]
    assert routed[0] != routed[1]  # the ranks' tokens go to different experts
    for r in second:
        for key in ("mixtral_False", "mixtral_True", "qwen2_moe_False", "qwen2_moe_True"):
            assert r[key][0] <= HF_TOL, (key, r[key][0])


def test_generate_with_different_lengths_needs_no_synced_gpus(second):
    lengths = [r["generate"]["length"] for r in second]
    assert lengths == [6, 10]
    assert all(r["generate"]["same"] for r in second)


@pytest.mark.parametrize("made_by", ["hand", "peft"])
def test_lora_ledger_and_no_frozen_gradients(second, made_by):
    for r in second:
        lora = r["lora"] if made_by == "hand" else r["peft"]
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


def test_parameters_touched_outside_forward(second):
    for r in second:
        for stage, e in r["edits"].items():
            stage = int(stage)
            if stage < 3:
                assert e["penalty"] <= TOL, (stage, e)
            else:
                assert "PartitionedParameterError" in e["penalty"], e
                assert "GatheredParameters" in e["penalty"], e
                assert "fc1.weight" in e["outside"] and "GatheredParameters" in e["outside"], e
            assert e["clamp"] <= TOL, (stage, e)
            assert "maybe.weight" in e["unfreeze"] and "destroy" in e["unfreeze"], (stage, e)
            assert e["freeze"] <= TOL, (stage, e)


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


GATED = [
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


def _gated_cases(rank: int, world: int) -> list[float]:
    torch.set_num_threads(1)
    return [_gated_leaf(rank, world, kind, stage, zc) for kind, stage, zc in GATED]


@pytest.fixture(scope="module")
def gated():
    return multirank.run(_gated_cases, 2, timeout=600)


def test_leaf_running_on_one_rank_trains_as_torch(gated):
    """The leaf remedy GatherMismatchError names: a leaf whose inner Linear runs on one
    rank only trains as torch does, at every stage (stage 3: parameter gathers and
    gradient reductions no longer meet in one group in a different order per rank)."""
    for rank, diffs in enumerate(gated):
        for (kind, stage, zc), diff in zip(GATED, diffs, strict=True):
            assert diff <= TOL, (rank, kind, stage, zc, diff)
