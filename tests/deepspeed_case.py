"""The model, data and configs shared by DeepSpeed (which makes the checkpoint fixtures,
``tests/data/deepspeed/make_checkpoints.py``, in a venv with deepspeed 0.19.8) and by
zeroshard (which loads them, ``tests/test_deepspeed_checkpoints.py``). Plain torch only:
this module is imported on both sides.

The model holds each thing a DeepSpeed checkpoint records: a tied weight
(``shared_params``), a frozen parameter (``frozen_param_fragments`` at stages 2-3), a
persistent buffer set away from its initial value and a non-persistent one, parameters
of odd sizes (padding at every stage) and two param groups (weight decay, none).
"""

from __future__ import annotations

import base64
import copy

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN, SEQ = 13, 6, 10, 5
ROWS = 4  # global batch: 2 ranks x 2 rows, or 1 rank x 4
SAVE_AT, MORE = 3, 3  # steps before the save, steps continued after it
LR, WD = 1e-2, 0.1
TEMPERATURE = 0.8  # the persistent buffer's value at the save (it starts at 1.0)


class TinyLM(nn.Module):
    temperature: torch.Tensor
    scratch: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.1, requires_grad=False)  # frozen
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.out_bias = nn.Parameter(torch.zeros(VOCAB))  # 13 elements: odd
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("temperature", torch.tensor(1.0))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        x = x + self.fc2(F.gelu(self.norm(self.fc1(x))))
        logits = self.head(x) / self.temperature + self.out_bias
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def build_model(seed: int = 1234) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def param_groups(model: nn.Module) -> list[dict]:
    """Weights decay; biases, norms and embeddings-as-vectors do not (as HF's Trainer)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]


def batch(step: int, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """Global step ``step``'s batch (its ``rows``): tokens and next-token targets."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    return tokens[rows, :-1], tokens[rows, 1:]


def config(
    stage: int, world: int, dtype: str = "fp32", accum: str | None = None, zero: dict | None = None
) -> dict:
    """A DeepSpeed config both sides accept: AdamW through torch (no C++ build), a
    warm-up schedule (its state is in the checkpoint), gradient clipping; ``accum``: the
    gradient accumulation dtype (bf16 at stage 1 with "fp32" is DeepSpeed's
    BF16_Optimizer, whose files differ); ``zero``: more zero_optimization keys."""
    cfg: dict = {
        "train_batch_size": ROWS,
        "train_micro_batch_size_per_gpu": ROWS // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": [0.9, 0.95], "eps": 1e-8, "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 10},
        },
        "zero_optimization": {"stage": stage, **(zero or {})},
        "steps_per_print": 1000,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if accum:
        cfg["data_types"] = {"grad_accum_dtype": accum}
    return copy.deepcopy(cfg)


#: the checkpoints made (directory name under tests/data/deepspeed/): DeepSpeed's stage,
#: compute dtype, gradient accumulation dtype, more zero_optimization keys (DeepSpeed's
#: side only); each on 2 ranks
CASES: dict[str, tuple[int, str, str | None, dict | None]] = {
    "zero0_fp32": (0, "fp32", None, None),  # no ZeRO: a torch optimizer state_dict
    "zero1_fp32": (1, "fp32", None, None),
    "zero2_fp32": (2, "fp32", None, None),
    "zero3_fp32": (3, "fp32", None, None),
    "zero2_elastic": (2, "fp32", None, {"elastic_checkpoint": True}),  # lean states
    "zero1_bf16": (1, "bf16", "fp32", None),  # DeepSpeed's BF16_Optimizer
    "zero2_bf16": (2, "bf16", None, None),
    "zero3_bf16": (3, "bf16", None, None),
}


def values(encoded: str) -> torch.Tensor:
    """The fp32 values ``make_checkpoints.py`` recorded (base64 of little-endian bytes)."""
    return torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.float32)
