"""Where CPU optimizer offload puts masters and gradients and what goes through the side
stream, at stages 1-3: run by test_device_seam.py on the CPU under the fake device
runtime, and by test_cuda.py on a GPU."""

from __future__ import annotations

import contextlib
from typing import Any

import parity
import torch

from zeroshard.distributed import device
from zeroshard.distributed.fake_device import FakeRuntime
from zeroshard.zero.grads.buckets import chunk_sum_of_squares

Z = "zero_optimization"
CPU = parity.PINNED_CPU


def offload_path(rank: int, world: int, fake: bool = False) -> list[dict]:
    """How CPU optimizer offload runs at stages 1-3 (and stage 3 with the parameters
    offloaded too): where masters and gradients are, whether the step writes back
    segment by segment, what went through the side stream. On a GPU (test_cuda.py), or
    on the CPU under the fake runtime."""
    out = []
    for stage, params_off in ((1, False), (2, False), (3, False), (3, True)):
        extra: dict[str, Any] = {"offload_optimizer": CPU}
        if stage == 3:
            extra["stage3_param_persistence_threshold"] = 0
        if params_off:
            extra["offload_param"] = CPU
        case = {"stage": stage, "steps": 2, "gas": 2, "micro": 1, "extra": {Z: extra}}
        with device.use(FakeRuntime()) if fake else contextlib.nullcontext():
            _, engine = parity.train(case, rank, world)
            squares = _landed_squares(engine, rank, world)
        opt, offload = engine.optimizer.states, engine.reducer.offload
        stager = offload.stager if offload is not None else None  # None: no host apart
        store = engine.flat.store.buffer
        lo, hi = store.data_ptr(), store.data_ptr() + store.numel() * store.element_size()
        out.append(
            {
                "stage": stage,
                "params_offloaded": params_off,
                "device": str(engine.device),
                "param_on": str(next(engine.module.parameters()).device),
                "masters_on": sorted({str(m.device) for m in opt.masters}),
                "masters_pinned": all(m.is_pinned() for m in opt.masters),
                "masters_are_shard": all(lo <= m.data_ptr() < hi for m in opt.masters),
                "grads_on": sorted({str(g.device) for g in engine.reducer.grad_chunks}),
                "separate": opt.separate,
                "pipelined": opt.pipelined,
                "side_stream": stager is not None and stager._stream is not None,
                "stager_pinned": stager is not None
                and all(b.is_pinned() for b in stager.buffers()),
                "moved": stager.submitted if stager is not None else 0,
                "pending": stager.pending if stager is not None else -1,
                "buckets": len(engine.reducer.launcher.buckets),  # segments with gradients
                "by_location": engine.memory_stats()["by_location"],
                **squares,
            }
        )
    return out


def _landed_squares(engine, rank: int, world: int) -> dict:
    """One more window (2 micro-steps): whether the host took each chunk's sum of
    squares as it landed (the step's norm then reads no gradient), equal bit for bit to
    the squares of the chunks taken afterwards, and forgotten once a chunk is edited."""
    reducer = engine.reducer
    x, y = (t.to(engine.device) for t in parity.batch(99, 2 * world))
    for m in range(2):
        loss = engine(
            x[m * world + rank : m * world + rank + 1], y[m * world + rank : m * world + rank + 1]
        )
        engine.backward(loss)
        if m == 0:
            engine.step()
    landed = reducer.landed_squares()
    chunks = reducer.grad_chunks
    match = landed is not None and all(
        torch.equal(a, chunk_sum_of_squares(c)) for a, c in zip(landed, chunks, strict=True)
    )
    next(c for c in chunks if c.numel()).mul_(1.0)  # an edit: the squares are stale
    forgotten = reducer.landed_squares() is None
    engine.step()
    return {
        "squares_landed": landed is not None,
        "squares_match": match,
        "squares_forgotten": forgotten,
    }


def check_offload_path(rows: list[dict], gpu: bool) -> None:
    """What :func:`offload_path` must find (``gpu``: on CUDA, with page-locked memory)."""
    assert len(rows) == 4, rows
    for r in rows:
        if gpu:
            assert r["device"] == "cuda:0" and r["param_on"].startswith("cuda"), r
        # masters (and moments) in host memory, page-locked on a GPU: the source of the
        # copies back; the gradient shard is in host memory too, written by the host
        # from the staging buffers, so it needs no pinning
        assert r["masters_on"] == ["cpu"] and r["grads_on"] == ["cpu"], r
        assert r["masters_pinned"] == gpu, r
        if r["params_offloaded"]:
            # stage 3 with the parameters in host memory too: the fp32 shard *is* the
            # master (one host copy, no write-back; gathers cast on the device)
            assert r["masters_are_shard"] and not r["separate"] and not r["pipelined"], r
        else:
            assert r["separate"] and r["pipelined"] and not r["masters_are_shard"], r
        # gradient chunks left the device through the staging buffers on the side
        # stream: each bucket once per window, at the boundary (stages 2, 3: the
        # micro-steps before it added up on the device, in fp32)
        assert r["side_stream"] and r["stager_pinned"] == gpu and r["pending"] == 0, r
        assert r["moved"] == 3 * r["buckets"], r  # 2 steps and _landed_squares' window
        # the norm adds up the squares the host took as each chunk landed
        assert r["squares_landed"] and r["squares_match"] and r["squares_forgotten"], r
        # memory_stats places them truthfully: the optimizer side on the host; the
        # parameters on the device unless offloaded
        if gpu:
            assert r["by_location"]["cpu"] > 0, r
            assert r["params_offloaded"] or r["by_location"].get("cuda:0", 0) > 0, r
