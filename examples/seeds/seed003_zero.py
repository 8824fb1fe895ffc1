"""seeds/003: the ZeRO-1, ZeRO-2 (+ offload_optimizer cpu) and ZeRO-3 examples with a
transformers GPT-2, `model(inputs, labels=inputs)`, `model.backward(loss)`, `model.step()`.

    zeroshard run --nproc 2 examples/seeds/seed003_zero.py --stage 1
    zeroshard run --nproc 2 examples/seeds/seed003_zero.py --stage 2
    zeroshard run --nproc 2 examples/seeds/seed003_zero.py --stage 3

What had to change, and why:
* `import deepspeed` -> `import zeroshard as deepspeed`.
* `AutoModelForCausalLM.from_pretrained("gpt2")` downloads weights; this machine has no
  model hub, so the same architecture is built from a `GPT2Config` (2 layers instead of
  12 to keep the CPU run short; any size works).
* The seed's configs (`{"train_batch_size": 8, "zero_optimization": {"stage": N}}`) have
  no optimizer and pass none to initialize(): there is nothing for `model.step()` to
  step. zeroshard says so at initialize(): `optimizer: no optimizer; add an "optimizer"
  section to the config, e.g. {"type": "AdamW", "params": {"lr": 1e-4}}, or pass
  optimizer= to initialize()`. We add that section.
* `.cuda()` on the inputs -> `.to(model.device)`, so the same line runs on CPU or GPU.
* The seed's ZeRO-2 example offloads the optimizer to CPU; kept as is.
"""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import zeroshard as deepspeed

parser = argparse.ArgumentParser()
parser.add_argument("--stage", type=int, default=1, choices=[1, 2, 3])
parser.add_argument("--local_rank", type=int, default=0)  # set by DeepSpeed-style launchers
args = parser.parse_args()

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2))  # from_pretrained("gpt2") needs a download

ds_config = {
    "train_batch_size": 8,
    "zero_optimization": {"stage": args.stage},
    "optimizer": {"type": "AdamW", "params": {"lr": 5e-5}},  # added: see the docstring
}
if args.stage == 2:
    ds_config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}

model, optimizer, _, _ = deepspeed.initialize(model=model, config=ds_config)

inputs = torch.randint(0, 50257, (1, 128)).to(model.device)
outputs = model(inputs, labels=inputs)
loss = outputs.loss
model.backward(loss)
model.step()
if model.global_rank == 0:
    print(
        f"seed003 ZeRO-{args.stage}: loss {loss.item():.3f}, step applied {model.was_step_applied()}"
    )
