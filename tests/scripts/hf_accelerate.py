"""accelerate's DeepSpeed plugin on zeroshard (run by tests/test_hf_trainer.py, 2 ranks):

    zeroshard run --nproc 2 --as-deepspeed tests/scripts/hf_accelerate.py OUT STAGE
    torchrun --nproc-per-node 2 tests/scripts/hf_accelerate.py OUT STAGE import

(the second: any launcher, with `import zeroshard.as_deepspeed` before accelerate's import)

A small MLP trains for 3 optimizer steps with ``Accelerator(deepspeed_plugin=...)`` and
gradient accumulation 4 (``accelerator.accumulate``, ``accelerator.backward``); rank 0
also trains the same model in one process on the 8 micro-batches each step covers
(fp32, plain torch: the reference) and writes both runs' losses and parameters'
largest difference to OUT/result.json.
"""

from __future__ import annotations

import json
import os
import sys

if "import" in sys.argv[3:]:
    import zeroshard.as_deepspeed  # noqa: F401  (the one line, before accelerate)

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin
from torch import nn

torch.set_num_threads(1)
OUT, STAGE = sys.argv[1], int(sys.argv[2])
MICRO, GAS, STEPS, WORLD, LR = 2, 4, 3, 2, 1e-2


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


gen = torch.Generator().manual_seed(1)
X = torch.randn(MICRO * GAS * WORLD * STEPS, 8, generator=gen)
Y = torch.randn(len(X), 4, generator=gen)
data = torch.utils.data.TensorDataset(X, Y)

plugin = DeepSpeedPlugin(
    hf_ds_config={
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": STAGE},
    }
)
accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=GAS)
model = build()
optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
loader = torch.utils.data.DataLoader(data, batch_size=MICRO, shuffle=False)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
losses, micro = [], 0
for x, y in loader:
    with accelerator.accumulate(model):
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    losses.append(loss.item())
    micro += 1
from zeroshard.zero import GatheredParameters  # noqa: E402

with GatheredParameters(list(model.module.parameters())):
    got = {n: p.detach().clone() for n, p in model.module.named_parameters()}
# accelerate's save_state / load_state (DeepSpeed's save_checkpoint / load_checkpoint)
accelerator.save_state(os.path.join(OUT, "state"))
for x, y in list(loader)[:GAS]:  # one more optimizer step moves the parameters
    x, y = x.to(accelerator.device), y.to(accelerator.device)
    with accelerator.accumulate(model):
        accelerator.backward(nn.functional.mse_loss(model(x), y))
with GatheredParameters(list(model.module.parameters())):
    moved = max(
        (p.detach() - got[n]).abs().max().item() for n, p in model.module.named_parameters()
    )
accelerator.load_state(os.path.join(OUT, "state"))
with GatheredParameters(list(model.module.parameters())):
    restored = max(
        (p.detach() - got[n]).abs().max().item() for n, p in model.module.named_parameters()
    )
result = {
    "restored": restored,
    "moved": moved,
    "processes": accelerator.num_processes,
    "engine": type(model).__name__,
    "steps": model.global_steps,
    "micro": micro,
    "losses": losses,
}

if accelerator.process_index == 0:
    # the reference: one process, each step's 8 micro-batches (rank r's m-th micro-batch
    # of a step is global batch (step * GAS + m) * WORLD + r: accelerate deals batches
    # round-robin), the mean of their losses
    ref = build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    ref_losses = []
    for step in range(STEPS):
        ref_opt.zero_grad()
        total = 0.0
        for m in range(GAS):
            for r in range(WORLD):
                b = (step * GAS + m) * WORLD + r
                xb, yb = X[b * MICRO : (b + 1) * MICRO], Y[b * MICRO : (b + 1) * MICRO]
                loss = nn.functional.mse_loss(ref(xb), yb)
                (loss / (GAS * WORLD)).backward()
                if r == 0:
                    ref_losses.append(loss.item())
        ref_opt.step()
    result["ref_losses"] = ref_losses
    result["param_diff"] = max(
        (p.detach() - got[n]).abs().max().item() for n, p in ref.named_parameters()
    )
    with open(os.path.join(OUT, "result.json"), "w") as f:
        json.dump(result, f)
accelerator.wait_for_everyone()
print(f"rank {accelerator.process_index} done", flush=True)
