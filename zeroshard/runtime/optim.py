"""Torch optimizers from the config's ``optimizer`` section. No communication.

DeepSpeed facts kept: its ``Adam`` type uses decoupled weight decay unless
``adam_w_mode`` is false; ``AdamW`` always does. Adam/AdamW use torch's fused kernel
(one pass over memory, CPU and CUDA, no C++ build) unless ``fused: false``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _fused_ok(device: torch.device) -> bool:
    return device.type in ("cpu", "cuda", "xpu", "mps")


def hyperparams(cfg) -> dict:
    """The per-group defaults the config's optimizer section gives."""
    if cfg.type == "SGD":
        return {
            "lr": cfg.lr,
            "momentum": cfg.momentum,
            "dampening": cfg.dampening,
            "weight_decay": cfg.weight_decay,
            "nesterov": cfg.nesterov,
        }
    return {
        "lr": cfg.lr,
        "betas": tuple(cfg.betas),
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
        "amsgrad": cfg.amsgrad,
    }


def optimizer_factory(cfg, device: torch.device) -> Callable[[list[dict]], torch.optim.Optimizer]:
    """A function building the configured torch optimizer over given param groups."""
    if cfg.type == "SGD":
        return lambda groups: torch.optim.SGD(groups, lr=cfg.lr)
    decoupled = cfg.type == "AdamW" or cfg.adam_w_mode
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    fused = cfg.fused if cfg.fused is not None else _fused_ok(device)
    return lambda groups: cls(groups, lr=cfg.lr, fused=bool(fused))
