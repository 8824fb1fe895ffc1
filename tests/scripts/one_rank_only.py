"""Fault-test worker: every rank initializes the same tiny engine (comm_timeout 3 s in
the config, unless argv[3] is "flag": then the launcher's --comm-timeout sets it), then
only rank 0 makes the call named by argv[1] ("save" or "eval"); rank 1 idles. The
watchdog must report every rank and end the job. argv[2]: where rank 0 saves."""

import sys
import time

import torch

import zeroshard
from zeroshard.models import GPT, GPTConfig

what, where = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=16))
config = {
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}
if sys.argv[3:] != ["flag"]:
    config["comm_timeout"] = 3
engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
if engine.global_rank == 0:
    if what == "save":
        engine.save_checkpoint(where)
    else:
        engine.eval()
        with torch.no_grad():
            engine(torch.zeros(1, 8, dtype=torch.long))
else:
    engine.train()
    time.sleep(60)
print(f"DONE rank={engine.global_rank}", flush=True)
