"""The suite computes on the CPU (gloo) unless told otherwise, also on a machine with
GPUs, so it checks the same thing everywhere; ``test_cuda.py`` asks for CUDA itself.
``ZEROSHARD_ACCELERATOR=cuda pytest tests`` runs everything on the GPU instead.

``make test`` runs the suite on two pytest-xdist workers (``-n 2 --dist loadgroup``),
so that both cores work. Two rules keep that correct and short:

* a file whose tests share a fixture wider than one test (``scope="module"`` and up,
  defined in the file: a spawn whose results several tests check) runs on one worker,
  so the fixture is built once; the other files' tests are shared out one by one;
* the files that take longest start first (``LONGEST_FIRST``): xdist hands out work in
  collection order, and a long file started last would decide the wall time.

Each test also starts from the process state the previous one found: the environment,
torch's default dtype and thread count are put back after it (under xdist a test's
neighbours depend on the worker, not on the file order)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("ZEROSHARD_ACCELERATOR", "cpu")

# Files by their time in the suite, the longest first (`pytest tests --durations=0`,
# summed per file): the subprocess-heavy files, then the long multi-rank files. Files
# not listed follow in their usual order. Only the order changes, never what runs.
# test_docs.py leads: its blocks run in order on one worker (one fixture), the longest
# chain of the suite (216 s of the 800 s at c49f934), which must not start late.
LONGEST_FIRST = [
    "test_docs.py",
    "test_benchmarks_smoke.py",
    "test_examples.py",
    "test_checkpoint.py",
    "test_launcher.py",
    "test_inference_tp.py",
    "test_memory_peak.py",
    "test_hangs.py",
    "test_tp_wrappers.py",
    "test_parity.py",
    "test_monitors.py",
    "test_hf_trainer.py",
    "test_dynamic.py",
    "test_ds_compat_names.py",
    "test_inference_stream.py",
    "test_report.py",
    "test_tp_engine.py",
    "test_zero3.py",
    "test_compile.py",
    "test_faults.py",
    "test_engine.py",
]


def _shares_a_fixture(item: pytest.Item) -> bool:
    """Whether the test uses a fixture defined in its own file that outlives one test."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    for defs in info.name2fixturedefs.values():
        for d in defs:
            if d.scope != "function" and d.baseid.endswith(".py"):
                return True
    return False


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    if config.pluginmanager.hasplugin("xdist"):
        grouped = {item.path.name for item in items if _shares_a_fixture(item)}
        for item in items:
            if item.path.name in grouped:
                item.add_marker(pytest.mark.xdist_group(item.path.stem))
    # a stable sort: tests keep their order within a file
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True)
def _process_state_restored():
    """The environment, torch's default dtype and its thread count as before the test
    (a test that sets one for itself would otherwise set it for the tests after it)."""
    import torch

    env = dict(os.environ)
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    yield
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)
    if torch.get_default_dtype() != dtype:
        torch.set_default_dtype(dtype)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A test that builds an engine in the pytest process itself gets a one-rank process
    group (as DeepSpeed's initialize makes one); it ends with the test, so that the next
    test sees torch.distributed as it was (test_pipeline_schedules checks an
    uninitialized world)."""
    import torch.distributed as dist

    before = dist.is_available() and dist.is_initialized()
    yield
    if not before and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
