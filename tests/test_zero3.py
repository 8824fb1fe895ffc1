"""ZeRO-3 on 2 ranks: Hugging Face models, partitioned construction, real-model quirks,
the 3 x 4Psi ledger (2 x 4Psi with reuse), memory_stats, GatheredParameters, generation
(one spawn runs all); prefetching, the persistence threshold, the live-parameter cap and
the reuse distance (a second spawn)."""

from __future__ import annotations

import functools

import cases
import multirank
import parity
import pytest
import torch
import torch.nn.functional as F
from torch import nn

TOL = 2e-5
HF_TOL = 5e-5
Z3 = {"stage3_param_persistence_threshold": 0}  # partition everything, even tiny tensors
NO_REUSE = {"stage3_max_reuse_distance": 0}  # free every unit after its forward


def _config(stage: int, micro: int = 2, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "reduce_scatter": True, **zero},
        "steps_per_print": 10**6,
    }


def _train_both(
    build, forward, stage, rank, world, *, steps=3, micro=2, init=False, probe=None, **zero
):
    """Train ``build()`` with zeroshard (this rank's rows) and single-process on all rows;
    returns (max param diff, max loss diff, engine, reference model, its optimizer).
    ``probe(phase, step, engine)`` runs at phases "start", "forward", "backward", "step"."""
    import zeroshard

    torch.manual_seed(0)
    ref = build()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
    torch.manual_seed(0)
    if init:
        with zeroshard.zero.Init():
            model = build()
    else:
        model = build()
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=_config(stage, micro, **zero)
    )
    loss_diff = 0.0
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 64, (micro * world, 16), generator=g)
        mine = ids[micro * rank : micro * (rank + 1)]
        probe = probe or (lambda phase, step, engine: None)
        probe("start", step, engine)
        loss = forward(engine, mine)
        probe("forward", step, engine)
        engine.backward(loss)
        probe("backward", step, engine)
        engine.step()
        probe("step", step, engine)
        ref_loss = forward(ref, ids)
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        loss_diff = max(loss_diff, abs(total.item() / world - ref_loss.item()))
    from zeroshard.zero import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        diff = max(
            (p.detach().float() - q.detach()).abs().max().item()
            for p, q in zip(model.parameters(), ref.parameters(), strict=True)
        )
    return diff, loss_diff, engine, ref, opt


# -- models -------------------------------------------------------------------------------
def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg)


def _hf_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


class Quirky(nn.Module):
    """Real-model habits: a block called twice per forward, a parameter used outside
    its module's forward (output projection tied through F.linear), a buffer, a frozen
    parameter, and a parameter of the root module itself."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
        self.norm = nn.LayerNorm(32)
        self.frozen = nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.tensor(0.5))
        self.out_bias = nn.Parameter(torch.zeros(64))

    def forward(self, ids):
        x, y = ids[:, :-1], ids[:, 1:]
        h = self.emb(x)
        h = self.block(h) + self.block(h * self.scale) + self.frozen(h)
        logits = F.linear(self.norm(h), self.emb.weight, self.out_bias)
        return F.cross_entropy(logits.reshape(-1, 64), y.reshape(-1))


def _quirky_loss(model, ids):
    return model(ids)


def _gpt_untied():
    from zeroshard.models import GPT, GPTConfig

    return GPT(
        GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=64, tie_embeddings=False)
    )


# -- the checks, each returning plain data ---------------------------------------------------
HF_BUILDS = {"gpt2": _gpt2, "llama": _llama}
# (model, stage, zero.Init) per Hugging Face case
HF_CASES = [
    (m, stage, init)
    for m in HF_BUILDS
    for stage, init in ((0, False), (1, False), (2, False), (3, False), (3, True))
]


def _hf_name(model: str, stage: int, init: bool) -> str:
    return f"hf {model}-s{stage}" + ("-init" if init else "")


def _hf_case(rank, world, model: str, stage: int, init: bool):
    kw = {"init": True} if init else {}
    return _train_both(HF_BUILDS[model], _hf_loss, stage, rank, world, **kw, **Z3)[:2]


def _quirky_cases(rank, world):
    out = {}
    for prefetch in (0, 10**6):
        diff, loss_diff, engine, ref, _ = _train_both(
            Quirky, _quirky_loss, 3, rank, world, stage3_prefetch_bucket_size=prefetch, **Z3
        )
        out[f"prefetch={prefetch}"] = (diff, loss_diff)
    # eval + no_grad forward (gather without grads) equals the reference's
    engine.eval()
    with torch.no_grad():
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(9))
        out["eval"] = abs(engine(ids).item() - ref(ids).item())
    engine.train()
    return out


def _init_exact(rank, world):
    """zero.Init holds 1/N of each parameter and reproduces eager initialization bitwise."""
    import zeroshard
    from zeroshard.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)
    torch.manual_seed(5)
    eager = GPT(cfg)
    after_eager = torch.rand(1).item()
    torch.manual_seed(5)
    with zeroshard.zero.Init():
        model = GPT(cfg)
    after_init = torch.rand(1).item()
    held = sum(p.untyped_storage().nbytes() for p in model.parameters())
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=_config(3, **Z3)
    )
    values = parity.full_params(engine)
    equal = all(torch.equal(values[n], p.detach()) for n, p in eager.named_parameters())
    # remote_device="cpu" keeps the slices in CPU memory, with the same values
    torch.manual_seed(5)
    with zeroshard.zero.Init(remote_device="cpu", pin_memory=True) as init:
        on_cpu = GPT(cfg)
    slices = {str(e.shard.device) for e in init._sealed.values()}
    engine2, *_ = zeroshard.initialize(
        model=on_cpu, model_parameters=on_cpu.parameters(), config=_config(3, **Z3)
    )
    values = parity.full_params(engine2)
    cpu_equal = all(torch.equal(values[n], p.detach()) for n, p in eager.named_parameters())
    refused = []
    for kwargs in ({"remote_device": "nvme"}, {"zero_quantized_weights": True}):
        try:
            zeroshard.zero.Init(**kwargs)
        except NotImplementedError as exc:
            refused.append(str(exc))
    return {
        "equal": equal,
        "rng_same": after_eager == after_init,
        "held_bytes": held,
        "cpu_slices": sorted(slices),
        "cpu_equal": cpu_equal,
        "refused": refused,
    }


def _ledger_memory(rank, world, **zero):
    import zeroshard

    torch.manual_seed(0)
    model = _gpt_untied()
    psi = sum(p.numel() for p in model.parameters())
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=_config(3, **Z3, **zero)
    )
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):  # the second step runs with the recorded prefetch order
        engine.reset_comm_stats()
        engine.backward(model(ids[:, :-1], ids[:, 1:]))
        engine.step()
    return {
        "stats": engine.comm_stats(),
        "flags": parity.flag_bytes(engine),
        "psi": psi,
        "memory": engine.memory_stats(),
        "largest_unit": max(s.numel for s in engine.flat.layout.segments),
    }


def _gathered_modify(rank, world):
    """GatheredParameters(modifier_rank=0): rank 0's edit reaches every shard and the
    master weights; training continues from it exactly like the reference."""
    from zeroshard.zero import GatheredParameters

    def build():
        return _gpt_untied()

    def loss_fn(m, ids):
        return m(ids[:, :-1], ids[:, 1:])

    diff, _, engine, ref, opt = _train_both(build, loss_fn, 3, rank, world, steps=1, **Z3)
    model = engine.module
    with GatheredParameters([model.head.weight]):
        before = model.head.weight.detach().clone()
    with GatheredParameters([model.head.weight], modifier_rank=0):
        if rank == 0:
            model.head.weight.data.mul_(0.5)
        else:
            model.head.weight.data.zero_()  # ignored: only the modifier rank's values count
    with GatheredParameters([model.head.weight]):
        exact = torch.equal(model.head.weight.detach(), before * 0.5)
    # training continues from the edited weights, like the reference does
    with torch.no_grad():
        ref.head.weight.mul_(0.5)
    ids = torch.randint(0, 64, (2 * world, 16), generator=torch.Generator().manual_seed(77))
    engine.backward(loss_fn(engine, ids[2 * rank : 2 * rank + 2]))
    engine.step()
    loss_fn(ref, ids).backward()
    opt.step()
    with GatheredParameters([model.head.weight]):
        after = (model.head.weight.detach() - ref.head.weight.detach()).abs().max().item()
    return {"before": diff, "exact": exact, "after": after}


def _generate(rank, world):
    """A Hugging Face generation loop (KV cache, no_grad, many forwards) under stage 3
    gives the reference model's tokens."""
    diff, _, engine, ref, _ = _train_both(_gpt2, _hf_loss, 3, rank, world, steps=1, **Z3)
    prompt = torch.tensor([[1, 2, 3, 4]])
    ours = engine.module.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    theirs = ref.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    return {"same": torch.equal(ours, theirs), "diff": diff}


def _all(rank, world):
    torch.set_num_threads(1)
    return cases.run_named(
        [
            *((_hf_name(*c), functools.partial(_hf_case, rank, world, *c)) for c in HF_CASES),
            ("quirky", lambda: _quirky_cases(rank, world)),
            ("init", lambda: _init_exact(rank, world)),
            ("ledger", lambda: _ledger_memory(rank, world, **NO_REUSE)),
            ("ledger_reuse", lambda: _ledger_memory(rank, world)),
            ("modify", lambda: _gathered_modify(rank, world)),
            ("generate", lambda: _generate(rank, world)),
        ]
    )


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("transformers")
    return multirank.run(_all, 2, timeout=600)


def test_hf_models_every_stage(results, subtests):
    def check(case: str, per_rank: list) -> None:
        for diff, loss_diff in per_rank:
            assert diff <= HF_TOL and loss_diff <= HF_TOL, (case, diff, loss_diff)

    cases.check_each(subtests, results, check, names=[_hf_name(*c) for c in HF_CASES])


def test_real_model_quirks(results):
    for r in cases.by_rank(results, "quirky"):
        q = r["quirky"]
        for key in ("prefetch=0", "prefetch=1000000"):
            assert q[key][0] <= TOL and q[key][1] <= TOL, (key, q[key])
        assert q["eval"] <= 1e-5


def test_partitioned_construction_is_exact(results):
    for r in cases.by_rank(results, "init"):
        i = r["init"]
        assert i["equal"] and i["rng_same"]
        assert i["held_bytes"] == 0  # parameters hold no storage; the slices live in Init
        assert i["cpu_slices"] == ["cpu"] and i["cpu_equal"]
        assert "remote_device='nvme'" in i["refused"][0]
        assert "zero_quantized_weights" in i["refused"][1]


def test_ledger_three_psi(results):
    for r in cases.by_rank(results, "ledger"):
        led = r["ledger"]
        stats, psi = led["stats"], led["psi"]
        assert set(stats) == {"all_gather", "reduce_scatter", "all_reduce"}, stats
        assert stats["all_reduce"]["bytes"] == led["flags"]  # the used-parameter flags
        gathered = stats["all_gather"]["bytes"]
        scattered = stats["reduce_scatter"]["bytes"]
        assert abs(gathered - 2 * 4 * psi) <= 0.03 * 2 * 4 * psi, (gathered, psi)
        assert abs(scattered - 4 * psi) <= 0.03 * 4 * psi, (scattered, psi)


def test_ledger_reuse_gathers_once(results):
    """With DeepSpeed's default stage3_max_reuse_distance (1e9) the units stay gathered
    from their forward through their backward: 4Psi gathered, not 2 x 4Psi."""
    for r in cases.by_rank(results, "ledger", "ledger_reuse"):
        led = r["ledger_reuse"]
        stats, psi = led["stats"], led["psi"]
        gathered = stats["all_gather"]["bytes"]
        assert abs(gathered - 4 * psi) <= 0.03 * 4 * psi, (gathered, psi)
        assert stats["reduce_scatter"]["bytes"] == r["ledger"]["stats"]["reduce_scatter"]["bytes"]


def test_memory_stats_one_nth(results):
    for r in cases.by_rank(results, "ledger"):
        m, psi = r["ledger"]["memory"], r["ledger"]["psi"]
        pad = 4 * 2 * 16 * 40  # per-unit alignment padding (40 units at most)
        assert m["params"] <= 4 * psi / 2 + pad
        # + the staging pool: two buckets (one filling, one whose reduction is in flight)
        assert m["grads"] <= 4 * psi / 2 + pad + 2 * 4 * r["ledger"]["largest_unit"]
        assert m["optimizer_states"] <= 8 * psi / 2 + pad + 64


def test_gathered_parameters_modifier(results):
    for r in cases.by_rank(results, "modify"):
        assert r["modify"]["before"] <= TOL
        assert r["modify"]["exact"]
        assert r["modify"]["after"] <= TOL


def test_generation_matches(results):
    for r in cases.by_rank(results, "generate"):
        assert r["generate"]["same"]


# -- prefetching, persistence threshold, live-parameter cap (their own spawn) --------------
class Wide(nn.Module):
    """32 -> 64 -> 32 with no bias: one large unit (4096 elements) keeping the width."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(64, 32) * 0.1)
        self.w2 = nn.Parameter(torch.randn(32, 64) * 0.1)

    def forward(self, h):
        return torch.tanh(h @ self.w1.t()) @ self.w2.t()


class Chain(nn.Module):
    """One unit per module, each used once per forward, sizes (threshold 0, no padding on
    2 ranks): emb 2048, a 1056, norm 64, wide 4096, head 2112. With ``swap`` every
    second forward runs ``wide`` before ``norm``, so the order recorded on the first
    forward mispredicts: what follows ``a`` in it (``norm``) is prefetched, yet ``wide``
    is asked for first (and likewise in backward)."""

    def __init__(self, swap: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.a = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)
        self.wide = Wide()
        self.head = nn.Linear(32, 64)
        self.swap, self.calls = swap, 0

    def forward(self, ids):
        x, y = ids[:, :-1], ids[:, 1:]
        h = torch.tanh(self.a(self.emb(x)))
        middle = (self.wide, self.norm) if self.swap and self.calls % 2 else (self.norm, self.wide)
        for m in middle:
            h = m(h)
        self.calls += 1
        return F.cross_entropy(self.head(h).reshape(-1, 64), y.reshape(-1))


def _chain_run(rank, world, *, swap=False, threshold=0, **zero):
    """Train Chain for 3 steps (parity with the reference); per step: the gatherer's
    counters by pass, the all-gather ledger bytes, and whether the parameters below
    ``threshold`` elements were whole with unchanged storage at every probe."""
    small = [n for n, p in Chain().named_parameters() if p.numel() < threshold]
    full = {n: p.numel() for n, p in Chain().named_parameters()}
    steps: list[dict] = []
    ptrs: dict[str, int] = {}
    whole = {"small": True, "others_freed_between_steps": True}

    def check(engine):
        for n, p in engine.module.named_parameters():
            if n in small:
                ptr = ptrs.setdefault(n, p.data.data_ptr())
                ok = p.data.numel() == full[n] and p.data.data_ptr() == ptr
                ok = ok and p.untyped_storage().nbytes() >= 4 * full[n]
                whole["small"] = whole["small"] and ok

    def probe(phase, step, engine):
        g = engine.params
        check(engine)
        if phase == "start":
            if not steps:  # first call: hooks that check inside every module's forward
                for m in engine.module.modules():
                    m.register_forward_pre_hook(lambda m, a: check(engine))
                    m.register_forward_hook(lambda m, a, o: check(engine))
            engine.reset_comm_stats()
            g.reset_stats()
            steps.append({})
        elif phase in ("forward", "backward"):
            steps[-1][phase] = g.stats()
            g.reset_stats()
        else:
            steps[-1]["all_gather_bytes"] = engine.comm_stats()["all_gather"]["bytes"]
            freed = all(  # released: no storage (metadata still answers the whole shape)
                p.untyped_storage().nbytes() == 0
                for n, p in engine.module.named_parameters()
                if n not in small
            )
            whole["others_freed_between_steps"] &= freed

    losses = []

    def forward(model, ids):
        loss = _quirky_loss(model, ids)
        if not isinstance(model, Chain):  # the engine's, not the reference's
            losses.append(loss.item())
        return loss

    zero = {"stage3_param_persistence_threshold": threshold, **zero}
    diff, loss_diff, engine, _, _ = _train_both(
        lambda: Chain(swap), forward, 3, rank, world, probe=probe, **zero
    )
    layout, persistent = engine.flat.layout, engine.params.persistent
    return {
        "diff": diff,
        "loss_diff": loss_diff,
        "losses": losses,
        "params": _digest(engine),
        "steps": steps,
        "whole": whole,
        "small_numel": sum(full[n] for n in small),
        "units": sorted(s.numel for s in layout.segments if s.index not in persistent),
        "persistent_numel": sum(layout.segments[s].numel for s in persistent),
        "shard_numel": layout.shard_numel,
        "memory_params": engine.memory_stats()["params"],
    }


def _digest(engine) -> str:
    """A hash of every parameter's bytes (gathered): equal digests, bitwise-equal models."""
    import hashlib

    from zeroshard.zero import GatheredParameters

    params = list(engine.module.parameters())
    with GatheredParameters(params):
        flat = torch.cat([p.detach().reshape(-1).float() for p in params])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def _reuse_off_path(rank, world, **zero):
    """Chain with the default reuse distance off the training path: an eval forward
    under no_grad, a grad-enabled forward with no backward (then another eval), and a
    step after a forward with no backward (the shards change while units are kept).
    Returns the losses, the gatherer's counters after each probe, and a digest."""
    import zeroshard
    from zeroshard.zero.params.gatherer import ParamGatherer

    torch.manual_seed(0)
    model = Chain()
    cfg = _config(3, stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0, **zero)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = engine.params
    assert isinstance(g, ParamGatherer)

    def batch(step):
        ids = torch.randint(0, 64, (2 * world, 16), generator=torch.Generator().manual_seed(step))
        return ids[2 * rank : 2 * rank + 2]

    losses, probes = [], {}

    def probe(name):
        probes[name] = {**g.stats(), "kept_now": len(g.kept_units())}
        g.reset_stats()

    def train(step):
        loss = _quirky_loss(engine, batch(step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())

    for step in range(2):  # the first step records the orders
        train(step)
    g.reset_stats()
    with torch.no_grad():
        losses.append(_quirky_loss(engine, batch(10)).item())
    probe("eval")
    losses.append(_quirky_loss(engine, batch(11)).item())  # grad enabled, no backward
    probe("forward_only")
    with torch.no_grad():
        losses.append(_quirky_loss(engine, batch(12)).item())
    probe("eval_after_forward")
    losses.append(_quirky_loss(engine, batch(13)).item())  # kept, then a step
    engine.step()  # Adam moves the parameters even with zero gradients
    probe("step_after_forward")
    for step in range(3, 5):
        train(step)
    return {"losses": losses, "probes": probes, "params": _digest(engine)}


def _threshold_boundary(rank, world):
    """Which parameters a threshold equal to their size makes persistent (DeepSpeed:
    ``numel <= stage3_param_persistence_threshold``)."""
    import zeroshard
    from zeroshard.zero.params.gatherer import ParamGatherer

    torch.manual_seed(0)
    model = Chain()
    engine, *_ = zeroshard.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=_config(3, stage3_param_persistence_threshold=32),
    )
    assert isinstance(engine.params, ParamGatherer)
    persistent = {
        id(engine.flat.params[pi])
        for s in engine.params.persistent
        for pi in engine.flat.layout.segments[s].params
    }
    return sorted(n for n, p in model.named_parameters() if id(p) in persistent)


def _chain(**kw):
    return functools.partial(_chain_run, **kw)


# the second spawn's runs by name, each ``fn(rank, world)``
_GATHER = {
    "prefetch0": _chain(stage3_prefetch_bucket_size=0, **NO_REUSE),
    "prefetch": _chain(stage3_prefetch_bucket_size=10**6, **NO_REUSE),
    "persist": _chain(threshold=33, stage3_prefetch_bucket_size=0, **NO_REUSE),
    "capped": _chain(
        swap=True, stage3_prefetch_bucket_size=10**6, stage3_max_live_parameters=1500, **NO_REUSE
    ),
    "uncapped": _chain(
        swap=True, stage3_prefetch_bucket_size=10**6, stage3_max_live_parameters=10**9, **NO_REUSE
    ),
    "boundary": _threshold_boundary,
    # reuse: DeepSpeed's default distance, a small one, and one under a cap
    "reuse": _chain(stage3_prefetch_bucket_size=10**6),
    "reuse_prefetch0": _chain(stage3_prefetch_bucket_size=0),
    "reuse_near": _chain(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=5000),
    "reuse_capped": _chain(stage3_prefetch_bucket_size=0, stage3_max_live_parameters=6300),
    "reuse_swap": _chain(swap=True, stage3_prefetch_bucket_size=10**6),
    "swap0": _chain(swap=True, stage3_prefetch_bucket_size=10**6, **NO_REUSE),
    "off_path": _reuse_off_path,
    "off_path0": functools.partial(_reuse_off_path, **NO_REUSE),
}


def _gather_cases(rank, world):
    torch.set_num_threads(1)
    return cases.run_named(
        (name, functools.partial(fn, rank, world)) for name, fn in _GATHER.items()
    )


@pytest.fixture(scope="module")
def gather_results():
    return multirank.run(_gather_cases, 2, timeout=300)


def _counter(run, fold, key):
    return fold(st[phase][key] for st in run["steps"] for phase in ("forward", "backward"))


def _parity(run):
    assert run["diff"] <= TOL and run["loss_diff"] <= TOL, (run["diff"], run["loss_diff"])


def test_prefetch_gathers_ahead_of_use(gather_results):
    for r in cases.by_rank(gather_results, "prefetch", "prefetch0"):
        on, off = r["prefetch"], r["prefetch0"]
        _parity(on)
        _parity(off)
        n = len(on["units"])  # 5 units, each used once per pass
        assert n == 5
        for step, (a, b) in enumerate(zip(on["steps"], off["steps"], strict=True)):
            for phase in ("forward", "backward"):
                # no prefetching at all without a window, nor on the recording step
                assert b[phase]["prefetched"] == b[phase]["prefetch_hits"] == 0
                assert b[phase]["gathers"] == n
                want = 0 if step == 0 else n - 1
                # after it, every unit but the first of the pass had its gather issued
                # before its module asked for it, and none was issued in vain
                assert a[phase]["prefetched"] == a[phase]["prefetch_hits"] == want, (step, a)
                assert a[phase]["gathers"] == n and a[phase]["evicted"] == 0
            assert a["all_gather_bytes"] == b["all_gather_bytes"] == 2 * 4 * sum(on["units"])


def test_persistence_threshold_keeps_small_params_whole(gather_results):
    for r in cases.by_rank(gather_results, "persist", "prefetch0"):
        base, p = r["prefetch0"], r["persist"]
        _parity(p)
        small = p["small_numel"]
        assert small == 32 + 32 + 32  # a.bias, norm.weight, norm.bias (head.bias: 64 > 33)
        assert p["persistent_numel"] == small  # packed without padding
        assert p["whole"]["small"] and p["whole"]["others_freed_between_steps"]
        assert base["whole"]["others_freed_between_steps"]
        for sb, sp in zip(base["steps"], p["steps"], strict=True):
            # forward + backward no longer gather them (2 x 4 bytes each), the step's
            # refresh of the persistent segment does once: a drop of exactly their bytes
            assert sb["all_gather_bytes"] - sp["all_gather_bytes"] == 4 * small
        # the shard is the same size; the small parameters are held whole on top of it
        assert p["shard_numel"] == base["shard_numel"]
        assert p["memory_params"] == 4 * p["shard_numel"] + 4 * small
        assert p["memory_params"] - base["memory_params"] == 4 * small


def test_persistence_threshold_is_inclusive(gather_results):
    for r in cases.by_rank(gather_results, "boundary"):
        assert r["boundary"] == ["a.bias", "norm.bias", "norm.weight"]


def test_max_live_parameters_caps_gathered_numel(gather_results):
    for r in cases.by_rank(gather_results, "capped", "uncapped"):
        capped, free = r["capped"], r["uncapped"]
        _parity(capped)
        _parity(free)
        largest, cap = max(capped["units"]), 1500
        assert cap < 2 * min(capped["units"][1:])  # smaller than any two units but norm

        # on the mispredicted steps a prefetched unit is live when a large one is asked
        # for: it is freed first, so no more than one unit is ever live beyond the cap
        # (without that, 4096 + 64 in forward and 4096 + 1056 in backward)
        assert _counter(capped, max, "peak_live_numel") <= max(cap, largest)
        assert _counter(capped, sum, "evicted") > 0
        assert _counter(capped, sum, "prefetched") > 0  # the cap still lets small ones in
        # without a cap, prefetching holds several units at once
        assert _counter(free, max, "peak_live_numel") > largest
        assert _counter(free, sum, "evicted") == 0


# -- stage3_max_reuse_distance ---------------------------------------------------------
# Chain's trace (forward order, then backward order; numel): emb 2048, a 1056, norm 64,
# wide 4096, head 2112 | head, wide, norm, a, emb. After its forward, a unit is kept if
# the units between now and its next use hold fewer elements than the distance: head 0,
# wide 2 x 2112 = 4224, norm 4096 + 2 x 2112 + 4096 = 12416, a 16896, emb 21056.
def _same(run, base):
    """Bitwise the same training: every loss and every final parameter."""
    assert run["losses"] == base["losses"], (run["losses"], base["losses"])
    assert run["params"] == base["params"]


def _after_recording(run):
    return run["steps"][1:]  # the first step records the orders: nothing is kept then


def test_reuse_default_skips_the_backward_gather(gather_results):
    for r in cases.by_rank(gather_results, "reuse", "prefetch", "reuse_prefetch0", "prefetch0"):
        n = 5
        for key, base in (("reuse", "prefetch"), ("reuse_prefetch0", "prefetch0")):
            run = r[key]
            _parity(run)
            _same(run, r[base])
            first = run["steps"][0]
            assert first["forward"]["kept"] == 0 and first["backward"]["gathers"] == n
            for st in _after_recording(run):
                assert st["forward"]["gathers"] == n and st["forward"]["kept"] == n, st
                assert st["backward"]["gathers"] == 0 and st["backward"]["reused"] == n, st
                assert st["backward"]["prefetched"] == 0
                assert st["all_gather_bytes"] == 4 * sum(run["units"])
            assert run["whole"]["others_freed_between_steps"]  # freed when backward ends


def test_reuse_distance_keeps_only_units_near_the_turn(gather_results):
    for r in cases.by_rank(gather_results, "reuse_near", "prefetch0"):
        run = r["reuse_near"]  # distance 5000: head and wide kept, not norm (12416)
        _parity(run)
        _same(run, r["prefetch0"])
        units = {"emb": 2048, "a": 1056, "norm": 64, "wide": 4096, "head": 2112}
        for st in _after_recording(run):
            assert st["forward"]["kept"] == 2 and st["forward"]["gathers"] == 5, st
            assert st["backward"]["reused"] == 2 and st["backward"]["gathers"] == 3, st
            kept = units["head"] + units["wide"]
            assert st["all_gather_bytes"] == 4 * (2 * sum(units.values()) - kept)


def test_live_cap_evicts_kept_units(gather_results):
    for r in cases.by_rank(gather_results, "reuse_capped", "prefetch0"):
        run, cap = r["reuse_capped"], 6300
        _parity(run)
        _same(run, r["prefetch0"])
        for st in _after_recording(run):
            # forward: wide (4096) evicts emb, whose next use is furthest; head (2112)
            # evicts a; norm, wide and head (6272) are left for the backward
            assert st["forward"]["kept"] == 5 and st["forward"]["evicted"] == 2, st
            assert st["backward"]["reused"] == 3 and st["backward"]["gathers"] == 2, st
            for phase in ("forward", "backward"):
                assert st[phase]["peak_live_numel"] <= cap, st


def test_reuse_with_a_mispredicted_order(gather_results):
    for r in cases.by_rank(gather_results, "reuse_swap", "swap0"):
        run = r["reuse_swap"]
        _parity(run)
        _same(run, r["swap0"])
        for st in _after_recording(run):
            assert st["backward"]["gathers"] == 0, st  # every unit kept, whatever the order


def test_reuse_off_the_training_path(gather_results):
    for r in cases.by_rank(gather_results, "off_path", "off_path0"):
        run, base = r["off_path"], r["off_path0"]
        _same(run, base)  # nothing stale after a step, whatever was kept before it
        p = run["probes"]
        # an eval forward under no_grad keeps nothing
        assert p["eval"]["kept"] == 0 and p["eval"]["kept_now"] == 0
        assert p["eval"]["gathers"] == 5 and p["eval"]["live_numel"] == 0
        # a grad-enabled forward keeps every unit until a backward or a step ...
        assert p["forward_only"]["kept_now"] == 5 and p["forward_only"]["live_numel"] > 0
        # ... an eval forward uses them without gathering, and frees them
        assert p["eval_after_forward"]["reused"] == 5
        assert p["eval_after_forward"]["gathers"] == 0
        assert p["eval_after_forward"]["live_numel"] == 0
        # ... and a step frees them: the shards changed
        assert p["step_after_forward"]["kept_now"] == 0
        assert p["step_after_forward"]["live_numel"] == 0
        assert base["probes"]["forward_only"]["kept_now"] == 0
