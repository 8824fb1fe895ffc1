"""Activation checkpointing and offload (zeroshard.checkpointing): gradients equal the
plain run with dropout on, memory actually drops, the DeepSpeed config section is
honoured. Single process except the engine test (one rank)."""

from __future__ import annotations

import copy
import logging

import multirank
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zeroshard import checkpointing
from zeroshard.checkpointing import (
    apply_activation_checkpointing,
    apply_activation_offload,
    checkpoint,
    configure,
)
from zeroshard.memory import ActivationTracker, activation_bytes
from zeroshard.models import GPT, Block, GPTConfig

TOL = 1e-6


@pytest.fixture(autouse=True)
def _defaults():
    checkpointing.reset()
    yield
    checkpointing.reset()


class Spy:
    """Counts (and records the shapes of) what goes through the offload pack/unpack."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.packed: list[tuple[int, ...]] = []
        self.unpacked = 0
        to_host, to_device = checkpointing._to_host, checkpointing._to_device

        def pack(t):
            self.packed.append(tuple(t.shape))
            return to_host(t)

        def unpack(p):
            self.unpacked += 1
            return to_device(p)

        monkeypatch.setattr(checkpointing, "_to_host", pack)
        monkeypatch.setattr(checkpointing, "_to_device", unpack)


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


# -- checkpoint() -------------------------------------------------------------------------
def _fn_with_dropout(w1: torch.Tensor, w2: torch.Tensor):
    def fn(x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.tanh(x @ w1), p=0.5, training=True)
        return F.dropout(F.gelu(h @ w2), p=0.3, training=True)

    return fn


def _grads_of(run, seed: int = 7) -> list[torch.Tensor]:
    torch.manual_seed(0)
    w1 = torch.randn(16, 32, requires_grad=True)
    w2 = torch.randn(32, 16, requires_grad=True)
    x = torch.randn(8, 16, requires_grad=True)
    torch.manual_seed(seed)
    run(_fn_with_dropout(w1, w2), x * 1.0).square().sum().backward()
    return [w1.grad, w2.grad, x.grad]


def test_checkpoint_with_dropout_matches_plain() -> None:
    plain = _grads_of(lambda fn, x: fn(x))
    ckpt = _grads_of(lambda fn, x: checkpoint(fn, x))
    assert _max_diff(plain, ckpt) <= TOL
    # the check can fail: a recompute that draws fresh dropout masks is caught
    fresh = _grads_of(
        lambda fn, x: torch.utils.checkpoint.checkpoint(
            fn, x, use_reentrant=False, preserve_rng_state=False
        )
    )
    assert _max_diff(plain, fresh) > 1e-2


def _gpt(dropout: float = 0.1, preset: str = "tiny", seq: int = 32) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset(preset, seq_len=seq, dropout=dropout))


def _gpt_grads(model: GPT, ids: torch.Tensor, seed: int = 3) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("offload", [False, True], ids=["kept", "offloaded"])
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_gpt_gradients_equal_with_dropout(policy: str, offload: bool) -> None:
    ref = _gpt(dropout=0.1)
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    loss0, g0 = _gpt_grads(ref, ids)
    _, g_other_seed = _gpt_grads(ref, ids, seed=4)
    assert _max_diff(g0, g_other_seed) > 1e-3  # dropout is on: masks change the gradients
    model = copy.deepcopy(ref)
    assert apply_activation_checkpointing(model, Block, policy, offload=offload) == 2
    loss1, g1 = _gpt_grads(model, ids)
    assert abs(loss0 - loss1) <= TOL
    assert _max_diff(g0, g1) <= TOL


# -- memory ---------------------------------------------------------------------------------
SEQ, BATCH = 256, 2


def _activation_memory(policy: str) -> tuple[int, int, GPTConfig]:
    """(bytes kept for backward when forward ends, peak over forward + backward)."""
    model = _gpt(dropout=0.0, preset="small", seq=SEQ)
    if policy != "none":
        apply_activation_checkpointing(model, Block, policy)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # gradient buffers exist, as in the engine
    ids = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    grads = [p.grad for p in model.parameters()]
    with ActivationTracker(exclude=[*model.parameters(), *grads, x, y]) as tracker:
        loss = model(x, y)
        kept = tracker.current
        loss.backward()
    return kept, tracker.peak, model.cfg


def test_checkpointing_reduces_activation_memory() -> None:
    kept, peak = {}, {}
    for policy in ("none", "selective", "full"):
        kept[policy], peak[policy], cfg = _activation_memory(policy)
    assert kept["full"] < kept["selective"] < kept["none"]
    assert peak["full"] < peak["selective"] < peak["none"]
    # by the expected factor: what the estimator says is kept (within 5%)
    for policy, measured in kept.items():
        expected = activation_bytes(
            layers=cfg.n_layer,
            hidden=cfg.d_model,
            seq=SEQ,
            micro_batch=BATCH,
            vocab=cfg.vocab_size,
            policy=policy,
            peak=False,
        )
        assert abs(measured - expected) <= 0.05 * measured, (policy, measured, expected)
    assert kept["none"] / kept["full"] > 6 and kept["none"] / kept["selective"] > 1.4


# -- offload ------------------------------------------------------------------------------
def test_offload_is_per_block_and_covers_selective_kept_matmuls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spy = Spy(monkeypatch)
    ref = _gpt(dropout=0.1)
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    _, g0 = _gpt_grads(ref, ids)
    model = copy.deepcopy(ref)
    n = apply_activation_checkpointing(
        model, lambda name, m: name == "blocks.0", "selective", offload=True
    )
    assert n == 1
    _, g1 = _gpt_grads(model, ids)
    assert _max_diff(g0, g1) <= TOL
    b, s, h = 2, 32, model.cfg.d_model
    # block 0 only: its input, then the outputs of qkv, attention projection, MLP up and
    # down projections (addmm on the flattened tokens)
    assert spy.packed == [(b, s, h), (b * s, 3 * h), (b * s, h), (b * s, 4 * h), (b * s, h)]
    assert spy.unpacked >= 2  # the input and the kept outputs the recompute needed


def test_offload_without_recompute(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch)
    ref = _gpt(dropout=0.1)
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    _, g0 = _gpt_grads(ref, ids)
    model = copy.deepcopy(ref)
    assert apply_activation_offload(model, lambda name, m: name == "blocks.1") == 1
    _, g1 = _gpt_grads(model, ids)
    assert _max_diff(g0, g1) <= TOL
    assert len(spy.packed) >= 10 and spy.unpacked == len(spy.packed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_moves_to_pinned_host_memory_on_cuda() -> None:
    x = torch.randn(4, 8, device="cuda")
    packed = checkpointing._to_host(x)
    dev, host = packed
    assert host.device.type == "cpu" and host.is_pinned() and dev == x.device
    assert torch.equal(checkpointing._to_device(packed), x)
    ref = _gpt(dropout=0.1).cuda()
    ids = torch.randint(0, 256, (2, 33), device="cuda")
    _, g0 = _gpt_grads(ref, ids)
    model = copy.deepcopy(ref)
    apply_activation_checkpointing(model, Block, "selective", offload=True)
    _, g1 = _gpt_grads(model, ids)
    assert _max_diff(g0, g1) <= TOL


# -- configure(): DeepSpeed's activation_checkpointing section --------------------------------
def test_cpu_checkpointing_offloads_checkpoint_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch)
    plain = _grads_of(lambda fn, x: checkpoint(fn, x))
    assert spy.packed == []  # default: nothing offloaded
    configure(deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True}})
    assert checkpointing.settings().cpu_checkpointing
    offloaded = _grads_of(lambda fn, x: checkpoint(fn, x))
    assert spy.packed == [(8, 16)] and spy.unpacked == 1  # the input, out and back
    assert _max_diff(plain, offloaded) <= TOL


def test_configure_reads_the_section_and_explicit_arguments_win(tmp_path, caplog) -> None:
    path = tmp_path / "ds.json"
    path.write_text(
        '{"train_batch_size": 8, "activation_checkpointing": {"partition_activations": true,'
        ' "contiguous_memory_optimization": true, "number_checkpoints": 4,'
        ' "synchronize_checkpoint_boundary": true}}'
    )
    with caplog.at_level(logging.WARNING, logger="zeroshard.checkpointing"):
        configure(deepspeed_config=str(path), checkpoint_in_cpu=True, num_checkpoints=6)
    s = checkpointing.settings()
    assert s.partition_activations and s.contiguous_memory_optimization
    assert s.cpu_checkpointing and s.synchronize_checkpoint_boundary
    assert s.number_checkpoints == 6
    assert "partition_activations has no effect" in caplog.text
    configure(checkpoint_in_cpu=False)  # without a config: from the defaults
    assert checkpointing.settings() == checkpointing.Settings()


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"num_checkpoints": 0}, ValueError),
        ({"num_checkpoints": 2.5}, ValueError),
        ({"num_checkpoints": True}, ValueError),
        ({"contiguous_checkpointing": True, "num_checkpoints": 2}, ValueError),
        ({"partition_activations": True, "contiguous_checkpointing": True}, ValueError),
    ],
)
def test_configure_validates(kwargs: dict, error: type) -> None:
    with pytest.raises(error):
        configure(**kwargs)
    assert checkpointing.settings() == checkpointing.Settings()  # unchanged


def test_partition_with_model_parallelism_is_refused() -> None:
    class MPU:
        def get_model_parallel_world_size(self) -> int:
            return 2

    with pytest.raises(NotImplementedError):
        configure(MPU(), partition_activations=True)


def test_profile_logs_checkpoint_time(caplog) -> None:
    configure(profile=True, synchronize=True)
    with caplog.at_level(logging.INFO, logger="zeroshard.checkpointing"):
        _grads_of(lambda fn, x: checkpoint(fn, x))
    assert "checkpoint" in caplog.text and "ms" in caplog.text


class _Net(nn.Module):
    """Calls checkpoint() in its forward, as Megatron calls deepspeed.checkpointing."""

    def __init__(self, use_checkpoint: bool) -> None:
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def _layer(self, i: int):
        def run(x):
            return F.dropout(torch.tanh(self.layers[i](x)), p=0.3, training=self.training)

        return run

    def forward(self, x):
        for i in range(len(self.layers)):
            x = checkpoint(self._layer(i), x) if self.use_checkpoint else self._layer(i)(x)
        return x.square().mean()


def _engine_applies_section(rank: int, world: int) -> dict:
    import zeroshard

    packed = []
    to_host = checkpointing._to_host
    checkpointing._to_host = lambda t: (packed.append(tuple(t.shape)), to_host(t))[1]
    weights = []
    for use in (False, True):
        torch.manual_seed(0)
        model = _Net(use)
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
            "zero_optimization": {"stage": 1},
        }
        if use:
            config["activation_checkpointing"] = {
                "cpu_checkpointing": True,
                "partition_activations": True,
                "contiguous_memory_optimization": True,
                "number_checkpoints": 3,
            }
        engine, *_ = zeroshard.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        torch.manual_seed(1)
        x = torch.randn(4, 16)
        torch.manual_seed(2)
        engine.backward(engine(x))
        engine.step()
        weights.append([p.detach().clone() for p in model.parameters()])
    s = checkpointing.settings()
    return {
        "packed": packed,
        "settings": [s.cpu_checkpointing, s.partition_activations, s.number_checkpoints],
        "diff": _max_diff(*weights),
    }


def test_engine_applies_the_config_section() -> None:
    (r,) = multirank.run(_engine_applies_section, 1, timeout=120)
    assert r["settings"] == [True, True, 3]
    assert r["packed"] == [[4, 16]] * 3  # each checkpoint's input went through the offload
    assert r["diff"] <= TOL
