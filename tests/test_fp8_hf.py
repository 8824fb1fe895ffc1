"""fp8 through Hugging Face on zeroshard (tests/scripts/hf_fp8.py, 2 ranks, one launch under
``zeroshard run --as-deepspeed``): accelerate's ``Accelerator(mixed_precision="fp8")``
(torchao converts the model before zeroshard sees it, weights wrapped for FSDP2's fp8
all-gather) trains exactly as zeroshard's own loop with the ``fp8`` section on the same
layers; the Trainer with the ``fp8`` key trains a GPT-2 (Conv1D layers through the
hand-written fp8 matmul, the tied lm_head through torchao) exactly as zeroshard's own loop
replaying its inputs. Marked slow: a launch imports transformers on both ranks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip(
    "torchao", reason="torchao is not installed (optional: pip install 'zeroshard[fp8]')"
)
if importlib.util.find_spec("deepspeed") is not None:  # the alias refuses to shadow it
    pytest.skip("a real DeepSpeed is installed", allow_module_level=True)


@pytest.mark.slow
def test_accelerate_fp8_and_the_trainer_fp8_key(tmp_path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "zeroshard.tools.cli", "run", "--nproc", "2", "--as-deepspeed"]
    proc = subprocess.run(
        [*cmd, str(ROOT / "tests" / "scripts" / "hf_fp8.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    r = json.loads((tmp_path / "result.json").read_text())
    # accelerate: zeroshard's engine, bf16 filled in, the middle Linear in fp8
    assert r["accelerate_engine"] == "Engine" and r["accelerate_bf16"]
    assert r["accelerate_fp8"] == ["2"] == r["own_fp8"]
    assert r["accelerate_losses"] == r["own_losses"]
    # the Trainer: every Conv1D and the lm_head in fp8, the same losses as our own loop
    assert len(r["trainer_fp8"]) == 9 and "lm_head" in r["trainer_fp8"]
    assert len(r["trainer_losses"]) == 4
    assert r["trainer_losses"] == r["trainer_own_losses"]
