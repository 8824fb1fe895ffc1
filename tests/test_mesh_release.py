"""``engine.destroy()`` destroys the process groups ``initialize`` created for the
engine's mesh (the DeviceMesh's axis groups; stage 3's reduction twin), never the
default group; the destroyed
engine's mesh refuses to hand out a Comm; and an engine built afterwards trains as the
first did. An idle gloo group's threads keep waking, so a process that built engine
after engine without this paid for every group ever made. One 2-rank spawn."""

from __future__ import annotations

import multirank
import parity
import torch


def _released(group) -> bool:
    """Whether torch.distributed no longer knows ``group`` (destroyed)."""
    import torch.distributed as dist

    try:
        dist.get_process_group_ranks(group)
    except (ValueError, RuntimeError, KeyError):
        return True
    return False


def _worker(rank: int, world: int) -> list[dict]:
    import torch.distributed as dist

    from zeroshard.distributed.mesh import MeshError

    out = []
    for case in ({"stage": 3, "steps": 2}, {"stage": 1, "steps": 2}):
        losses, first = parity.train(case, rank, world)
        owned = first.mesh.owned_groups()
        live_before = [not _released(g) for g in owned]
        first.destroy()
        refused = ""
        try:
            first.mesh.comm("zero_shard")
        except MeshError as exc:
            refused = str(exc)
        ones = torch.ones(1)
        dist.all_reduce(ones)  # the default group still serves
        again, second = parity.train(case, rank, world)
        out.append(
            {
                "owned": len(owned),
                "live_before": all(live_before),
                "released": [_released(g) for g in owned],
                "refused": refused,
                "world_sum": ones.item(),
                "same_losses": max(abs(a - b) for a, b in zip(losses, again, strict=True)),
                "second_owned": len(second.mesh.owned_groups()),
            }
        )
        second.destroy()
    return out


def test_destroy_releases_the_groups_initialize_made() -> None:
    for per_rank in multirank.run(_worker, 2, timeout=300):
        for r in per_rank:
            assert r["owned"] > 0 and r["live_before"], r
            assert all(r["released"]), r
            assert "released" in r["refused"] and "zero_shard" in r["refused"], r
            assert r["world_sum"] == 2.0, r
            assert r["same_losses"] <= parity.TOL and r["second_owned"] == r["owned"], r
