"""seeds/003's ZeRO-1 config exactly as printed (no optimizer anywhere): zeroshard
refuses it at initialize() and says what to add.

    zeroshard run --nproc 2 examples/seeds/seed003_as_printed.py
"""

from transformers import GPT2Config, GPT2LMHeadModel

import zeroshard as deepspeed
from zeroshard.config import ConfigError

model = GPT2LMHeadModel(GPT2Config(n_layer=1))
ds_config = {"train_batch_size": 8, "zero_optimization": {"stage": 1}}
try:
    deepspeed.initialize(model=model, config=ds_config)
except ConfigError as exc:
    print(f"refused as expected: {exc}")
else:
    raise SystemExit("expected a ConfigError naming the missing optimizer")
