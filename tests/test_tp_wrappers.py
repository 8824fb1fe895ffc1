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

import types

import multirank
import pytest
import torch
from tp_parity import TOL, grad_diffs, param_diffs, twin

from zeroshard.parallel.autotp import apply_tensor_parallel, sync_partial_grads

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
        emb = backbone.get_input_embeddings()
        self.head = torch.nn.Linear(emb.embedding_dim, emb.num_embeddings, bias=False)
        self.head.weight = emb.weight

    def forward(self, ids):
        logits = self.head(self.backbone(input_ids=ids).last_hidden_state)
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
        )


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
    "gpt2_lora": (lambda: lora(gpt2(), ["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True),
                  _peft_loss,
                  ["base_model.model.transformer.h.0.attn.c_attn.lora_B.default.weight",
                   "base_model.model.transformer.h.0.mlp.c_proj.lora_A.default.weight"]),
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
}  # fmt: skip


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


def _apply_cases(rank: int, world: int) -> dict:
    from zeroshard.comm import Comm

    comm, vcomm, out = Comm(), Comm(), {}
    for key, (build, loss_fn, must_split) in CASES.items():
        ref = build().train()
        model = twin(ref)
        sharding = apply_tensor_parallel(model, comm)
        # SGD: a step is linear in the gradient (Adam's would turn the round-off of a
        # near-zero LoRA gradient, 1e-8 against 1e-2, into a whole step of difference)
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.02, momentum=0.9)
        opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
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
        out[key] = {
            **worst,
            "params": param_diffs(ref, model, vcomm),
            "missing": [n for n in must_split if n not in sharding.slices],
            "n_split": len(sharding.slices),
            "replicated": sorted(sharding.replicated),
        }
    return out


@pytest.fixture(scope="module")
def applied():
    return multirank.run(_apply_cases, 2, timeout=600)


@pytest.mark.parametrize("key", list(CASES))
def test_wrapped_model_tp2_matches_unsplit(applied, key):
    for r in applied:
        c = r[key]
        assert c["missing"] == [] and c["n_split"] > 0, c
        assert c["loss"] <= TOL and c["grads"] <= TOL and c["params"] <= TOL, c


def test_wrappers_own_head_is_kept_whole(applied):
    assert "v_head.weight" in applied[0]["llama_reward_head"]["replicated"]
    assert "v_head.bias" in applied[0]["llama_reward_head"]["replicated"]


# -- no processes ------------------------------------------------------------------------


def _fake_comm(t: int = 2):
    return types.SimpleNamespace(world_size=t, rank=0)
