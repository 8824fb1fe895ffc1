"""seeds/001 "실행 방법 A": Hugging Face's Trainer with `TrainingArguments(deepspeed=...)`,
on zeroshard. The one added step is the launcher flag `--as-deepspeed`, which makes the
Trainer's `import deepspeed` give zeroshard (see README, "Using it from Hugging Face"):

    zeroshard --num_gpus 2 --as-deepspeed examples/seeds/seed001_method_a.py

(or `import zeroshard.as_deepspeed` as the script's first line, then any launcher).

Differences from the seed, none of them about zeroshard:
* the model is GPT-2's architecture at a tiny size built from its config (no download
  here; `from_pretrained` of a local directory works the same, also under ZeRO-3, where
  it builds the model under zero.Init: tests/test_hf_trainer.py);
* the seed's `train_dataset=[{"input_ids":[0]}]` has no labels, so the model returns no
  loss and the Trainer stops (with DeepSpeed too); 8 short rows with labels instead;
* the config (seed001_method_a_ds_config.json, next to this file) says "auto" where the
  seed says `"train_batch_size": 0`, `"gradient_accumulation_steps": 8` and
  `"bf16": {"enabled": true}`: the Trainer checks those keys against TrainingArguments
  and refuses the seed's values ("Please correct the following DeepSpeed config values
  that mismatch TrainingArguments values: - ds train_batch_size=0 vs hf train_batch_size
  (calculated)=2 ..."), with DeepSpeed as with zeroshard. "auto" is what it asks for;
* `output_dir` is `runs/seed001_method_a` (the seed's "out" would land in the directory
  the script is started from; `runs/` is where this repository's examples write);
* the config file has no `//` comments: transformers reads it with `json.load`, which
  refuses them ("Expecting property name enclosed in double quotes"), with DeepSpeed too.
  (zeroshard's own reader takes them: seed001_method_b_as_printed.py.)
"""

import os

from transformers import AutoModelForCausalLM, GPT2Config, Trainer, TrainingArguments

config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64)
model = AutoModelForCausalLM.from_config(config)  # the seed: from_pretrained("gpt2")
args = TrainingArguments(
    output_dir=os.path.join("runs", "seed001_method_a"),
    per_device_train_batch_size=1,  # micro-batch
    deepspeed=os.path.join(os.path.dirname(__file__), "seed001_method_a_ds_config.json"),
    num_train_epochs=1,
    report_to=[],
)
rows = [
    {"input_ids": [i, i + 1, i + 2, i + 3], "labels": [i, i + 1, i + 2, i + 3]} for i in range(8)
]
trainer = Trainer(model=model, args=args, train_dataset=rows)
trainer.train()
