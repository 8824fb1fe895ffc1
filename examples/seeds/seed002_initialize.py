"""seeds/002: `initialize(model=model, model_parameters=model.parameters(), config="ds_config.json")`.

    zeroshard run --nproc 2 examples/seeds/seed002_initialize.py

The seed shows only the call; the model and config here are ours (a small GPT and a
ZeRO-3 config file, seed002_ds_config.json). Nothing in the call had to change.
"""

import os

import torch

import zeroshard as deepspeed
from zeroshard.models import GPT, GPTConfig

HERE = os.path.dirname(os.path.abspath(__file__))
torch.manual_seed(0)
model = GPT(GPTConfig.preset("tiny"))

model_engine, optimizer, _, _ = deepspeed.initialize(
    model=model,
    model_parameters=model.parameters(),
    config=os.path.join(HERE, "seed002_ds_config.json"),
)

for _step in range(4):
    ids = torch.randint(0, 256, (model_engine.train_micro_batch_size_per_gpu(), 33))
    loss = model_engine(ids[:, :-1], ids[:, 1:])
    model_engine.backward(loss)
    model_engine.step()
if model_engine.global_rank == 0:
    print(
        f"seed002: loss {loss.item():.3f} after {model_engine.global_steps} steps, ZeRO stage "
        f"{model_engine.zero_optimization_stage()}"
    )
