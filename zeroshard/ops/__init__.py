"""DeepSpeed's ``deepspeed.ops`` optimizers, as torch's own kernels (no C++/CUDA build):
``ops.adam.DeepSpeedCPUAdam`` and ``ops.adam.FusedAdam`` are torch's fused Adam/AdamW."""

from zeroshard.ops import adam

__all__ = ["adam"]
