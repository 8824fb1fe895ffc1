"""Fault-test worker: both ranks train 3 steps of a tiny stage-2 engine (comm_timeout 3 s),
then rank 1 stalls in its own code (argv[1] "sleep": asleep, its watchdog thread alive;
"stop": SIGSTOP, nothing of it runs) while rank 0 starts a 4th step and blocks in its
first collective. The watchdog report must say where rank 1 stopped: after step() of
step 3 returned, with its last collective."""

import os
import signal
import subprocess
import sys
import time

import torch

import zeroshard
from zeroshard.models import GPT, GPTConfig

torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=16))
config = {
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2},
    "comm_timeout": 3,
}
engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
# both ranks leave initialize together (a plain barrier, outside the watchdog): on a loaded
# host one rank can finish initialize seconds after the other, and step 0's first
# collective would then outlast the 3 s comm_timeout before any stall is staged
torch.distributed.barrier()
x = torch.zeros(1, 8, dtype=torch.long)
for step in range(4):
    if step == 3 and engine.global_rank == 1:
        if sys.argv[1] == "stop":  # continued 10 s later, so that the launcher can end it
            cont = f"sleep 10; kill -CONT {os.getpid()}"  # its own session: outlives a group kill
            subprocess.Popen(["sh", "-c", cont], start_new_session=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)
    engine.backward(engine(x, x))
    engine.step()
print(f"DONE rank={engine.global_rank}", flush=True)
