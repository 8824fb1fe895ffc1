"""``zero.Init`` makes parameters in the config's 16-bit dtype (``config_dict_or_path``'s
``bf16`` / ``fp16`` section) or in ``dtype=``, as DeepSpeed's does, with the numbers of
the usual construction: a model built under ``Init(dtype=bf16)`` equals, bit for bit, the
same model built without it (same seed) and then cast to bf16 (initializers draw in the
dtype the code chose, and only the kept slice is cast). Two ranks, one spawn.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from multirank import run

from zeroshard.config import ConfigError
from zeroshard.zero.params.init import config_dtype


def _gpt(seed: int):
    from zeroshard.models import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32))


class TruncInit(torch.nn.Module):
    """A layer initialized with trunc_normal_, whose in-place steps round differently in
    bf16 than in fp32 (ViT-style models use it)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(32, 64)
        torch.nn.init.trunc_normal_(self.proj.weight, std=0.02)


def _model(seed: int):
    torch.manual_seed(seed)
    trunc = TruncInit()
    return torch.nn.ModuleDict({"gpt": _gpt(seed + 1), "trunc": trunc})


def _whole(model) -> dict[str, torch.Tensor]:
    from zeroshard.zero import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _built(rank: int, world: int, path: str) -> dict:
    import zeroshard
    from zeroshard.zero import Init

    out: dict = {}
    cases: dict[str, dict[str, Any]] = {
        "dtype_bf16": {"dtype": torch.bfloat16},
        "config_bf16": {"config_dict_or_path": {"bf16": {"enabled": True}}},
        "config_fp16_path": {"config_dict_or_path": path},
        "config_auto": {"config_dict_or_path": {"bf16": {"enabled": "auto"}}},
        "no_config": {},
    }
    for name, kwargs in cases.items():
        with Init(**kwargs):
            model = _model(7)
        dtypes = sorted({str(p.dtype) for p in model.parameters()})
        whole = _whole(model)
        ref = _model(7)
        target = next(iter(whole.values())).dtype
        same = all(torch.equal(whole[n], p.detach().to(target)) for n, p in ref.named_parameters())
        out[name] = {"dtypes": dtypes, "equal_to_cast_reference": same}
    # the bf16 model trains at stage 3 under a bf16 config
    with Init(config_dict_or_path={"bf16": {"enabled": True}}):
        model = _gpt(7)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zeroshard.initialize(model=model, config=config)
    torch.manual_seed(rank)
    ids = torch.randint(0, 64, (2, 16))
    loss = engine(ids, ids)
    engine.backward(loss)
    engine.step()
    out["trains"] = bool(torch.isfinite(loss))
    engine.destroy()
    return out


def test_init_dtype_and_numerics(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"fp16": {"enabled": True}, "bf16": {"enabled": False}}))
    res = run(_built, 2, str(path))
    assert res[0] == res[1]
    r = res[0]
    assert r["dtype_bf16"] == {"dtypes": ["torch.bfloat16"], "equal_to_cast_reference": True}
    assert r["config_bf16"] == {"dtypes": ["torch.bfloat16"], "equal_to_cast_reference": True}
    assert r["config_fp16_path"] == {"dtypes": ["torch.float16"], "equal_to_cast_reference": True}
    # "auto" not filled in yet, or no config: the dtype the code chose
    assert r["config_auto"] == {"dtypes": ["torch.float32"], "equal_to_cast_reference": True}
    assert r["no_config"] == {"dtypes": ["torch.float32"], "equal_to_cast_reference": True}
    assert r["trains"]


def test_config_dtype_reading(tmp_path) -> None:
    assert config_dtype({"bf16": {"enabled": True}}) is torch.bfloat16
    assert config_dtype({"bfloat16": {"enabled": True}}) is torch.bfloat16
    assert config_dtype({"fp16": {"enabled": True}, "bf16": {"enabled": False}}) is torch.float16
    assert config_dtype({"fp16": {"enabled": "auto"}}) is None
    assert config_dtype({"zero_optimization": {"stage": 3}}) is None
    with pytest.raises(ConfigError, match="both true"):
        config_dtype({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    with pytest.raises(ConfigError, match="config file not found"):
        config_dtype(str(tmp_path / "missing.json"))
    from zeroshard.zero import Init

    with pytest.raises(ValueError, match="same argument"):
        Init(config={"bf16": {"enabled": True}}, config_dict_or_path={})
