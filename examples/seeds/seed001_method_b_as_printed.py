"""seeds/001 method B exactly as printed, with its ds_config.json unchanged
(seed001_ds_config.json: `//` comments, only `"gradient_accumulation_steps": 8` and
`"train_batch_size": 0`). Only `deepspeed` is replaced by `zeroshard`.

    zeroshard run --nproc 2 examples/seeds/seed001_method_b_as_printed.py

DeepSpeed refuses this config (nothing fixes the micro-batch size). zeroshard takes it
from the first batch the model sees, since the loop feeds its own batches (no
`training_data`), and says so in one log line: 8 rows, so train_batch_size is
8 x 8 x 2 = 128 on 2 ranks. (seed001_method_b.py runs the same loop with the
micro-batch size written in the config.)
"""

import os

import torch

import zeroshard as ds

HERE = os.path.dirname(os.path.abspath(__file__))

model = torch.nn.Linear(768, 768)
optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
engine, optim, _, _ = ds.initialize(
    model=model, optimizer=optim, config=os.path.join(HERE, "seed001_ds_config.json")
)

for _ in range(10):
    x = torch.randn(8, 768, device=engine.device)
    y = model(x).sum()
    engine.backward(y)
    engine.step()

if engine.global_rank == 0:
    print(
        f"seed001 method B as printed: {engine.global_steps} optimizer step(s) after 10 "
        f"micro-steps, micro-batch {engine.train_micro_batch_size_per_gpu()} (from the first "
        f"batch), train_batch_size {engine.train_batch_size()}"
    )
