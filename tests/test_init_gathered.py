"""Parameters built under ``zero.Init`` before ``initialize`` (issue 13, part 3), on 2
ranks in one spawn: reading one outside a gather raises an error naming it (it used to
read freed memory and crash); ``GatheredParameters`` gathers them, ``modifier_rank=r``
writes rank r's values into every rank's slice (``None``: nothing is written back);
then ``initialize`` and training match a single-process reference. The same for
Hugging Face ``from_pretrained`` under ZeRO-3, which loads the checkpoint exactly that
way (rank 0 writes inside ``GatheredParameters(..., modifier_rank=0)``)."""

from __future__ import annotations

import sys
import types
from typing import Any

import cases
import multirank
import pytest
import torch

TOL = 2e-5


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def _gpt(seed: int):
    from zeroshard.models import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32))


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
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


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    return GPT2LMHeadModel(cfg)


def _gpt_loss(model, ids):
    return model(ids[:, :-1], ids[:, 1:])


def _hf_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _train(model, ref, forward, stage, rank, world, steps=3) -> tuple[float, float]:
    """initialize ``model`` (this rank's rows) and train ``ref`` on all rows; return
    the largest loss and parameter differences."""
    import zeroshard

    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=_config(stage)
    )
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
    loss_diff = 0.0
    for step in range(steps):
        ids = torch.randint(0, 64, (2 * world, 16), generator=torch.Generator().manual_seed(step))
        loss = forward(engine, ids[2 * rank : 2 * rank + 2])
        engine.backward(loss)
        engine.step()
        ref_loss = forward(ref, ids)
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        loss_diff = max(loss_diff, abs(total.item() / world - ref_loss.item()))
    with zeroshard.zero.GatheredParameters(list(model.parameters())):
        diff = max(
            (p.detach() - q.detach()).abs().max().item()
            for p, q in zip(model.parameters(), ref.parameters(), strict=True)
        )
    engine.destroy()
    return loss_diff, diff


def _plain(rank, world) -> dict:
    import zeroshard
    from zeroshard.zero import GatheredParameters
    from zeroshard.zero.params.hooks import PartitionedParameterError
    from zeroshard.zero.params.init import sealing_init

    out: dict[str, Any] = {}
    eager = _gpt(5)
    torch.manual_seed(5)
    with zeroshard.zero.Init() as init:
        model = _gpt(5)
    params = dict(model.named_parameters())
    name, w = next(iter(params.items()))
    # outside a gather: metadata and aliases are fine, reading raises naming the parameter
    out["shape_kept"] = all(params[n].shape == p.shape for n, p in eager.named_parameters())
    sd = model.state_dict()
    out["state_dict_keys"] = sorted(sd) == sorted(eager.state_dict())
    errors = []
    ids = torch.randint(0, 64, (2, 16))
    for use in (
        lambda: w.sum(),
        lambda: repr(w),
        lambda: w.data.float().mean(),
        lambda: sd[name] * 2,
        lambda: w[0].clone(),
        lambda: _gpt_loss(model, ids),
    ):
        try:
            use()
            errors.append("no error")
        except PartitionedParameterError as exc:
            errors.append(str(exc))
    try:  # moving it would read it; a move to where it already is does not
        model.to(torch.float64)
        errors.append("no error")
    except PartitionedParameterError as exc:
        errors.append(str(exc))
    out["errors"] = errors
    out["name"] = name
    out["noop_to"] = model.to("cpu").float() is model and type(w) is not torch.nn.Parameter

    # modifier_rank=None: gathered values are the whole tensors; writes are dropped
    with GatheredParameters(list(model.parameters())):
        out["gathered_equal"] = all(
            torch.equal(params[n].detach(), p.detach()) for n, p in eager.named_parameters()
        )
        out["alias_reads"] = torch.equal(sd[name], eager.state_dict()[name])
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    with GatheredParameters(list(model.parameters())):
        out["none_dropped"] = all(
            torch.equal(params[n].detach(), p.detach()) for n, p in eager.named_parameters()
        )

    # modifier_rank=0: rank 0 loads a checkpoint, rank 1 writes garbage that must not win
    src = _gpt(7)
    with GatheredParameters(list(model.parameters()), modifier_rank=0):
        if rank == 0:
            model.load_state_dict(src.state_dict())
        else:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(-3.0)
    # every rank's slice now holds its part of rank 0's values
    slices_ok = True
    for n, p in src.named_parameters():
        entry = init.entry(params[n])
        c = entry.shard.numel()
        flat = p.detach().reshape(-1)[rank * c : (rank + 1) * c]
        slices_ok &= torch.equal(entry.shard[: flat.numel()], flat)
    out["slices_rank0"] = bool(slices_ok)
    # modifier_rank=1, nested blocks: rank 1's write to one parameter lands everywhere
    b = params["blocks.0.attn.qkv.bias"]
    with GatheredParameters([w], modifier_rank=0):
        with GatheredParameters([w, b], modifier_rank=1):
            if rank == 1:
                with torch.no_grad():
                    b.add_(0.5)
        out["outer_still_whole"] = torch.equal(w.detach(), src.state_dict()[name])
    expected = {n: p.detach().clone() for n, p in src.state_dict().items()}
    bname = next(n for n, p in params.items() if p is b)
    expected[bname] += 0.5
    with GatheredParameters(list(model.parameters())):
        out["after_writes"] = all(
            torch.equal(p.detach(), expected[n]) for n, p in model.named_parameters()
        )
    out["still_sealed"] = sealing_init(w) is init

    # then initialize (stage 3) and train: parity with the single-process reference
    ref = _gpt(0)
    ref.load_state_dict(expected)
    out["z3"] = _train(model, ref, _gpt_loss, 3, rank, world)
    out["handed_over"] = sealing_init(w) is None

    # stage 1 takes a zero.Init model over as plain, whole parameters
    torch.manual_seed(5)
    with zeroshard.zero.Init():
        model1 = _gpt(5)
    with GatheredParameters(list(model1.parameters()), modifier_rank=0):
        if rank == 0:
            model1.load_state_dict(src.state_dict())
    ref1 = _gpt(0)
    ref1.load_state_dict(src.state_dict())
    out["z1"] = _train(model1, ref1, _gpt_loss, 1, rank, world)
    out["z1_plain"] = all(type(p) is torch.nn.Parameter for p in model1.parameters())
    return out


def _deepspeed_shim():
    """What transformers' ZeRO-3 loading reaches for in ``deepspeed``, mapped onto
    zeroshard, so this test does not depend on the alias package (issue 13, part 4)."""
    import torch.distributed as dist

    import zeroshard

    ds: Any = types.ModuleType("deepspeed")
    ds.zero = zeroshard.zero
    ds.comm = types.SimpleNamespace(get_rank=dist.get_rank)
    acc: Any = types.ModuleType("deepspeed.accelerator")
    acc.get_accelerator = lambda: types.SimpleNamespace(current_device_name=lambda: "cpu")
    ds.accelerator = acc
    # transformers' prevent_arange_dtype_change() swaps this hook (zero.Init here patches
    # no constructor, so there is nothing to wrap)
    pp: Any = types.ModuleType("deepspeed.runtime.zero.partition_parameters")
    pp.zero_wrapper_for_fp_tensor_constructor = lambda fn, *args, **kwargs: fn
    pp._orig_torch_arange = torch.arange
    zero_pkg: Any = types.ModuleType("deepspeed.runtime.zero")
    zero_pkg.partition_parameters = pp
    runtime: Any = types.ModuleType("deepspeed.runtime")
    runtime.zero = zero_pkg
    ds.runtime = runtime
    for mod in (ds, acc, runtime, zero_pkg, pp):
        mod.__path__ = []  # importable as packages
        sys.modules.setdefault(mod.__name__, mod)


class _Zero3:
    def __init__(self) -> None:
        self.config = {"zero_optimization": {"stage": 3}}

    def is_zero3(self) -> bool:
        return True


def _hf(rank, world, path) -> dict:
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM
    from transformers.integrations import deepspeed as hf_ds

    from zeroshard.zero import GatheredParameters
    from zeroshard.zero.params.init import is_sealed

    _deepspeed_shim()
    out: dict[str, Any] = {}
    flag = _Zero3()
    hf_ds.set_hf_deepspeed_config(flag)
    try:
        model = LlamaForCausalLM.from_pretrained(path)
    finally:
        hf_ds.unset_hf_deepspeed_config()
    saved = load_file(f"{path}/model.safetensors")
    params = dict(model.named_parameters())
    out["sealed"] = all(is_sealed(p) for p in params.values())
    with GatheredParameters(list(params.values())):
        out["loaded_equal"] = all(torch.equal(params[k].detach(), v) for k, v in saved.items())
        out["loaded_keys"] = sorted(set(saved) - set(params))
    ref = LlamaForCausalLM.from_pretrained(path)  # no ZeRO-3: the plain load
    out["z3"] = _train(model, ref, _hf_loss, 3, rank, world, steps=2)

    # GPT-2 ties its output embedding to the input one
    from transformers import GPT2LMHeadModel

    hf_ds.set_hf_deepspeed_config(flag)
    try:
        gpt2 = GPT2LMHeadModel.from_pretrained(f"{path}-gpt2")
    finally:
        hf_ds.unset_hf_deepspeed_config()
    saved = load_file(f"{path}-gpt2/model.safetensors")
    params = dict(gpt2.named_parameters())
    with GatheredParameters(list(params.values())):
        out["gpt2_equal"] = all(torch.equal(params[k].detach(), v) for k, v in saved.items())
    out["gpt2_tied"] = gpt2.lm_head.weight is gpt2.transformer.wte.weight
    return out


def _all(rank, world, path) -> dict:
    return cases.run_named(
        [("plain", lambda: _plain(rank, world)), ("hf", lambda: _hf(rank, world, path))]
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from transformers import LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(3)
    LlamaForCausalLM(_llama_config()).save_pretrained(path)
    _gpt2().save_pretrained(f"{path}-gpt2")
    return multirank.run(_all, 2, str(path), timeout=300)


def test_reading_outside_a_gather_raises_naming_the_parameter(results):
    for p in cases.values(results, "plain"):
        assert p["shape_kept"] and p["state_dict_keys"]
        assert len(p["errors"]) == 7 and p["noop_to"]
        for msg in p["errors"]:
            assert p["name"] in msg and "GatheredParameters" in msg and "zero.Init" in msg, msg


def test_gathered_parameters_before_initialize(results):
    for p in cases.values(results, "plain"):
        assert p["gathered_equal"] and p["alias_reads"]
        assert p["none_dropped"], "modifier_rank=None must not write back"
        assert p["slices_rank0"], "rank 0's values must land in every rank's slice"
        assert p["outer_still_whole"] and p["after_writes"]
        assert p["still_sealed"] and p["handed_over"]
        assert p["z1_plain"]


@pytest.mark.parametrize("stage", ["z3", "z1"])
def test_then_initialize_trains_like_the_reference(results, stage):
    for p in cases.values(results, "plain"):
        loss_diff, param_diff = p[stage]
        assert loss_diff <= TOL and param_diff <= TOL, (loss_diff, param_diff)


def test_from_pretrained_under_zero3(results):
    for h in cases.values(results, "hf"):
        assert h["sealed"] and h["loaded_equal"] and h["loaded_keys"] == []
        assert h["gpt2_equal"] and h["gpt2_tied"]
        loss_diff, param_diff = h["z3"]
        assert loss_diff <= TOL and param_diff <= TOL, (loss_diff, param_diff)
