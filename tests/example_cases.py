"""The example launches tests/test_examples.py runs, as the examples' docstrings print
them; tests/test_docs.py checks that every command an example's docstring prints is one
of :data:`LAUNCHED` (or a step of `make demo`)."""

from __future__ import annotations

from typing import Any

import pytest

CASES = [
    (
        ["--num_gpus", "2", "examples/seeds/seed001_method_b.py"],
        "seed001 method B: 1 optimizer step",
    ),
    (
        ["run", "--nproc", "2", "examples/seeds/seed001_method_b_as_printed.py"],
        (  # the seed's config file unchanged: the micro-batch size from the first batch
            "seed001 method B as printed: 1 optimizer step(s) after 10 micro-steps, micro-batch 8",
            "train_micro_batch_size_per_gpu is not in the config; taken from the first batch: 8",
        ),
    ),
    (["run", "--nproc", "2", "examples/seeds/seed002_initialize.py"], "seed002: loss"),
    (
        ["run", "--nproc", "2", "examples/seeds/seed003_as_printed.py"],
        (
            "forward without an optimizer: loss",
            "training refused as expected: engine.backward(): this engine has no optimizer",
        ),
    ),
    (
        [
            "--num_gpus",
            "2",
            "examples/seeds/seed001_method_a_equivalent.py",
            "--deepspeed",
            "examples/seeds/seed001_ds_config.json",
        ],
        "method A equivalent: 4 steps",
    ),
    pytest.param(  # the docstring's other spelling of the same launch
        ["run", "--nproc", "2", "examples/seeds/seed001_method_b.py"],
        "seed001 method B: 1 optimizer step",
        marks=pytest.mark.slow,
    ),
]


def argv(case: Any) -> list[str]:
    """A case's command line (a plain tuple or a pytest.param)."""
    return list(case.values[0] if hasattr(case, "values") else case[0])


METHOD_A = ["--num_gpus", "2", "--as-deepspeed", "examples/seeds/seed001_method_a.py"]
STAGES = (1, 2, 3)
#: every command these tests launch, as the examples' docstrings print them (the doc-test
#: checks that each printed command is one of these)
LAUNCHED = ["zeroshard " + " ".join(argv(c)) for c in CASES] + [
    "zeroshard " + " ".join(METHOD_A),
    "python examples/seeds/seed001_method_b.py",
    *(f"zeroshard run --nproc 2 examples/seeds/seed003_zero.py --stage {s}" for s in STAGES),
]
