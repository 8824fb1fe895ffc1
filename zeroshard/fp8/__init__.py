"""fp8 training: the Linear layers' matmuls in fp8 with dynamic scaling, everything else
in bf16 (the config's ``fp8`` section).

* ``convert.py``: which layers, and the swap (torchao's ``Float8Linear`` for
  ``nn.Linear``; the hand-written matmul for tensor-parallel and ``Conv1D`` layers);
* ``scaled_mm.py``: the hand-written fp8 matmul (torchao's numerics; global scales
  under tensor parallelism: amax all-reduces over the ``tp`` group).
"""

from zeroshard.fp8.convert import (
    Fp8Error,
    Fp8Model,
    check_fp8_device,
    convert_to_fp8,
    preconverted,
    torchao_float8,
    unwrap_fp8_weights,
)
from zeroshard.fp8.scaled_mm import RECIPES, Recipe, Split, fp8_linear

__all__ = [
    "RECIPES",
    "Fp8Error",
    "Fp8Model",
    "Recipe",
    "Split",
    "check_fp8_device",
    "convert_to_fp8",
    "fp8_linear",
    "preconverted",
    "torchao_float8",
    "unwrap_fp8_weights",
]
