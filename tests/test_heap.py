"""offload/heap.py: freed host memory leaves the process (glibc), in a fresh interpreter
each (``mallopt`` is process-wide): holes between kept tensors are given back by
``release_free_heap``, and with ``map_large_allocations`` they are never made."""

from __future__ import annotations

import subprocess
import sys

import pytest

_SCRIPT = r"""
import sys, torch
from zeroshard.offload import heap
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
mode = sys.argv[1]
if mode == "mapped":
    assert heap.map_large_allocations()
base = rss()
# as zero.Init and stage-3 units do: 8 MiB temporaries between kept 64 KiB slices
kept, temps = [], []
for i in range(96):
    temps.append(torch.ones(2 << 20))  # 8 MiB, under glibc's dynamic mmap threshold
    kept.append(torch.ones(16 << 10))
big = torch.ones(40 << 20)  # one 160 MiB tensor: glibc raises its threshold past 8 MiB
del big
temps.clear()
for i in range(96):  # the same sizes again, interleaved anew
    temps.append(torch.ones(2 << 20))
    kept.append(torch.ones(16 << 10))
temps.clear()
held = rss() - base
if mode == "trim":
    heap.release_free_heap()
print(held, rss() - base)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_temporaries_leave_the_process() -> None:
    def run(mode: str) -> tuple[float, float]:
        out = subprocess.run(
            [sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        held, after = (float(x) for x in out.stdout.split())
        return held, after

    plain_held, _ = run("plain")
    _, trimmed = run("trim")
    mapped_held, _ = run("mapped")
    # 768 MiB of temporaries were freed; 12 MiB of slices are kept
    assert plain_held > 300, plain_held  # glibc kept the holes
    assert trimmed < 64, trimmed  # malloc_trim gave them back
    assert mapped_held < 64, mapped_held  # never made: each had its own mapping


def test_init_maps_large_allocations_for_nvme_configs() -> None:
    """zero.Init under an NVMe-offload config turns the mapping on before it builds (the
    heap it would leave behind is what training's buffers would reuse and keep)."""
    from zeroshard.zero.params.init import config_swaps

    nvme = {"device": "nvme", "nvme_path": "/x"}
    assert config_swaps({"zero_optimization": {"stage": 3, "offload_param": nvme}})
    assert config_swaps({"zero_optimization": {"stage": 3, "offload_optimizer": nvme}})
    assert not config_swaps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    assert not config_swaps({"zero_optimization": {"stage": 3}})
    assert not config_swaps({"train_batch_size": 1})
