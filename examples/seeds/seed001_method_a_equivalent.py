"""seeds/001 "실행 방법 A" hands a ds_config to Hugging Face's Trainer
(`TrainingArguments(deepspeed="ds_config.json")`). The Trainer itself runs on zeroshard
with one added step, `--as-deepspeed` (seed001_method_a.py next to this file, and the
README's "Using it from Hugging Face"). This file is the other way: the loop the Trainer
runs for you, written against zeroshard's API directly, with no `deepspeed` alias:

    zeroshard --num_gpus 2 examples/seeds/seed001_method_a_equivalent.py --deepspeed examples/seeds/seed001_ds_config.json

Differences from the seed: the model is built from a config (no download here);
`per_device_train_batch_size=1` becomes the config's `train_micro_batch_size_per_gpu`
(the Trainer would fill the seed's `"train_batch_size": 0` in the same way); the seed's
`gradient_accumulation_steps: 8` becomes 1 so that the 8-sample toy dataset makes 4
optimizer steps on 2 ranks (the Trainer likewise overrides it from
`TrainingArguments.gradient_accumulation_steps`); the optimizer (the Trainer's default
AdamW) is given to initialize(). The seed's file is read with its `//` comments by
zeroshard's own config reader.
"""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import zeroshard
from zeroshard.config import read_config_file

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
parser.add_argument("--num_train_epochs", type=int, default=1)
zeroshard.add_config_arguments(parser)
args = parser.parse_args()

config = read_config_file(args.deepspeed)  # DeepSpeed's JSON dialect: `//` comments allowed
config["train_micro_batch_size_per_gpu"] = 1  # TrainingArguments(per_device_train_batch_size=1)
config["gradient_accumulation_steps"] = 1  # one tiny epoch: step every micro-batch

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2))  # AutoModelForCausalLM.from_pretrained("gpt2")
train_dataset = [{"input_ids": torch.randint(0, 50257, (32,))} for _ in range(8)]
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)  # the Trainer's default

engine, optimizer, loader, _ = zeroshard.initialize(
    model=model,
    optimizer=optimizer,
    training_data=train_dataset,
    config=config,
    collate_fn=lambda rows: {"input_ids": torch.stack([r["input_ids"] for r in rows])},
)
for _ in range(args.num_train_epochs):  # trainer.train()
    for batch in loader:
        ids = batch["input_ids"].to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
if engine.global_rank == 0:
    print(f"method A equivalent: {engine.global_steps} steps, last loss {loss.item():.3f}")
