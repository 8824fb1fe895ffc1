"""Run the peers' own DeepSpeed test suites on zeroshard (``make test-peers``; issue 30).

    python tests/peers/run_peers.py [SUITE ...] [-k EXPR] [--only SUBSTR] [--target-timeout S]
                                    [--peers-dir DIR] [--junit-dir DIR]

SUITE is ``transformers``, ``accelerate`` or ``deepspeed`` (default: all three). The
suites' files are read from ``PEERS_DIR`` (``--peers-dir``; default ``$PEERS_DIR``, else
``/work/peers``), prepared once by ``make peers-fetch`` (see :data:`SUITES` for the pinned
versions and files); nothing is fetched here. Each suite runs in its own pytest process with
``import deepspeed`` served by zeroshard in every process (``sitecustomize.py``), the CPU
markers lifted (``peers_plugin.py``) and the hub names the tests load answered by tiny
models built from code into ``PEERS_DIR/hub`` (``peers_hub.py``). Prints, per suite,
``passed / failed / skipped / errors`` from pytest's JUnit XML, per target and in all, and
Markdown table rows for ``benchmarks/RESULTS.md``; exits 0 whatever the counts (this is a
measurement). Each target runs in its own pytest process group under ``--target-timeout``
seconds: a target that runs past it is interrupted (its report then counts the tests it
finished) and its whole process group killed, ranks included, so one hang cannot eat the
run. ``--only`` runs the targets
whose path contains one of the given substrings.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


@dataclass(frozen=True, kw_only=True)
class Suite:
    """One peer suite: where its files sit in PEERS_DIR and what pytest collects."""

    name: str
    version: str
    """the pinned release the files come from"""
    root: str
    """the directory (under PEERS_DIR) pytest runs from and that goes on sys.path"""
    targets: tuple[str, ...]
    """the files or directories collected, relative to ``root``"""
    extra: tuple[str, ...] = ()
    """further pytest arguments"""
    env: tuple[tuple[str, str], ...] = ()
    """further environment variables of the suite's processes"""
    paths: tuple[str, ...] = ()
    """directories (under PEERS_DIR) put first on the suite's PYTHONPATH"""


# DeepSpeed's tests/unit: the 33 files of the runtime (engine, ZeRO, activation
# checkpointing, runtime utils), the part zeroshard answers for; v0.16.5
DS_UNIT = (
    *(
        f"unit/runtime/zero/{f}"
        for f in (
            "test_ignore_unused_parameters.py",
            "test_nvme_checkpointing.py",
            "test_offload_states.py",
            "test_unwrap_model.py",
            "test_zero_config.py",
            "test_zero_context.py",
            "test_zero_context_ancestry.py",
            "test_zero_context_return.py",
            "test_zero_dynamic_class.py",
            "test_zero_leaf_module.py",
            "test_zero_multiple_run.py",
            "test_zero_nesting_init.py",
            "test_zero_offloadpp.py",
            "test_zero_tensor_fragment.py",
            "test_zero_tiled.py",
            "test_zeropp.py",
        )
    ),
    *(
        f"unit/runtime/{f}"
        for f in (
            "test_autocast.py",
            "test_data.py",
            "test_data_efficiency.py",
            "test_ds_config_dict.py",
            "test_ds_config_model.py",
            "test_ds_initialize.py",
            "test_lr_schedulers.py",
            "test_multi_output_model.py",
            "test_multiple_models.py",
            "test_mup_optimizers.py",
            "test_no_sync_ctxt.py",
            "test_pld.py",
            "test_runtime_utils.py",
        )
    ),
    "unit/runtime/activation_checkpointing",
    "unit/runtime/utils",
    "unit/runtime/zero/test_zero.py",  # last: the longest by far
)

SUITES = {
    "transformers": Suite(
        name="transformers",
        version="5.24 (tests at commit 0a5ecfb6)",
        root="transformers",
        targets=("tests/trainer/distributed/test_trainer_distributed_deepspeed.py",),
    ),
    "accelerate": Suite(
        name="accelerate",
        version="1.15",
        root="accelerate",
        targets=("tests/deepspeed",),
        env=(("RUN_SLOW", "1"),),  # its @slow tests run accelerate's scripts: they run here
        paths=("accelerate/src",),  # the package as in accelerate's checkout (fetch_peers.sh)
    ),
    "deepspeed": Suite(
        name="deepspeed",
        version="0.16.5 tests/unit",
        root="deepspeed/tests",
        targets=DS_UNIT,
    ),
}


def environment(peers: Path, root: Path) -> dict[str, str]:
    """The environment of a suite's pytest process (and of every process it starts)."""
    sys.path[:0] = [str(HERE), str(peers / "site")]  # the stand-ins need sentencepiece
    from peers_hub import build, env  # type: ignore[import-not-found]  # (sys.path above)

    hub = build(peers / "hub")
    paths = [str(REPO), str(HERE), str(peers / "site"), str(root)]
    old = os.environ.get("PYTHONPATH")
    bin_dir = os.path.dirname(sys.executable)  # the `accelerate` command the tests launch
    return {
        **os.environ,
        "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
        **env(hub),
        "PYTHONPATH": os.pathsep.join(paths + ([old] if old else [])),
        "ZEROSHARD_AS_DEEPSPEED": "1",
        "DS_ACCELERATOR": "cpu",
        "ZEROSHARD_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_DISABLED": "true",
        "DS_UNITTEST_TIMEOUT": "300",  # DeepSpeed's harness: a hung rank fails the test
    }


def counts(junit: Path) -> dict[str, int]:
    """passed / failed / skipped / errors from a JUnit XML report."""
    out = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        if "error" in kinds:
            out["errors"] += 1
        elif "failure" in kinds:
            out["failed"] += 1
        elif "skipped" in kinds:
            out["skipped"] += 1
        else:
            out["passed"] += 1
    return out


def _run_target(cmd: list[str], root: Path, env: dict[str, str], timeout: float) -> bool:
    """Runs one target's pytest in a process group of its own; False when it ran past
    ``timeout``. Then pytest is interrupted (SIGINT: it stops and still writes its JUnit
    report of the tests it finished) and, a minute later, its whole process group is
    killed (DeepSpeed's harness forks ranks, accelerate's tests launch children)."""
    proc = subprocess.Popen(cmd, cwd=root, env=env, start_new_session=True)
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return False


def run(
    suite: Suite,
    peers: Path,
    junit_dir: Path,
    keyword: str | None,
    *,
    only: list[str] | None = None,
    target_timeout: float = 900.0,
) -> tuple[dict[str, int], list[tuple[str, dict[str, int] | str]]]:
    """Runs ``suite``; returns its totals and, per target, its counts (or why it has none)."""
    root = peers / suite.root
    targets = [t for t in suite.targets if not only or any(o in t for o in only)]
    missing = [t for t in targets if not (root / t).exists()]
    if missing:
        sys.exit(f"run_peers: {suite.name}: {missing} not in {root}; run `make peers-fetch`")
    env = {**environment(peers, root), **dict(suite.env)}
    if suite.paths:
        first = [str(peers / p) for p in suite.paths]
        env["PYTHONPATH"] = os.pathsep.join([*first, env["PYTHONPATH"]])
    result = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    per_target: list[tuple[str, dict[str, int] | str]] = []
    t0 = time.time()
    for target in targets:  # one pytest per target: a hang loses one target
        i = suite.targets.index(target)
        junit = junit_dir / f"{suite.name}-{i:02d}.xml"
        junit.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "pytest", target, "-p", "peers_plugin", "-q"]
        cmd += ["-o", "addopts=", "-p", "no:cacheprovider", f"--junitxml={junit}", *suite.extra]
        cmd += ["--continue-on-collection-errors"]  # a file that fails to import is counted
        if suite.name == "deepspeed":  # DeepSpeed's own pytest.ini deselection, kept
            cmd += ["-m", "not sequential and not nightly and not inference and not evaluation"]
        if keyword:
            cmd += ["-k", keyword]
        t1 = time.time()
        finished = _run_target(cmd, root, env, target_timeout)
        if not finished and not junit.exists():
            why = f"timed out after {target_timeout:.0f} s (killed; no report)"
            per_target.append((target, why))
        elif junit.exists():
            c = counts(junit)
            for kind, n in c.items():
                result[kind] += n
            done = {**c, "seconds": round(time.time() - t1)}
            if not finished:  # the tests it finished before the interrupt
                done["timed_out"] = 1
            per_target.append((target, done))
        else:
            per_target.append((target, "no report (pytest died)"))
        print(f"run_peers: {suite.name}: {target}: {per_target[-1][1]}", flush=True)
    result["seconds"] = round(time.time() - t0)
    return result, per_target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("suites", nargs="*", help=f"of {sorted(SUITES)} (default: all)")
    ap.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    ap.add_argument(
        "--only", action="append", default=None, help="run only targets containing this"
    )
    ap.add_argument(
        "--target-timeout", type=float, default=900.0, help="seconds per target (default 900)"
    )
    ap.add_argument("--peers-dir", default=os.environ.get("PEERS_DIR", "/work/peers"))
    ap.add_argument("--junit-dir", default="runs/peers")
    args = ap.parse_args(argv)
    peers, junit_dir = Path(args.peers_dir).resolve(), Path(args.junit_dir).resolve()
    junit_dir.mkdir(parents=True, exist_ok=True)
    rows, target_rows = [], []
    for name in args.suites or list(SUITES):
        if name not in SUITES:
            ap.error(f"no suite {name!r}: {sorted(SUITES)}")
        suite = SUITES[name]
        r, per_target = run(
            suite,
            peers,
            junit_dir,
            args.keyword,
            only=args.only,
            target_timeout=args.target_timeout,
        )
        print(f"run_peers: {name}: {r}", flush=True)
        rows.append(
            f"| {name} {suite.version} | {r['passed']} | {r['failed']} | {r['skipped']} "
            f"| {r.get('errors', 0)} | {r['seconds']} s |"
        )
        for target, c in per_target:
            if isinstance(c, str):
                target_rows.append(f"| `{target}` | {c} | | | | |")
            else:
                cut = " (timed out: the tests finished before it)" if c.get("timed_out") else ""
                target_rows.append(
                    f"| `{target}`{cut} | {c['passed']} | {c['failed']} | {c['skipped']} "
                    f"| {c['errors']} | {c['seconds']} s |"
                )
    print("| suite | passed | failed | skipped | errors | wall |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("| target | passed | failed | skipped | errors | wall |")
    print("|---|---|---|---|---|---|")
    print("\n".join(target_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
