"""``deepspeed.utils.zero_to_fp32`` on zeroshard checkpoints (integrations/zero_to_fp32.py).

Two ranks train a small model with tied weights and a frozen layer at stages 2 and 3 in
bf16 and save; the fp32 state dict read back must equal the fp32 masters bit for bit
(gathered on the ranks through GatheredParameters before they are cast: the masters
are what the checkpoint holds), tied names must share one tensor, frozen parameters
keep their saved dtype, and loading into the live engine restores the saved values
and keeps it training. One spawn covers both stages.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from multirank import run
from torch import nn

from zeroshard.compat.zero_to_fp32 import (
    LazyTensor,
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
    main,
)
from zeroshard.zero.optim.memory_store import MemoryStates


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 6)
        self.mid = nn.Linear(6, 6)
        self.out = nn.Linear(6, 6)
        self.out.weight = self.mid.weight  # tied
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.tensor([2.0]))

    def forward(self, x):
        return self.out(self.mid(self.emb(x)) + self.frozen(x)) * self.scale


def _masters(engine) -> dict[str, list[float]]:
    """Every trainable parameter's fp32 master, whole (via the checkpoint's reader of
    this rank's shards would be circular: read the optimizer's masters directly)."""
    flat = engine.flat
    out = {}
    names = {id(p): n for n, p in engine.module.named_parameters()}
    masters = engine.optimizer.states.masters
    whole = torch.zeros(flat.layout.total_numel)
    for piece in flat.layout.pieces(flat.rank):
        seg = flat.layout.segments[piece.segment]
        lo = piece.shard_lo - seg.shard_start
        chunk = masters[piece.segment][lo : lo + piece.numel]
        start = flat.layout.param_range(piece.param)[0] + piece.param_lo
        whole[start : start + piece.numel] = chunk.float()
    torch.distributed.all_reduce(whole)
    for i, p in enumerate(flat.params):
        if flat.group_of[i] >= 0:
            lo, hi = flat.layout.param_range(i)
            out[names[id(p)]] = whole[lo:hi].tolist()
    return out


def _train_save_load(rank: int, world: int, root: str) -> dict:
    import zeroshard
    from zeroshard.zero import GatheredParameters

    results = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        model = Tied()
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
        }
        engine, *_ = zeroshard.initialize(model=model, config=config)
        torch.manual_seed(rank)
        for _ in range(2):
            loss = engine(torch.randn(2, 6)).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
        masters = _masters(engine)
        # DeepSpeed's name for them (transformers checks their dtype)
        assert engine.optimizer is not None
        states = engine.optimizer.states
        assert isinstance(states, MemoryStates)  # masters in memory (no NVMe)
        flat32 = engine.optimizer.fp32_partitioned_groups_flat
        exposed = {
            "dtypes": sorted({str(t.dtype) for t in flat32}),
            "same_storage": all(
                a.data_ptr() == b.data_ptr() for a, b in zip(flat32, states.masters, strict=True)
            ),
            "numel": sum(t.numel() for t in flat32) == engine.flat.layout.shard_numel,
        }
        ckpt = os.path.join(root, f"stage{stage}")
        engine.save_checkpoint(ckpt)
        with GatheredParameters(list(model.parameters())):
            saved = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        loss = engine(torch.randn(2, 6)).float().pow(2).mean()  # move away from the save
        engine.backward(loss)
        engine.step()
        load_state_dict_from_zero_checkpoint(engine.module, ckpt)  # collective
        with GatheredParameters(list(model.parameters())):
            back = {
                n: torch.equal(p.detach().float(), saved[n]) for n, p in model.named_parameters()
            }
        loss = engine(torch.randn(2, 6)).float().pow(2).mean()  # it keeps training
        engine.backward(loss)
        engine.step()
        results[stage] = {
            "masters": masters,
            "restored": back,
            "finite": bool(loss.isfinite()),
            "exposed": exposed,
        }
        engine.destroy()
    return results


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("z2f"))
    return root, run(_train_save_load, 2, root)[0]


@pytest.mark.parametrize("stage", [2, 3])
def test_fp32_state_dict_is_the_masters(saved, stage: int) -> None:
    root, results = saved
    ckpt = os.path.join(root, f"stage{stage}")
    sd = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    masters = results[str(stage)]["masters"]
    assert set(masters) <= set(sd) and masters
    for name, values in masters.items():
        assert sd[name].dtype == torch.float32
        assert torch.equal(sd[name].reshape(-1), torch.tensor(values)), name
    assert sd["out.weight"] is sd["mid.weight"]  # tied names share one tensor
    assert sd["frozen.weight"].dtype == torch.bfloat16  # frozen: as saved
    assert "scale" in sd  # buffers too
    assert set(get_fp32_state_dict_from_zero_checkpoint(ckpt, tag=None)) == set(sd)
    with open(os.path.join(ckpt, "latest")) as f:
        tag = f.read().strip()
    assert set(get_fp32_state_dict_from_zero_checkpoint(ckpt, tag=tag)) == set(sd)
    lean = get_fp32_state_dict_from_zero_checkpoint(ckpt, exclude_frozen_parameters=True)
    assert "frozen.weight" not in lean and "emb.weight" in lean
    lazy = get_fp32_state_dict_from_zero_checkpoint(ckpt, lazy_mode=True)
    assert isinstance(lazy["emb.weight"], LazyTensor) and lazy["out.weight"] is lazy["mid.weight"]
    assert lazy["emb.weight"].shape == (6, 6)
    assert torch.equal(lazy["emb.weight"].contiguous(), sd["emb.weight"])
    r = results[str(stage)]
    assert all(r["restored"].values()) and r["finite"], r["restored"]
    assert r["exposed"] == {"dtypes": ["torch.float32"], "same_storage": True, "numel": True}


def test_load_into_a_plain_model_and_convert(saved, tmp_path, caplog) -> None:
    root, _ = saved
    ckpt = os.path.join(root, "stage3")
    sd = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    model = load_state_dict_from_zero_checkpoint(Tied(), ckpt)
    assert torch.equal(model.emb.weight, sd["emb.weight"]) and model.out.weight is model.mid.weight
    with caplog.at_level(logging.WARNING, logger="zeroshard"):
        files = convert_zero_checkpoint_to_fp32_state_dict(ckpt, str(tmp_path / "out"))
    assert "zeroshard writes model.safetensors instead" in caplog.text
    assert [os.path.basename(f) for f in files] == ["model.safetensors"]
    assert not any(f.endswith((".bin", ".pt")) for f in os.listdir(tmp_path / "out"))
    from safetensors.torch import load_file

    weights = load_file(files[0])
    assert set(weights) == set(sd) and all(torch.equal(weights[k], sd[k]) for k in sd)
    shards = convert_zero_checkpoint_to_fp32_state_dict(
        ckpt, str(tmp_path / "sharded"), max_shard_size="200B", safe_serialization=True
    )
    assert len(shards) > 1
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(sd)
    assert main([ckpt, str(tmp_path / "script"), "--max_shard_size", "5GB"]) == 0
    assert os.listdir(tmp_path / "script") == ["model.safetensors"]


def test_bad_input_is_named(saved, tmp_path) -> None:
    from zeroshard.checkpoint.format import CheckpointError

    root, _ = saved
    with pytest.raises(CheckpointError, match="no 'latest' file"):
        get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match="tag"):
        get_fp32_state_dict_from_zero_checkpoint(os.path.join(root, "stage2"), tag="../x")
    assert main([str(tmp_path), str(tmp_path / "o")]) == 2
