"""ZeRO on models as people write them (issue 14): parameters that get no gradient in a
step, on some ranks or on all, against single-process torch, at stages 0-3 with and
without CPU offload (on the GPU code path), on 2 gloo ranks. One spawn runs every case.

Rules (torch's and DDP's): a parameter with no gradient on any rank in a whole
accumulation window is not stepped (torch skips ``grad=None``: no moment update, no
weight decay); one used on some ranks only is stepped with its gradient averaged with
zeros from the others.
"""

from __future__ import annotations

import multirank
import pytest
import torch
import torch.nn.functional as F
from torch import nn

TOL = 2e-5
STEPS = 6
MICRO = 2


class Net(nn.Module):
    """``extra`` is used only on the rows ``rows`` names; ``maybe`` only when ``use``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.maybe = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 4)
        self.extra = nn.Parameter(torch.randn(16) * 0.1)

    def forward(self, x, y, rows: slice | None = None, use: bool = True):
        h = torch.tanh(self.fc1(x))
        if rows is not None:
            h = torch.cat([h[: rows.start], h[rows] + self.extra, h[rows.stop :]])
        if use:
            h = h + torch.tanh(self.maybe(h))
        return F.mse_loss(self.fc2(h), y)


def _data(step: int, rows: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)


def _uses(step: int) -> bool:
    return step % 3 != 1  # ``maybe`` idles every third step, after building up momentum


def _opt(params, kind: str):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.1)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _reference(world: int, kind: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    opt = _opt(model.parameters(), kind)
    for step in range(STEPS):
        x, y = _data(step, MICRO * world)
        # rank 0's rows see ``extra``; every row sees ``maybe`` on the steps that use it
        model(x, y, rows=slice(0, MICRO), use=_uses(step)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _config(stage: int, kind: str, offload: bool) -> dict:
    zc: dict = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload:
        zc["offload_optimizer"] = {"device": "cpu"}
    params = {"lr": 0.05, "momentum": 0.9} if kind == "sgd" else {"lr": 1e-2}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {
            "type": "SGD" if kind == "sgd" else "AdamW",
            "params": {**params, "weight_decay": 0.1},
        },
        "zero_optimization": zc,
        "steps_per_print": 10**6,
    }


def _train(rank: int, world: int, stage: int, kind: str, offload: bool):
    import os

    import zeroshard
    from zeroshard.offload.staging import STAGE_ON_CPU_ENV
    from zeroshard.zero import GatheredParameters

    os.environ[STAGE_ON_CPU_ENV] = "1" if offload else "0"
    torch.manual_seed(0)
    model = Net()
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=_config(stage, kind, offload)
    )
    os.environ.pop(STAGE_ON_CPU_ENV)
    for step in range(STEPS):
        x, y = _data(step, MICRO * world)
        lo = rank * MICRO
        rows = slice(0, MICRO) if rank == 0 else None  # extra: rank 0 only
        loss = engine(x[lo : lo + MICRO], y[lo : lo + MICRO], rows=rows, use=_uses(step))
        engine.backward(loss)
        engine.step()
    with GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(rank: int, world: int, cases: list) -> list[dict]:
    torch.set_num_threads(1)
    out = []
    for stage, kind, offload in cases:
        ref = _reference(world, kind)
        got = _train(rank, world, stage, kind, offload)
        out.append({n: (got[n] - ref[n]).abs().max().item() for n in ref})
    return out


CASES = [
    (stage, kind, offload)
    for stage in (0, 1, 2, 3)
    for kind in ("adamw", "sgd")
    for offload in ((False, True) if stage else (False,))
]


@pytest.fixture(scope="module")
def results():
    return multirank.run(_worker, 2, CASES, timeout=600)


def test_no_gradient_parameters_follow_torch(results):
    """``maybe`` (no gradient anywhere every third step) and ``extra`` (rank 0 only)
    end where single-process torch leaves them, with momentum and weight decay."""
    failures = []
    for rank, per_rank in enumerate(results):
        for case, diffs in zip(CASES, per_rank, strict=True):
            worst = max(diffs.values())
            if worst > TOL:
                failures.append(f"rank {rank} {case}: {diffs}")
    assert not failures, "\n".join(failures)
