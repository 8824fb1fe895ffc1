"""zeroshard: ZeRO sharded training on PyTorch, with DeepSpeed's config and API.

Public API (everything else is private)::

    engine, optimizer, loader, scheduler = zeroshard.initialize(model=..., config=...)
    zeroshard.init_distributed()
    zeroshard.add_config_arguments(parser)
    zeroshard.resume(engine, "ckpt/")   # load ckpt/latest if there is one: (path, client_state)
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
    from zeroshard.config import DeepSpeedConfigError
    from zeroshard.distributed import init_distributed
    from zeroshard.engine import DeepSpeedEngine
    from zeroshard.inference import init_inference
    from zeroshard.integrations.deepspeed_names import tp_model_init
    from zeroshard.restart import resume

_LAZY = {
    "initialize": "zeroshard.api",
    "add_config_arguments": "zeroshard.api",
    "init_distributed": "zeroshard.distributed",
    "resume": "zeroshard.restart",
    "init_inference": "zeroshard.inference",
    "DeepSpeedEngine": "zeroshard.engine",
    "tp_model_init": "zeroshard.integrations.deepspeed_names",
    "DeepSpeedConfigError": "zeroshard.config",  # DeepSpeed's name for ConfigError
}

# as deepspeed.<name>: zeroshard.comm.get_rank(), zeroshard.accelerator.get_accelerator(), ...
_SUBMODULES = ("zero", "utils", "comm", "pipe", "accelerator", "ops")

__all__ = [
    "DeepSpeedConfigError",
    "DeepSpeedEngine",
    "__version__",
    "accelerator",
    "add_config_arguments",
    "comm",
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
