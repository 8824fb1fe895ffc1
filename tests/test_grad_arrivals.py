"""Gradients that do not arrive once per parameter per step, against single-process
torch, at stages 0-3 on 2 and 3 gloo ranks (one spawn per world size):

* two ``engine.backward`` calls before one ``engine.step`` (gradient accumulation 1):
  the step applies the gradient of the sum of both losses;
* a parameter whose gradient arrives twice in one backward (used inside a reentrant
  checkpoint and outside it: autograd accumulates into ``.grad`` twice);
* gradient accumulation over 3 micro-steps, with a parameter used only on the last;
* a rank whose backward reaches no parameter (an empty batch's constant loss): it still
  takes part in the reduction and must step with the others' average, not zeros;
* three backwards before one step with the boundary set, unset, set again
  (``set_gradient_accumulation_boundary``, as accelerate calls it);
* two backwards, the boundary set then unset, then set again and a step with no backward
  after it: the step reduces the window's local sums first (before, stage 0 ranks
  stepped on their own unreduced sums and diverged, stage 1 stepped on zeros);
* two backwards before one step, the first with ranks > 0 idle: a slot that got nothing
  before the first reduction holds the others' gradient after it, and the second
  backward adds to it (before, stages 0-1 overwrote it on the idle ranks).

Stage 2 with the optimizer offloaded (under the fake device runtime, so the reducer
stages its moves as on a GPU) runs the orders again, plus "held_step": two backwards
with the boundary unset, then the boundary set and a step with no backward. Its
micro-steps before a boundary add up on the device (window ON_DEVICE) and cross to the
host at the boundary's backward, or at the step's read (LAND) in "held_step".

The reducer divides a gradient by the number of ranks while it copies it into its bucket
(issue 20); these are the arrivals where that division must not be applied twice or
skipped. At stage 0, ``param.grad`` after backward must be the averaged gradient.
"""

from __future__ import annotations

import contextlib
import functools

import cases
import multirank
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

TOL = 2e-5
MICRO = 2
STEPS = 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.shared = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 4)
        self.late = nn.Parameter(torch.randn(4) * 0.1)

    def forward(self, x, y, *, reentrant: bool = False, late: bool = False):
        h = torch.tanh(self.fc1(x))
        if reentrant:  # ``shared`` inside a reentrant checkpoint and again outside it
            h = checkpoint(lambda t: torch.tanh(self.shared(t)), h, use_reentrant=True)
        h = torch.tanh(self.shared(h))
        out = self.fc2(h)
        if late:
            out = out + self.late
        return F.mse_loss(out, y)


def _data(step: int, k: int, rows: int):
    g = torch.Generator().manual_seed(1000 * step + k)
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)


def _losses(model, step: int, kind: str, rows: slice, world: int):
    """The losses of one step, each with the batch of every rank (reference) or this
    rank's rows; "twice": two backwards, "reentrant": one, "accum": three micro-steps,
    "toggle": three backwards, the middle one with the boundary unset; "toggle_step":
    two, the second with it unset; "held_step": two, both with it unset; "idle_first": two."""
    n = {"twice": 2, "held_step": 2, "reentrant": 1, "accum": 3, "idle": 1, "toggle": 3}.get(
        kind, 2
    )
    out = []
    for k in range(n):
        x, y = _data(step, k, MICRO * world)
        late = kind == "accum" and k == n - 1
        out.append(model(x[rows], y[rows], reentrant=kind == "reentrant", late=late))
    return out


def _reference(world: int, kind: str):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    grads = None
    for step in range(STEPS):
        losses = _losses(model, step, kind, slice(None), world)
        scale = 1 / len(losses) if kind == "accum" else 1.0
        if kind == "idle":  # only rank 0's rows contribute; the average is over every rank
            x, y = _data(step, 0, MICRO * world)
            losses, scale = [model(x[:MICRO], y[:MICRO])], 1 / world
        if kind == "idle_first":  # the first backward: only rank 0's rows
            x, y = _data(step, 0, MICRO * world)
            losses[0] = model(x[:MICRO], y[:MICRO]) / world
        sum(losses).mul(scale).backward()
        if step == STEPS - 1:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, grads


def _train(rank: int, world: int, stage: int, kind: str, offload: bool = False):
    from zeroshard.distributed import device
    from zeroshard.distributed.fake_device import FakeRuntime

    # offload: a device apart from the host (the fake runtime), so the reducer stages
    with device.use(FakeRuntime()) if offload else contextlib.nullcontext():
        return _train_on(rank, world, stage, kind, offload)


def _train_on(rank: int, world: int, stage: int, kind: str, offload: bool):
    import zeroshard
    from zeroshard.zero import GatheredParameters

    torch.manual_seed(0)
    model = Net()
    zc: dict = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload:
        zc["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 3 if kind == "accum" else 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": zc,
        "steps_per_print": 10**6,
    }
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    grads = {}
    for step in range(STEPS):
        losses = _losses(engine, step, kind, rows, world)
        if kind in ("idle", "idle_first") and rank > 0:  # no parameter gets a gradient
            losses[0] = torch.zeros((), requires_grad=True)
        for k, loss in enumerate(losses):
            if kind == "toggle":  # boundary, not, boundary (as accelerate could set it)
                engine.set_gradient_accumulation_boundary(k != 1)
            if kind == "toggle_step":  # boundary, not; then boundary and a step
                engine.set_gradient_accumulation_boundary(k == 0)
            if kind == "held_step":  # not, not; then boundary and a step
                engine.set_gradient_accumulation_boundary(False)
            engine.backward(loss)
            last = k == len(losses) - 1
            if last and step == STEPS - 1 and stage == 0 and kind != "toggle_step":
                # param.grad holds the average
                grads = {
                    n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
                }
            if kind == "accum" or last:
                if kind in ("toggle_step", "held_step"):
                    engine.set_gradient_accumulation_boundary(True)
                engine.step()
    with GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, grads


def _diffs(rank: int, world: int, stage: int, kind: str, offload: bool) -> dict:
    ref, ref_grads = _reference(world, kind)
    got, grads = _train(rank, world, stage, kind, offload)
    diffs = {n: (got[n] - ref[n]).abs().max().item() for n in ref}
    diffs |= {f"{n}.grad": (g - ref_grads[n]).abs().max().item() for n, g in grads.items()}
    # idle: no .grad was set; toggle_step: none read (unreduced after backward)
    if stage == 0 and not (kind == "idle" and rank > 0) and kind != "toggle_step":
        diffs["grads present"] = float(set(grads) != set(ref_grads))
    return diffs


def _name(case: tuple) -> str:
    stage, kind, offload = case
    return f"stage={stage} {kind} offload={offload}"


def _worker(rank: int, world: int, case_list: list) -> dict:
    return cases.run_named(
        (_name(c), functools.partial(_diffs, rank, world, *c)) for c in case_list
    )


# stage 3 reduces ``shared``'s own unit once its first gradient is in, so a second one is
# refused by name (the reducer's "received a gradient after its bucket was already
# reduced"); at stages 0-2 this model is one bucket, reduced at the end of backward.
# An idle rank at stage 3 would skip the backward's parameter gathers the others run.
CASES = [
    (stage, kind, False)
    for stage in (0, 1, 2, 3)
    for kind in ("twice", "reentrant", "accum", "idle", "toggle", "toggle_step", "idle_first")
    if (stage, kind) not in ((3, "reentrant"), (3, "idle"), (3, "idle_first"))
]
# stage 2, optimizer offloaded: the window held on the device
CASES += [
    (2, kind, True)
    for kind in ("twice", "accum", "idle", "toggle", "toggle_step", "idle_first", "held_step")
]


@pytest.fixture(scope="module", params=[2, 3])
def results(request):
    world = request.param
    return world, multirank.run(_worker, world, CASES, timeout=600)


def test_arrivals_match_torch(results, subtests):
    """Parameters and (stage 0) the averaged ``param.grad`` match torch's."""
    world, ranks = results

    def check(case: str, per_rank: list) -> None:
        failures = []
        for rank, diffs in enumerate(per_rank):
            worst = max(diffs.values())
            if worst > TOL:
                failures.append(f"world {world} rank {rank} {case}: {diffs}")
        assert not failures, "\n".join(failures)

    cases.check_each(subtests, ranks, check, names=[_name(c) for c in CASES])
