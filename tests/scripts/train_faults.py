"""Training script for the launcher fault tests (tests/test_faults.py).

Trains parity.build_model at stage 2 on parity.batch data (global batch 4 = 2 per rank on
2 ranks), printing ``LOSS step=S <mean loss repr>`` from rank 0 after each step. Options:
``--ckpt DIR`` sets the config's checkpoint.dir (resume from it, save there on SIGTERM);
``--save-every K`` saves there every K steps; ``--kill-rank R --kill-step S`` SIGKILLs
rank R before step S in the first attempt (TORCHELASTIC_RESTART_COUNT 0); ``--sleep T``
waits T seconds after each step; ``--hold`` keeps all-reducing after training until
stopped (for the node-loss test).
"""

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import parity

import zeroshard

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=10)
p.add_argument("--ckpt")
p.add_argument("--save-every", type=int, default=0)
p.add_argument("--kill-rank", type=int, default=-1)
p.add_argument("--kill-step", type=int, default=-1)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--hold", action="store_true")
args = p.parse_args()
torch.set_num_threads(1)

case = {"stage": 2, "micro": 2, "steps": args.steps}
cfg = parity.ds_config(case)
if args.ckpt:
    cfg["checkpoint"] = {"dir": args.ckpt}
model = parity.build_model(case)
engine, *_ = zeroshard.initialize(
    model=model, model_parameters=parity.param_groups(model), config=cfg
)
rank, world = engine.global_rank, engine.world_size
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
print(
    f"START rank={rank} step={engine.global_steps} restart={restart} pid={os.getpid()}", flush=True
)
micro = 2
for step in range(engine.global_steps, args.steps):
    if restart == 0 and rank == args.kill_rank and step == args.kill_step:
        os.kill(os.getpid(), signal.SIGKILL)
    x, y = parity.batch(step, micro * world)
    loss = engine(x[rank * micro : (rank + 1) * micro], y[rank * micro : (rank + 1) * micro])
    engine.backward(loss)
    engine.step()
    total = loss.detach().clone()
    if world > 1:
        dist.all_reduce(total)
    if rank == 0:
        print(f"LOSS step={step} {total.item() / world!r}", flush=True)
    if args.save_every and (step + 1) % args.save_every == 0:
        engine.save_checkpoint(args.ckpt)
    time.sleep(args.sleep)
print(f"DONE rank={rank} step={engine.global_steps}", flush=True)
if args.hold:
    while True:
        dist.all_reduce(torch.ones(1))
        time.sleep(0.1)
