"""Pipeline schedules as plain data: one list of :class:`Action` per stage rank.

``build_schedule(name, stages, microbatches, virtual=1)`` returns, for each pipeline
rank, the ordered actions it runs in one ``train_batch``: compute (``F`` forward,
``B`` whole backward, ``BI`` input-gradient half, ``BW`` weight-gradient half) and the
point-to-point transfers around them (``RECV_F`` / ``SEND_F`` carry activations to the
next virtual stage, ``RECV_B`` / ``SEND_B`` carry gradients back). The executor
(``exec.py``) walks the list: a receive blocks, a send does not (it is waited
for at the end of the batch), so a schedule is correct when :func:`simulate` finishes it
without a deadlock; the tests check that for every schedule and size.

Schedules (``p`` stages, ``m`` micro-batches, ``v`` virtual stages per rank):

* ``gpipe``: all forwards, then all backwards. Holds ``m`` micro-batches' activations.
* ``1f1b``: ``p - s - 1`` warm-up forwards on stage ``s``, then one forward / one
  backward alternately, then the remaining backwards (PipeDream-Flush). Holds at most
  ``p - s`` micro-batches' activations; same bubble as GPipe, ``(p-1)/(m+p-1)``.
* ``interleaved_1f1b``: Megatron's virtual pipeline: rank ``s`` holds the model chunks
  ``c * p + s`` for ``c < v``; forwards go through chunks in groups of ``p``
  micro-batches. ``m`` must be a multiple of ``p``. Bubble divided by ``v``.
* ``zb_h1``: zero-bubble H1 (Qi et al., 2023): 1F1B with each backward split into the
  input-gradient pass ``BI`` (on the critical path: the previous stage waits for it)
  and the weight-gradient pass ``BW`` (nobody waits for it). Stage ``s`` defers up to
  ``s`` weight passes and runs them where 1F1B would wait in its cool-down. With
  F = BI = BW the makespan is ``3m + p - 1`` units against 1F1B's ``3m + 3(p - 1)``
  (:func:`simulate`: the bubble is a third of 1F1B's), and every stage holds at most
  ``p`` micro-batches (1F1B's first stage's peak; a micro-batch counts until its BW).

Why not torch.distributed.pipelining's schedules: they ship the same four (``GPipe``,
``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``), but
they drive their own ``PipelineStage`` objects, which issue ``torch.distributed``
send/recv themselves (outside ``distributed/comm.py``'s ledger), own the loss scaling and gradient
accumulation that zeroshard's engine and ZeRO reducer do, and need shapes inferred or
given up front. Their action lists (``_Action``) are an internal API. So the orders are
built here, from the papers' definitions, as data a test prints and checks.

No collectives, no devices.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroshard import ZeroshardError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
COMPUTE = ("F", "B", "BI", "BW")
KINDS = (*COMPUTE, "SEND_F", "RECV_F", "SEND_B", "RECV_B")


class ScheduleError(ZeroshardError, ValueError):
    """A schedule that cannot be built for these sizes; the message says why."""


@dataclass(frozen=True)
class Action:
    """One step of a stage's schedule: ``kind`` (see :data:`KINDS`), the micro-batch,
    and ``chunk``, the model chunk on this rank (virtual stage ``chunk * p + rank``)."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        c = f"c{self.chunk}" if self.chunk else ""
        return f"{self.kind}{self.microbatch}{c}"


def check_sizes(name: str, stages: int, microbatches: int, virtual: int = 1) -> None:
    """Raise :class:`ScheduleError` naming the problem if ``name`` cannot run these sizes."""
    if name not in SCHEDULES:
        raise ScheduleError(f"pipeline.schedule: unknown schedule {name!r}; one of {SCHEDULES}")
    for what, n in (("stages", stages), ("micro-batches", microbatches), ("virtual", virtual)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ScheduleError(f"pipeline: {what} must be a whole number >= 1, got {n!r}")
    if name == "interleaved_1f1b":
        if virtual < 2:
            raise ScheduleError(
                "pipeline.virtual_stages: interleaved_1f1b needs at least 2 model chunks per "
                f"stage, got {virtual}"
            )
        if microbatches % stages:
            raise ScheduleError(
                f"pipeline: interleaved_1f1b needs the micro-batch count (gradient_accumulation"
                f"_steps = {microbatches}) to be a multiple of the stages ({stages})"
            )
    elif virtual != 1:
        raise ScheduleError(
            f"pipeline.virtual_stages: {virtual} model chunks per stage need the schedule "
            f"interleaved_1f1b, not {name}"
        )


def _one_f_one_b(p: int, s: int, m: int) -> list[tuple[str, int]]:
    warmup = min(p - s - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(m - warmup, m)]
    return order


def _zb_h1(p: int, s: int, m: int) -> list[tuple[str, int]]:
    """1F1B with split backwards; stage ``s`` keeps up to ``s`` weight passes pending
    and runs them in what would be 1F1B's cool-down wait."""
    warmup, lag = min(p - s - 1, m), s
    order = [("F", i) for i in range(warmup)]
    pending: list[int] = []

    def backward(i: int) -> None:
        order.append(("BI", i))
        pending.append(i)
        if len(pending) > lag:
            order.append(("BW", pending.pop(0)))

    for i in range(m - warmup):
        order.append(("F", warmup + i))
        backward(i)
    for i in range(m - warmup, m):  # cool-down: one weight pass after each input pass,
        order.append(("BI", i))  # run while the next input gradient is on its way
        pending.append(i)
        order.append(("BW", pending.pop(0)))
    order += [("BW", i) for i in pending]
    return order


def _interleaved(p: int, s: int, m: int, v: int) -> list[tuple[str, int, int]]:
    """Megatron's interleaved order: forward k touches chunk (k // p) % v of micro-batch
    (k // (p v)) p + k % p; backward k the chunks in reverse."""
    total = m * v

    def fwd(k: int) -> tuple[str, int, int]:
        return ("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def bwd(k: int) -> tuple[str, int, int]:
        return ("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
    order = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [fwd(warmup + k), bwd(k)]
    order += [bwd(k) for k in range(total - warmup, total)]
    return order


def compute_order(name: str, stages: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:  # fmt: skip
    """The compute actions of each stage, without transfers."""
    check_sizes(name, stages, microbatches, virtual)
    p, m = stages, microbatches
    out = []
    for s in range(p):
        if name == "gpipe":
            steps = [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
        elif name == "1f1b":
            steps = [(k, i, 0) for k, i in _one_f_one_b(p, s, m)]
        elif name == "zb_h1":
            steps = [(k, i, 0) for k, i in _zb_h1(p, s, m)]
        else:
            steps = _interleaved(p, s, m, virtual)
        out.append([Action(k, i, c) for k, i, c in steps])
    return out


def build_schedule(name: str, stages: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:  # fmt: skip
    """Every stage's actions, transfers included: a forward of a virtual stage that has a
    predecessor is preceded by ``RECV_F`` and one that has a successor is followed by
    ``SEND_F``; a backward (``B`` or ``BI``) of a virtual stage that has a successor is
    preceded by ``RECV_B``, and followed by ``SEND_B`` when it has a predecessor."""
    p, v = stages, virtual
    last = p * v - 1
    out = []
    for s, actions in enumerate(compute_order(name, stages, microbatches, virtual)):
        steps: list[Action] = []
        for a in actions:
            vs = a.chunk * p + s
            if a.kind == "F":
                if vs > 0:
                    steps.append(Action("RECV_F", a.microbatch, a.chunk))
                steps.append(a)
                if vs < last:
                    steps.append(Action("SEND_F", a.microbatch, a.chunk))
            elif a.kind in ("B", "BI"):
                if vs < last:
                    steps.append(Action("RECV_B", a.microbatch, a.chunk))
                steps.append(a)
                if vs > 0:
                    steps.append(Action("SEND_B", a.microbatch, a.chunk))
            else:
                steps.append(a)
        out.append(steps)
    return out


def peer(kind: str, stage: int, chunk: int, stages: int) -> tuple[int, int]:
    """(stage, chunk) at the other end of a transfer: ``*_F`` sends go to the next
    virtual stage and receives come from the previous one; ``*_B`` the other way."""
    vs = chunk * stages + stage
    other = vs + 1 if kind in ("SEND_F", "RECV_B") else vs - 1
    return other % stages, other // stages


def forward_only(stages: int, m: int, virtual: int = 1) -> list[list[Action]]:
    """``eval_batch``'s schedule: each stage forwards micro-batch by micro-batch, chunk
    by chunk, receiving and sending around each forward."""
    out = []
    last = stages * virtual - 1
    for s in range(stages):
        steps = []
        for i in range(m):
            for c in range(virtual):
                vs = c * stages + s
                if vs > 0:
                    steps.append(Action("RECV_F", i, c))
                steps.append(Action("F", i, c))
                if vs < last:
                    steps.append(Action("SEND_F", i, c))
        out.append(steps)
    return out


DURATIONS = {"F": 1.0, "B": 2.0, "BI": 1.0, "BW": 1.0}


def simulate(schedule: list[list[Action]], durations: dict[str, float] | None = None) -> dict:
    """Run ``schedule`` on an idealized machine (compute takes ``durations[kind]``,
    transfers are instant, a receive waits for its send) and return
    ``{"makespan", "busy": [per stage], "bubble": idle / (stages x makespan),
    "peak_inflight": [per stage: most micro-batches forwarded but not yet backward
    (weight pass) done]}``. Raises :class:`ScheduleError` on a deadlock or a transfer
    without its partner."""
    dur = {**DURATIONS, **(durations or {})}
    p = len(schedule)
    sent: dict[tuple, float] = {}
    clock, pos, busy = [0.0] * p, [0] * p, [0.0] * p
    inflight, peak = [0] * p, [0] * p
    split = any(a.kind == "BI" for stage in schedule for a in stage)
    while any(pos[s] < len(schedule[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while pos[s] < len(schedule[s]):
                a = schedule[s][pos[s]]
                if a.kind.startswith("SEND"):
                    ds, dc = peer(a.kind, s, a.chunk, p)
                    sent[(a.kind[5:], ds, dc, a.microbatch)] = clock[s]
                elif a.kind.startswith("RECV"):
                    key = (a.kind[5:], s, a.chunk, a.microbatch)
                    if key not in sent:
                        break
                    clock[s] = max(clock[s], sent.pop(key))
                else:
                    clock[s] += dur[a.kind]
                    busy[s] += dur[a.kind]
                    if a.kind == "F":
                        inflight[s] += 1
                        peak[s] = max(peak[s], inflight[s])
                    elif a.kind == ("BW" if split else "B"):
                        inflight[s] -= 1
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: str(schedule[s][pos[s]]) for s in range(p) if pos[s] < len(schedule[s])}
            raise ScheduleError(f"schedule deadlocks: stages wait at {stuck}")
    if sent:
        raise ScheduleError(f"transfers never received: {sorted(sent)}")
    makespan = max(clock)
    return {
        "makespan": makespan,
        "busy": busy,
        "bubble": 1.0 - sum(busy) / (p * makespan) if makespan else 0.0,
        "peak_inflight": peak,
    }


def render(schedule: list[list[Action]]) -> str:
    """One line per stage: ``stage 0: F0 SEND_F0 F1 ...`` (for printing in tests)."""
    return "\n".join(
        f"stage {s}: " + " ".join(str(a) for a in actions) for s, actions in enumerate(schedule)
    )
