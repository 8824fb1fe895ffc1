"""seeds/001, "실행 방법 B" (Python API), with `deepspeed` replaced by `zeroshard`.

    zeroshard --num_gpus 2 examples/seeds/seed001_method_b.py
    zeroshard run --nproc 2 examples/seeds/seed001_method_b.py
    python examples/seeds/seed001_method_b.py          # one rank, no launcher

What had to change, and why:
* `import deepspeed as ds` -> `import zeroshard as ds`; nothing else in the loop.
* The seed's ds_config.json (seed001_ds_config.json, kept verbatim, `//` comments and
  all) gives only `"gradient_accumulation_steps": 8` and `"train_batch_size": 0`
  ("computed"). 0 is read as "derive it", but nothing fixes the micro-batch, so
  zeroshard stops with: `train_micro_batch_size_per_gpu: only gradient_accumulation_steps
  (8) is given; set train_micro_batch_size_per_gpu or train_batch_size too`. DeepSpeed
  refuses this config too. seed001_method_b_ds_config.json is the seed's file with one
  line added, `"train_micro_batch_size_per_gpu": 8` (the rows each call feeds), and it
  is passed by path, as the seed does: zeroshard reads the `//` comments itself.
* The loop calls the raw `model(x)` (not the engine) with fp32 inputs while bf16 is on:
  zeroshard casts the module to bf16 and casts floating inputs of the wrapped module to
  the compute dtype, so this works as written.
"""

import os

import torch

import zeroshard as ds

HERE = os.path.dirname(os.path.abspath(__file__))
config = os.path.join(HERE, "seed001_method_b_ds_config.json")  # the seed's file + 1 line

torch.manual_seed(0)
model = torch.nn.Linear(768, 768)
optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
engine, optim, _, _ = ds.initialize(model=model, optimizer=optim, config=config)

for _ in range(10):
    x = torch.randn(8, 768, device=engine.device)
    y = model(x).sum()
    engine.backward(y)
    engine.step()

if engine.global_rank == 0:
    print(
        f"seed001 method B: {engine.global_steps} optimizer step(s) after 10 micro-steps "
        f"(accumulation {engine.gradient_accumulation_steps()}), bf16 {engine.bfloat16_enabled()}, "
        f"ZeRO stage {engine.zero_optimization_stage()} with CPU optimizer offload"
    )
