"""seeds/001 method B exactly as printed (config file unchanged): zeroshard refuses the
config at initialize() with a message naming the key and the fix, not a traceback from
deep inside. Run: zeroshard run --nproc 2 examples/seeds/seed001_method_b_as_printed.py
"""

import os

import torch

import zeroshard as ds
from zeroshard.config import ConfigError

HERE = os.path.dirname(os.path.abspath(__file__))
model = torch.nn.Linear(768, 768)
optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
try:
    ds.initialize(model=model, optimizer=optim, config=os.path.join(HERE, "seed001_ds_config.json"))
except ConfigError as exc:
    print(f"refused as expected: {exc}")
else:
    raise SystemExit("expected a ConfigError naming train_micro_batch_size_per_gpu")
