"""Hugging Face's Trainer on zeroshard (run by tests/test_hf_trainer.py, 2 ranks):

    zeroshard run --nproc 2 --as-deepspeed tests/scripts/hf_trainer.py OUT STAGE [peft]

For ZeRO stage STAGE: (1) the Trainer trains a tiny GPT-2 (built from a config, saved,
reloaded with from_pretrained after TrainingArguments, so under zero.Init at stage 3)
for 4 optimizer steps of 2 micro-batches, saving a checkpoint after step 2; every
micro-batch's loss and inputs are recorded; (2) zeroshard's own loop replays the same
inputs on the same initial weights and config; (3) a second Trainer resumes from the
step-2 checkpoint; (4) save_model, then from_pretrained: logits compared; (5) with
"peft", a LoRA model (peft) trains under the Trainer. Rank 0 writes OUT/result.json.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

torch.set_num_threads(1)
OUT, STAGE = sys.argv[1], int(sys.argv[2])
WITH_PEFT = "peft" in sys.argv[3:]
RANK = int(os.environ["RANK"])
MICRO, GAS, STEPS, LR = 2, 2, 4, 1e-3

CONFIG = {  # the seed's config with the keys the Trainer fills set to "auto"
    "bf16": {"enabled": "auto"},
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {
        "stage": STAGE,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "reduce_scatter": True,
        "overlap_comm": True,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


def base_model_dir() -> str:
    """A tiny GPT-2 from a config, saved by rank 0 (the others wait for its marker)."""
    path = os.path.join(OUT, "base")
    done = os.path.join(OUT, "base.done")
    if RANK == 0 and not os.path.exists(done):
        torch.manual_seed(0)
        cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32)
        cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0  # no dropout: exact replay
        cfg.bos_token_id = cfg.eos_token_id = 0
        GPT2LMHeadModel(cfg).save_pretrained(path, is_main_process=True)
        open(done, "w").close()
    for _ in range(600):
        if os.path.exists(done):
            return path
        time.sleep(0.1)
    raise TimeoutError(f"rank {RANK}: {done} did not appear")


gen = torch.Generator().manual_seed(1)
DATA = [{"input_ids": torch.randint(0, 128, (16,), generator=gen)} for _ in range(64)]
for row in DATA:
    row["labels"] = row["input_ids"]


class Recording(Trainer):
    """The Trainer, recording each micro-batch's mean loss and inputs."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.model_accepts_loss_kwargs = False  # mean per micro-batch, divided by GAS
        self.seen: list[tuple[float, list]] = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        self.seen.append((out.loss.item(), inputs["input_ids"].tolist()))
        return (out.loss, out) if return_outputs else out.loss


def args(run: str, **kw) -> TrainingArguments:
    return TrainingArguments(
        output_dir=os.path.join(OUT, run),
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=GAS,
        max_steps=STEPS,
        learning_rate=LR,
        deepspeed=copy.deepcopy(CONFIG),
        report_to=[],
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        disable_tqdm=True,
        **kw,
    )


def lr_now(trainer) -> float:
    return trainer.model_wrapped.optimizer.param_groups[0]["lr"]


result: dict = {}
# (1) the Trainer, uninterrupted (TrainingArguments first: from_pretrained sees ZeRO-3)
targs = args("run1")
model = GPT2LMHeadModel.from_pretrained(base_model_dir())
if STAGE == 3:
    from zeroshard.zero.params.init import is_sealed

    result["zero_init"] = all(is_sealed(p) for p in model.parameters())
t1 = Recording(model=model, args=targs, train_dataset=DATA)
t1.train()
engine = t1.model_wrapped
result["engine"] = type(engine).__name__
result["world"] = [targs.world_size, t1.accelerator.num_processes, dist.get_world_size()]
result["lr1"] = lr_now(t1)
result["lrs1"] = [h["learning_rate"] for h in t1.state.log_history if "learning_rate" in h]
result["loss1"] = [loss for loss, _ in t1.seen]
seen1 = list(t1.seen)  # evaluate() below records too
result["eval_loss"] = t1.evaluate(eval_dataset=DATA[:8])["eval_loss"]  # type: ignore[arg-type]  # a list is a map-style dataset
config = copy.deepcopy(engine.config)

# (4) save_model -> from_pretrained: the same logits as the trained engine's module
probe = torch.arange(16).reshape(1, 16) % 128
t1.save_model(os.path.join(OUT, "saved"))
dist.barrier()  # rank 0 wrote it
from zeroshard.zero import GatheredParameters  # noqa: E402

engine.module.eval()  # type: ignore[union-attr]
with torch.no_grad(), GatheredParameters(list(engine.module.parameters())):  # type: ignore[union-attr]
    trained = engine.module(probe).logits.float()  # type: ignore[operator]
engine.destroy()  # type: ignore[operator]
from transformers.integrations.deepspeed import unset_hf_deepspeed_config  # noqa: E402

del t1, targs
unset_hf_deepspeed_config()  # load plainly, not under zero.Init
reloaded = GPT2LMHeadModel.from_pretrained(os.path.join(OUT, "saved"))
with torch.no_grad():
    result["saved_logits_diff"] = (reloaded(probe).logits.float() - trained).abs().max().item()

# (2) zeroshard's own loop on the same inputs, weights and config
from transformers import get_linear_schedule_with_warmup  # noqa: E402

import zeroshard  # noqa: E402

own_model = GPT2LMHeadModel.from_pretrained(base_model_dir())
opt = torch.optim.AdamW(own_model.parameters(), lr=LR, weight_decay=0.0)
own, *_ = zeroshard.initialize(
    model=own_model,
    optimizer=opt,
    lr_scheduler=lambda o: get_linear_schedule_with_warmup(o, 0, STEPS),
    config=config,
)
own_losses = []
for _loss, seen_ids in seen1:
    ids_t = torch.tensor(seen_ids)
    loss = own(input_ids=ids_t, labels=ids_t).loss
    own.backward(loss)
    own.step()
    own_losses.append(loss.item())
result["loss_own"] = own_losses
result["lr_own"] = own.get_lr()[0]
own.destroy()
del own, own_model, opt

# (3) resume from the checkpoint of step 2: the rest of run 1, learning rate included
targs = args("run1", resume_from_checkpoint=None)
t2 = Recording(
    model=GPT2LMHeadModel.from_pretrained(base_model_dir()), args=targs, train_dataset=DATA
)
t2.train(resume_from_checkpoint=os.path.join(OUT, "run1", "checkpoint-2"))
result["loss_resumed"] = [loss for loss, _ in t2.seen]
result["lr_resumed"] = lr_now(t2)
result["lrs_resumed"] = [h["learning_rate"] for h in t2.state.log_history if "learning_rate" in h]
t2.model_wrapped.destroy()  # type: ignore[operator]
del t2, targs

# (5) a LoRA model made with peft, trained under the Trainer
if WITH_PEFT:
    from peft import LoraConfig, get_peft_model

    targs = args("lora")
    base = GPT2LMHeadModel.from_pretrained(base_model_dir())
    lora = get_peft_model(base, LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    t3 = Recording(model=lora, args=targs, train_dataset=DATA)
    t3.train()
    result["lora_losses"] = [loss for loss, _ in t3.seen]
    result["lora_trainable"] = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    result["lora_steps"] = t3.state.global_step
    t3.model_wrapped.destroy()  # type: ignore[operator]

if RANK == 0:
    with open(os.path.join(OUT, "result.json"), "w") as f:
        json.dump(result, f)
print(f"rank {RANK} done", flush=True)
