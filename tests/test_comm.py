"""Comm's reduce-scatter algorithms agree: the backend's own, an all-reduce keeping this
rank's chunk, and point-to-point sends (gloo's default) or an all-to-all plus a local sum
in rank order. The all-gather's two paths agree too."""

from __future__ import annotations

import multirank
import pytest
import torch
import torch.distributed as dist

from zeroshard.distributed.comm import Comm


def _inputs(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(n, generator=g).to(dtype)


def _worker(rank: int, world: int) -> dict:
    out: dict = {}
    pair = dist.new_group([0, 1])  # every rank creates it; ranks 0-1 use it
    comms = {world: Comm()}
    if rank < 2:
        comms[2] = Comm(pair)
    for size, comm in comms.items():
        assert comm.reduce_scatter_via == "send_recv"  # gloo
        for dtype in (torch.float32, torch.bfloat16):
            n = 6 * 1001
            chunk = n // size
            everyone = [_inputs(r, n, dtype) for r in range(size)]
            mine = slice(comm.rank * chunk, (comm.rank + 1) * chunk)
            # rank-order sum of this rank's chunk in fp32, rounded once to the dtype
            expect = everyone[0][mine].to(torch.float32, copy=True)
            for r in range(1, size):
                expect += everyone[r][mine]
            expect = expect.to(dtype)
            got = {}
            for via in ("native", "all_reduce", "all_to_all", "send_recv"):
                x = everyone[comm.rank].clone()
                res = torch.empty(chunk, dtype=dtype)
                comm.reduce_scatter(res, x, via=via)
                got[via] = res
            # asynchronous, into a view of the input (how the gradient reducer calls it),
            # with a scratch buffer larger than needed
            scratch = torch.full((n + 7,), float("nan"), dtype=dtype)
            for via in ("all_to_all", "send_recv"):
                x = everyone[comm.rank].clone()
                own = x[mine]
                handle = comm.reduce_scatter(own, x, async_op=True, via=via, scratch=scratch)
                handle.wait()
                got[f"async {via}"] = own.clone()
            # all-gather: point to point (gloo's default) and the backend's, into views
            # of one buffer with this rank's part already in place or not
            gathered = {}
            for via in ("native", "send_recv"):
                full = torch.full((n,), float("nan"), dtype=dtype)
                comm.all_gather(full, everyone[comm.rank][mine].clone(), via=via)
                gathered[via] = full
                full2 = torch.full((n,), float("nan"), dtype=dtype)
                full2[mine] = everyone[comm.rank][mine]
                h = comm.all_gather(full2, full2[mine], async_op=True, via=via)
                h.wait()
                gathered[via + " in place"] = full2
            whole = torch.cat([everyone[r][r * chunk : (r + 1) * chunk] for r in range(size)])
            assert all(torch.equal(v, whole) for v in gathered.values()), (size, dtype)
            key = f"{size}-{dtype}"
            out[key] = {
                via: {
                    "exact": bool(torch.equal(v, expect)),
                    "err": float((v.double() - expect.double()).abs().max()),
                }
                for via, v in got.items()
            }
            out[key]["scale"] = float(expect.double().abs().max())
    for via in ("send_recv", "all_to_all"):  # sizes that do not split: named, no hang
        with pytest.raises(ValueError, match="not 3 ranks x 2"):
            comms[world].reduce_scatter(torch.empty(2), torch.empty(7), via=via)
    with pytest.raises(ValueError, match="not 3 ranks x 2"):
        comms[world].all_gather(torch.empty(7), torch.empty(2), via="send_recv")
    with pytest.raises(ValueError, match="via='bogus'"):
        comms[world].reduce_scatter(torch.empty(1), torch.empty(world), via="bogus")
    out["uneven"] = _uneven_all_to_all(rank, world)
    return out


def _uneven_all_to_all(rank: int, world: int) -> dict:
    """Split sizes: rank r sends rank j ``r + j + 1`` rows of ``10 r + j``; the ledger
    counts the send buffer's bytes on the group's axis. Bad splits name the problem."""
    from zeroshard import ArgumentError
    from zeroshard.distributed.ledger import Ledger

    comm = Comm(None, Ledger(), axis="ep")
    sizes = [rank + j + 1 for j in range(world)]  # what rank sends to j = what j sends here
    inp = torch.cat([torch.full((n, 3), 10.0 * rank + j) for j, n in enumerate(sizes)])
    got = torch.empty(sum(sizes), 3)
    comm.all_to_all(got, inp, output_splits=sizes, input_splits=sizes)
    want = torch.cat([torch.full((n, 3), 10.0 * j + rank) for j, n in enumerate(sizes)])
    errors = []
    bad = (
        lambda: comm.all_to_all(got, inp, input_splits=sizes),
        lambda: comm.all_to_all(got, inp, output_splits=sizes[:-1], input_splits=sizes),
    )
    for call in bad:
        try:
            call()
        except ArgumentError as exc:
            errors.append(str(exc))
    return {
        "exact": bool(torch.equal(got, want)),
        "bytes": comm.ledger.by_axis()["ep"]["all_to_all"]["bytes"],
        "sent": inp.numel() * 4,
        "errors": errors,
    }


def test_reduce_scatter_algorithms_agree() -> None:
    results = multirank.run(_worker, 3, timeout=120)
    for rank, res in enumerate(results):
        uneven = res.pop("uneven")
        assert uneven["exact"] and uneven["bytes"] == uneven["sent"], (rank, uneven)
        assert "both output_splits and input_splits" in uneven["errors"][0], uneven
        assert "output_splits" in uneven["errors"][1] and "rank parts" in uneven["errors"][1]
        for key, per in res.items():
            size = int(key.split("-")[0])
            # sends and the all-to-all sum in rank order, exactly as the reference does
            for via in ("all_to_all", "send_recv", "async all_to_all", "async send_recv"):
                assert per[via]["exact"], (rank, key, via, per)
            if size == 2:  # a + b: one rounding whatever the algorithm
                assert all(v["exact"] for k, v in per.items() if k != "scale"), (rank, key, per)
            else:  # other algorithms may add in another order: round-off of the dtype
                eps = 1e-6 if "float32" in key else 1e-2
                for via in ("native", "all_reduce"):
                    assert per[via]["err"] <= 4 * eps * per["scale"], (rank, key, per)
        assert len(res) == (4 if rank < 2 else 2)
