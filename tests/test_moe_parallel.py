"""Expert parallelism on 4 gloo ranks (ep 2 x dp_shard 2), one spawn for every case:

* parity with one fp32 process (``moe_cases.reference``), drop_tokens off: a model built
  with ``deepspeed.moe.layer.MoE`` at ZeRO 0-3 (stage 2 with the optimizer offloaded)
  and a transformers Mixtral at ZeRO 1 and 3, with gradient clipping: losses, the
  global gradient norm (each parameter counted once) and every parameter (experts
  against the global experts each rank holds) within 2e-5;
* the ledger: all-to-all bytes on the ``ep`` axis per MoE layer and step equal
  ``2 * (rows sent + rows received) * hidden * 4 + 8 * experts`` (``dispatch.py``);
  expert gradients are reduce-scattered over ``expert_shard`` and dense ones over
  ``zero_shard``, each its own segments' bytes;
* memory: ``memory_stats()["experts"]`` at ep 2 against ep 1 on the same 4 ranks:
  parameters, gradients and optimizer states halve at stage 0; at stage 1 parameters
  and gradients halve (the optimizer shard is the same 1/N of all experts either way);
* refusals: expert parallelism with sequence parallelism, a MoE layer whose ep_size
  does not divide the data-parallel size.
"""

from __future__ import annotations

import functools
from typing import Any

import cases
import moe_cases as mc
import multirank
import pytest
import torch

WORLD, EP, STEPS = 4, 2, 3
CLIP = 0.05  # small enough that every step clips
PARITY: list[dict[str, Any]] = [
    {"kind": "ds", "stage": 0},
    {"kind": "ds", "stage": 1},
    {"kind": "ds", "stage": 2, "offload": True},
    {"kind": "ds", "stage": 3},
    {"kind": "hf", "stage": 1},
    {"kind": "hf", "stage": 3},
    # two losses, one step: a second backward after the boundary's reduction (stage 0
    # keeps the window's average as its local sums; stage 1 restates its chunk)
    {"kind": "ds", "stage": 0, "second": 50},
    {"kind": "ds", "stage": 1, "second": 50},
    # nothing persistent: the router's weight, read by its parent (TopKGate), is gathered
    # on access in forward and again for backward
    {"kind": "ds", "stage": 3, "persist": 0},
]


def _config(case: dict, ep: int = EP) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": case["stage"]}
    if case.get("offload"):
        zero["offload_optimizer"] = {"device": "cpu"}
    if "persist" in case:
        zero["stage3_param_persistence_threshold"] = case["persist"]
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": mc.LR, "weight_decay": 0.0}},
        "zero_optimization": zero,
        "gradient_clipping": case.get("clip", CLIP),
    }
    if case["kind"] == "hf":
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    return cfg


def _engine(case: dict, rank: int, ep: int = EP):
    import zeroshard

    if case["kind"] == "ds":
        model = mc.DSMoEModel(ep_size=ep, ep_rank=rank % ep)
    else:
        model = mc.tiny_mixtral()
    engine, *_ = zeroshard.initialize(model=model, config=_config(case, ep))
    return engine


def _local_params(engine) -> dict[str, torch.Tensor]:
    from zeroshard.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _name(case: dict) -> str:
    return (
        f"{case['kind']}-z{case['stage']}"
        + ("-two-losses" if case.get("second") else "")
        + ("-nothing-persistent" if "persist" in case else "")
    )


def _parity(rank: int, world: int, case: dict) -> dict:
    second = case.get("second", 0)
    ref_losses, ref_norms, ref = mc.reference(case["kind"], world, STEPS, CLIP, second)
    engine = _engine(case, rank)
    losses, norms = [], []
    for step in range(STEPS):
        loss = mc.loss_of(engine, case["kind"], step, rank)
        engine.backward(loss)
        if second:
            more = mc.loss_of(engine, case["kind"], step + second, rank)
            engine.backward(more)
            loss = loss + more
        engine.step()
        losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    diff = mc.diff_to_reference(engine.module, _local_params(engine), ref)
    moved = max(
        (ref[n] - t).abs().max().item() for n, t in mc.reference(case["kind"], world, 0)[2].items()
    )
    engine.destroy()
    return {"losses": losses, "ref_losses": ref_losses, "norms": norms,
            "ref_norms": ref_norms, "diff": diff, "moved": moved}  # fmt: skip


def _ledger(rank: int, world: int, kind: str) -> dict:
    """One training step of the model at stage 1: the ep axis' all-to-all bytes
    against the formula from the rows each layer exchanged."""
    from zeroshard.moe.hf import ExpertParallelExperts
    from zeroshard.moe.layer import MOELayer

    case = {"kind": kind, "stage": 1, "clip": 0.0}
    engine = _engine(case, rank)
    engine.reset_comm_stats()
    loss = mc.loss_of(engine, kind, 0, rank)
    engine.backward(loss)
    engine.step()
    axes = engine.comm_stats(by_axis=True)
    layers = [
        m for m in engine.module.modules() if isinstance(m, (MOELayer, ExpertParallelExperts))
    ]
    hidden = mc.H if kind == "ds" else 16
    formula = sum(
        2 * (m.rows_sent + m.rows_received) * hidden * 4 + 8 * m.num_experts for m in layers
    )
    segs = engine.flat.layout.segments
    out = {
        "a2a": axes["ep"]["all_to_all"]["bytes"],
        "formula": formula,
        "a2a_calls": axes["ep"]["all_to_all"]["calls"],
        "layers": len(layers),
        "expert_rs": axes["expert_shard"]["reduce_scatter"]["bytes"],
        "expert_segments": sum(s.numel * 4 for s in segs if s.kind),
        "dense_rs": axes["zero_shard"]["reduce_scatter"]["bytes"],
        "dense_segments": sum(s.numel * 4 for s in segs if not s.kind),
    }
    engine.destroy()
    return out


def _memory(rank: int, world: int) -> dict:
    out = {}
    for stage in (0, 1):
        for ep in (1, EP):
            engine = _engine({"kind": "ds", "stage": stage}, rank, ep=ep)
            loss = mc.loss_of(engine, "ds", 0, rank)
            engine.backward(loss)
            engine.step()
            out[f"{stage}/{ep}"] = engine.memory_stats()["experts"]
            engine.destroy()
    return out


def _refusals(rank: int, world: int) -> dict:
    import zeroshard
    from zeroshard.moe.layer import MoE

    out = {}
    cfg = _config({"kind": "ds", "stage": 1}) | {"sequence_parallel_size": 2}
    cfg["train_micro_batch_size_per_gpu"] = 2
    too_wide = torch.nn.Sequential(MoE(mc.H, torch.nn.Linear(mc.H, mc.H), num_experts=8, ep_size=8))
    for name, model, config in (
        ("sp", mc.DSMoEModel(ep_size=2, ep_rank=rank % 2), cfg),
        ("ep8", too_wide, _config({"kind": "ds", "stage": 1})),
    ):
        try:
            zeroshard.initialize(model=model, config=config)
            out[name] = "accepted"
        except zeroshard.ZeroshardError as exc:
            out[name] = str(exc)
    return out


LEDGER = ("ds", "hf")


def _worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    return cases.run_named(
        [
            *((_name(c), functools.partial(_parity, rank, world, c)) for c in PARITY),
            *((f"ledger {k}", functools.partial(_ledger, rank, world, k)) for k in LEDGER),
            ("memory", lambda: _memory(rank, world)),
            ("refusals", lambda: _refusals(rank, world)),
        ]
    )


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return multirank.run(_worker, WORLD, timeout=900)


@pytest.mark.parametrize("i", range(len(PARITY)), ids=[_name(c) for c in PARITY])
def test_parity_with_one_process(results, i: int) -> None:
    per_rank = cases.values(results, _name(PARITY[i]))
    losses = [sum(r["losses"][s] for r in per_rank) / WORLD for s in range(STEPS)]
    ref = per_rank[0]
    assert max(abs(a - b) for a, b in zip(losses, ref["ref_losses"], strict=True)) < mc.TOL
    for r in per_rank:  # the norm every rank reports is the whole model's, pre-clip
        assert max(abs(a - b) for a, b in zip(r["norms"], ref["ref_norms"], strict=True)) < mc.TOL
    assert max(r["diff"] for r in per_rank) < mc.TOL
    assert ref["moved"] > 100 * mc.TOL  # training moved the parameters: a lost step fails


def _check_ledger(kind: str, per_rank: list) -> None:
    for got in per_rank:
        assert got["layers"] == 2
        assert got["a2a"] == got["formula"], (kind, got)
        # per layer: forward counts + rows out + rows back, backward rows twice
        assert got["a2a_calls"] == 5 * got["layers"], (kind, got)
        assert got["expert_rs"] == got["expert_segments"] > 0, (kind, got)
        assert got["dense_rs"] == got["dense_segments"] > 0, (kind, got)


def test_ledger_matches_the_formula(results, subtests: pytest.Subtests) -> None:
    cases.check_each(subtests, results, _check_ledger, names=[f"ledger {k}" for k in LEDGER])


def test_expert_bytes_fall_by_ep(results) -> None:
    for m in cases.values(results, "memory"):
        for kind in ("params", "grads", "optimizer_states"):
            assert m["0/1"][kind] == EP * m["0/2"][kind] > 0, (kind, m)
        for kind in ("params", "grads"):
            assert m["1/1"][kind] == EP * m["1/2"][kind] > 0, (kind, m)


def test_refused_by_name(results) -> None:
    for refusals in cases.values(results, "refusals"):
        assert "sequence_parallel_size with expert parallelism" in refusals["sp"]
        assert "does not divide the data-parallel size (4" in refusals["ep8"]
