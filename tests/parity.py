"""Shared parity harness: the same GPT, data and optimizer, trained by zeroshard on N
ranks and by plain single-process PyTorch on the full batch.

A *case* is a dict: stage, gas (accumulation steps), micro (micro-batch), clip, steps,
client (pass a torch optimizer instead of a config section), dtype ("fp32"|"bf16"|"fp16"),
dropout (the GPT's dropout probability; 0 by default),
bucket (reduce/allgather bucket elements), extra (merged into the config), lr (the decay
group's lr; the no-decay group gets twice it), opt (the config optimizer, a key of OPTS).
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

import cases
import torch
import torch.nn.functional as F  # noqa: F401  (kept for case authors)

from zeroshard.models import GPT, GPTConfig

if TYPE_CHECKING:
    import pytest

SEQ = 16
PINNED_CPU = {"device": "cpu", "pin_memory": True}  # an offload section
TOL = 2e-5  # parity tolerance against the fp32 reference (losses, parameters, norms)
BF16_TOL = (2e-3, 1.5e-2, 1e-2)  # bf16 runs against the same fp32 reference
LR, LR_NODECAY, WD = 1e-3, 2e-3, 0.1
MOMENTUM = 0.9

# config optimizer -> (DeepSpeed "optimizer" section without lr, the matching torch class
# and its extra constructor arguments). DeepSpeed's "Adam" decouples weight decay unless
# adam_w_mode is false, which makes it torch's Adam with L2 decay.
OPTS: dict[str, Any] = {
    "AdamW": ({"type": "AdamW"}, torch.optim.AdamW, {}),
    "Adam": ({"type": "Adam"}, torch.optim.AdamW, {}),
    "Adam-L2": ({"type": "Adam", "params": {"adam_w_mode": False}}, torch.optim.Adam, {}),
    "SGD": (
        {"type": "SGD", "params": {"momentum": MOMENTUM}},
        torch.optim.SGD,
        {"momentum": MOMENTUM},
    ),
}


def build_model(case: dict) -> GPT:
    torch.manual_seed(1234)
    cfg = GPTConfig(
        vocab_size=64,
        seq_len=SEQ,
        n_layer=2,
        n_head=2,
        d_model=32,
        tie_embeddings=case.get("tied", True),
        dropout=case.get("dropout", 0.0),
    )
    model = GPT(cfg)
    if case.get("frozen", True):
        model.pos_emb.weight.requires_grad_(False)
    if case.get("unused"):  # trainable, but forward never touches it: no gradient ever
        model.unused = torch.nn.Parameter(torch.randn(7))
    return model


def param_groups(model: torch.nn.Module, with_hyper: bool = True, lr: float = LR) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    if not with_hyper:
        return [{"params": decay}, {"params": no_decay}]
    return [
        {"params": decay, "weight_decay": WD},
        {"params": no_decay, "weight_decay": 0.0, "lr": lr * LR_NODECAY / LR},
    ]


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, 64, (rows, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def ds_config(case: dict) -> dict:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": case.get("micro", 2),
        "gradient_accumulation_steps": case.get("gas", 1),
        "gradient_clipping": case.get("clip", 0.0),
        # reduce-scatter (the paper's volumes, which ledger tests check) also on gloo,
        # where zeroshard would otherwise all-reduce (tests/test_engine.py checks that)
        "zero_optimization": {"stage": case["stage"], "overlap_comm": True, "reduce_scatter": True},
        "steps_per_print": 10**6,
    }
    if not case.get("client"):
        section, _, _ = OPTS[case.get("opt", "AdamW")]
        params = {**section.get("params", {}), "lr": case.get("lr", LR), "weight_decay": WD}
        cfg["optimizer"] = {"type": section["type"], "params": params}
    if case.get("bucket", 3000) is not None:  # None: leave the bucket sizes to the engine
        bucket = case.get("bucket", 3000)
        cfg["zero_optimization"] |= {"reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    dtype = case.get("dtype", "fp32")
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    for k, v in case.get("extra", {}).items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    return cfg


def initial_params(case: dict) -> dict[str, torch.Tensor]:
    """The parameters before training (fp32)."""
    return {n: p.detach().clone() for n, p in build_model(case).named_parameters()}


def reference(
    case: dict, world: int, norms: list[float] | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process fp32 PyTorch (the case's optimizer) on the whole global batch.
    ``norms``, if given, receives each step's global gradient norm before clipping."""
    model = build_model(case)
    lr = case.get("lr", LR)
    groups = [g for g in param_groups(model, lr=lr) if any(p.requires_grad for p in g["params"])]
    if case.get("client"):
        opt = torch.optim.AdamW(groups, lr=lr)
    else:
        _, cls, kwargs = OPTS[case.get("opt", "AdamW")]
        opt = cls(groups, lr=lr, **kwargs)
    rows = case.get("micro", 2) * case.get("gas", 1) * world
    losses = []
    for step in range(case.get("steps", 4)):
        x, y = batch(step, rows)
        loss = model(x, y)
        loss.backward()
        trainable = [p for p in model.parameters() if p.requires_grad]
        if case.get("clip", 0.0) > 0:
            norm = torch.nn.utils.clip_grad_norm_(trainable, case["clip"])
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in trainable if p.grad is not None])
        if norms is not None:
            norms.append(norm.item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train(case: dict, rank: int, world: int, norms: list | None = None, mpu=None):
    """Train with zeroshard on this rank; returns (per-step mean micro loss, engine).
    ``norms``, if given, receives ``engine.get_global_grad_norm()`` after each step.
    ``rank`` / ``world`` are the data-parallel rank and size (``mpu``: passed on)."""
    import zeroshard

    model = build_model(case)
    lr = case.get("lr", LR)
    kwargs: dict[str, Any] = {}
    if case.get("client"):
        kwargs["optimizer"] = torch.optim.AdamW(param_groups(model, lr=lr), lr=lr)
    else:
        kwargs["model_parameters"] = param_groups(model, lr=lr)
    # "staged": on this CPU-only machine, run offload as on a GPU (separate fp32 masters,
    # double-buffered gradient moves to the host, write-back); read at construction
    from zeroshard.offload.staging import STAGE_ON_CPU_ENV

    os.environ[STAGE_ON_CPU_ENV] = "1" if case.get("staged") else "0"
    engine, _, _, _ = zeroshard.initialize(model=model, config=ds_config(case), mpu=mpu, **kwargs)
    os.environ.pop(STAGE_ON_CPU_ENV)
    micro, gas = case.get("micro", 2), case.get("gas", 1)
    losses = []
    for step in range(case.get("steps", 4)):
        x, y = (t.to(engine.device) for t in batch(step, micro * gas * world))
        total = 0.0
        for m in range(gas):
            lo = (m * world + rank) * micro
            loss = engine(x[lo : lo + micro], y[lo : lo + micro])
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / gas)
        if norms is not None:
            norms.append(engine.get_global_grad_norm())
    return losses, engine


def full_params(engine) -> dict[str, torch.Tensor]:
    """Every parameter of the engine's module, whole, in fp32."""
    from zeroshard.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return {
            n: p.detach().to("cpu", torch.float32, copy=True)
            for n, p in engine.module.named_parameters()
        }


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def l2_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """L2 norm of the difference of all parameters taken together."""
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    return sum((a[k].float() - b[k].float()).square().sum().item() for k in a) ** 0.5


def case_name(case: dict) -> str:
    """A case's name in reports (``stage=2 gas=4 clip=0.8 zero.reduce_scatter=False``)."""
    return cases.label(case).replace("extra.zero_optimization.", "zero.")


def run_case(rank: int, world: int, case: dict) -> dict:
    """One case trained on this rank and its single-process reference: losses, norms and
    parameter distances for :func:`check_parity`."""
    ref_norms: list[float] = []
    norms: list[float] = []
    ref_losses, ref_params = reference(case, world, ref_norms)
    losses, engine = train(case, rank, world, norms)
    params, initial = full_params(engine), initial_params(case)
    # the process groups made for its mesh go with it: a spawn runs many cases, and an
    # idle gloo group's threads keep waking
    engine.destroy()
    return {
        "case": case,
        "losses": losses,
        "ref_losses": ref_losses,
        "norms": norms,
        "ref_norms": ref_norms,
        "param_diff": max_param_diff(params, ref_params),
        "movement": max_param_diff(ref_params, initial),
        "update_err": l2_param_diff(params, ref_params) / l2_param_diff(ref_params, initial),
    }


def named_cases(rank: int, world: int, case_list: list[dict]) -> list[tuple[str, Any]]:
    """``(name, fn)`` per case for :func:`cases.run_named` (to batch with other cases)."""
    return [(case_name(c), functools.partial(run_case, rank, world, c)) for c in case_list]


def run_cases(rank: int, world: int, case_list: list[dict]) -> dict[str, dict]:
    """Every case on this rank, by name (a ``multirank.run`` job; see :mod:`cases`)."""
    return cases.run_named(named_cases(rank, world, case_list))


def assert_close(case: dict, per_rank: list[dict], world: int) -> None:
    """One case's per-rank results (:func:`run_case`'s) match the reference: mean loss
    per step, final parameters, the pre-clip global norm of clipping cases; and the
    reference moved far more than the tolerance (a lost step cannot pass)."""
    steps = len(per_rank[0]["losses"])
    losses = [sum(r["losses"][s] for r in per_rank) / world for s in range(steps)]
    loss_diff = max(abs(a - b) for a, b in zip(losses, per_rank[0]["ref_losses"], strict=True))
    param_diff = max(r["param_diff"] for r in per_rank)
    norm_diff = max(  # the engine reports the pre-clip norm when it clips
        (
            abs(a - b)
            for r in per_rank
            for a, b in zip(r["norms"], r["ref_norms"], strict=True)
            if case.get("clip", 0.0) > 0
        ),
        default=0.0,
    )
    tol = BF16_TOL if case.get("dtype") == "bf16" else (TOL, TOL, TOL)
    close = loss_diff <= tol[0] and param_diff <= tol[1] and norm_diff <= tol[2]
    assert close and per_rank[0]["movement"] > 50 * TOL, (
        f"{case}: loss {loss_diff:.3g} param {param_diff:.3g} norm {norm_diff:.3g}"
    )


def check_parity(
    subtests: pytest.Subtests, case_list: list[dict], results: list, world: int
) -> None:
    """:func:`assert_close` for each case of ``results`` (the ranks' :func:`run_cases`),
    each under its own subtest."""
    by_name = {case_name(c): c for c in case_list}
    cases.check_each(
        subtests,
        results,
        lambda name, per_rank: assert_close(by_name[name], per_rank, world),
        names=list(by_name),
    )


def flag_bytes(engine) -> int:
    """Ledger bytes of the step's flags: an all-reduce (counted twice) of one byte per
    trainable parameter (got a gradient?) plus one (inf/nan seen?), on each group
    gradients are reduced over."""
    return 2 * (sum(g >= 0 for g in engine.flat.group_of) + 1)
