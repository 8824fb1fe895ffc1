"""Dtype policy and the fp16 loss scaler. No communication of its own: the overflow
flag the scaler consumes comes from the optimizer's global-norm all-reduce.

Policy: parameters and activations in the compute dtype (fp32, bf16 or fp16), gradient
buffers in the reduce dtype (``communication_data_type`` / ``data_types.grad_accum_dtype``
if set, else the compute dtype), optimizer master weights and states always fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroshard import NonFiniteError

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class DtypePolicy:
    """Which dtype each kind of tensor has."""

    compute: torch.dtype = torch.float32
    grad: torch.dtype = torch.float32
    master: torch.dtype = torch.float32

    @property
    def separate_master(self) -> bool:
        """Whether the fp32 master weights are a copy (else they are the parameters)."""
        return self.compute != self.master

    @classmethod
    def from_config(cls, config) -> DtypePolicy:
        compute = config.compute_dtype
        name = config.communication_data_type or config.grad_accum_dtype
        return cls(compute=compute, grad=_DTYPES[name] if name else compute)


class LossScaler:
    """Static (``dynamic=False``) or dynamic loss scale for fp16 training.

    Dynamic rule (as DeepSpeed's): on overflow, if ``hysteresis`` overflows in a row
    have used up the tolerance, divide the scale by ``factor`` (not below ``min_scale``),
    otherwise spend one unit of hysteresis; after ``window`` overflow-free steps
    multiply the scale by ``factor``.
    """

    def __init__(
        self,
        *,
        init_scale: float = 1.0,
        dynamic: bool = False,
        window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_scale: float = 1.0,
        factor: float = 2.0,
    ) -> None:
        self.scale = float(init_scale)
        self.dynamic = dynamic
        self.window = window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = min_scale
        self.factor = factor
        self.cur_hysteresis = hysteresis
        self.iteration = 0
        self.last_overflow_iter = -1

    @classmethod
    def from_config(cls, fp16) -> LossScaler:
        if not fp16.enabled:
            return cls()
        if fp16.loss_scale:
            return cls(init_scale=fp16.loss_scale)
        return cls(
            init_scale=2.0**fp16.initial_scale_power,
            dynamic=True,
            window=fp16.loss_scale_window,
            hysteresis=fp16.hysteresis,
            consecutive_hysteresis=fp16.consecutive_hysteresis,
            min_scale=fp16.min_loss_scale,
        )

    def update(self, overflow: bool) -> None:
        """Account for one optimizer step attempt (skipped when ``overflow``). As
        DeepSpeed does, an overflow that would lower a scale already at its minimum
        (its hysteresis spent: that many overflows in a row) is an error: every later
        step would be skipped."""
        if self.dynamic:
            if overflow:
                if self.hysteresis == 1 or self.cur_hysteresis == 1:
                    if self.scale <= self.min_scale:
                        raise NonFiniteError(
                            f"fp16: the gradients overflow at the minimum loss scale "
                            f"(fp16.min_loss_scale = {self.min_scale:g}) after "
                            f"{self.hysteresis} overflow(s) in a row: every step would be "
                            "skipped. The model's values leave fp16's range: train in bf16, "
                            "lower the learning rate, or clip gradients"
                        )
                    self.scale = max(self.scale / self.factor, self.min_scale)
                else:
                    self.cur_hysteresis -= 1
                self.last_overflow_iter = self.iteration
            else:
                if self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                if (self.iteration - self.last_overflow_iter) % self.window == 0:
                    if not self.consecutive_hysteresis:
                        self.cur_hysteresis = self.hysteresis
                    self.scale *= self.factor
        self.iteration += 1

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "cur_hysteresis": self.cur_hysteresis,
            "iteration": self.iteration,
            "last_overflow_iter": self.last_overflow_iter,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
