"""fp8 through Hugging Face's two routes on zeroshard (run by tests/test_fp8_hf.py, 2 ranks):

    zeroshard run --nproc 2 --as-deepspeed tests/scripts/hf_fp8.py OUT

(1) accelerate's ``Accelerator(mixed_precision="fp8")`` with the DeepSpeed plugin: accelerate
converts the model with torchao (every Linear but the first and last, weights wrapped for
FSDP2's fp8 all-gather) and hands it to zeroshard; a small MLP trains 3 steps, and
zeroshard's own loop with the config's ``fp8`` section keeping the same two layers in bf16
trains the same model on the same batches. (2) The Trainer with the ``fp8`` key in its
DeepSpeed config trains a tiny GPT-2 (Conv1D layers: the hand-written fp8 matmul; the
tied lm_head: torchao) for 2 optimizer steps; zeroshard's own loop replays its inputs.
Rank 0 writes both runs' losses and the layers that ran fp8 to OUT/result.json.
"""

from __future__ import annotations

import copy
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin
from torch import nn

import zeroshard

torch.set_num_threads(1)
OUT = sys.argv[1]
RANK = int(os.environ["RANK"])
result: dict = {}


def fp8_layers(module: nn.Module) -> list[str]:
    """Layers running fp8 matmuls: torchao's Float8Linear, or a Conv1D given ours."""
    return [
        n
        for n, m in module.named_modules()
        if type(m).__name__ == "Float8Linear"
        or (type(m).__name__ == "Conv1D" and "forward" in m.__dict__)
    ]


# -- (1) accelerate's mixed_precision="fp8" ------------------------------------------------
def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))  # fmt: skip


gen = torch.Generator().manual_seed(1)
BATCHES = [(torch.randn(4, 32, generator=gen), torch.randn(4, 16, generator=gen)) for _ in range(6)]
MINE = BATCHES[RANK::2]  # this rank's 3 micro-batches
DS = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2}}  # fmt: skip

plugin = DeepSpeedPlugin(hf_ds_config=copy.deepcopy(DS))
accelerator = Accelerator(mixed_precision="fp8", deepspeed_plugin=plugin)
model = mlp()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, opt = accelerator.prepare(model, opt)
result["accelerate_engine"] = type(model).__name__
result["accelerate_fp8"] = fp8_layers(model.module)
result["accelerate_bf16"] = model.parsed_config.bf16.enabled
losses = []
for x, y in MINE:
    loss = nn.functional.mse_loss(model(x).float(), y)
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
result["accelerate_losses"] = losses
model.destroy()

own_cfg = {**DS, "bf16": {"enabled": True}, "fp8": {"enabled": True, "filter_fqns": ["0", "4"]}}
own_model = mlp()
own, *_ = zeroshard.initialize(
    model=own_model, optimizer=torch.optim.AdamW(own_model.parameters(), lr=1e-2), config=own_cfg
)
result["own_fp8"] = fp8_layers(own.module)
losses = []
for x, y in MINE:
    loss = nn.functional.mse_loss(own(x).float(), y)
    own.backward(loss)
    own.step()
    losses.append(loss.item())
result["own_losses"] = losses
own.destroy()

# -- (2) the Trainer with the fp8 key ---------------------------------------------------------
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainingArguments,
    get_linear_schedule_with_warmup,
    training_args,
)

MICRO, GAS, STEPS = 2, 2, 2
CONFIG = {
    "bf16": {"enabled": "auto"},
    "fp8": {"enabled": True},
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "zero_optimization": {"stage": 2},
}


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32)
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    return GPT2LMHeadModel(cfg)


gen = torch.Generator().manual_seed(2)
DATA = [{"input_ids": torch.randint(0, 128, (16,), generator=gen)} for _ in range(16)]
for row in DATA:
    row["labels"] = row["input_ids"]


class Recording(Trainer):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.model_accepts_loss_kwargs = False
        self.seen: list[tuple[float, list]] = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        self.seen.append((out.loss.item(), inputs["input_ids"].tolist()))
        return (out.loss, out) if return_outputs else out.loss


# TrainingArguments refuses bf16=True on a host without a bf16 GPU unless use_cpu, which
# turns DeepSpeed (zeroshard) off; this CPU-only test host passes that guard as a GPU would
training_args.is_torch_bf16_gpu_available = lambda: True
targs = TrainingArguments(
    output_dir=os.path.join(OUT, "trainer"),
    per_device_train_batch_size=MICRO,
    gradient_accumulation_steps=GAS,
    max_steps=STEPS,
    learning_rate=1e-3,
    bf16=True,
    deepspeed=copy.deepcopy(CONFIG),
    report_to=[],
    save_strategy="no",
    disable_tqdm=True,
)
trainer = Recording(model=gpt2(), args=targs, train_dataset=DATA)
trainer.train()
engine = trainer.model_wrapped
result["trainer_fp8"] = fp8_layers(engine.module)  # type: ignore[arg-type]
result["trainer_losses"] = [loss for loss, _ in trainer.seen]
config = copy.deepcopy(engine.config)
engine.destroy()  # type: ignore[operator]

own_model = gpt2()
own, *_ = zeroshard.initialize(
    model=own_model,
    optimizer=torch.optim.AdamW(own_model.parameters(), lr=1e-3, weight_decay=0.0),
    lr_scheduler=lambda o: get_linear_schedule_with_warmup(o, 0, STEPS),
    config=config,
)
losses = []
for _loss, ids in trainer.seen:
    t = torch.tensor(ids)
    loss = own(input_ids=t, labels=t).loss
    own.backward(loss)
    own.step()
    losses.append(loss.item())
result["trainer_own_losses"] = losses
own.destroy()

if RANK == 0:
    with open(os.path.join(OUT, "result.json"), "w") as f:
        json.dump(result, f)
