"""Hugging Face's Trainer and accelerate on zeroshard, on 2 CPU ranks under our launcher
with the one documented step (``zeroshard run --as-deepspeed``), issue 13.

The Trainer (``tests/scripts/hf_trainer.py``, one launch per stage runs every case):
losses equal zeroshard's own loop on the same inputs to 2e-5; accelerate sees 2
processes; resuming from a checkpoint continues the losses and the learning-rate
schedule; ``save_model`` then ``from_pretrained`` gives identical logits; at stage 3
the model is loaded under zero.Init and a peft LoRA model trains. accelerate
(``tests/scripts/hf_accelerate.py``): ``Accelerator(deepspeed_plugin=...)`` with
gradient accumulation 4 matches a single-process fp32 reference to 2e-5.

Each launch imports transformers on both ranks (~10 s of CPU each on this machine):
stage 2 is the representative case; stage 3 with peft and accelerate are marked slow.
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
TOL = 2e-5

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
if importlib.util.find_spec("deepspeed") is not None:  # the alias refuses to shadow it
    pytest.skip("a real DeepSpeed is installed", allow_module_level=True)


def _launch(
    script: str, out: Path, *args: str, timeout: float = 600, torchrun: bool = False
) -> dict:
    """2 ranks under `zeroshard run --as-deepspeed`, or (``torchrun``) under torch's own
    launcher, the script then importing zeroshard.as_deepspeed itself."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "zeroshard.tools.cli", "run", "--nproc", "2", "--as-deepspeed"]
    if torchrun:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
        ]
        args = (*args, "import")
    proc = subprocess.run(
        [*cmd, str(ROOT / "tests" / "scripts" / script), str(out), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return json.loads((out / "result.json").read_text())


def _check_trainer(r: dict, stage: int) -> None:
    assert r["engine"] == "Engine"
    assert r["world"] == [2, 2, 2]  # TrainingArguments, accelerate, torch.distributed
    assert len(r["loss1"]) == 8  # 4 steps x 2 micro-batches on this rank
    diff = max(abs(a - b) for a, b in zip(r["loss1"], r["loss_own"], strict=True))
    assert diff <= TOL, (stage, r["loss1"], r["loss_own"])
    assert r["lr1"] == r["lr_own"]
    # resumed at step 2: steps 3 and 4 as in the uninterrupted run, same schedule
    assert len(r["loss_resumed"]) == 4
    resumed = max(abs(a - b) for a, b in zip(r["loss_resumed"], r["loss1"][4:], strict=True))
    assert resumed <= TOL, (r["loss_resumed"], r["loss1"][4:])
    assert r["lrs_resumed"] == r["lrs1"] and r["lr_resumed"] == r["lr1"]
    assert r["saved_logits_diff"] == 0.0
    assert 0 < r["eval_loss"] < 100  # Trainer.evaluate through the engine


def test_trainer_zero2_two_ranks(tmp_path) -> None:
    _check_trainer(_launch("hf_trainer.py", tmp_path, "2"), 2)


@pytest.mark.slow
def test_trainer_zero3_from_pretrained_and_peft(tmp_path) -> None:
    r = _launch("hf_trainer.py", tmp_path, "3", "peft")
    assert r["zero_init"]  # from_pretrained after TrainingArguments built it partitioned
    _check_trainer(r, 3)
    assert r["lora_steps"] == 4 and r["lora_trainable"] > 0
    assert all(abs(x) < 100 for x in r["lora_losses"])


def _check_accelerate(r: dict) -> None:
    assert r["processes"] == 2 and r["engine"] == "Engine"
    assert r["steps"] == 3 and r["micro"] == 12  # 3 optimizer steps of 4 micro-batches
    diff = max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"], strict=True))
    assert diff <= TOL, (r["losses"], r["ref_losses"])
    assert r["param_diff"] <= TOL
    # save_state, one more step (it moved them), load_state: back where they were
    assert r["moved"] > 1e-4 and r["restored"] == 0.0


def test_accelerate_gradient_accumulation_zero2(tmp_path) -> None:
    _check_accelerate(_launch("hf_accelerate.py", tmp_path, "2"))


@pytest.mark.slow
def test_accelerate_gradient_accumulation_zero3_torchrun(tmp_path) -> None:
    """Launched by torchrun, `import zeroshard.as_deepspeed` in the script."""
    _check_accelerate(_launch("hf_accelerate.py", tmp_path, "3", torchrun=True))
