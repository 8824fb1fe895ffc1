"""Flat layout index math: no processes, no tensors beyond small checks."""

from __future__ import annotations

import random

import pytest
import torch

from zeroshard.zero.layout.partition import FlatLayout, greedy_segments


def _random_numels(rng: random.Random, n: int) -> list[int]:
    return [rng.choice([0, 1, 3, 7, 16, 100, 1000, rng.randint(1, 5000)]) for _ in range(n)]


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("seed", range(5))
def test_every_element_owned_exactly_once(world: int, seed: int) -> None:
    rng = random.Random(seed * 31 + world)
    numels = _random_numels(rng, rng.randint(1, 30))
    align = rng.choice([1, 4, 16])
    layout = FlatLayout(
        numels, world, bucket_numel=rng.choice([None, 50, 1000, 10**6]), align=align
    )
    # segment geometry: equal chunks, alignment, padded to world*align
    for seg in layout.segments:
        assert seg.numel % (world * align) == 0 and seg.used <= seg.numel < seg.used + world * align
        assert seg.chunk * world == seg.numel
    assert layout.total_numel == sum(s.numel for s in layout.segments)
    assert layout.shard_numel * world == layout.total_numel
    # every parameter element belongs to exactly one rank, at the right shard offset
    owner = [torch.full((n,), -1) for n in numels]
    for rank in range(world):
        for piece in layout.pieces(rank):
            seg = layout.segments[piece.segment]
            lo, _ = layout.param_range(piece.param)
            flat_lo = lo + piece.param_lo
            c_lo, c_hi = seg.chunk_range(rank)
            assert c_lo <= flat_lo and flat_lo + piece.numel <= c_hi
            assert piece.shard_lo == seg.shard_start + flat_lo - c_lo
            view = owner[piece.param][piece.param_lo : piece.param_hi]
            assert (view == -1).all()
            view.fill_(rank)
    assert all((o >= 0).all() for o in owner)


def test_parameter_straddles_ranks() -> None:
    layout = FlatLayout([10, 6], 4, align=1)  # one segment of 16: chunks of 4
    assert [(p.param, p.param_lo, p.param_hi) for p in layout.pieces(2)] == [(0, 8, 10), (1, 0, 2)]
    assert [(p.param, p.param_lo, p.param_hi, p.shard_lo) for p in layout.pieces(3)] == [
        (1, 2, 6, 0)
    ]


def test_uneven_total_is_padded() -> None:
    layout = FlatLayout([5, 3, 7, 1], 2, bucket_numel=8, align=2)
    assert [s.params for s in layout.segments] == [(0, 1), (2, 3)]
    assert [s.numel for s in layout.segments] == [8, 8]
    assert layout.owned_span(1, [2], 0) == (4, 8) and layout.owned_span(1, [3], 1) == (7, 8)


def test_greedy_segments() -> None:
    assert greedy_segments([5, 5, 5], 10) == [[0, 1], [2]]
    assert greedy_segments([20, 1, 1], 10) == [[0], [1, 2]]  # too big: a segment of its own
    assert greedy_segments([3, 4], None) == [[0, 1]]
    assert greedy_segments([], 10) == []


def test_explicit_groups_must_cover_in_order() -> None:
    with pytest.raises(ValueError, match="every parameter once"):
        FlatLayout([1, 2, 3], 2, groups=[[0], [2]])
    with pytest.raises(ValueError, match="world_size"):
        FlatLayout([1], 0)


def test_owned_span_requires_contiguous_members() -> None:
    layout = FlatLayout([4, 4, 4], 1, groups=[[0, 1, 2]])
    with pytest.raises(ValueError, match="not contiguous"):
        layout.owned_span(0, [0, 2], 0)


def test_stage3_persistence_thresholds() -> None:
    """numel <= stage3_param_persistence_threshold stays whole (DeepSpeed's rule), while
    the persistent total fits stage3_model_persistence_threshold."""
    from zeroshard.zero.layout.segments import unit_segments

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 8))
    groups = [{"params": list(model.parameters())}]
    sizes = {id(p): p.numel() for p in model.parameters()}  # 16, 4, 4, 4, 32, 8

    def persistent(threshold: int, model_threshold: int | None = None) -> list[int]:
        plan = unit_segments(model, groups, threshold, 10**6, model_threshold)
        return sorted(sizes[id(plan.params[i])] for s in plan.persistent for i in plan.segments[s])

    assert persistent(3) == []
    assert persistent(4) == [4, 4, 4]  # inclusive
    assert persistent(8) == [4, 4, 4, 8]
    assert persistent(8, model_threshold=9) == [4, 4]  # in module order until the cap
    assert persistent(10**6, model_threshold=0) == []


def test_gpt_presets_are_buildable() -> None:
    """Every built-in GPT preset splits d_model evenly into heads (checked without
    building the big ones)."""
    from zeroshard.models.gpt import PRESETS

    for name, (_, n_head, d_model) in PRESETS.items():
        assert d_model % n_head == 0, name
