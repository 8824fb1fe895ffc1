"""NVMe (swap file) offload: ZeRO-Infinity's tier, tested on the local disk.

Parity of stage 3 with parameters and optimizer states in swap files; the files exist
under nvme_path while training and are gone after a clean exit; memory_stats puts the
swapped bytes under "nvme" and leaves only the buffer pool in RAM.
"""

from __future__ import annotations

import os

import multirank
import parity
import pytest
import rss
import torch


def _nvme(path: str, **extra) -> dict:
    off = {"device": "nvme", "nvme_path": path}
    return {
        "offload_optimizer": {
            **off,
            "pipeline_read": True,
            "pipeline_write": True,
            "buffer_count": 6,
        },
        "offload_param": off,
        "stage3_param_persistence_threshold": 0,
        "sub_group_size": 5000,  # several sub-groups: exercises the read/step/write pipeline
        **extra,
    }


def test_nvme_parity(tmp_path, subtests: pytest.Subtests) -> None:
    z = "zero_optimization"
    cases = [
        {"stage": 3, "gas": 4, "micro": 1, "clip": 1.0, "extra": {z: _nvme(str(tmp_path / "a"))}},
        {
            "stage": 3,
            "gas": 1,
            "clip": 0.5,
            "extra": {
                z: {
                    "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "b")},
                    "sub_group_size": 3000,
                }
            },
        },
        {"stage": 3, "gas": 2, "dtype": "bf16", "extra": {z: _nvme(str(tmp_path / "c"))}},
        {  # parameters in swap files, optimizer (fp32 masters) in memory
            "stage": 3,
            "gas": 4,
            "micro": 1,
            "clip": 1.0,
            "extra": {
                z: {
                    "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "d")},
                    "stage3_param_persistence_threshold": 0,
                }
            },
        },
    ]
    parity.check_parity(subtests, cases, multirank.run(parity.run_cases, 2, cases, timeout=600), 2)
    assert not os.listdir(tmp_path / "a"), "swap files left behind after a clean exit"


def _files_and_memory(rank: int, world: int, path: str) -> dict:
    case = {"stage": 3, "steps": 2, "extra": {"zero_optimization": _nvme(path)}}
    _, engine = parity.train(case, rank, world)
    listing = {}
    for root, _, files in os.walk(path):
        for f in files:
            listing[os.path.relpath(os.path.join(root, f), path)] = os.path.getsize(
                os.path.join(root, f)
            )
    mem = engine.memory_stats()
    psi = sum(s.used for s in engine.flat.layout.segments)
    direct = next(iter(engine._swap_spaces.values())).direct
    return {"files": listing, "memory": mem, "psi": psi, "direct": direct}


def test_swap_files_while_training(tmp_path) -> None:
    path = str(tmp_path / "swap")
    results = multirank.run(_files_and_memory, 2, path, timeout=300)
    for rank, r in enumerate(results):
        mine = {k: v for k, v in r["files"].items() if f"-rank{rank}-" in k}
        names = {os.path.basename(k) for k in mine}
        assert {"params", "master", "exp_avg", "exp_avg_sq"} <= names, r["files"]
        m, psi = r["memory"], r["psi"]
        # parameters (fp32) and optimizer states (master + 2 moments) of this rank's shard
        assert m["by_location"]["nvme"] >= (4 + 12) * psi / 2
        assert m["by_location"]["nvme"] == sum(mine.values())
        # RAM: the gathered persistent units (none: threshold 0) + grads + buffer sets only
        assert m["by_location"]["cpu"] < m["by_location"]["nvme"]
    assert not os.path.exists(path) or not os.listdir(path)


def test_swap_space_rejects_unaligned_io(tmp_path) -> None:
    from zeroshard.offload.nvme import SwapSpace, aligned_empty

    space = SwapSpace(str(tmp_path), "t")
    f = space.file("x", 3 * 4096)
    buf = aligned_empty(4096)
    buf.fill_(7)
    space.write_async(f, buf, 4096).result()
    back = aligned_empty(4096)
    space.read_async(f, back, 4096).result()
    assert torch.equal(buf, back)
    with pytest.raises(ValueError, match="unaligned"):
        f.read(aligned_empty(4096 * 2)[1:4097], 0)
    with pytest.raises(ValueError, match="past the end"):
        f.read(aligned_empty(4096 * 2), 2 * 4096)
    space.close()
    assert not os.path.exists(space.dir)


def test_stale_swap_dirs_of_dead_processes_are_removed(tmp_path, monkeypatch) -> None:
    """A crashed run's swap directory is deleted by the next space made in the same
    nvme_path, also on hosts whose names contain dashes; live processes' and other
    hosts' directories are kept."""
    import socket
    import subprocess

    from zeroshard.offload import nvme

    host = "ip-10-0-0-1"
    monkeypatch.setattr(socket, "gethostname", lambda: host)
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is now free (reuse within the test is vanishingly unlikely)
    names = {
        "dead": f"zeroshard-swap-{host}-{dead.pid}-rank0-abc_12",
        "live": f"zeroshard-swap-{host}-{os.getpid()}-rank1-xyz_9",
        "other_host": f"zeroshard-swap-otherhost-{dead.pid}-rank0-q1",
        "not_ours": "my-data",
    }
    for name in names.values():
        os.makedirs(tmp_path / name / "sub")
        (tmp_path / name / "sub" / "master").write_bytes(b"x" * 10)
    space = nvme.SwapSpace(str(tmp_path), "rank0")
    left = set(os.listdir(tmp_path))
    assert names["dead"] not in left
    assert {names["live"], names["other_host"], names["not_ours"]} <= left
    space.close()


def _train_gpt(rank: int, world: int, nvme: str | None) -> dict:
    from zeroshard.models import GPTConfig

    zc: dict = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if nvme:
        zc.update(_nvme(nvme, sub_group_size=1_000_000))
    cfg = GPTConfig(vocab_size=256, seq_len=16, n_layer=8, n_head=8, d_model=512)
    engine, delta = rss.train_gpt(cfg, zc, partitioned=True)
    m = engine.memory_stats()
    pools = []
    if nvme:
        pools = engine.flat.store.buffers() + [
            t for s in engine.optimizer.inner.sets for t in s.values()
        ]
    return {
        "delta_mib": delta,
        "memory": m,
        "pool_bytes": sum(t.untyped_storage().nbytes() for t in pools),
        "pool_buffers": len(pools),
    }


@pytest.mark.slow
def test_nvme_ram_holds_only_the_buffer_pool(tmp_path, monkeypatch) -> None:
    """Measured: the bytes memory_stats moves to "nvme" really leave RAM (peak RSS), and
    what stays of the parameter and optimizer side is the buffer pool alone."""
    monkeypatch.setitem(os.environ, "MALLOC_MMAP_THRESHOLD_", "65536")  # RSS follows frees
    mem = multirank.run(_train_gpt, 2, None, timeout=300, start="spawn")
    swp = multirank.run(_train_gpt, 2, str(tmp_path / "swap"), timeout=300, start="spawn")
    for a, b in zip(mem, swp, strict=True):
        ma, mb = a["memory"], b["memory"]
        # in RAM, params + optimizer states are exactly the pools (plus the buffers of
        # units gathered right now: none between steps, threshold 0)
        in_ram = mb["params"] + mb["optimizer_states"] - mb["by_location"]["nvme"]
        assert in_ram == b["pool_bytes"], (in_ram, b["pool_bytes"])
        assert b["pool_buffers"] <= 5 + 2 * 3  # buffer_count (params) + 2 sets of 3 (Adam)
        # RSS: the run without NVMe holds its params + states in RAM; with NVMe they are
        # on disk and only the pools remain, so peak RSS drops by (nearly) the difference
        expected = (ma["params"] + ma["optimizer_states"] - in_ram) / 2**20
        saved = a["delta_mib"] - b["delta_mib"]
        assert expected > 100, expected  # a model large enough for RSS to show it
        assert saved >= 0.8 * expected, (saved, expected, a["delta_mib"], b["delta_mib"])
        print(
            f"peak RSS above baseline: in memory {a['delta_mib']:.0f} MiB, NVMe "
            f"{b['delta_mib']:.0f} MiB (states off RAM: {expected:.0f} MiB)"
        )


def test_swap_writer_writes_each_chunk_once(tmp_path) -> None:
    """The NVMe optimizer writes its new masters sub-group after sub-group: the swapped
    parameter store's writer assembles each chunk and writes it once, whole, where a
    write per piece read, patched and wrote the whole chunk each time. Runs that start
    or stop inside a chunk keep the stored values around them."""
    from zeroshard.offload.nvme import BufferPool, SwapSpace
    from zeroshard.offload.store import SwapShard
    from zeroshard.zero.layout.partition import FlatLayout

    layout = FlatLayout([3000, 5000, 1000, 2500], 1, groups=[[0], [1], [2, 3]], align=1024)
    n = layout.shard_numel
    space = SwapSpace(str(tmp_path), "t")
    try:
        chunk_bytes = max(seg.chunk for seg in layout.segments) * 4
        shard = SwapShard(
            space.file("params", n * 4), BufferPool(2, chunk_bytes, "b"), layout, torch.float32
        )
        before = torch.randn(n)
        shard.write("param", 0, before)
        moves = {"read": 0, "write": 0}
        for op in moves:
            real = getattr(shard.file, op)

            def counted(buf, offset, real=real, op=op) -> None:
                moves[op] += buf.numel()
                real(buf, offset)

            setattr(shard.file, op, counted)
        new = torch.randn(n)
        writer = shard.writer()
        for a in range(0, n, 700):  # sub-groups of 700 elements, smaller than any chunk
            writer.put(a, new[a : a + 700])
        writer.close()
        assert torch.equal(shard.read("param", 0, n), new)
        assert moves == {"read": n * 4, "write": n * 4}, moves  # the read: shard.read
        # a run from inside one chunk to inside another keeps the values around it
        s1, s2 = layout.segments[1], layout.segments[2]
        a, b = s1.shard_start + 100, s2.shard_start + 50
        writer = shard.writer()
        writer.put(a, before[a:b])
        writer.close()
        expect = new.clone()
        expect[a:b] = before[a:b]
        assert torch.equal(shard.read("param", 0, n), expect)
        assert shard.pool.lent == 0
    finally:
        space.close()
