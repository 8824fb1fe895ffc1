"""Expert parallelism composed with the other axes, on 4 gloo ranks in one spawn, each
against one fp32 process:

* ep 2 x tp 2: a transformers Mixtral, its attention and dense layers split by AutoTP,
  its experts split over ep and whole within each tensor-parallel rank (ZeRO 1 and 3);
* pp 2 x ep 2: a PipelineModule with MoE layers (1F1B, gradient clipping; ZeRO 1 and 3);
* ep 2 x dp 2 at ZeRO 3 with parameters and optimizer offloaded to CPU, to NVMe swap
  files, and with the model built under ``zero.Init``;
* refused by name: experts split by tensor parallelism
  (``expert_parallel.expert_tensor_parallel_size``).
"""

from __future__ import annotations

import functools
from typing import Any

import cases
import moe_cases as mc
import multirank
import pytest
import torch

WORLD, STEPS, CLIP = 4, 3, 0.05


def _opt() -> dict[str, Any]:
    return {"type": "AdamW", "params": {"lr": mc.LR, "weight_decay": 0.0}}


def _local(engine) -> dict[str, torch.Tensor]:
    from zeroshard.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _train(engine, kind: str, index: int, world: int) -> dict:
    """STEPS steps of ``moe_cases``' data for batch ``index``; the losses, the
    one-process reference's, and the largest parameter difference to it."""
    losses = []
    for step in range(STEPS):
        loss = mc.loss_of(engine, kind, step, index)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    ref_losses, _, ref = mc.reference(kind, world, STEPS)
    diff = mc.diff_to_reference(engine.module, _local(engine), ref)
    return {"losses": losses, "ref_losses": ref_losses, "diff": diff}


def _tp(rank: int, stage: int) -> dict:
    import zeroshard

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": _opt(),
        "zero_optimization": {"stage": stage},
        "tensor_parallel": {"autotp_size": 2},
        "expert_parallel": {"enabled": True, "autoep_size": 2},
    }
    engine, *_ = zeroshard.initialize(model=mc.tiny_mixtral(), config=cfg)
    dp, ndp = engine.mesh.coord("dp"), engine.mesh.size("dp")
    trained = _train(engine, "hf", dp, ndp)
    split = sum(1 for p in engine.module.parameters() if hasattr(p, "zeroshard_tp_slice"))
    out = {
        **trained,
        "mesh": engine.mesh.describe(),
        "tp_split": split,
        "dp": dp,
    }
    engine.destroy()
    return out


def _pipe(rank: int, stage: int) -> dict:
    import zeroshard
    from zeroshard.moe.marks import global_names
    from zeroshard.parallel.pipeline.engine import PipelineEngine

    gas = 2

    def batch(step: int, i: int):
        g = torch.Generator().manual_seed(1000 * step + i)
        return torch.randn(2, mc.TOKENS, mc.H, generator=g), torch.randint(
            0, mc.H, (2,), generator=g
        )

    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "optimizer": _opt(),
        "zero_optimization": {"stage": stage},
        "gradient_clipping": CLIP,
    }
    engine, *_ = zeroshard.initialize(model=mc.pipe_model(2, 2, rank % 2), config=cfg)
    assert isinstance(engine, PipelineEngine)
    dp, ndp = engine.mesh.coord("dp"), engine.mesh.size("dp")
    losses = [
        float(engine.train_batch(iter([batch(s, dp * gas + i) for i in range(gas)])))
        for s in range(STEPS)
    ]
    torch.manual_seed(0)
    ref = mc.pipe_model(1, 1, 0)
    opt = torch.optim.AdamW(ref.parameters(), lr=mc.LR, weight_decay=0.0)
    ref_losses = []
    for s in range(STEPS):
        n, total = gas * ndp, 0.0
        for i in range(n):
            x, y = batch(s, i)
            loss = mc.pipe_loss(ref(x), y) / n
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        ref_losses.append(total)
    want = dict(ref.named_parameters())
    names = global_names(engine.module)
    local = _local(engine)
    diff = max((t - want[names.get(n, n)]).abs().max().item() for n, t in local.items())
    out = {"losses": losses, "ref_losses": ref_losses, "diff": diff, "mesh": engine.mesh.describe()}
    engine.destroy()
    return out


def _offload(rank: int, device: str = "cpu") -> dict:
    import tempfile

    import zeroshard

    where: dict[str, Any] = {"device": device}
    if device == "nvme":
        where["nvme_path"] = tempfile.mkdtemp(prefix=f"zs-moe-nvme-{rank}-")
    zero = {"stage": 3, "offload_param": where, "offload_optimizer": where}
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": _opt(), "zero_optimization": zero}
    model = mc.DSMoEModel(ep_size=2, ep_rank=rank % 2)
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    out = {
        **_train(engine, "ds", rank, WORLD),
        "cpu": engine.memory_stats()["by_location"].get("cpu", 0),
    }
    engine.destroy()
    return out


def _zero_init(rank: int) -> dict:
    """A MoE model built under zero.Init (its expert copies come out whole, the dense
    parameters sharded at construction) trains as one built without it."""
    import zeroshard

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": _opt(),
        "zero_optimization": {"stage": 3},
    }
    with zeroshard.zero.Init(config_dict_or_path=cfg):
        model = mc.DSMoEModel(ep_size=2, ep_rank=rank % 2)
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    out = _train(engine, "ds", rank, WORLD)
    engine.destroy()
    return out


def _refusals(rank: int) -> dict:
    import zeroshard

    out = {}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": _opt(),
        "zero_optimization": {"stage": 1},
    }
    etp = {**cfg, "expert_parallel": {"enabled": True, "expert_tensor_parallel_size": 2}}
    for name, config in (("etp", etp),):
        try:
            zeroshard.initialize(model=mc.tiny_mixtral(), config=config)
            out[name] = "accepted"
        except zeroshard.ZeroshardError as exc:
            out[name] = str(exc)
    return out


def _worker(rank: int, world: int) -> dict:
    return cases.run_named(
        [
            *((f"tp z{stage}", functools.partial(_tp, rank, stage)) for stage in (1, 3)),
            *((f"pipe z{stage}", functools.partial(_pipe, rank, stage)) for stage in (1, 3)),
            ("offload", lambda: _offload(rank)),
            ("offload_nvme", lambda: _offload(rank, "nvme")),
            ("zero_init", lambda: _zero_init(rank)),
            ("refusals", lambda: _refusals(rank)),
        ]
    )


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return multirank.run(_worker, WORLD, timeout=900)


def _losses_match(per_rank: list[dict], groups: int) -> float:
    """Max gap between the reference's losses and the mean over data-parallel ranks."""
    seen: dict[int, list[float]] = {}
    for r in per_rank:
        seen.setdefault(r.get("dp", 0), r["losses"])
    mean = [sum(v[s] for v in seen.values()) / len(seen) for s in range(STEPS)]
    assert len(seen) == groups
    return max(abs(a - b) for a, b in zip(mean, per_rank[0]["ref_losses"], strict=True))


@pytest.mark.parametrize("stage", ["z1", "z3"])
def test_ep_with_tensor_parallel_dense_layers(results, stage: str) -> None:
    per_rank = cases.values(results, f"tp {stage}")
    assert per_rank[0]["mesh"] == "ep2 x tp2" and per_rank[0]["tp_split"] > 0
    assert _losses_match(per_rank, 2) < mc.TOL
    assert max(r["diff"] for r in per_rank) < mc.TOL


@pytest.mark.parametrize("stage", ["z1", "z3"])
def test_ep_with_pipeline_stages(results, stage: str) -> None:
    per_rank = cases.values(results, f"pipe {stage}")
    assert per_rank[0]["mesh"] == "pp2 x ep2"
    for r in per_rank:  # the pipeline engine reports the batch's mean loss on every rank
        assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"], strict=True)) < mc.TOL
        assert r["diff"] < mc.TOL


@pytest.mark.parametrize("case", ["offload", "offload_nvme", "zero_init"])
def test_ep_with_zero3_offload_and_zero_init(results, case: str) -> None:
    per_rank = cases.values(results, case)
    mean = [sum(r["losses"][s] for r in per_rank) / WORLD for s in range(STEPS)]
    assert max(abs(a - b) for a, b in zip(mean, per_rank[0]["ref_losses"], strict=True)) < mc.TOL
    assert max(r["diff"] for r in per_rank) < mc.TOL


def test_refused_by_name(results) -> None:
    for refusals in cases.values(results, "refusals"):
        assert "expert_parallel.expert_tensor_parallel_size" in refusals["etp"], refusals
