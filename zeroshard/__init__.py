"""zeroshard: ZeRO sharded training on PyTorch, with DeepSpeed's config and API.

Public API (everything else is private)::

    engine, optimizer, loader, scheduler = zeroshard.initialize(model=..., config=...)
    zeroshard.init_distributed()
    zeroshard.add_config_arguments(parser)
    zeroshard.resume(engine, "ckpt/")   # load ckpt/latest, say so: (path, client_state)
    engine = zeroshard.init_inference(model, config)   # engine(x), engine.generate(ids)

Names are imported on first use, so the command-line tools start quickly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:  # the type checker sees the real types of the lazily imported names
    from zeroshard import accelerator, comm, ops, pipe, utils, zero
    from zeroshard.api import add_config_arguments, initialize
    from zeroshard.checkpoint.resume import resume
    from zeroshard.compat.deepspeed_names import tp_model_init
    from zeroshard.config import DeepSpeedConfigError
    from zeroshard.distributed.process_group import init_distributed
    from zeroshard.inference import init_inference
    from zeroshard.runtime.engine import DeepSpeedEngine


class ZeroshardError(Exception):
    """The root of the errors zeroshard raises: ``except zeroshard.ZeroshardError`` catches
    each of them. Every one also keeps the standard base it has always had (``ValueError``,
    ``RuntimeError``...), so ``except ValueError`` catches what it did."""


class ArgumentError(ZeroshardError, ValueError):
    """A bad argument to a zeroshard function or class, where no narrower error fits."""


class UsageError(ZeroshardError, RuntimeError):
    """A call the current state does not allow: wrong order, a destroyed engine, a
    gradient outside ``engine.backward()``, a process started without its environment."""


class InternalError(ZeroshardError, RuntimeError):
    """An invariant of zeroshard's own does not hold: a bug to report."""


class NotBuiltError(ZeroshardError, NotImplementedError):
    """A DeepSpeed feature or option zeroshard has not built (yet)."""


class NonFiniteError(ZeroshardError, FloatingPointError):
    """Non-finite (inf/NaN) gradients or loss where the config says to stop."""


_LAZY = {
    "initialize": "zeroshard.api",
    "add_config_arguments": "zeroshard.api",
    "init_distributed": "zeroshard.distributed.process_group",
    "resume": "zeroshard.checkpoint.resume",
    "init_inference": "zeroshard.inference",
    "DeepSpeedEngine": "zeroshard.runtime.engine",
    "tp_model_init": "zeroshard.compat.deepspeed_names",
    "DeepSpeedConfigError": "zeroshard.config",  # DeepSpeed's name for ConfigError
    "get_accelerator": "zeroshard.compat.accelerator",  # DeepSpeed exports it at the top
}

# as deepspeed.<name>: zeroshard.comm.get_rank(), zeroshard.accelerator.get_accelerator(), ...
_SUBMODULES = ("zero", "utils", "comm", "pipe", "accelerator", "ops")

__all__ = [
    "ArgumentError",
    "DeepSpeedConfigError",
    "DeepSpeedEngine",
    "InternalError",
    "NonFiniteError",
    "NotBuiltError",
    "UsageError",
    "ZeroshardError",
    "__version__",
    "accelerator",
    "add_config_arguments",
    "comm",
    "get_accelerator",
    "init_distributed",
    "init_inference",
    "initialize",
    "ops",
    "pipe",
    "resume",
    "tp_model_init",
    "utils",
    "zero",
]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"zeroshard.{name}")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zeroshard' has no attribute {name!r}")
