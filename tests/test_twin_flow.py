"""ZeRO-Offload++ Twin-Flow (``offload_optimizer.ratio``): the leading segments of each
rank's shard keep their masters, optimizer states and reduced gradients on the device and
step there; the rest is offloaded and steps on the host.

On this CPU-only machine the split is taken on the GPU's code path
(``ZEROSHARD_STAGE_ON_CPU=1``: "staged"): separate masters, gradients staged to the host
for the offloaded share only. Parity at stages 1-3 and ratios 0 / 0.3 / 1 against the
single-process fp32 reference, and at stage 3 with NVMe (the offloaded share's states in
swap files); where each share lives; fp16 overflow skipping and bf16 beside plain
offload; a checkpoint saved at one ratio resumed at another ratio, stage, device (CPU,
NVMe) and world size. One spawn of 2 ranks (and one of 1 rank for the world-size
change).
"""

from __future__ import annotations

import os
from typing import Any

import cases
import multirank
import parity
import pytest
import resume
import torch

from zeroshard.config import load_config
from zeroshard.config.schema import ConfigError
from zeroshard.offload.placement import Placement
from zeroshard.offload.staging import STAGE_ON_CPU_ENV

Z = "zero_optimization"


def _offload(ratio: float) -> dict:
    return {"offload_optimizer": {**parity.PINNED_CPU, "ratio": ratio}}


def _case(stage: int, ratio: float, **kw: Any) -> dict:
    return {"stage": stage, "gas": 2, "micro": 1, "clip": 1.0, "staged": True, "extra": {Z: _offload(ratio)}, **kw}  # fmt: skip


PARITY = [
    *(_case(stage, ratio) for stage in (1, 2, 3) for ratio in (0.0, 0.3, 1.0)),
    # a CPU-only run: host and device are one memory, nothing to split (as plain offload)
    _case(2, 0.3, staged=False),
    _case(2, 0.3, dtype="bf16"),
    # a torch optimizer of the user's, re-pointed at masters on both sides; SGD's momentum
    _case(3, 0.3, client=True),
    _case(1, 0.3, opt="SGD", lr=0.1),
]


def _nvme(root: str, ratio: float, name: str) -> dict:
    """Twin-Flow with NVMe: the device's share in memory, the rest in swap files."""
    off = {"device": "nvme", "nvme_path": os.path.join(root, name), "ratio": ratio}
    off |= {"pipeline_read": True, "pipeline_write": True, "buffer_count": 6}
    return {"offload_optimizer": off, "sub_group_size": 2000}


def _parity_cases(root: str) -> list[dict]:
    nvme = [
        {**_case(3, ratio, dtype=dtype), "extra": {Z: _nvme(root, ratio, f"p{ratio}{dtype}")}}
        for ratio, dtype in ((0.0, "fp32"), (0.3, "fp32"), (0.6, "bf16"))
    ]
    return PARITY + nvme


def _where(rank: int, world: int) -> list[dict]:
    """Where each share lives after one step at gas 1 (each bucket's chunk moved once)."""
    out = []
    for stage in (1, 2, 3):
        for ratio in (0.0, 0.3, 1.0):
            case = {**_case(stage, ratio), "gas": 1, "steps": 1}
            _, engine = parity.train(case, rank, world)
            states, reducer = engine.optimizer.states, engine.reducer
            k = states.device_segments
            stores = [m.untyped_storage().data_ptr() for m in states.masters]
            chunks = reducer.grad_chunks
            host = reducer.grad_shard
            hlo = host.data_ptr()
            hhi = hlo + host.numel() * host.element_size()
            memory = engine.memory_stats()
            twin = memory.get("twin_flow")
            largest = max(seg.chunk for seg in engine.flat.layout.segments)
            with_grads = [s for s, c in enumerate(chunks) if c.numel()]
            out.append(
                {
                    "stage": stage,
                    "ratio": ratio,
                    "segments": len(engine.flat.layout.segments),
                    "device_segments": k,
                    "largest_share": largest / engine.flat.layout.shard_numel,
                    "shard": engine.flat.layout.shard_numel,
                    "chunks": [seg.chunk for seg in engine.flat.layout.segments],
                    # the device's masters share one buffer, the host's another
                    "master_buffers": [len(set(stores[:k])), len(set(stores[k:]))],
                    # gradients of the device's share are not in the host shard
                    "grads_on_host": [
                        s for s in with_grads if hlo <= chunks[s].data_ptr() < hhi and host.numel()
                    ],
                    "with_grads": with_grads,
                    "moved": reducer.offload.stager.submitted,
                    "twin": twin,
                    "optimizer_states": memory["optimizer_states"],
                    "grads": memory["grads"],
                    "twin_shard": reducer.twin_shard is not None,
                }
            )
    return out


FP16_STEPS = 8


def _where_nvme(rank: int, world: int, root: str) -> dict:
    """Twin-Flow with NVMe, ratio 0.3 at stage 3 (gas 1): what is on the device, in
    the swap files and in host memory."""
    case = {**_case(3, 0.3), "gas": 1, "steps": 2, "extra": {Z: _nvme(root, 0.3, "where")}}
    _, engine = parity.train(case, rank, world)
    states = engine.optimizer.states
    memory = engine.memory_stats()
    out = {
        "store": type(states).__name__,
        "device_numel": states.device_numel,
        "shard": engine.flat.layout.shard_numel,
        "nvme": memory["by_location"].get("nvme", 0),
        "twin": memory["twin_flow"],
        "moved": engine.reducer.offload.stager.submitted,
        "with_grads": sum(1 for c in engine.reducer.grad_chunks if c.numel()),
        "on_device": sum(
            1
            for s, c in enumerate(engine.reducer.grad_chunks)
            if c.numel() and s < states.device_segments
        ),
        "kinds": list(states.kinds),
    }
    # a scheduler's change reaches the device's optimizer at the next step
    for g in engine.optimizer.param_groups:
        g["lr"] *= 0.5
    x, y = parity.batch(9, world)
    engine.backward(engine(x[rank : rank + 1], y[rank : rank + 1]))
    engine.step()
    out["lrs"] = [[g["lr"] for g in groups.param_groups] for groups in (states, states.device)]
    return out


def _fp16_skips(rank: int, world: int) -> list[dict]:
    """fp16 with a loss scale that overflows the first steps: twin and plain offload
    skip the same steps and end with the same parameters."""
    out = []
    for ratio in (0.3, 1.0):
        case = {**_case(3, ratio), "dtype": "fp16", "steps": FP16_STEPS}
        case["extra"] = {**case["extra"], "fp16": {"enabled": True, "initial_scale_power": 20, "hysteresis": 1}}  # fmt: skip
        losses, engine = parity.train(case, rank, world)
        params = parity.full_params(engine)
        out.append(
            {
                "losses": losses,
                "skipped": engine.skipped_steps,
                "params": {k: v.flatten().tolist() for k, v in params.items()},
            }
        )
    return out


RESUME = {"stage": 2, "zero": _offload(0.3)}


def _chains(root: str) -> list[tuple[dict, list[dict]]]:
    """(saved at, [resumed at, ...]): across ratios, stages and NVMe both ways."""
    return [
        (
            RESUME,
            [
                {"stage": 2, "zero": _offload(1.0)},
                {"stage": 2, "zero": _offload(0.0)},
                {"stage": 3, "zero": _offload(0.6)},
                {"stage": 1, "zero": {"offload_optimizer": {"device": "none"}}},
                {"stage": 3, "zero": _nvme(root, 0.5, "load")},
            ],
        ),
        (
            {"stage": 3, "zero": _nvme(root, 0.5, "save")},
            [{"stage": 3, "zero": _offload(1.0)}, {"stage": 2, "zero": _offload(0.3)}],
        ),
    ]


def _staged(case: dict, world: int):
    os.environ[STAGE_ON_CPU_ENV] = "1"
    try:
        return resume.make(case, world)
    finally:
        os.environ.pop(STAGE_ON_CPU_ENV)


def _summary(engine, losses: list[float]) -> dict:
    params = parity.full_params(engine)
    return {
        "losses": losses,
        "params": {k: v.flatten().tolist() for k, v in params.items()},
        "lr": engine.get_lr(),
    }


def _resume(rank: int, world: int, root: str, phase: str) -> list[list[dict]]:
    """Per chain of :func:`_chains`: ``first``, the straight run (10 steps) of the saved
    config and its checkpoint after 5; ``second``, each resumed config from that
    checkpoint for the last 5."""
    out = []
    for i, (saved, loads) in enumerate(_chains(root)):
        ckpt = os.path.join(root, f"ckpt{i}")
        if phase == "first":
            engine = _staged(saved, world)
            losses = resume.train(engine, rank, world, range(5))
            engine.save_checkpoint(ckpt)
            losses += resume.train(engine, rank, world, range(5, 10))
            out.append([_summary(engine, losses)])
            continue
        done = []
        for case in loads:
            engine = _staged(case, world)
            engine.load_checkpoint(ckpt)
            assert engine.global_steps == 5
            done.append(_summary(engine, resume.train(engine, rank, world, range(5, 10))))
        out.append(done)
    return out


def _job(rank: int, world: int, root: str) -> dict:
    return {
        "parity": parity.run_cases(rank, world, _parity_cases(root)),
        "where": _where(rank, world),
        "nvme": _where_nvme(rank, world, root),
        "fp16": _fp16_skips(rank, world),
        "resume": _resume(rank, world, root, "first"),
        "resumed": _resume(rank, world, root, "second"),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[list[dict], str]:
    root = str(tmp_path_factory.mktemp("twin"))
    return multirank.run(_job, 2, root, timeout=600), root


def test_parity_at_every_stage_and_ratio(two_ranks, subtests: pytest.Subtests) -> None:
    results, root = two_ranks
    case_list = _parity_cases(root)
    per_rank = [r["parity"] for r in results]
    parity.check_parity(subtests, case_list, per_rank, 2)

    # on this CPU the device's share steps with the same kernels: bit for bit the
    # losses of plain offload (ratio 1)
    def key(c: dict) -> tuple:
        ratio = c["extra"][Z]["offload_optimizer"]["ratio"]
        return (c["stage"], ratio, c.get("staged"), c.get("dtype"), c.get("opt"), c.get("client"))

    by = {key(c): cases.values(per_rank, parity.case_name(c))[0] for c in case_list}
    for stage in (1, 2, 3):
        plain = by[stage, 1.0, True, None, None, None]["losses"]
        assert by[stage, 0.3, True, None, None, None]["losses"] == plain, stage
        assert by[stage, 0.0, True, None, None, None]["losses"] == plain, stage


def test_each_share_lives_where_the_ratio_says(two_ranks) -> None:
    results, _ = two_ranks
    for per_rank in results:
        for r in per_rank["where"]:
            k, n = r["device_segments"], r["segments"]
            if r["ratio"] == 1.0:  # plain offload, unchanged: no split, no report
                assert k == 0 and r["twin"] is None and not r["twin_shard"], r
                assert r["grads_on_host"] == r["with_grads"] and r["moved"] == len(r["with_grads"])
                continue
            twin = r["twin"]
            # the most leading segments within 1 - ratio of the shard
            share = twin["device_share"]
            assert share <= 1 - r["ratio"] + 1e-9, r
            assert share > 1 - r["ratio"] - r["largest_share"], r
            assert (k == n) == (r["ratio"] == 0.0), r
            assert r["master_buffers"] == [1 if k else 0, 1 if k < n else 0], r
            # only the offloaded share's gradients crossed to the host, once each
            on_device = [s for s in r["with_grads"] if s < k]
            assert r["grads_on_host"] == [s for s in r["with_grads"] if s >= k], r
            assert r["moved"] == len(r["with_grads"]) - len(on_device), r
            # the report splits the optimizer side by place, and adds up
            opt = twin["optimizer_states"]
            assert opt["device"] + opt["host"] == r["optimizer_states"], r
            assert opt["device"] > 0 and (opt["host"] > 0) == (r["ratio"] > 0), r
            # AdamW: an fp32 master per element, two moments per trainable one (stage 3
            # keeps frozen parameters in a segment of their own), a step counter per
            # parameter piece
            chunks, trained = r["chunks"], set(r["with_grads"])
            for place, segs in (("device", range(k)), ("host", range(k, n))):
                want = sum(4 * chunks[s] + 8 * chunks[s] * (s in trained) for s in segs)
                assert want <= opt[place] < want + 4096, (place, r)
            assert round(share * r["shard"]) == sum(chunks[:k]), r
            grads = twin["grads"]
            assert (grads["device"] > 0) == (r["stage"] >= 2), r  # stage 1: in the full buffer
            assert grads["device"] + grads["host"] <= r["grads"], r


def test_nvme_holds_the_offloaded_share(two_ranks) -> None:
    results, _ = two_ranks
    for per_rank in results:
        r = per_rank["nvme"]
        assert r["store"] == "TwinStates", r
        rest = r["shard"] - r["device_numel"]
        assert 0.6 < r["twin"]["device_share"] <= 0.7, r
        # masters and both moments of the offloaded share, in whole disk blocks
        assert 12 * rest <= r["nvme"] < 12 * rest + 3 * 4096, r
        # the device's share: masters and moments in device memory; the host keeps
        # only the swap buffers
        assert r["twin"]["optimizer_states"]["device"] >= 12 * r["device_numel"] - 8 * 256, r
        assert r["moved"] == 2 * (r["with_grads"] - r["on_device"]), r  # 2 steps
        assert r["kinds"] == ["exp_avg", "exp_avg_sq", "master"], r
        halved = [parity.LR / 2, parity.LR_NODECAY / 2]
        assert r["lrs"] == [halved, halved], r["lrs"]


def test_fp16_overflow_skips_alike(two_ranks) -> None:
    results, _ = two_ranks
    for per_rank in results:
        twin, plain = per_rank["fp16"]
        assert 0 < plain["skipped"] < FP16_STEPS, plain["skipped"]  # some skipped, some not
        assert twin["skipped"] == plain["skipped"]
        assert twin["losses"] == plain["losses"] and twin["params"] == plain["params"]


def _same_training(straight: dict, got: dict, what: Any) -> None:
    assert got["lr"] == straight["lr"], what
    diff = max(abs(a - b) for a, b in zip(got["losses"], straight["losses"][5:], strict=True))
    assert diff <= parity.TOL, (what, diff)
    for name, values in straight["params"].items():
        err = max(abs(a - b) for a, b in zip(got["params"][name], values, strict=True))
        assert err <= parity.TOL, (what, name, err)


def test_checkpoint_resumes_at_another_ratio_stage_and_world_size(two_ranks) -> None:
    results, root = two_ranks
    chains = _chains(root)
    for (saved, loads), (straight,), resumed in zip(chains, results[0]["resume"], results[0]["resumed"], strict=True):  # fmt: skip
        for case, got in zip(loads, resumed, strict=True):
            _same_training(straight, got, (saved, case))
    one = multirank.run(_resume, 1, root, "second", timeout=300)[0]
    for (saved, loads), (straight,), resumed in zip(chains, results[0]["resume"], one, strict=True):  # fmt: skip
        for case, got in zip(loads, resumed, strict=True):
            _same_training(straight, got, ("1 rank", saved, case))


# -- config and index math (no processes) -------------------------------------------------
def _zero(**offload: Any) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, Z: {"stage": 3, **offload}}


@pytest.mark.parametrize(
    ("zero", "says"),
    [
        ({"offload_optimizer": {"device": "none", "ratio": 0.5}}, 'needs device "cpu" or "nvme"'),
        (
            {"offload_optimizer": {"device": "cpu", "ratio": 0.5, "delayed_update": True}},
            "delayed_update",
        ),
        (
            {
                "offload_optimizer": {"device": "cpu", "ratio": 0.5},
                "offload_param": {"device": "cpu"},
            },
            "offload_param",
        ),
        ({"offload_optimizer": {"device": "cpu", "ratio": 1.5}}, "ratio"),
    ],
)
def test_ratios_not_built_are_refused_by_name(zero: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=r"offload_optimizer\.ratio") as err:
        load_config(_zero(**zero))
    assert says in str(err.value)


def test_ratio_is_read() -> None:
    cfg = load_config(_zero(offload_optimizer={"device": "cpu", "ratio": 0.25}))
    assert cfg.zero_optimization.offload_optimizer.ratio == 0.25
    assert not cfg.inert


class _Seg:
    def __init__(self, index: int, shard_start: int, chunk: int) -> None:
        self.index, self.shard_start, self.chunk = index, shard_start, chunk


class _Layout:
    def __init__(self, chunks: list[int]) -> None:
        starts = [sum(chunks[:i]) for i in range(len(chunks))]
        self.segments = [_Seg(i, a, c) for i, (a, c) in enumerate(zip(starts, chunks, strict=True))]  # fmt: skip
        self.shard_numel = sum(chunks)


@pytest.mark.parametrize(
    ("ratio", "count"), [(0.0, 4), (0.1, 3), (0.3, 2), (0.5, 2), (0.55, 1), (0.9, 0), (1.0, 0)]
)
def test_device_segments_never_hold_more_than_asked(monkeypatch, ratio: float, count: int) -> None:
    monkeypatch.setenv(STAGE_ON_CPU_ENV, "1")
    cpu = torch.device("cpu")
    place = Placement(device=cpu, param_shard=cpu, optimizer=cpu, optimizer_offload="cpu", optimizer_ratio=ratio)  # fmt: skip
    layout = _Layout([40, 10, 30, 20])  # 100 elements
    assert place.device_segments(layout) == count
    monkeypatch.setenv(STAGE_ON_CPU_ENV, "0")  # host and device one memory: no split
    assert place.device_segments(layout) == 0
