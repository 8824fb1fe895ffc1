"""Torch optimizers from the config's ``optimizer`` section, the learning-rate scheduler
(the ``scheduler`` section or the one given to ``initialize``), and what a step with
inf/nan values does. No communication.

DeepSpeed facts kept: its ``Adam`` type uses decoupled weight decay unless
``adam_w_mode`` is false; ``AdamW`` always does. Adam/AdamW use torch's fused kernel
(one pass over memory, CPU and CUDA, no C++ build) unless ``fused: false``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from zeroshard import ArgumentError
from zeroshard.config.schema import ConfigError
from zeroshard.runtime.schedulers import build_scheduler

if TYPE_CHECKING:
    from zeroshard.zero.optim.optimizer import ShardedOptimizer


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


def nonfinite_policy(config) -> str:
    """What a step with inf/nan gradients or loss does: "skip", "raise" or "apply"
    (``nonfinite_gradients``; in bf16, DeepSpeed's ``check_grad_overflow`` when given)."""
    check = config.bf16.check_grad_overflow
    if config.bf16.enabled and check is not None:
        if not check:
            return "apply"
        return "skip" if config.nonfinite_gradients == "apply" else config.nonfinite_gradients
    return config.nonfinite_gradients


def make_scheduler(config, optimizer: ShardedOptimizer | None, client):
    """The learning-rate scheduler: the config's ``scheduler`` section, or the one given
    to ``initialize`` (an instance, or a callable taking the optimizer); None without."""
    sc = config.scheduler
    if optimizer is None:
        if sc is not None or client is not None:
            raise ConfigError(
                "scheduler",
                "a learning-rate scheduler was given (the config's 'scheduler' section "
                "or lr_scheduler=) but no optimizer; give an optimizer too, or leave "
                "the scheduler out for inference",
            )
        return None
    if sc is not None:
        if client is not None:
            raise ArgumentError(
                "initialize: both the config's 'scheduler' section and an lr_scheduler "
                "argument were given; use one"
            )
        return build_scheduler(sc.type, sc.params, optimizer.inner)
    if callable(client) and not hasattr(client, "step"):
        return client(optimizer.inner)
    return client
