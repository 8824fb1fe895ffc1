"""``DeepSpeedCPUAdam`` and ``FusedAdam``: torch's fused Adam (decoupled weight decay by
default, as DeepSpeed's ``adamw_mode`` / ``adam_w_mode``). No communication.

torch's fused kernel makes one pass over parameters, gradients and both moments, on the
CPU and on CUDA, which is what DeepSpeed's JIT-built C++/CUDA ops are for.
"""

from __future__ import annotations

import torch

from zeroshard import NotBuiltError


class _TorchFusedAdam(torch.optim.Adam):
    def __init__(self, params, lr, betas, eps, weight_decay, amsgrad, decoupled, bias_correction):
        if not bias_correction:
            raise NotBuiltError(
                f"{type(self).__name__}(bias_correction=False) is not built yet in zeroshard"
            )
        super().__init__(
            params,
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            fused=True,
            decoupled_weight_decay=decoupled,
        )


class DeepSpeedCPUAdam(_TorchFusedAdam):
    """DeepSpeed's CPU Adam (``adamw_mode=True``: AdamW), stepped by torch's fused kernel."""

    def __init__(
        self,
        model_params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        super().__init__(
            model_params, lr, betas, eps, weight_decay, amsgrad, adamw_mode, bias_correction
        )


class FusedAdam(_TorchFusedAdam):
    """DeepSpeed's fused Adam (``adam_w_mode=True``: AdamW), as torch's fused kernel."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        super().__init__(
            params, lr, betas, eps, weight_decay, amsgrad, adam_w_mode, bias_correction
        )
