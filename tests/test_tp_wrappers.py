"""AutoTP on models inside other modules (issue 26, point 2): a loss wrapper, a peft
LoRA model, a wrapper of a wrapper, a reward-model head, a wrapper's own head tied to
the embedding; transformers Llama, GPT-2 and Mixtral with random weights.

Each case must equal the unsplit single-process fp32 model to 2e-5: on 2 ranks the
loss, every gradient (re-assembled from the shards) and the parameters after 3 SGD
steps; on 4 ranks (tp2 x dp2) through ``initialize`` at ZeRO stages 1-3, the
parameters and the clipped gradient norm after 3 steps, and a checkpoint saved there
keeps the wrapper's global names (it loads at dp4 and converts to whole tensors).
What AutoTP cannot split is named in one error.
"""

from __future__ import annotations

import ast
import functools
import types
from typing import Any

import cases
import multirank
import pytest
import torch
from tp_parity import TOL, grad_diffs, param_diffs, twin

from zeroshard.parallel.tensor.autotp import apply_tensor_parallel, sync_partial_grads

pytest.importorskip("transformers")
pytest.importorskip("peft")

V, S, B = 64, 8, 2


class LossWrapper(torch.nn.Module):
    """``forward`` returns the causal-LM loss of the model it holds as ``m``."""

    def __init__(self, m: torch.nn.Module):
        super().__init__()
        self.m = m

    def forward(self, ids):
        return self.m(input_ids=ids, labels=ids).loss


class Outer(torch.nn.Module):
    """A wrapper of a wrapper: the model sits at ``inner.m``."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, ids):
        return self.inner(ids)


class RewardModel(torch.nn.Module):
    """A base model and a scalar head of the wrapper's own (kept whole on every rank),
    trained on pairs (rows 0, 1: chosen, rejected) with the Bradley-Terry loss."""

    def __init__(self, backbone: torch.nn.Module, hidden: int):
        super().__init__()
        self.backbone = backbone
        self.v_head = torch.nn.Linear(hidden, 1)

    def forward(self, ids):
        reward = self.v_head(self.backbone(input_ids=ids).last_hidden_state[:, -1]).squeeze(-1)
        return -torch.nn.functional.logsigmoid(reward[0::2] - reward[1::2]).mean()


class TiedHeadLM(torch.nn.Module):
    """A base model and a language-model head of the wrapper's own, tied to the base's
    token embedding (split over the vocabulary: the head follows it)."""

    def __init__(self, backbone: torch.nn.Module):
        super().__init__()
        self.backbone = backbone
        emb = backbone.get_input_embeddings()  # type: ignore[operator]
        self.head = torch.nn.Linear(emb.embedding_dim, emb.num_embeddings, bias=False)
        self.head.weight = emb.weight

    def forward(self, ids):
        logits = self.head(self.backbone(input_ids=ids).last_hidden_state)
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
        )


class GPTLoss(torch.nn.Module):
    """zeroshard's built-in GPT under a wrapper that shifts the targets."""

    def __init__(self):
        super().__init__()
        from zeroshard.models import GPT, GPTConfig

        torch.manual_seed(3)
        self.gpt = GPT(GPTConfig(vocab_size=V, seq_len=16, n_layer=2, n_head=4, d_model=32))

    def forward(self, ids):
        return self.gpt(ids[:, :-1], ids[:, 1:])


def llama(base: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

    torch.manual_seed(7)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=0, eos_token_id=1, pad_token_id=None, use_cache=False)  # fmt: skip
    return (LlamaModel if base else LlamaForCausalLM)(cfg).float()


def gpt2(base: bool = False):
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

    torch.manual_seed(5)
    cfg = GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=16, resid_pdrop=0,
                     embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=1, use_cache=False)  # fmt: skip
    return (GPT2Model if base else GPT2LMHeadModel)(cfg)


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(6)
    return MixtralForCausalLM(MixtralConfig(vocab_size=V, hidden_size=32, intermediate_size=32,
                                            num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2, num_local_experts=4,
                                            num_experts_per_tok=2, max_position_embeddings=64,
                                            use_cache=False, router_jitter_noise=0.0))  # fmt: skip


def lora(model, targets, **kw):
    """A peft LoRA model whose B is random (peft starts it at zero, which would leave
    A's gradient zero and the split of B untested)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(11)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **kw)
    return get_peft_model(model, cfg)


_LLAMA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_loss(m, ids):
    return m(input_ids=ids, labels=ids).loss


# name -> (build, loss(model, ids), names of parameters that must end up split)
CASES = {
    "llama_loss_wrapper": (lambda: LossWrapper(llama()), lambda m, x: m(x),
                           ["m.model.layers.0.self_attn.q_proj.weight", "m.lm_head.weight"]),
    "llama_lora": (lambda: lora(llama(), [*_LLAMA_ALL, "lm_head", "embed_tokens"]), _peft_loss,
                   ["base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight",
                    "base_model.model.model.layers.0.self_attn.o_proj.lora_A.default.weight",
                    "base_model.model.model.layers.1.mlp.down_proj.base_layer.weight",
                    "base_model.model.model.embed_tokens.base_layer.weight"]),
    # the head tied to wte, trained as a copy (peft's modules_to_save): both split alike
    "gpt2_lora": (lambda: lora(gpt2(), ["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True,
                               modules_to_save=["lm_head"]),
                  _peft_loss,
                  ["base_model.model.transformer.h.0.attn.c_attn.lora_B.default.weight",
                   "base_model.model.transformer.h.0.mlp.c_proj.lora_A.default.weight",
                   "base_model.model.lm_head.modules_to_save.default.weight",
                   "base_model.model.lm_head.original_module.weight"]),
    "gpt_wrapped": (GPTLoss, lambda m, x: m(x), ["gpt.blocks.0.attn.qkv.weight", "gpt.head.weight"]),
    "mixtral_nested": (lambda: Outer(LossWrapper(mixtral())), lambda m, x: m(x),
                       ["inner.m.model.layers.0.mlp.experts.gate_up_proj",
                        "inner.m.model.layers.1.self_attn.o_proj.weight"]),
    "mixtral_lora_nested": (lambda: Outer(LossWrapper(lora(mixtral(), ["q_proj", "o_proj"]))),
                            lambda m, x: m(x),
                            ["inner.m.base_model.model.model.layers.0.self_attn.q_proj"
                             ".lora_B.default.weight"]),
    "llama_reward_head": (lambda: RewardModel(llama(base=True), 32), lambda m, x: m(x),
                          ["backbone.layers.0.mlp.down_proj.weight"]),
    "gpt2_tied_head": (lambda: TiedHeadLM(gpt2(base=True)), lambda m, x: m(x),
                       ["head.weight", "backbone.h.1.attn.c_attn.weight"]),
    # Megatron-SP: B of the gathered lm_head splits and gathers like its base
    "llama_lora_sp": (lambda: lora(llama(), [*_LLAMA_ALL, "lm_head"]), _peft_loss,
                      ["base_model.model.lm_head.lora_B.default.weight",
                       "base_model.model.model.layers.0.mlp.up_proj.lora_B.default.weight"]),
    # the vocabulary stays split through the loss of the causal LM inside the PeftModel
    "llama_lora_loss_parallel": (lambda: lora(llama(), ["q_proj", "lm_head"]), _peft_loss,
                                 ["base_model.model.lm_head.lora_B.default.weight",
                                  "base_model.model.lm_head.base_layer.weight"]),
}  # fmt: skip
OPTIONS: dict[str, dict[str, Any]] = {
    "llama_lora_sp": {"sequence_parallel": True},
    "llama_lora_loss_parallel": {"loss_parallel": True},
}


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


def _apply_case(key: str, comm, vcomm) -> dict:
    build, loss_fn, must_split = CASES[key]
    ref = build().train()
    model = twin(ref)
    sharding = apply_tensor_parallel(model, comm, **OPTIONS.get(key, {}))
    # SGD: a step is linear in the gradient (Adam's would turn the round-off of a
    # near-zero LoRA gradient, 1e-8 against 1e-2, into a whole step of difference)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.002, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.002, momentum=0.9)
    worst = {"loss": 0.0, "grads": 0.0}
    for step in range(3):
        ids = _ids(step)
        loss_ref, loss = loss_fn(ref, ids), loss_fn(model, ids)
        loss_ref.backward()
        loss.backward()
        sync_partial_grads(model, comm)
        worst["loss"] = max(worst["loss"], abs(loss.item() - loss_ref.item()))
        worst["grads"] = max(worst["grads"], max(grad_diffs(ref, model, vcomm).values()))
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    return {
        **worst,
        "params": param_diffs(ref, model, vcomm),
        "missing": [n for n in must_split if n not in sharding.slices],
        "n_split": len(sharding.slices),
        "replicated": sorted(sharding.replicated),
    }


def _apply_cases(rank: int, world: int) -> dict:
    from zeroshard.distributed.comm import Comm

    comm, vcomm = Comm(), Comm()
    return cases.run_named((key, functools.partial(_apply_case, key, comm, vcomm)) for key in CASES)


@pytest.fixture(scope="module")
def applied():
    return multirank.run(_apply_cases, 2, timeout=600)


@pytest.mark.parametrize("key", list(CASES))
def test_wrapped_model_tp2_matches_unsplit(applied, key):
    for c in cases.values(applied, key):
        assert c["missing"] == [] and c["n_split"] > 0, c
        assert c["loss"] <= TOL and c["grads"] <= TOL and c["params"] <= TOL, c


def test_wrappers_own_head_is_kept_whole(applied):
    head = cases.values(applied, "llama_reward_head")[0]
    assert "v_head.weight" in head["replicated"]
    assert "v_head.bias" in head["replicated"]


# -- no processes ------------------------------------------------------------------------


def _fake_comm(t: int = 2):
    return types.SimpleNamespace(world_size=t, rank=0)


# -- 4 ranks: tp2 x dp2 through initialize ------------------------------------------------

DP, MICRO, STEPS = 2, 2, 3
ENGINE_CASES = [
    {"model": "llama_lora", "stage": 3, "clip": 0.5},
    {"model": "llama_reward_head", "stage": 3, "clip": 0.05},
    {"model": "gpt2_lora", "stage": 2, "offload": True},
    {"model": "mixtral_nested", "stage": 1, "clip": 0.5},
    {"model": "gpt2_tied_head", "stage": 0, "clip": 0.5},
]


def _config(case: dict, tp: bool, micro: int) -> dict:
    zc = {"stage": case["stage"], "stage3_param_persistence_threshold": 0}
    if case.get("offload"):
        zc["offload_optimizer"] = {"device": "cpu"}
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_clipping": case.get("clip", 0.0),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
        "zero_optimization": zc,
        "steps_per_print": 10**6,
    }
    if tp:
        cfg["tensor_parallel"] = {"autotp_size": 2}
    return cfg


def _batch(step: int) -> torch.Tensor:
    """The whole batch of a step (4 rows); each data-parallel rank takes its share."""
    return torch.randint(0, V, (MICRO * DP, S), generator=torch.Generator().manual_seed(100 + step))


def _reference(case: dict):
    build, loss_fn, _ = CASES[case["model"]]
    model = build()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    norms = []
    for step in range(STEPS):
        loss_fn(model, _batch(step)).backward()
        if case.get("clip"):
            norms.append(torch.nn.utils.clip_grad_norm_(params, case["clip"]).item())
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _engine(case: dict, tp: bool = True):
    import os

    import zeroshard
    from zeroshard.offload.staging import STAGE_ON_CPU_ENV

    model = CASES[case["model"]][0]()
    micro = MICRO * DP // (4 // (2 if tp else 1))  # one micro-batch per step
    os.environ[STAGE_ON_CPU_ENV] = "1" if case.get("offload") else "0"
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=_config(case, tp, micro)
    )
    os.environ.pop(STAGE_ON_CPU_ENV)
    return engine


def _steps(engine, case: dict, first: int, count: int) -> list[float]:
    loss_fn = CASES[case["model"]][1]
    dp, rows = engine.mesh.coord("dp"), MICRO * DP // engine.mesh.size("dp")
    norms = []
    for step in range(first, first + count):
        engine.backward(loss_fn(engine, _batch(step)[dp * rows : (dp + 1) * rows]))
        engine.step()
        norms.append(engine.get_global_grad_norm())
    return norms


def _engine_case(case: dict) -> dict:
    from tp_parity import whole_params as _whole

    ref, ref_norms = _reference(case)
    engine = _engine(case)
    norms = _steps(engine, case, 0, STEPS)
    got = _whole(engine)
    return {
        "param": max((got[n] - ref[n]).abs().max().item() for n in ref),
        "norm": max((abs(a - b) for a, b in zip(norms, ref_norms, strict=False)), default=0.0),
        "sizes": [engine.mesh.size(a) for a in ("dp", "tp")],
        "names": sorted(got) == sorted(ref),
    }


def _wrapped_checkpoint(rank: int, root: str) -> dict:
    """A peft LoRA Llama saved at tp2 x dp2 (ZeRO-3): the export holds whole tensors
    under the wrapper's global names; dp4 loads it bitwise and continues within 2e-5."""
    from safetensors.torch import load_file
    from tp_parity import whole_params as _whole

    from zeroshard.checkpoint.export import export_checkpoint

    case = {"model": "llama_lora", "stage": 3, "clip": 0.5}
    engine = _engine(case)
    _steps(engine, case, 0, 2)
    engine.save_checkpoint(root, tag="wrapped")
    saved = _whole(engine)
    _steps(engine, case, 2, 1)
    after = _whole(engine)
    out: dict[str, Any] = {}
    if rank == 0:
        export_checkpoint(f"{root}/wrapped", f"{root}/whole.safetensors")
        files = load_file(f"{root}/whole.safetensors")
        out["export_names"] = sorted(files) == sorted(saved)
        out["export"] = max((files[n].float() - saved[n]).abs().max().item() for n in saved)
    other = _engine({**case, "stage": 2}, tp=False)
    other.load_checkpoint(root, tag="wrapped")
    loaded = _whole(other)
    _steps(other, case, 2, 1)
    out["loaded"] = max((loaded[n] - saved[n]).abs().max().item() for n in saved)
    out["continued"] = max((_whole(other)[n] - after[n]).abs().max().item() for n in after)
    out["sizes"] = [other.mesh.size(a) for a in ("dp", "tp")]
    return out


def _engine_worker(rank: int, world: int, root: str) -> dict:
    return cases.run_named(
        [
            *((cases.label(c), functools.partial(_engine_case, c)) for c in ENGINE_CASES),
            ("checkpoint", lambda: _wrapped_checkpoint(rank, root)),
        ]
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return multirank.run(_engine_worker, 4, str(tmp_path_factory.mktemp("wrapped")), timeout=900)


@pytest.mark.parametrize("i", range(len(ENGINE_CASES)), ids=[str(c) for c in ENGINE_CASES])
def test_wrapped_model_tp2_dp2_matches_single_process(trained, i):
    for got in cases.values(trained, cases.label(ENGINE_CASES[i])):
        assert got["sizes"] == [2, 2] and got["names"], got
        assert got["param"] <= TOL and got["norm"] <= TOL, (ENGINE_CASES[i], got)


def test_wrapped_checkpoint_keeps_global_names(trained):
    for rank, c in enumerate(cases.values(trained, "checkpoint")):
        assert c["sizes"] == [4, 1], c
        assert c["loaded"] == 0.0 and c["continued"] <= TOL, c
        if rank == 0:
            assert c["export_names"] and c["export"] == 0.0, c


# -- refusals, no processes ------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.o_proj = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
        self.gate, self.fc2 = torch.nn.Linear(32, 4), torch.nn.Linear(32, 32)


class WithOwnBlocks(torch.nn.Module):
    """A known model, a head kept whole, and repeated blocks AutoTP has no plan for."""

    def __init__(self):
        super().__init__()
        self.m = llama(base=True)
        self.adapter = torch.nn.ModuleList([Block(), Block()])
        self.score = torch.nn.Linear(32, 1)


def _unchanged(model, fn):
    before = {n: p.clone() for n, p in model.state_dict().items()}
    types_before = [type(m) for m in model.modules()]
    fn()
    after = model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert [type(m) for m in model.modules()] == types_before


def test_names_every_layer_it_cannot_split_in_one_error():
    model = WithOwnBlocks()
    with pytest.raises(ValueError) as err:
        _unchanged(model, lambda: apply_tensor_parallel(model, _fake_comm()))
    msg = str(err.value)
    for name in ("adapter.*.q_proj", "adapter.*.o_proj", "adapter.*.gate", "adapter.*.fc2"):
        assert f"{name} (Linear" in msg and "2 layers" in msg, msg
    assert "score" not in msg and "m.layers" not in msg, msg  # kept whole / planned
    assert "LlamaModel at 'm'" in msg, msg
    # the suggested fix is DeepSpeed's name rule, and it is accepted as printed
    suggested = (
        "{'adapter.*.q_proj': 'column', 'adapter.*.o_proj': 'row', "
        "'adapter.*.gate': 'replicate', 'adapter.*.fc2': 'row'}"
    )
    assert f"tp_plan={suggested}" in msg, msg
    sharding = apply_tensor_parallel(
        WithOwnBlocks(), _fake_comm(), tp_plan=ast.literal_eval(suggested)
    )
    assert (
        "adapter.1.o_proj.weight" in sharding.slices
        and "adapter.1.gate.weight" in sharding.replicated
    )
    sharding = apply_tensor_parallel(model, _fake_comm(), tp_plan={"adapter.*": "replicate"})
    assert (
        "score.weight" in sharding.replicated and "adapter.0.q_proj.weight" in sharding.replicated
    )
    assert "m.layers.0.self_attn.q_proj.weight" in sharding.slices


def test_names_layers_a_known_models_plan_misses_and_models_without_plans():
    model = LossWrapper(llama())
    model.m.model.layers[0].mlp.extra = torch.nn.Linear(32, 32)  # type: ignore[index, union-attr]
    with pytest.raises(ValueError, match=r"split m\.model\.layers\.0\.mlp\.extra \(Linear"):
        _unchanged(model, lambda: apply_tensor_parallel(model, _fake_comm()))
    plain = LossWrapper(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)))
    with pytest.raises(
        ValueError, match=r"split m\.0 \(Linear \(8, 8\)\), m\.1 \(Linear \(8, 8\)\) \(no model"
    ):
        apply_tensor_parallel(plain, _fake_comm())


def test_refuses_peft_adapters_it_cannot_split_consistently():
    model = lora(llama(), ["q_proj"], use_dora=True)
    with pytest.raises(ValueError, match=r"q_proj: a LoRA variant \(DoRA, \.\.\.\) around a layer"):
        _unchanged(model, lambda: apply_tensor_parallel(model, _fake_comm()))
    experts = lora(mixtral(), [], target_parameters=["mlp.experts.gate_up_proj"])
    with pytest.raises(ValueError, match=r"experts: LoRA around a MixtralExperts split"):
        _unchanged(experts, lambda: apply_tensor_parallel(experts, _fake_comm()))


def test_refuses_sequence_parallel_with_parameters_of_the_wrapper():
    model = RewardModel(llama(base=True), 32)
    with pytest.raises(ValueError, match=r"own parameters \(v_head\.weight, v_head\.bias\)"):
        _unchanged(
            model, lambda: apply_tensor_parallel(model, _fake_comm(), sequence_parallel=True)
        )


def test_two_models_in_one_tree_both_split_and_loss_parallel_needs_one():
    pair = torch.nn.ModuleDict({"policy": llama(), "reference": llama()})  # e.g. DPO's pair
    sharding = apply_tensor_parallel(twin(pair), _fake_comm())
    for side in ("policy", "reference"):
        assert f"{side}.model.layers.1.mlp.gate_proj.weight" in sharding.slices
    with pytest.raises(ValueError, match=r"exactly one .*LlamaForCausalLM at 'policy', "):
        apply_tensor_parallel(pair, _fake_comm(), loss_parallel=True)


def test_plan_entries_are_named_from_the_root():
    model = LossWrapper(llama())
    with pytest.raises(ValueError, match=r"for LlamaForCausalLM at 'm' write 'm\.model\.layers"):
        _unchanged(
            model,
            lambda: apply_tensor_parallel(
                model, _fake_comm(), tp_plan={"model.layers.*.mlp.down_proj": "replicate"}
            ),
        )
    sharding = apply_tensor_parallel(
        model, _fake_comm(), tp_plan={"m.model.layers.*.mlp.down_proj": "replicate"}
    )
    assert "m.model.layers.1.mlp.down_proj.weight" in sharding.replicated
    assert "m.model.layers.1.mlp.up_proj.weight" in sharding.slices


def test_finds_the_model_inside_torch_compile():
    compiled = torch.compile(LossWrapper(llama()))  # OptimizedModule: names under _orig_mod.
    sharding = apply_tensor_parallel(compiled, _fake_comm())  # type: ignore[arg-type]  # torch types compile()'s result as a callable
    assert "_orig_mod.m.model.layers.0.self_attn.q_proj.weight" in sharding.slices
    assert sharding.slices["_orig_mod.m.lm_head.weight"].dim == 0
