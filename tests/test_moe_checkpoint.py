"""Checkpoints of expert-parallel models keep global expert names, on 4 gloo ranks in
one spawn:

* a ``deepspeed.moe.layer.MoE`` model saved at ep 2 (ZeRO 1 and 3) loads at ep 1 and at
  ep 4: the loaded parameters are the saved global ones, and one more training step
  from the load matches the saving engine's own next step (optimizer states came too);
* a transformers Mixtral saved at ep 2 (its fused expert tensors recorded as an ``ep``
  split) loads at ep 4 and into the stock model (expert parallelism off);
* ``zeroshard convert`` writes each expert once, under its global name and shape, and the
  file loads into the unsplit model; so does ``save_16bit_model``; the consolidated
  state dict written by ``save_pretrained`` loads into the stock Mixtral with
  ``from_pretrained``.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import cases
import moe_cases as mc
import multirank
import pytest
import torch

WORLD = 4


def _engine(kind: str, stage: int, ep: int, rank: int):
    import zeroshard

    cfg: dict = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": mc.LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage},
    }
    if kind == "ds":
        model = mc.DSMoEModel(ep_size=ep, ep_rank=rank % ep)
    else:
        model = mc.tiny_mixtral()
        if ep > 0:
            cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    return engine


def _step(engine, kind: str, step: int, rank: int) -> None:
    loss = mc.loss_of(engine, kind, step, rank)
    engine.backward(loss)
    engine.step()


def _whole(engine) -> dict[str, torch.Tensor]:
    """Every global tensor of the engine (rank 0; other ranks: empty)."""
    return dict(engine._zero3_consolidated_16bit_state_dict())


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:6]
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _save_and_load(rank: int, tmp: str, kind: str, stage: int, loads: tuple) -> dict:
    """Save at ep 2 and load at each ep of ``loads``: per load (rank 0), the loaded
    parameters against the saved ones and one more step against the saver's."""
    out: dict = {}
    saver = _engine(kind, stage, 2, rank)
    for step in range(2):
        _step(saver, kind, step, rank)
    path = os.path.join(tmp, f"{kind}{stage}")
    saver.save_checkpoint(path, tag="t")
    saved = _whole(saver)
    _step(saver, kind, 2, rank)
    after = _whole(saver)
    if kind == "hf" and stage == 1:
        saver.save_16bit_model(os.path.join(tmp, "16bit"), "model.safetensors")
        if rank == 0:
            saver.module.save_pretrained(os.path.join(tmp, "pretrained"), state_dict=after)
        out["after_hf"] = {k: v.tolist() for k, v in after.items()} if rank == 0 else None
    if kind == "ds" and stage == 1:
        saver.save_16bit_model(os.path.join(tmp, "16bit_ds"), "model.safetensors")
        out["after_ds"] = {k: v.tolist() for k, v in after.items()} if rank == 0 else None
    saver.destroy()
    for ep in loads:
        loader = _engine(kind, stage, ep, rank)
        loader.load_checkpoint(path, tag="t")
        loaded = _whole(loader)
        _step(loader, kind, 2, rank)
        again = _whole(loader)
        if rank == 0:
            out[f"{kind}{stage}->ep{ep}"] = (_diff(loaded, saved), _diff(again, after))
        loader.destroy()
    return out


SAVES = (("ds", 1, (1, 4)), ("ds", 3, (1, 4)), ("hf", 1, (4, 0)))


def _worker(rank: int, world: int, tmp: str) -> dict:
    return cases.run_named(
        (f"{kind}{stage}", functools.partial(_save_and_load, rank, tmp, kind, stage, loads))
        for kind, stage, loads in SAVES
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[list[dict], str]:
    tmp = str(tmp_path_factory.mktemp("moe_ckpt"))
    return multirank.run(_worker, WORLD, tmp, timeout=900), tmp


def test_ep2_save_loads_at_other_ep_sizes(results, subtests: pytest.Subtests) -> None:
    def check(name: str, per_rank: list) -> None:
        out = per_rank[0]
        checked = [k for k in out if "->" in k]
        assert len(checked) == 2, checked
        for key in checked:
            loaded, continued = out[key]
            assert loaded == 0.0, (key, loaded)  # fp32 masters: exact
            assert continued < mc.TOL, (key, continued)

    cases.check_each(subtests, results[0], check, names=[f"{k}{s}" for k, s, _ in SAVES])


def test_convert_and_16bit_write_each_expert_once(results) -> None:
    from safetensors.torch import load_file

    tmp = results[1]
    for kind, ckpt, sixteen in (("ds", "ds1", "16bit_ds"), ("hf", "hf1", "16bit")):
        out = cases.values(results[0], ckpt)[0]
        dest = os.path.join(tmp, f"{kind}-converted.safetensors")
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        done = subprocess.run(
            [sys.executable, "-m", "zeroshard.tools.cli", "convert", os.path.join(tmp, ckpt), dest],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        converted = load_file(dest)
        model = mc.DSMoEModel() if kind == "ds" else mc.tiny_mixtral()
        want = {k: v.shape for k, v in model.state_dict().items()}
        assert {k: v.shape for k, v in converted.items()} == want  # global names, once each
        model.load_state_dict(converted)
        written = load_file(os.path.join(tmp, sixteen, "model.safetensors"))
        assert {k: v.shape for k, v in written.items()} == want
        after = {k: torch.tensor(v) for k, v in out[f"after_{kind}"].items()}
        assert _diff(written, after) == 0.0


def test_save_pretrained_loads_into_the_stock_model(results) -> None:
    import transformers

    out, tmp = cases.values(results[0], "hf1")[0], results[1]
    stock = transformers.MixtralForCausalLM.from_pretrained(os.path.join(tmp, "pretrained"))
    after = {k: torch.tensor(v) for k, v in out["after_hf"].items()}
    assert _diff({k: v for k, v in stock.state_dict().items()}, after) == 0.0
    assert stock.model.layers[0].mlp.experts.gate_up_proj.shape[0] == mc.EXPERTS
