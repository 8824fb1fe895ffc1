"""fp8 against bf16 on real text (benchmarks/stdlib_gpt.py: a byte-level GPT on Python's
standard library, the held-out bytes from files it never saw): the training loss logged
every 25 steps (the mean since the last log; both runs see the same batches) stays within
2% of bf16's at every logged step over 300 steps, and the held-out perplexity within 2%.
The 300-step run is slow (minutes: ``make test-all``); ``make test`` runs a 40-step cut.
Both runs use the engine's own precision for the held-out loss.
"""

from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import stdlib_gpt

pytest.importorskip(
    "torchao", reason="torchao is not installed (optional: pip install 'zeroshard[fp8]')"
)


def _compare(steps: int, preset: str, log_every: int, eval_bytes: int, **shape) -> None:
    kw = {"log_every": log_every, "eval_bytes": eval_bytes, **shape}
    bf16 = stdlib_gpt.loss_curve(steps, preset, "bf16", **kw)
    fp8 = stdlib_gpt.loss_curve(steps, preset, "fp8", **kw)
    assert fp8["steps"] == bf16["steps"] and len(fp8["steps"]) == math.ceil(steps / log_every)
    rel = [abs(a - b) / b for a, b in zip(fp8["losses"], bf16["losses"], strict=True)]
    assert max(rel) <= 0.02, list(zip(fp8["steps"], fp8["losses"], bf16["losses"], strict=True))
    assert fp8["losses"] != bf16["losses"]  # fp8 ran: its roundings moved the curve
    assert bf16["losses"][-1] < 0.8 * bf16["losses"][0]  # and the model learned
    ratio = math.exp(fp8["heldout"] - bf16["heldout"])  # perplexity fp8 / bf16
    assert abs(ratio - 1) <= 0.02, (fp8["heldout"], bf16["heldout"])


def test_fp8_loss_curve_short() -> None:
    """40 steps of GPT tiny: the representative cut for ``make test``."""
    _compare(40, "tiny", log_every=10, eval_bytes=200_000)


@pytest.mark.slow
def test_fp8_loss_curve_300_steps() -> None:
    check = dict(stdlib_gpt.FP8_CHECK)
    _compare(check.pop("steps"), check.pop("preset"), log_every=25, eval_bytes=stdlib_gpt.CORPUS_BYTES, **check)  # fmt: skip
