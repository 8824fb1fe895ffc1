"""``engine.compile()`` and the config's ``compile`` section at every ZeRO stage (issue 32),
on 2 ranks in one spawn: compiled and eager training agree within the fp32 parity
tolerance after several steps at stages 0, 1, 2, 3 and 3 with parameter and optimizer
offload (and stage 1 with ``overlap_param_gather``, compiled per region), and a counting
backend shows dynamo captured graphs and ran them each step (a compile that silently
ran eager would fail). Stage 3 compiles one region per gathered block: the two blocks
of the GPT share one graph. ``aot_eager`` traces forward and backward through
AOTAutograd as inductor does, without a C++ compiler; one inductor case (slow) runs the
real code generator.
"""

from __future__ import annotations

import dataclasses
import functools

import cases
import multirank
import parity
import pytest
import torch

from zeroshard.config import ConfigError, load_config

WORLD = 2
STEPS = 4
OFFLOAD = {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
CASES: list[dict] = [
    {"stage": 0},
    {"stage": 1},
    {"stage": 1, "extra": {"zero_optimization": {"overlap_param_gather": True}}},
    {"stage": 2},
    {"stage": 3},
    {"stage": 3, "extra": {"zero_optimization": OFFLOAD}},
]


class Counting:
    """A dynamo backend that counts the graphs it compiles and the calls of them, and
    hands them to ``inner``."""

    def __init__(self, inner: str = "aot_eager") -> None:
        self.inner, self.graphs, self.calls = inner, 0, 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        compiled = torch._dynamo.lookup_backend(self.inner)(gm, example_inputs)

        def run(*args):
            self.calls += 1
            return compiled(*args)

        return run


def _train(case: dict, rank: int, world: int, compile_with=None, via_config: bool = False):
    case = {**case, "steps": 0}
    if via_config:
        case["extra"] = {**case.get("extra", {}), "compile": {"enabled": True, "backend": "aot_eager"}}  # fmt: skip
    _, engine = parity.train(case, rank, world)
    if compile_with is not None:
        engine.compile(backend=compile_with)
    losses = []
    for step in range(STEPS):
        x, y = parity.batch(step, 2 * world)
        loss = engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = parity.full_params(engine)
    compiled = engine.is_compiled
    engine.destroy()
    return losses, params, compiled


def _compiled_case(rank: int, world: int, case: dict, inner: str) -> dict:
    import torch._dynamo

    torch._dynamo.reset()
    eager_losses, eager_params, _ = _train(case, rank, world)
    counting = Counting(inner)
    losses, params, compiled = _train(case, rank, world, compile_with=counting)
    return {
        "loss": max(abs(a - b) for a, b in zip(losses, eager_losses, strict=True)),
        "param": parity.max_param_diff(params, eager_params),
        "moved": parity.max_param_diff(eager_params, parity.initial_params(case)),
        "graphs": counting.graphs,
        "calls": counting.calls,
        "compiled": compiled,
    }


def _via_config(rank: int, world: int) -> dict:
    """The config's switch: compiled at initialize."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    _, eager_params, _ = _train({"stage": 3}, rank, world)
    _, params, compiled = _train({"stage": 3}, rank, world, via_config=True)
    return {
        "param": parity.max_param_diff(params, eager_params),
        "graphs": counters["stats"]["unique_graphs"],
        "compiled": compiled,
    }


def _refusals(rank: int, world: int) -> dict:
    out = {}
    _, engine = parity.train({"stage": 3, "steps": 0}, rank, world)
    for name, call in (
        ("schedule", lambda: engine.compile(backend="eager", schedule=[])),
        ("autograd", lambda: engine.compile(backend="eager", compiled_autograd_enabled=True)),
        ("backend", lambda: engine.compile(backend="no-such-backend")),
    ):
        try:
            call()
            out[name] = "accepted"
        except (NotImplementedError, ValueError) as err:
            out[name] = f"{type(err).__name__}: {err}"
    engine.destroy()
    try:
        bad = {"compile": {"enabled": True, "backend": "no-such-backend"}}
        parity.train({"stage": 3, "steps": 0, "extra": bad}, rank, world)
        out["config_backend"] = "accepted"
    except ConfigError as err:
        out["config_backend"] = str(err)
    return out


def _ranks(rank: int, world: int, case_list: list[dict], inner: str) -> dict:
    named = [
        (parity.case_name(c), functools.partial(_compiled_case, rank, world, c, inner))
        for c in case_list
    ]
    if inner == "aot_eager":
        named += [
            ("config", functools.partial(_via_config, rank, world)),
            ("refusals", functools.partial(_refusals, rank, world)),
        ]
    return cases.run_named(named)


def _check(
    subtests: pytest.Subtests, results: list[dict], case_list: list[dict], tol: float
) -> None:
    by_name = {parity.case_name(c): c for c in case_list}

    def check(name: str, per_rank: list) -> None:
        case = by_name[name]
        for got in per_rank:
            assert got["compiled"], case
            assert got["loss"] <= tol and got["param"] <= tol, (case, got)
            assert got["moved"] > 50 * parity.TOL, (case, got)  # training moved the weights
            assert got["graphs"] >= 1, (case, got)
            assert got["calls"] >= STEPS, (case, got)  # each step ran compiled code
            if case["stage"] == 3:  # embedding (x2 shapes), block (shared), norm, head
                assert got["graphs"] <= 2 * 5, (case, got)

    cases.check_each(subtests, results, check, names=list(by_name))


def _check_config(per_rank: list) -> None:
    for c in per_rank:
        assert c["compiled"] and c["param"] <= parity.TOL, c
        assert c["graphs"] >= 1, c


def _check_refusals(per_rank: list) -> None:
    for r in per_rank:
        assert r["schedule"].startswith("NotBuiltError") and "DeepCompile" in r["schedule"]
        assert r["autograd"].startswith("NotBuiltError"), r["autograd"]
        assert "unknown torch.compile backend 'no-such-backend'" in r["backend"], r["backend"]
        assert r["config_backend"].startswith("compile.backend: unknown torch.compile backend")


def test_compiled_matches_eager_at_every_stage(subtests: pytest.Subtests) -> None:
    results = multirank.run(_ranks, WORLD, CASES, "aot_eager", timeout=900)
    _check(subtests, results, CASES, parity.TOL)
    cases.check(subtests, results, "config", _check_config)
    cases.check(subtests, results, "refusals", _check_refusals)


@pytest.mark.slow
def test_inductor_compiled_matches_eager_at_stage_3(subtests: pytest.Subtests) -> None:
    """The real code generator (C++ kernels on the CPU): within the fp32 tolerance."""
    stage3: list[dict] = [{"stage": 3}]
    results = multirank.run(_ranks, WORLD, stage3, "inductor", timeout=1800)
    _check(subtests, results, stage3, parity.TOL)


def _cfg(**compile_section) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "compile": compile_section}


def test_compile_section_keys() -> None:
    """``enabled``/``backend``/``kwargs`` are read (kwargs are torch.compile's own);
    backend and kwargs without enabled are reported as meaning nothing; DeepCompile's
    keys are refused; an unknown key is an error."""
    cfg = load_config(_cfg(enabled=True, backend="aot_eager", kwargs={"dynamic": False}))
    assert (cfg.compile.enabled, cfg.compile.backend, cfg.compile.kwargs) == (True, "aot_eager", {"dynamic": False})  # fmt: skip
    assert cfg.inert == ()
    assert "compile.enabled true" in dict(load_config(_cfg(backend="eager")).inert)["compile.backend"]  # fmt: skip
    for section, path, words in (
        ({"kwargs": {"fullgrpah": True}}, "compile.kwargs.fullgrpah", "not a keyword"),
        ({"kwargs": {"backend": "eager"}}, "compile.kwargs.backend", "compile.backend"),
        ({"deepcompile": True}, "compile.deepcompile", "not built yet"),
        ({"offload_activation": True}, "compile.offload_activation", "not built yet"),
        ({"passes": ["z3"]}, "compile.passes", "not built yet"),
        ({"enable": True}, "compile.enable", "unknown key"),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(_cfg(**section))
        assert str(err.value).startswith(path) and words in str(err.value), err.value


# DeepSpeed 0.19.8's CompileConfig (deepspeed/compile/config.py) besides the 0.14 switch:
# each key with a value away from its default
DEEPCOMPILE_019 = {
    "deepcompile": True,
    "free_activation": True,
    "free_activation_threshold": 1024,
    "offload_activation": True,
    "offload_activation_pin_memory": False,
    "offload_opt_states": True,
    "double_buffer": False,
    "symmetric_memory": True,
    "debug_log": True,
    "offload_parameters": True,
    "sync_before_reduce": True,
    "sync_after_reduce": True,
    "sync_before_allgather": True,
    "sync_after_allgather": True,
    "keep_int_input_tensors": False,
    "keep_all_input_tensors": True,
    "passes": ["z1"],
}


def test_every_deepcompile_key_is_refused_by_name() -> None:
    """Every DeepCompile key of DeepSpeed 0.19, set, is refused naming it (DeepCompile is
    not built); at its default it is accepted; ``autoep_non_moe`` (DeepCompile's for AutoEP
    layers) is reported as meaning nothing."""
    from zeroshard.config.features import CompileConfig

    known = {f.name for f in dataclasses.fields(CompileConfig)}
    assert set(DEEPCOMPILE_019) | {"autoep_non_moe", "enabled", "backend", "kwargs"} == known
    for name, value in DEEPCOMPILE_019.items():
        with pytest.raises(ConfigError) as err:
            load_config(_cfg(**{name: value}))
        assert str(err.value).startswith(f"compile.{name}: ") and "not built yet" in str(err.value), err.value  # fmt: skip
    defaults = {f.name: f.default for f in dataclasses.fields(CompileConfig) if f.name in DEEPCOMPILE_019}  # fmt: skip
    assert load_config(_cfg(**defaults)).inert == ()
    assert "compile.autoep_non_moe" in dict(load_config(_cfg(autoep_non_moe=True)).inert)
