"""The GPU code paths of offload and streaming, on the CPU, through the device seam's
fake runtime (zeroshard/distributed/device.py, zeroshard/distributed/fake_device.py): it
claims the CPU as an accelerator apart from host memory, runs side-stream copies only
once something waits for them, and logs every copy, record and wait in order.

Each test asserts the order a GPU run must follow and, because late copies would leave
stale values behind, parity with the single-process fp32 reference as well:

* gradient staging to the host (zero/grads/offload.py, offload/staging.py): the side stream
  waits for compute before it copies a reduced chunk out of a staging bucket, records
  an event, and the compute stream waits on that event before the bucket is filled
  again; the host waits on it before backward ends;
* the offloaded step's write-back (zero/optim/memory_store.py): per segment, the host steps the
  masters, then their upload is issued (before the next segment's step, so it
  overlaps it); one event after the last upload, waited for by the host before the
  next step rewrites the masters. The uploads are on the compute stream, so compute
  uses the parameters after them without an event of its own;
* streamed inference (inference/streaming.py): each unit's forward starts after its
  read and its upload, with an event recorded after the upload, and a host buffer is
  read into again only after the host waited on that event.

One spawn of two ranks (gloo) runs every engine case.
"""

from __future__ import annotations

import copy
import functools

import cases
import multirank
import parity
import pytest
import torch
from offload_paths import check_offload_path, offload_path

from zeroshard.distributed import device
from zeroshard.distributed.fake_device import FakeRuntime

Z = "zero_optimization"
CPU = {"device": "cpu", "pin_memory": True}
STEPS = 3  # the first builds and warms up (buffers made); the log covers the others


def _cases() -> dict[str, dict]:
    part = {"stage3_param_persistence_threshold": 0}
    return {
        "stage1": {"stage": 1, "gas": 2, "micro": 1, "extra": {Z: {"offload_optimizer": CPU}}},
        "stage2": {"stage": 2, "gas": 2, "micro": 1, "extra": {Z: {"offload_optimizer": CPU}}},
        # one micro-step per window: each bucket's staging buffer itself goes to the host
        "stage2_gas1": {"stage": 2, "gas": 1, "micro": 1, "extra": {Z: {"offload_optimizer": CPU}}},
        "stage3": {
            "stage": 3,
            "gas": 2,
            "micro": 1,
            "extra": {Z: {"offload_optimizer": CPU, **part}},
        },
    }


def _steps(engine, case: dict, rank: int, world: int, steps: range) -> list[float]:
    micro, gas = case["micro"], case["gas"]
    losses = []
    for step in steps:
        x, y = parity.batch(step, micro * gas * world)
        total = 0.0
        for m in range(gas):
            lo = (m * world + rank) * micro
            loss = engine(x[lo : lo + micro], y[lo : lo + micro])
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / gas)
    return losses


def _instrument(fake: FakeRuntime, engine) -> None:
    """Name the buffers the log mentions; mark when a staging bucket is taken (after
    any wait in it), when backward is done, and what each host step steps."""
    reducer, states = engine.reducer, engine.optimizer.states
    for i, buf in enumerate(reducer.launcher.staging.free):
        fake.name(buf, f"staging{i}")
    dev_acc = reducer.offload.dev_acc if reducer.offload is not None else None
    if dev_acc is not None:  # made by the first window's first micro-step
        fake.name(dev_acc, "devacc")
    for s, master in enumerate(states.masters):
        fake.name(master, f"master{s}")
        fake.name(engine.flat.store.chunk(s), f"param{s}")
    staging_for, finish, step = reducer.launcher.staging_for, reducer.finish, states.inner.step

    def staging_for_logged(b):
        fresh = b.staging is None
        out = staging_for(b)
        if fresh:
            fake.note("fill", fake.label(out))
        return out

    def finish_logged():
        finish()
        fake.note("backward done")

    def step_logged(*args, **kwargs):
        labels = {fake.label(p) for g in states.inner.param_groups for p in g["params"]}
        fake.note("step", *sorted(labels))
        return step(*args, **kwargs)

    reducer.launcher.staging_for = staging_for_logged
    reducer.finish = finish_logged
    states.inner.step = step_logged


def _engine_case(rank: int, world: int, case: dict) -> dict:
    fake = FakeRuntime()
    with device.use(fake):
        _, engine = parity.train({**case, "steps": 1}, rank, world)
        _instrument(fake, engine)
        fake.log.clear()
        losses = _steps(engine, case, rank, world, range(1, STEPS))
    ref_losses, ref_params = parity.reference({**case, "steps": STEPS}, world)
    return {
        "log": [list(e) for e in fake.log],
        "losses": losses,
        "ref_losses": ref_losses[1:],
        "param_diff": parity.max_param_diff(parity.full_params(engine), ref_params),
        "segments": len(engine.flat.layout.segments),
        # segments with a trainable parameter (stage 3 keeps frozen ones apart)
        "buckets": len(engine.reducer.launcher.buckets),
        "separate": engine.optimizer.states.separate,
        "pipelined": engine.optimizer.states.pipelined,
        "pending": fake.pending(),
    }


def _engine_worker(rank: int, world: int) -> dict:
    return cases.run_named(
        [
            *(
                (name, functools.partial(_engine_case, rank, world, case))
                for name, case in _cases().items()
            ),
            ("offload_path", lambda: offload_path(rank, world, fake=True)),
        ]
    )


# -- assertions on the log ---------------------------------------------------------------


def _index(log: list[list], entry: list, start: int = 0) -> int:
    for i in range(start, len(log)):
        if log[i] == entry:
            return i
    raise AssertionError(f"{entry} not in the log after {start}: {log[start : start + 20]}")


def _check_staging(name: str, log: list[list], sharded: bool, accumulated: bool) -> int:
    """Every copy to the host follows a wait for compute and is followed by its event;
    a staging bucket is refilled only after compute waited on its last copy's event;
    the host waits on every event before backward ends. ``accumulated`` (sharded, with
    accumulation): every copy comes from the fp32 sum made on the device, none from a
    staging bucket. Returns the copies seen."""
    copies = [i for i, e in enumerate(log) if e[0] == "copy" and e[1] != "compute"]
    refills = 0
    # the stager's landing thread logs its host waits ("sync") between the issuing
    # thread's entries: the neighbours of a copy are the issuer's, syncs aside
    before = [e for e in log if e[0] != "sync"]
    at = {i: sum(e[0] != "sync" for e in log[:i]) for i in copies}  # i in ``before``
    for i in copies:
        _, stream, dst, src = log[i]
        k = at[i]
        assert before[k - 1] == ["wait_stream", stream, "compute"], (name, before[k - 1 : k + 1])
        assert before[k + 1][:1] == ["record"] and before[k + 1][2] == stream, (name, before[k + 1])
        assert dst.startswith("host"), (name, log[i])
        event = before[k + 1][1]
        done = _index(log, ["backward done"], i)
        assert ["sync", event] in log[i:done], (name, event, "not waited for by the host")
        if not sharded:
            continue
        assert src == ("devacc" if accumulated else "staging") or (
            not accumulated and src.startswith("staging")
        ), (name, log[i])
        if accumulated:  # the next window overwrites it after this backward's host sync
            continue
        refill = next((j for j in range(i, len(log)) if log[j] == ["fill", src]), None)
        if refill is not None:
            refills += 1
            assert ["wait_event", "compute", event] in log[i:refill], (
                name,
                f"{src} refilled before compute waited for {event}",
                log[i:refill],
            )
    if sharded and not accumulated:
        assert refills >= len(copies) // 2, (name, refills, len(copies))
    return len(copies)


def _check_write_back(name: str, log: list[list], segments: int) -> None:
    """Per segment: the host step, then the upload of that segment, before the next
    segment's step; an event after the last upload; the next step waits on it first."""
    steps = [i for i, e in enumerate(log) if e[0] == "step"]
    uploads = [i for i, e in enumerate(log) if e[0] == "copy" and e[1] == "compute"]
    assert len(steps) == len(uploads) == 2 * segments, (name, len(steps), len(uploads))
    for k, (i, j) in enumerate(zip(steps, uploads, strict=True)):
        s = k % segments
        assert log[j][2:] == [f"param{s}", f"master{s}"], (name, log[j])
        # the host stepped this segment's masters (none: a segment of frozen parameters)
        assert log[i][1:] in ([f"master{s}"], []), (name, log[i])
        nxt = steps[k + 1] if k + 1 < len(steps) else len(log)
        assert i < j < nxt, (name, f"segment {s}'s upload is not between its step and the next")
    for first in (0, segments):  # each step: the event after its last upload
        last = uploads[first + segments - 1]
        assert log[last + 1][0] == "record" and log[last + 1][2] == "compute", (name, log[last + 1])
    event = log[uploads[segments - 1] + 1][1]
    assert ["sync", event] in log[uploads[segments - 1] : steps[segments]], (
        name,
        "the second step rewrote the masters before waiting for their uploads",
    )


def _check_engine_case(name: str, per_rank: list) -> None:
    for c in per_rank:  # the order first: its failures say which wait is missing
        sharded = name != "stage1"
        gas = _cases()[name]["gas"]
        moved = _check_staging(name, c["log"], sharded, accumulated=sharded and gas > 1)
        # each bucket crosses once per window, whatever the accumulation: the
        # micro-steps before the boundary add up on the device (stages 2, 3)
        assert moved == (STEPS - 1) * c["buckets"], (name, moved)
        assert c["separate"] and c["pipelined"], name
        _check_write_back(name, c["log"], c["segments"])
        assert c["pending"] == 0, (name, "side-stream copies never waited for")
    # then the values: a copy run late would have left stale gradients or parameters;
    # the mean loss of the ranks is the reference's
    losses = [sum(c["losses"][s] for c in per_rank) / 2 for s in range(STEPS - 1)]
    diffs = [abs(a - b) for a, b in zip(losses, per_rank[0]["ref_losses"], strict=True)]
    assert max(diffs) <= parity.TOL, (name, diffs)
    assert max(c["param_diff"] for c in per_rank) <= parity.TOL, name


def _check_offload_path(per_rank: list) -> None:
    for rows in per_rank:
        check_offload_path(rows, gpu=False)


def test_offload_orders_copies_and_waits_on_the_fake_device(subtests: pytest.Subtests) -> None:
    results = multirank.run(_engine_worker, 2, timeout=600)
    cases.check_each(subtests, results, _check_engine_case, names=list(_cases()))
    cases.check(subtests, results, "offload_path", _check_offload_path)


# -- streamed inference ---------------------------------------------------------------------


def test_streamed_inference_waits_for_each_upload() -> None:
    """Each unit's forward comes after its read, its upload and the upload's event; a
    host buffer is read into again only after the host waited on the event of the
    upload that read it last. The tokens equal the in-memory model's."""
    from zeroshard.inference.streaming import StreamConfig, stream_weights
    from zeroshard.models import GPT, GPTConfig

    torch.manual_seed(0)
    ref = GPT(GPTConfig(vocab_size=64, seq_len=32, n_layer=3, n_head=4, d_model=32)).eval()
    ids = torch.randint(2, 64, (2, 5), generator=torch.Generator().manual_seed(3))

    def greedy(model, ids, new):
        with torch.no_grad():
            for _ in range(new):
                ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
        return ids

    want = greedy(ref, ids, 4)
    fake = FakeRuntime()
    with device.use(fake):
        model = copy.deepcopy(ref)
        sw = stream_weights(model, StreamConfig(device="cpu", buffer_count=3))
        assert sw is not None and sw.upload  # the CPU is "apart" under the fake
        take, read = sw._take_buffer, sw._read
        made: list[torch.Tensor] = []

        def take_named(evict_for):
            buf = take(evict_for)
            if buf is not None and fake.label(buf) == "?":
                fake.name(buf, f"buf{len(made)}")
                made.append(buf)
            return buf

        def read_logged(unit, buf):
            fake.note("read", unit.name, fake.label(buf))
            read(unit, buf)
            fake.note("read done", unit.name, fake.label(buf))

        sw._take_buffer, sw._read = take_named, read_logged  # type: ignore[method-assign]
        for u in sw.units:
            u.module.register_forward_pre_hook(lambda m, a, n=u.name: fake.note("forward", n))
        got = greedy(model, ids, 4)
    assert len(made) == 3
    assert torch.equal(got, want)
    log = fake.log
    forwards = [i for i, e in enumerate(log) if e[0] == "forward"]
    assert len(forwards) == 4 * len(sw.units), len(forwards)
    reused = 0
    for i in forwards:
        unit = log[i][1]
        copy_at = max(j for j in range(i) if log[j][0] == "copy")
        _, stream, _, buf = log[copy_at]
        assert stream == "compute" and buf.startswith("buf"), log[copy_at]
        # the read threads' notes may fall anywhere: the next entry of this thread
        rec = next((j for j in range(copy_at + 1, i) if not log[j][0].startswith("read")), i)
        assert log[rec][0] == "record" and log[rec][2] == "compute", (
            unit,
            "no event recorded after the upload, before the forward",
            log[copy_at : i + 1],
        )
        # the unit's read into that buffer completed before the upload was issued
        done = max((j for j in range(copy_at) if log[j][:2] == ("read done", unit)), default=-1)
        assert done >= 0 and log[done][2] == buf, (unit, buf, log[done])
        event = log[rec][1]
        again = next(
            (j for j in range(i, len(log)) if log[j][:1] == ("read",) and log[j][2] == buf), None
        )
        if again is not None:
            reused += 1
            assert ("sync", event) in log[copy_at:again], (
                unit,
                buf,
                event,
                "read into before its upload was waited for",
            )
    assert reused >= len(forwards) - 3, reused  # every buffer but the last ones
