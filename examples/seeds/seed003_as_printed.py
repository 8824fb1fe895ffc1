"""seeds/003's ZeRO-1 config exactly as printed (no optimizer anywhere). As in DeepSpeed,
initialize() builds an engine without an optimizer (for evaluation and inference):
forward runs, and the first training call is refused, naming what to add.

    zeroshard run --nproc 2 examples/seeds/seed003_as_printed.py
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import zeroshard as deepspeed
from zeroshard import UsageError

model = GPT2LMHeadModel(GPT2Config(n_layer=1))
ds_config = {"train_batch_size": 8, "zero_optimization": {"stage": 1}}
engine, optimizer, _, _ = deepspeed.initialize(model=model, config=ds_config)
assert optimizer is None and engine.optimizer is None
ids = torch.randint(0, model.config.vocab_size, (4, 8))
loss = engine(input_ids=ids, labels=ids).loss
print(f"forward without an optimizer: loss {loss.item():.3f}")
try:
    engine.backward(loss)
except UsageError as exc:
    print(f"training refused as expected: {exc}")
else:
    raise SystemExit("expected a UsageError naming the missing optimizer")
