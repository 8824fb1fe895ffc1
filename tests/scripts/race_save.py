"""A one-rank job for tests/test_faults.py's racing-saves test.

``race_save.py DIR JOB``: for each ``save`` line on stdin, train one step on data of its
own (seeded by JOB) and save tag ``t`` into DIR, recording in client_state the digest of
what it saved; print one JSON line (ok, digest, error). For each ``verify`` line, load
DIR/t into this job's engine (as ``load_checkpoint(DIR, tag="t")`` finds it; the job
goes on from there) and print whether the loaded state matches the digest its manifest
records.
"""

import hashlib
import json
import os
import sys

import torch

for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
    os.environ.pop(k, None)
torch.set_num_threads(1)
torch.manual_seed(0)

import zeroshard  # noqa: E402
from zeroshard.checkpoint.load import CheckpointError  # noqa: E402
from zeroshard.checkpoint.save import CheckpointSaveError  # noqa: E402

root, job = sys.argv[1], int(sys.argv[2])
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
cfg = {
    "train_batch_size": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 1},
}
engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
gen = torch.Generator().manual_seed(job)


def digest() -> str:
    h = hashlib.sha256()
    for p in engine.module.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    assert engine.optimizer is not None
    for group in engine.optimizer.inner.param_groups:
        for v in group["params"]:
            for k, t in sorted(engine.optimizer.inner.state.get(v, {}).items()):
                h.update(k.encode() + t.detach().reshape(-1).contiguous().numpy().tobytes())
    return h.hexdigest()


print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "save":
        engine.backward(engine(torch.randn(2, 256, generator=gen)).sum())
        engine.step()
        d = digest()
        try:
            engine.save_checkpoint(root, tag="t", client_state={"digest": d, "job": job})
            print(json.dumps({"ok": True, "digest": d}), flush=True)
        except CheckpointSaveError as exc:
            print(json.dumps({"ok": False, "digest": d, "error": str(exc)}), flush=True)
    else:
        try:
            _path, client = engine.load_checkpoint(root, tag="t")
            ok = client["digest"] == digest()
            print(json.dumps({"ok": ok, "digest": client["digest"]}), flush=True)
        except CheckpointError as exc:
            print(json.dumps({"ok": False, "error": str(exc)}), flush=True)
