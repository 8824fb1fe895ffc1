"""tests/cases.py: one failing case of a batched multi-rank run is reported by name, and
the other cases are still checked (and pass).

The end-to-end test runs a tiny test file in a pytest subprocess (``pytester``): one
2-rank spawn with three batches of cases,
* ``check``: every case runs; the parent's check of case ``b`` fails (a wrong value);
* ``symmetric``: case ``e`` raises on both ranks before any collective, in a batch that
  goes on after a failure (``stop_on_failure=False``);
* ``lockstep``: case ``y`` raises on rank 1 between two all-reduces: rank 1 stops, rank 0
  raises when rank 1's connection closes, and case ``z`` is reported as not run;
and reads the per-case outcomes from the subprocess's report."""

from __future__ import annotations

import os
import re

import cases
import pytest

pytest_plugins = ["pytester"]

TESTS = os.path.dirname(os.path.abspath(__file__))

TINY = """
import cases
import multirank
import torch
import torch.distributed as dist


def _summed(rank, value, raise_on=None):
    t = torch.tensor([float(value)])
    dist.all_reduce(t)
    if rank == raise_on:
        raise ValueError("broken between two collectives")
    dist.all_reduce(t)
    return t.item()


def _raise_everywhere():
    raise ValueError("raises on every rank before any collective")


def _ranks(rank, world):
    return {
        "check": cases.run_named(
            [(n, lambda v=v: _summed(rank, v)) for n, v in (("a", 1), ("b", 2), ("c", 3))]
        ),
        "symmetric": cases.run_named(
            [("d", lambda: _summed(rank, 4)), ("e", _raise_everywhere), ("f", lambda: _summed(rank, 5))],
            stop_on_failure=False,
        ),
        "lockstep": cases.run_named(
            [
                ("x", lambda: _summed(rank, 6)),
                ("y", lambda: _summed(rank, 7, raise_on=1)),
                ("z", lambda: _summed(rank, 8)),
            ]
        ),
    }


# each value, all-reduced twice over 2 ranks: 4x; the check of "b" expects a wrong value (8)
EXPECTED = {"a": 4.0, "b": 9.0, "c": 12.0, "d": 16.0, "f": 20.0, "x": 24.0, "y": 28.0, "z": 32.0}


def test_batched(subtests):
    results = multirank.run(_ranks, 2, timeout=120)

    def check(name, per_rank):
        assert per_rank == [EXPECTED[name]] * 2

    for batch in ("check", "symmetric", "lockstep"):
        cases.check_each(subtests, [r[batch] for r in results], check)
"""


def test_a_failing_case_is_named_and_the_others_still_pass(pytester, monkeypatch) -> None:
    root = os.path.dirname(TESTS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([root, TESTS]))
    monkeypatch.delenv(cases.BREAK_ENV, raising=False)
    pytester.makepyfile(test_tiny=TINY)
    res = pytester.runpytest_subprocess("-v", "-p", "no:cacheprovider", timeout=300)
    out = res.stdout.str()
    outcome = {
        m[2]: m[1]
        for m in re.finditer(r"SUB(PASSED|FAILED)\S*\(case='(\w)'\)", out.replace(" ", ""))
    }
    assert outcome == {
        "a": "PASSED",
        "b": "FAILED",
        "c": "PASSED",
        "d": "PASSED",
        "e": "FAILED",
        "f": "PASSED",
        "x": "PASSED",
        "y": "FAILED",
        "z": "FAILED",
    }, out
    # each failure says why, by case and rank
    assert "assert [8.0, 8.0] == [9.0, 9.0]" in out, out
    assert "case 'e' raised on rank 0" in out and "case 'e' raised on rank 1" in out, out
    assert "case 'y' raised on rank 1" in out and "broken between two collectives" in out, out
    assert "not run: case 'y' raised before it on rank 1" in out, out
    assert "contains 4 failed subtests" in out, out


def test_run_named_records_each_case() -> None:
    """In one process: values by name; a failure stops the batch (naming the cases not
    run) unless ``stop_on_failure=False``; names are unique; the break variable works."""

    def boom() -> None:
        raise KeyError("k")

    got = cases.run_named([("one", lambda: 1), ("two", boom), ("three", lambda: 3)])
    assert got["one"] == {"value": 1}
    assert (
        "case 'two' raised on rank" in got["two"]["raised"] and "KeyError" in got["two"]["raised"]
    )
    assert got["three"] == {"not_run": "not run: case 'two' raised before it on rank 0"}
    assert list(got) == ["one", "two", "three"]

    got = cases.run_named([("one", boom), ("two", lambda: 2)], stop_on_failure=False)
    assert "raised" in got["one"] and got["two"] == {"value": 2}

    with pytest.raises(ValueError, match="repeated: \\['a'\\]"):
        cases.run_named([("a", lambda: 1), ("a", lambda: 2)])

    os.environ[cases.BREAK_ENV] = "two"  # conftest puts the environment back
    got = cases.run_named([("one", lambda: 1), ("two", lambda: 2)])
    assert got["one"] == {"value": 1} and "BrokenOnPurpose" in got["two"]["raised"]

    assert (
        cases.label({"stage": 3, "extra": {"z": {"t": 0}}, "e": {}}) == "stage=3 extra.z.t=0 e={}"
    )
