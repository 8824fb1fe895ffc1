"""Named cases in one multi-rank spawn, each checked and reported on its own.

A spawn is costly, so a test runs many scenarios (stages, layouts, offload modes) in one
``multirank.run``. Two halves keep one failing scenario from hiding the others:

* on each rank, :func:`run_named` runs the cases in order and returns, per case name,
  ``{"value": ...}`` (what the case returned: numbers for the parent to compare),
  ``{"raised": "case X raised on rank r: <traceback>"}`` or ``{"not_run": "..."}``.
  A case that raises on one rank may leave the ranks out of step in their collectives
  (it stopped between two of them): with ``stop_on_failure`` (the default) the rank stops
  there and names the remaining cases as not run. Its peers, waiting in a collective of
  the failed case, see the connection close when it exits and raise in turn.
* in the parent, :func:`check_each` checks every case under ``subtests.test(case=name)``:
  each case is reported by name, pass or fail, and a failing case does not stop the
  checks of the others. A case that raised or did not run fails with the ranks' reports.

``ZEROSHARD_TEST_BREAK_CASE=name`` (several: comma-separated) makes the named cases raise
on every rank before they start, to see how a file reports a failing case without
editing it."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import pytest

BREAK_ENV = "ZEROSHARD_TEST_BREAK_CASE"


class BrokenOnPurpose(RuntimeError):
    """Raised for a case named in ``ZEROSHARD_TEST_BREAK_CASE``."""


def label(case: dict) -> str:
    """A case dict as a readable name: ``key=value`` pairs, nested dicts flattened with
    dots (``{"extra": {"a": {"b": 1}}}`` -> ``extra.a.b=1``), an absolute path as its last
    part (temporary directories differ from run to run)."""

    def flat(d: dict, prefix: str) -> list[str]:
        out = []
        for k, v in d.items():
            if isinstance(v, dict) and v:
                out += flat(v, f"{prefix}{k}.")
            elif isinstance(v, str) and os.path.isabs(v):
                out.append(f"{prefix}{k}=.../{os.path.basename(v)}")
            else:
                out.append(f"{prefix}{k}={v}")
        return out

    return " ".join(flat(case, ""))


def run_named(
    cases: Iterable[tuple[str, Callable[[], Any]]], *, stop_on_failure: bool = True
) -> dict[str, dict]:
    """Run each ``(name, fn)`` in order on this rank; return ``{name: record}`` (see the
    module docstring). ``stop_on_failure=False`` only where a case that raises cannot
    leave the ranks out of step (it uses no collectives, or every rank raises alike
    before any): the rank then goes on with the next case."""
    cases = list(cases)
    names = [name for name, _ in cases]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"case names must be unique; repeated: {sorted(dup)}")
    broken = {n.strip() for n in os.environ.get(BREAK_ENV, "").split(",") if n.strip()}
    rank = int(os.environ.get("RANK", "0"))
    out: dict[str, dict] = {}
    for i, (name, fn) in enumerate(cases):
        try:
            if name in broken:
                raise BrokenOnPurpose(f"{BREAK_ENV} names case {name!r}")
            out[name] = {"value": fn()}
        except Exception:
            out[name] = {
                "raised": f"case {name!r} raised on rank {rank}:\n{traceback.format_exc()}"
            }
            if stop_on_failure:
                why = f"not run: case {name!r} raised before it on rank {rank}"
                out |= {later: {"not_run": why} for later in names[i + 1 :]}
                break
    return out


def values(results: list[dict], name: str) -> list[Any]:
    """Each rank's value for case ``name`` (``results``: the ranks' :func:`run_named`
    returns); fails, with every rank's report, where a rank raised or did not run it."""
    reports = []
    for rank, per_case in enumerate(results):
        record = per_case.get(name)
        if record is None:
            reports.append(f"rank {rank} has no record of case {name!r}")
        elif "value" not in record:
            reports.append(record.get("raised") or record.get("not_run") or repr(record))
    if reports:
        pytest.fail("\n".join(reports), pytrace=False)
    return [per_case[name]["value"] for per_case in results]


def by_rank(results: list[dict], *names: str) -> list[dict[str, Any]]:
    """Per rank, ``{name: value}`` for the cases ``names`` (for a check that compares
    several cases); fails as :func:`values` does where one raised or did not run."""
    got = {name: values(results, name) for name in names}
    return [{name: got[name][rank] for name in names} for rank in range(len(results))]


def check_each(
    subtests: pytest.Subtests,
    results: list[dict],
    check: Callable[[str, list[Any]], None],
    names: Iterable[str] | None = None,
) -> None:
    """``check(name, per_rank_values)`` for every case (``names``, else every name a rank
    reported, in order), each under its own ``subtests.test(case=name)``."""
    if names is None:
        names = list(dict.fromkeys(n for per_case in results for n in per_case))
    for name in names:
        with subtests.test(case=name):
            check(name, values(results, name))


def check(
    subtests: pytest.Subtests, results: list[dict], name: str, fn: Callable[[list[Any]], None]
) -> None:
    """``fn(per_rank_values)`` for the one case ``name``, under ``subtests.test(case=name)``."""
    with subtests.test(case=name):
        fn(values(results, name))
