"""Pipeline schedules as data, and PipelineModule's partitioning: no processes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zeroshard.config import ConfigError, load_config
from zeroshard.parallel.pipeline.module import partition_layers
from zeroshard.parallel.pipeline.schedules import (
    Action,
    ScheduleError,
    build_schedule,
    compute_order,
    forward_only,
    render,
    simulate,
)
from zeroshard.pipe import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec

SIZES = [(2, 2), (2, 4), (2, 5), (4, 4), (4, 8), (3, 7)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1"])
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_every_microbatch_once_and_no_deadlock(name: str, p: int, m: int) -> None:
    schedule = build_schedule(name, p, m)
    assert len(schedule) == p
    for s, actions in enumerate(schedule):
        kinds = ("F", "BI", "BW") if name == "zb_h1" else ("F", "B")
        for kind in kinds:
            got = sorted(a.microbatch for a in actions if a.kind == kind)
            assert got == list(range(m)), (s, kind, render(schedule))
        # a backward never precedes its own forward; BW follows its BI
        seen: dict[tuple[str, int], int] = {}
        for i, a in enumerate(actions):
            seen[(a.kind, a.microbatch)] = i
        for i in range(m):
            back = seen.get(("B", i), seen.get(("BI", i)))
            assert back is not None and seen[("F", i)] < back
            if name == "zb_h1":
                assert seen[("BI", i)] < seen[("BW", i)]
    simulate(schedule)  # raises on a deadlock


def test_print_schedules() -> None:
    text = render(build_schedule("1f1b", 2, 3))
    assert text.splitlines() == [
        "stage 0: F0 SEND_F0 RECV_B0 B0 F1 SEND_F1 RECV_B1 B1 F2 SEND_F2 RECV_B2 B2"[:0]
        + "stage 0: F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 F2 SEND_F2 RECV_B1 B1 RECV_B2 B2",
        "stage 1: RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 SEND_B1 RECV_F2 F2 B2 SEND_B2",
    ]
    assert [str(a) for a in compute_order("gpipe", 2, 2)[1]] == ["F0", "F1", "B0", "B1"]
    assert Action("F", 3, 1) == Action("F", 3, 1) and str(Action("F", 3, 1)) == "F3c1"


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 4)])
def test_memory_bounds_and_bubbles(p: int, m: int) -> None:
    """1F1B holds at most p - s micro-batches on stage s, GPipe all m; ZB-H1 holds at
    most p and has a third of 1F1B's idle time (F = BI = BW = 1, B = 2)."""
    gpipe, ofob, zb = (simulate(build_schedule(n, p, m)) for n in ("gpipe", "1f1b", "zb_h1"))
    assert gpipe["peak_inflight"] == [m] * p
    assert ofob["peak_inflight"] == [min(p - s, m) for s in range(p)]
    assert max(zb["peak_inflight"]) <= p
    assert gpipe["makespan"] == ofob["makespan"] == 3 * m + 3 * (p - 1)
    assert zb["makespan"] == 3 * m + (p - 1)
    inter = simulate(build_schedule("interleaved_1f1b", p, m, 2), {"F": 0.5, "B": 1.0})
    assert inter["bubble"] < ofob["bubble"]
    # interleaved: each model chunk's micro-batches hold (p - s - 1) * 2 + (v - 1) * p + 1
    assert inter["peak_inflight"][0] <= 2 * (p - 1) + p + 1


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 4), (4, 4), (4, 8), (2, 6)])
def test_interleaved(p: int, m: int) -> None:
    schedule = build_schedule("interleaved_1f1b", p, m, 2)
    for actions in schedule:
        for kind in ("F", "B"):
            got = sorted((a.microbatch, a.chunk) for a in actions if a.kind == kind)
            assert got == [(i, c) for i in range(m) for c in range(2)]
    simulate(schedule)


@pytest.mark.parametrize(("p", "m", "v"), [(2, 3, 1), (4, 4, 2), (3, 5, 2)])
def test_forward_only(p: int, m: int, v: int) -> None:
    """eval_batch's schedule: every (micro-batch, chunk) forwarded once, no deadlock."""
    schedule = forward_only(p, m, v)
    for actions in schedule:
        got = sorted((a.microbatch, a.chunk) for a in actions if a.kind == "F")
        assert got == [(i, c) for i in range(m) for c in range(v)]
    simulate(schedule)


def test_bad_sizes() -> None:
    with pytest.raises(ScheduleError, match="multiple of the stages"):
        build_schedule("interleaved_1f1b", 4, 6, 2)
    with pytest.raises(ScheduleError, match="interleaved_1f1b needs at least 2"):
        build_schedule("interleaved_1f1b", 2, 4, 1)
    with pytest.raises(ScheduleError, match="virtual_stages"):
        build_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ScheduleError, match="unknown schedule"):
        build_schedule("pipedream", 2, 4)
    with pytest.raises(ScheduleError, match="micro-batches"):
        build_schedule("1f1b", 2, 0)


# -- partitioning ---------------------------------------------------------------------------
def _layers() -> list:
    return [
        nn.Linear(4, 4),
        nn.ReLU(),
        nn.Linear(4, 8),
        nn.ReLU(),
        nn.Linear(8, 8),
        nn.Linear(8, 2),
    ]


def test_partition_methods() -> None:
    layers = _layers()
    # parameters: 20, 0, 40, 0, 72, 18 -> heaviest part as light as possible
    assert partition_layers(layers, 2, "parameters") == [0, 4, 6]
    assert partition_layers(layers, 3, "uniform") == [0, 2, 4, 6]
    bounds = partition_layers(layers, 2, "type:linear")
    assert sum(isinstance(m, nn.Linear) for m in layers[bounds[0] : bounds[1]]) == 2
    with pytest.raises(PipelineError, match="only 6 layers"):
        partition_layers(layers, 7)
    with pytest.raises(PipelineError, match="matches 0 layers"):
        partition_layers(layers, 2, "type:conv")
    with pytest.raises(PipelineError, match="partition_method"):
        partition_layers(layers, 2, "random")


def test_stage_builds_only_its_layers_with_global_names() -> None:
    specs = [
        TiedLayerSpec("embed", nn.Embedding, 10, 4),
        LayerSpec(nn.Linear, 4, 4),
        LayerSpec(nn.Linear, 4, 4),
        LayerSpec(nn.Linear, 4, 4),
        TiedLayerSpec("embed", nn.Embedding, 10, 4, forward_fn=lambda m, x: x @ m.weight.t()),
    ]
    stages = [
        PipelineModule(specs, num_stages=2, partition_method="uniform", stage_id=s)
        for s in range(2)
    ]
    names = [sorted(n for n, _ in m.named_parameters()) for m in stages]
    assert stages[0].parts == [0, 2, 5]
    assert names[0] == ["1.bias", "1.weight", "tied_modules.embed.weight"]
    assert names[1] == ["2.bias", "2.weight", "3.bias", "3.weight", "tied_modules.embed.weight"]
    assert stages[0].tied_stages == {"embed": [0, 1]}
    assert [n for n, _ in stages[1].tied_parameters("embed")] == ["tied_modules.embed.weight"]
    ids = torch.tensor([[1, 2]])
    hidden = stages[0](ids)
    assert hidden.shape == (1, 2, 4) and stages[1](hidden).shape == (1, 2, 10)
    with pytest.raises(PipelineError, match=r"needs torch\.distributed"):
        PipelineModule(specs, num_stages=2)
    with pytest.raises(PipelineError, match="only 5 layers"):
        PipelineModule(specs, num_stages=3, virtual_stages=2, stage_id=0)


def test_seed_layers_make_values_independent_of_the_cut() -> None:
    specs = [LayerSpec(nn.Linear, 4, 4) for _ in range(4)]
    one = PipelineModule(specs, num_stages=1, seed_layers=True, stage_id=0)
    two = PipelineModule(specs, num_stages=2, seed_layers=True, stage_id=1)
    assert torch.equal(one.get_parameter("3.weight"), two.get_parameter("3.weight"))


def test_checkpoint_interval_same_values() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4) for _ in range(5)]
    plain = PipelineModule(layers, num_stages=1, stage_id=0)
    ckpt = PipelineModule(layers, num_stages=1, stage_id=0, activation_checkpoint_interval=2)
    x = torch.randn(3, 4, requires_grad=True)
    a, b = plain(x), ckpt(x)
    assert torch.equal(a, b)


def test_config_section() -> None:
    cfg = load_config(
        {"train_batch_size": 8, "gradient_accumulation_steps": 4, "pipeline": {"stages": "auto"}},
        world_size=4,
        module_stages=2,
    )
    assert cfg.pipeline_stages == 2 and cfg.dp_world_size == 2
    assert cfg.pipeline.schedule == "1f1b" and cfg.pipeline.pipe_partitioned
    with pytest.raises(ConfigError, match=r"pipeline\.stages: 4, but the PipelineModule"):
        load_config({"train_batch_size": 8, "pipeline": {"stages": 4}}, module_stages=2)
    with pytest.raises(ConfigError, match=r"pipeline\.micro_batches: 3, but gradient_acc"):
        load_config({"train_batch_size": 8, "pipeline": {"micro_batches": 3}})
    with pytest.raises(ConfigError, match=r"pipeline\.schedule"):
        load_config({"train_batch_size": 8, "pipeline": {"schedule": "dualpipe"}})
    with pytest.raises(ConfigError, match=r"pipeline\.partition"):
        load_config({"train_batch_size": 8, "pipeline": {"partition": "random"}})
    with pytest.raises(ConfigError, match=r"pipeline\.stagez"):
        load_config({"train_batch_size": 8, "pipeline": {"stagez": 2}})


# -- bad input --------------------------------------------------------------------------
def test_bad_models_and_configs_are_named() -> None:
    from zeroshard.api import as_pipeline_module as _split
    from zeroshard.parallel.pipeline.module import check_config as _check_module

    def cfg(**pipe):
        zero = pipe.pop("zero", 1)
        return load_config(
            {
                "train_batch_size": 8,
                "zero_optimization": {"stage": zero},
                "pipeline": {"stages": 2, **pipe},
            },
            world_size=2,
        )

    with pytest.raises(ValueError, match=r"cannot split Linear .* not an nn\.Sequential"):
        _split(nn.Linear(2, 2), cfg())
    model = PipelineModule([nn.Linear(2, 2), nn.Linear(2, 2)], num_stages=2, stage_id=0)
    with pytest.raises(PipelineError, match=r"is not a zeroshard\.pipe\.PipelineModule"):
        _check_module(nn.Linear(2, 2), cfg())
    _check_module(model, cfg(zero=3))  # works (tests/test_pipeline.py measures its cost)
    with pytest.raises(PipelineError, match=r"pipeline\.partition: 'uniform'"):
        _check_module(model, cfg(partition="uniform"))
    with pytest.raises(PipelineError, match=r"pipeline\.seed_layers"):
        _check_module(model, cfg(seed_layers=True))
    with pytest.raises(PipelineError, match=r"pipeline\.virtual_stages"):
        _check_module(model, cfg(virtual_stages=2))
    _check_module(model, cfg(partition="best"))  # DeepSpeed's default: parameters
