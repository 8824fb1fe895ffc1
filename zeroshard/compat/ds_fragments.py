"""DeepSpeed's tensor-fragment API (``deepspeed.utils.safe_get_full_fp32_param`` and its
siblings): read or write one parameter's fp32 master, gradient or optimizer state
through the engine that shards it.

Not built yet in zeroshard: each function raises, naming itself, when called (importing
them works, so code that only mentions them runs). zeroshard's own ways to the same
values: ``GatheredParameters`` (parameters), ``engine.save_checkpoint`` /
``zeroshard convert`` (masters and optimizer states).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zeroshard import NotBuiltError

NAMES = (
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
    "safe_set_full_grad",
    "safe_update_full_grad_vectorized",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
)


def _not_built(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotBuiltError(
            f"deepspeed.utils.{name}: DeepSpeed's tensor-fragment API is not built yet in "
            "zeroshard; read parameters with zero.GatheredParameters, masters and optimizer "
            "states from a checkpoint (engine.save_checkpoint, zeroshard convert)"
        )

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"DeepSpeed's ``{name}``: not built yet in zeroshard (raises)."
    return refuse


FRAGMENT_FUNCTIONS: dict[str, Callable[..., Any]] = {name: _not_built(name) for name in NAMES}
