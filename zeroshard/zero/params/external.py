"""DeepSpeed's ``zero.register_external_parameter``: nothing to register here. No
communication.

DeepSpeed's stage 3 must be told when a module's forward reads a parameter another
module owns (a tied output layer reading the embedding's weight). zeroshard's gatherer
finds such reads itself (the module's parameter dict is watched, see ``wiring.py``), so
these calls only check their arguments and return.
"""

from __future__ import annotations

import torch
from torch import nn


def register_external_parameter(module: nn.Module, parameter: torch.Tensor) -> None:
    """Accepted for DeepSpeed compatibility; the gatherer finds external reads itself."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"register_external_parameter: module must be an nn.Module, got {type(module).__name__}"
        )
    if not isinstance(parameter, torch.Tensor):
        raise TypeError(
            "register_external_parameter: parameter must be a tensor, got "
            f"{type(parameter).__name__}"
        )


def unregister_external_parameter(module: nn.Module, parameter: torch.Tensor) -> None:
    """The inverse of :func:`register_external_parameter` (also nothing to do)."""
    register_external_parameter(module, parameter)
