"""The device mesh and its first 2-D use, hybrid sharding (MiCS / HSDP).

Pure index math first (no processes); then one 4-rank spawn (2 replicas x 2 shards)
that trains at stages 1, 2 and 3 against the single-process fp32 reference and records
one step's ledger per mesh axis.
"""

from __future__ import annotations

import functools

import cases
import multirank
import parity
import pytest

from zeroshard.distributed.mesh import AXES, Mesh, MeshError, MeshShape

TOL = parity.TOL
SHARD = 2  # zero_optimization.mics_shard_size: 4 ranks = 2 replicas x 2 shards


def test_coords_are_row_major_with_tp_fastest():
    shape = MeshShape(pp=2, dp_replicate=1, dp_shard=2, sp=1, tp=2)
    assert shape.world == 8
    assert shape.coords(0) == dict.fromkeys(AXES, 0)
    assert shape.coords(1)["tp"] == 1 and shape.coords(2)["dp_shard"] == 1
    assert shape.coords(4)["pp"] == 1
    for rank in range(8):
        assert shape.rank_of(shape.coords(rank)) == rank
    assert shape.partitions(("tp",)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.partitions(("dp_shard",)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.partitions(("pp", "tp")) == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_for_world_hybrid_and_errors():
    assert MeshShape.for_world(8) == MeshShape(dp_shard=8)
    assert MeshShape.for_world(8, shard_size=2) == MeshShape(dp_replicate=4, dp_shard=2)
    assert MeshShape.for_world(8, shard_size=8) == MeshShape(dp_shard=8)
    assert MeshShape.for_world(8, shard_size=-1) == MeshShape(dp_shard=8)
    assert MeshShape.for_world(8, tp=2, pp=2) == MeshShape(pp=2, dp_shard=2, tp=2)
    with pytest.raises(MeshError, match="mics_shard_size: 3 does not divide"):
        MeshShape.for_world(8, shard_size=3)
    with pytest.raises(MeshError, match="autotp_size"):
        MeshShape.for_world(6, tp=4)
    with pytest.raises(MeshError, match="whole number"):
        MeshShape(tp=0)


def test_one_process_mesh_has_local_comms():
    mesh = Mesh.build(MeshShape())
    assert mesh.size("dp") == 1 and mesh.coord("zero_shard") == 0
    assert mesh.comm("zero_shard").world_size == 1
    with pytest.raises(KeyError, match="no mesh axis"):
        mesh.comm("data")


def _one_gpu_host(rank: int, world: int) -> dict:
    """``torch.cuda`` answers as on a host with one GPU (what DeviceMesh and the device
    seam ask: is_available, device_count, is_initialized, set_device, init): an ordinal past it
    raises as CUDA does, and setting a device initializes the runtime."""
    import torch

    state: dict = {"initialized": False, "set": []}

    def set_device(device) -> None:
        index = device if isinstance(device, int) else torch.device(device).index or 0
        if index >= 1:
            raise RuntimeError(f"CUDA error: invalid device ordinal ({index})")
        state["initialized"] = True
        state["set"].append(index)

    torch.cuda.set_device = set_device  # this spawned rank's torch only
    torch.cuda.is_initialized = lambda: state["initialized"]
    torch.cuda.device_count = lambda: 1
    torch.cuda.is_available = lambda: True  # DeviceMesh's gloo-on-a-GPU-host branch
    torch.cuda.init = lambda: state.update(initialized=True)
    mesh = Mesh.build(MeshShape(dp_shard=world), device_type="cuda")
    return {"set": state["set"], "dp": mesh.size("dp"), "coord": mesh.coord("dp_shard")}


def test_ranks_sharing_one_gpu_build_the_mesh():
    """Two ranks on one GPU (gloo, as test_cuda.py runs every multi-rank case on a
    one-GPU host): DeviceMesh would make ``cuda:LOCAL_RANK`` current and rank 1 would
    die with "invalid device ordinal"; the mesh makes ``cuda:0`` current first."""
    for rank, r in enumerate(multirank.run(_one_gpu_host, 2, timeout=120)):
        assert r == {"set": [0], "dp": 2, "coord": rank}, r


def _cases() -> list[dict]:
    z = {"zero_optimization": {"mics_shard_size": SHARD, "stage3_param_persistence_threshold": 0}}
    return [
        {"stage": 1, "gas": 2, "clip": 0.8, "frozen": False, "extra": z},
        {"stage": 2, "gas": 2, "clip": 0.8, "frozen": False, "bucket": 3000, "extra": z},
        {"stage": 2, "gas": 1, "frozen": False, "bucket": 10**9, "extra": z},
        {"stage": 3, "gas": 2, "clip": 0.8, "frozen": False, "extra": z},
        # the GPU code path's offload (separate host masters, staged moves) with replicas
        {"stage": 2, "gas": 2, "frozen": False, "staged": True, "extra": _offload(z)},
        {"stage": 3, "gas": 1, "frozen": False, "staged": True, "extra": _offload(z)},
    ]


def _offload(z: dict) -> dict:
    zo = {**z["zero_optimization"], "offload_optimizer": {"device": "cpu"}}
    return {"zero_optimization": zo}


def _ledger(rank: int, world: int, case: dict) -> dict:
    """One step's ledger per mesh axis, after training ``case``."""
    # untied: a tied embedding is gathered once more, for the head's forward
    one = {**case, "gas": 1, "clip": 0.0, "steps": 1, "tied": False}
    if case["stage"] == 3:  # reuse distance 0: gathered again for backward
        zo = {**one["extra"]["zero_optimization"], "stage3_max_reuse_distance": 0}
        one["extra"] = {**one["extra"], "zero_optimization": zo}
    _, engine = parity.train(one, rank, world)
    engine.reset_comm_stats()
    x, y = parity.batch(99, 2 * world)
    engine.backward(engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
    engine.step()
    return {
        "axes": engine.comm_stats(by_axis=True),
        "numel": engine.flat.layout.total_numel,
        "stage": case["stage"],
        "coords": engine.mesh.coords,
        "dp": engine.dp_world_size,
        "flags": parity.flag_bytes(engine),
    }


def _ledger_name(case: dict) -> str:
    return f"ledger stage{case['stage']}-{case.get('bucket')}"


def _worker(rank: int, world: int, case_list: list[dict], ckpt: str) -> dict:
    return cases.run_named(
        [
            *parity.named_cases(rank, world, case_list),
            *((_ledger_name(c), functools.partial(_ledger, rank, world, c)) for c in case_list[:4]),
            ("checkpoint", lambda: _checkpoint(rank, world, ckpt)),
            ("mpu", lambda: _mpu(rank, world)),
        ]
    )


class _MPU:
    """A Megatron-style mpu: tensor-parallel pairs of adjacent ranks, data-parallel
    across them (the model is replicated here, so tp ranks compute the same thing)."""

    def __init__(self, rank: int, world: int) -> None:
        import torch.distributed as dist

        tp_groups = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
        dp_groups = [dist.new_group(list(range(j, world, 2))) for j in range(2)]
        self.tp, self.dp = tp_groups[rank // 2], dp_groups[rank % 2]

    def get_data_parallel_group(self):
        return self.dp

    def get_model_parallel_group(self):
        return self.tp


def _mpu(rank: int, world: int) -> dict:
    import torch.distributed as dist

    mpu = _MPU(rank, world)
    case = {"stage": 2, "gas": 2, "clip": 0.8}
    _, ref_params = parity.reference(case, 2)
    _, engine = parity.train(case, dist.get_rank(mpu.dp), 2, mpu=mpu)
    return {
        "dp": engine.dp_world_size,
        "tp": engine.mesh.size("tp"),
        "param": parity.max_param_diff(parity.full_params(engine), ref_params),
    }


def _step(engine, rank: int, world: int, step: int) -> float:
    x, y = parity.batch(step, 2 * world)
    loss = engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
    engine.backward(loss)
    engine.step()
    return loss.item()


def _checkpoint(rank: int, world: int, ckpt: str) -> dict:
    """A hybrid stage-3 save loads into the same layout, into plain ZeRO-2 and into
    hybrid ZeRO-1; each continues like the engine that saved it."""
    z = {"mics_shard_size": SHARD, "stage3_param_persistence_threshold": 0}
    case = {"stage": 3, "gas": 1, "steps": 3, "extra": {"zero_optimization": z}}
    _, engine = parity.train(case, rank, world)
    engine.save_checkpoint(ckpt, tag="hybrid")
    saved = parity.full_params(engine)
    _step(engine, rank, world, 50)
    after = parity.full_params(engine)
    out = {}
    for name, stage, mics in (("same", 3, SHARD), ("zero2", 2, -1), ("hybrid1", 1, SHARD)):
        zc = {"mics_shard_size": mics, "stage3_param_persistence_threshold": 0}
        _, other = parity.train(
            {"stage": stage, "steps": 0, "extra": {"zero_optimization": zc}}, rank, world
        )
        other.load_checkpoint(ckpt, tag="hybrid")
        loaded = parity.full_params(other)
        _step(other, rank, world, 50)
        out[name] = {
            "loaded": parity.max_param_diff(loaded, saved),
            "continued": parity.max_param_diff(parity.full_params(other), after),
        }
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("hybrid-ckpt"))
    return multirank.run(_worker, 4, _cases(), ckpt, timeout=600)


def _check_checkpoint(per_rank: list) -> None:
    for r in per_rank:
        for name, diffs in r.items():
            assert diffs["loaded"] == 0.0, (name, diffs)
            assert diffs["continued"] <= (0.0 if name == "same" else TOL), (name, diffs)


def test_hybrid_checkpoint_reshards(results, subtests):
    cases.check(subtests, results, "checkpoint", _check_checkpoint)


def test_hybrid_parity(results, subtests):
    parity.check_parity(subtests, _cases(), results, 4)


def _check_ledger(key: str, per_rank: list) -> None:
    """All-gathers and reduce-scatters stay inside the shard group; across replicas
    only the all-reduce of each reduced shard, 4 Psi / shard size (counted 2x)."""
    for rank, led in enumerate(per_rank):
        axes, numel, stage = led["axes"], led["numel"], led["stage"]
        assert led["dp"] == 4
        assert led["coords"]["dp_shard"] == rank % SHARD
        assert led["coords"]["dp_replicate"] == rank // SHARD
        assert set(axes) == {"zero_shard", "zero_replicate"}, (key, axes)
        shard, rep = axes["zero_shard"], axes["zero_replicate"]
        assert set(shard) == {"reduce_scatter", "all_gather", "all_reduce"}, (key, shard)
        assert set(rep) == {"all_reduce"}, (key, rep)
        assert shard["reduce_scatter"]["bytes"] == 4 * numel, key
        gathers = 2 if stage == 3 else 1  # stage 3: forward and backward
        assert shard["all_gather"]["bytes"] == gathers * 4 * numel, key
        # besides the used-parameter flags, one byte per parameter on each group
        assert shard["all_reduce"]["bytes"] == led["flags"], key
        assert rep["all_reduce"]["bytes"] == 2 * 4 * numel // SHARD + led["flags"], key


def test_hybrid_ledger_per_axis(results, subtests):
    """The ledger of one step per case (``_check_ledger``), each case on its own."""
    names = [_ledger_name(c) for c in _cases()[:4]]
    cases.check_each(subtests, results, _check_ledger, names=names)


def _check_mpu(per_rank: list) -> None:
    for m in per_rank:
        assert (m["dp"], m["tp"]) == (2, 2)
        assert m["param"] <= TOL, m


def test_initialize_with_mpu(results, subtests):
    cases.check(subtests, results, "mpu", _check_mpu)
