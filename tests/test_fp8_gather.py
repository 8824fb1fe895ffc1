"""The fp8 all-gather of ZeRO-3 weights (``fp8.enable_fsdp_float8_all_gather``) on 2 gloo
ranks, one spawn: every run against the same run gathering bf16 weights.

The bound is zero. The fp8 matmul casts the whole bf16 weight with one tensorwise scale
from its amax; the fp8 all-gather takes the same amax (the max of the shards' amaxes, an
exact reduction) before the cast, and the cast is elementwise, so the cast of a shard is
the shard of the cast, bit for bit; the matmul then runs the same ``torch._scaled_mm``
on the same operands (``scaled_mm.py`` is torchao's numerics, tests/test_fp8.py checks
it bitwise). The model has no Linear biases, so both runs lay parameters out in the
same units (an fp8 weight is alone in its unit either way): the gradient reductions,
the clipping norm and Adam see the same numbers in the same order. Losses and the fp32
masters must therefore be equal, not close; a run whose gather or matmul differs by one
rounding anywhere fails.

The ledger: with no reuse or prefetch, each fp8 Linear weight is gathered once in
forward and once for backward per step, so the all-gather bytes fall by exactly
``2 x (elements of those weights)`` a step (2 bytes a element to 1), and each of those
gathers adds one all-reduce of one float32 amax (8 bytes as the ledger counts an
all-reduce). Without the feature the bytes stay equal and the test fails.

With the default ``stage3_param_persistence_threshold`` the bf16 run packs small weights
into persistent units while the fp8 run lays each fp8 weight out alone: without clipping
the runs are still equal; with clipping the global norm sums its pieces in another order
(round-off, which fp8 rounding then amplifies), so the cases here set the threshold to 0.
Also checked: GatheredParameters outside the passes gives the bf16 values; inside the
weight's forward it and any read of the weight's values are refused by name, as is
``engine.compile()``, and the engine trains on afterwards; a model with no weight it can
gather in fp8 is refused.
"""

from __future__ import annotations

import os
from typing import Any

import multirank
import pytest
import torch

pytest.importorskip(
    "torchao", reason="torchao is not installed (optional: pip install 'zeroshard[fp8]')"
)

STEPS = 3
PLAIN = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}  # fmt: skip


def _model() -> Any:
    from zeroshard.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, bias=False))


def _config(case: dict, gather: bool) -> dict:
    zero = {"stage": 3, "reduce_scatter": True, **case.get("zero", {})}
    if case.get("offload"):
        zero |= {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    if case.get("nvme"):  # the shard in a swap file (a directory per run)
        zero |= {"offload_param": {"device": "nvme", "nvme_path": f"{case['nvme']}-{gather}"}}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": case.get("gas", 1),
        "gradient_clipping": case.get("clip", 0.0),
        "bf16": {"enabled": True},
        "data_types": {"grad_accum_dtype": "fp32"},
        "fp8": {"enabled": True, "enable_fsdp_float8_all_gather": gather},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "steps_per_print": 10**6,
    }


def _train(case: dict, gather: bool, rank: int, root: str) -> dict[str, Any]:
    import zeroshard
    from zeroshard.checkpoint.export import open_checkpoint
    from zeroshard.checkpointing import checkpoint

    model = _model()
    if case.get("before"):  # accelerate's fp8: torchao converts first, weights wrapped for FSDP2
        from zeroshard.fp8 import torchao_float8

        f8 = torchao_float8()
        cfg = f8.Float8LinearConfig(pad_inner_dim=True, enable_fsdp_float8_all_gather=True)
        f8.convert_to_float8_training(model, config=cfg, module_filter_fn=lambda m, fqn: fqn != "head")  # fmt: skip
    if case.get("ac"):
        for block in model.blocks:
            block.forward = lambda *a, _f=block.forward: checkpoint(_f, *a)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=_config(case, gather))  # fmt: skip
    losses, ledger = [], []
    gas = case.get("gas", 1)
    for step in range(STEPS):
        engine.reset_comm_stats()
        for m in range(gas):
            g = torch.Generator().manual_seed(100 * step + 10 * m + rank)
            x = torch.randint(0, 64, (2, 17), generator=g)
            loss = engine(x[:, :-1], x[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(loss.float().item())
        stats = engine.comm_stats()
        ledger.append({op: stats[op] for op in ("all_gather", "all_reduce") if op in stats})
    path = os.path.join(root, f"{case['name']}-{gather}")
    engine.save_checkpoint(path, tag="t")
    entries, fetch, _ = open_checkpoint(os.path.join(path, "t"))
    masters = {name: fetch(name).float() for name, _, _ in entries}
    out: dict[str, Any] = {"losses": losses, "ledger": ledger, "engine": engine, "model": model}
    out["masters"] = masters
    return out


def _gathered_weight_checks(engine: Any) -> dict[str, Any]:
    """Outside the passes, GatheredParameters gives an fp8-gathered weight's bf16 values
    (the masters'); inside its forward the weight's values are refused by name; so is
    engine.compile() (not built with the fp8 all-gather)."""
    from zeroshard import NotBuiltError, UsageError
    from zeroshard.zero import GatheredParameters

    try:
        engine.compile(backend="eager")
        compiled = "accepted"
    except NotBuiltError as err:
        compiled = str(err)

    layer = engine.module.blocks[0].mlp.fc
    with GatheredParameters([layer.weight]):
        value = layer.weight.detach().float().clone()
    refused, inside = "", ""

    def peek(module, args):
        nonlocal inside
        try:
            with GatheredParameters([module.weight]):
                pass
        except UsageError as err:
            inside = str(err)
        module.weight.sum()

    handle = layer.register_forward_pre_hook(peek)
    try:
        x = torch.zeros(2, 17, dtype=torch.long)
        engine(x[:, :-1], x[:, 1:])
    except Exception as err:  # the class and text are checked
        refused = f"{type(err).__name__}: {err}"
    handle.remove()
    engine.module.zero_grad(set_to_none=True)
    # after both refusals the engine still trains (the uses they took are dropped)
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(7))
    engine.backward(engine(x[:, :-1], x[:, 1:]))
    engine.step()
    return {"fc_weight": value, "refused": refused, "inside": inside, "compile": compiled}


def _no_eligible_layer(rank: int) -> str:
    """A model whose only Linear layer's weight is tied to an embedding: refused by name."""
    import zeroshard

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(64, 32)
            self.head = torch.nn.Linear(32, 64, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            return self.head(self.emb(x)).float().mean()

    model = Tied()
    try:
        zeroshard.initialize(model=model, model_parameters=model.parameters(), config=_config({}, True))  # fmt: skip
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "accepted"


def _worker(rank: int, world: int, root: str) -> dict[str, Any]:
    model = _model()
    fp8_weights = sum(
        m.weight.numel()
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n != "head"  # head: tied to tok_emb
    )
    out: dict[str, Any] = {"fp8_weights": fp8_weights, "fp8_layers": 4 * 2}
    cases: list[dict[str, Any]] = [
        {"name": "plain", "zero": PLAIN},
        {
            "name": "composed",
            "gas": 2,
            "clip": 0.05,
            "ac": True,
            "offload": True,
            "zero": {"stage3_param_persistence_threshold": 0},
        },
        {"name": "nvme", "nvme": os.path.join(root, "swap"), "zero": PLAIN},
        {"name": "before", "before": True, "zero": PLAIN},
    ]
    for case in cases:
        runs = {}
        for gather in (False, True):
            run = _train(case, gather, rank, root)
            engine, model = run.pop("engine"), run.pop("model")
            if gather and case["name"] == "plain":
                got = _gathered_weight_checks(engine)
                master = run["masters"]["blocks.0.mlp.fc.weight"].bfloat16().float()
                out["gathered"] = {"is_master": torch.equal(got.pop("fc_weight"), master), **got}
            engine.destroy()
            # destroy() gave every layer its own forward back (those converted before too)
            run["patched"] = [n for n, m in model.named_modules() if "forward" in m.__dict__ and "Linear" in type(m).__name__]  # fmt: skip
            runs[gather] = run
        out[case["name"]] = {
            "losses_equal": runs[False]["losses"] == runs[True]["losses"],
            "losses": runs[True]["losses"],
            "masters_equal": all(
                torch.equal(runs[False]["masters"][n], t) for n, t in runs[True]["masters"].items()
            ),
            "ledger": [runs[g]["ledger"] for g in (False, True)],
            "patched": runs[True]["patched"],
        }
    out["no_eligible"] = _no_eligible_layer(rank)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict[str, Any]]:
    return multirank.run(_worker, 2, str(tmp_path_factory.mktemp("fp8g")), timeout=600)


@pytest.mark.parametrize("case", ["plain", "composed", "nvme", "before"])
def test_fp8_all_gather_trains_bitwise_as_the_bf16_gather(results, case: str) -> None:
    """plain: no reuse, prefetch or persistent units; composed: gradient accumulation,
    clipping, activation checkpointing, optimizer and parameters offloaded to the CPU,
    the default prefetch and reuse; nvme: the parameter shard in a swap file; before:
    the Linear layers converted by torchao before initialize() (accelerate's fp8, weights
    wrapped for FSDP2's fp8 all-gather), with the same bytes saved."""
    for r in results:
        got = r[case]
        assert got["losses_equal"] and got["masters_equal"], got["losses"]
        assert got["patched"] == []
        assert all(0 < loss < 10 for loss in got["losses"])


def test_ledger_all_gather_bytes_of_fp8_weights_halve(results) -> None:
    for r in results:
        saved, layers = 2 * r["fp8_weights"], r["fp8_layers"]
        for bf16, fp8 in zip(*r["plain"]["ledger"], strict=True):
            assert fp8["all_gather"]["calls"] == bf16["all_gather"]["calls"]
            # 2 bytes per element -> 1, for a forward and a backward gather of each weight
            assert bf16["all_gather"]["bytes"] - fp8["all_gather"]["bytes"] == saved
            amax = fp8["all_reduce"]["calls"] - bf16.get("all_reduce", {"calls": 0})["calls"]
            amax_bytes = fp8["all_reduce"]["bytes"] - bf16.get("all_reduce", {"bytes": 0})["bytes"]  # fmt: skip
            assert (amax, amax_bytes) == (2 * layers, 2 * layers * 8)
        for bf16, fp8 in zip(*r["before"]["ledger"], strict=True):
            assert bf16["all_gather"]["bytes"] - fp8["all_gather"]["bytes"] == saved
        composed = r["composed"]["ledger"]
        for bf16, fp8 in zip(*composed, strict=True):
            assert fp8["all_gather"]["bytes"] < bf16["all_gather"]["bytes"]


def test_weight_values_outside_and_inside_the_passes(results) -> None:
    for r in results:
        got = r["gathered"]
        assert got["is_master"]
        assert got["refused"].startswith("PartitionedParameterError"), got["refused"]
        assert "'blocks.0.mlp.fc.weight'" in got["refused"]
        assert "gathered only in fp8 (fp8.enable_fsdp_float8_all_gather)" in got["refused"]
        assert got["inside"].startswith("GatheredParameters on the parameters of 'blocks.0.mlp.fc'"), got["inside"]  # fmt: skip
        assert got["compile"].startswith("engine.compile() with fp8.enable_fsdp_float8_all_gather is not built")  # fmt: skip


def test_a_model_with_no_weight_to_gather_in_fp8_is_refused_by_name(results) -> None:
    for r in results:
        msg = r["no_eligible"]
        assert msg.startswith("Fp8Error: fp8.enable_fsdp_float8_all_gather: no Linear"), msg
        assert "head (its weight is also emb.weight (tied)" in msg
