"""DeepSpeed's ``deepspeed.utils.zero_to_fp32`` on zeroshard checkpoints: the whole fp32
model from a sharded checkpoint, with DeepSpeed's function names and arguments.

* :func:`get_fp32_state_dict_from_zero_checkpoint`: a ``state_dict`` of whole tensors on
  the CPU (trainable parameters from the fp32 masters, frozen ones and buffers in their
  saved dtype; tied names share one tensor); ``lazy_mode`` defers each tensor's assembly
  to its ``.contiguous()``.
* :func:`load_state_dict_from_zero_checkpoint`: the same, loaded into a model.
* :func:`convert_zero_checkpoint_to_fp32_state_dict` and the script entry
  (``python -m zeroshard.compat.zero_to_fp32 CKPT_DIR OUT_DIR``): written as
  safetensors, one file or shards of at most ``max_shard_size`` with an index, like
  ``zeroshard convert``.

It reads zeroshard's checkpoints (checked as ``load_checkpoint`` checks them: checksums,
manifest, non-finite values), at any world size and stage, not DeepSpeed's ``.pt``
files. Output is never a pickle: ``safe_serialization=False`` (DeepSpeed's default, which
writes ``pytorch_model.bin``) writes ``model.safetensors`` too, and says so.

Communication: none (``load_state_dict_from_zero_checkpoint`` into a model a live engine
manages goes through ``GatheredParameters``: stage 3 gathers and broadcasts).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from zeroshard import ArgumentError

_M = TypeVar("_M", bound=nn.Module)

log = logging.getLogger("zeroshard")

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "main",
    "to_torch_tensor",
]


class LazyTensor:
    """A tensor of the checkpoint, assembled from its pieces when ``contiguous()`` is
    called (``lazy_mode=True``); ``shape`` and ``dtype`` are known before."""

    def __init__(self, fetch: Callable[[], torch.Tensor], dtype: torch.dtype, shape) -> None:
        self._fetch = fetch
        self.dtype = dtype
        self.shape = torch.Size(shape)

    def contiguous(self) -> torch.Tensor:
        return self._fetch().to(self.dtype).contiguous()

    def numel(self) -> int:
        return self.shape.numel()

    def __repr__(self) -> str:
        return f"LazyTensor(shape={tuple(self.shape)}, dtype={self.dtype})"


def _open(checkpoint_dir: str, tag: str | None, exclude_frozen_parameters: bool):
    """``(entries, fetch, aliases)`` of the checkpoint at ``checkpoint_dir/tag`` (or the
    one ``latest`` names, or ``checkpoint_dir`` itself)."""
    from zeroshard.checkpoint.export import open_checkpoint
    from zeroshard.checkpoint.validate import resolve_path

    checkpoint_dir = os.fspath(checkpoint_dir)
    path = resolve_path(checkpoint_dir, tag)
    entries, fetch, manifest = open_checkpoint(path)
    params = manifest["params"]
    aliases = dict(manifest.get("aliases", {}))
    if exclude_frozen_parameters:
        # frozen: outside every optimizer group (stage 3 lays them out), or saved whole
        # as parameters (stages 0-2 keep them out of the layout)
        frozen = {n for n, e in params.items() if e["group"] < 0}
        frozen |= {n for n, e in manifest["whole"].items() if not e.get("buffer", True)}
        frozen |= {a for a, n in aliases.items() if n in frozen}
        entries = [e for e in entries if e[0] not in frozen]
    return entries, fetch, aliases


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, Any]:
    """The whole model's ``state_dict`` from the checkpoint under ``checkpoint_dir``
    (``tag``: its tag directory; default: the one ``latest`` names), on the CPU.

    Trainable parameters come from the fp32 masters; frozen parameters and buffers keep
    the dtype they were saved in. Names tied to one tensor share one tensor here too.
    ``exclude_frozen_parameters`` leaves out parameters that got no gradient;
    ``lazy_mode`` returns :class:`LazyTensor` values (``.contiguous()`` assembles one)."""
    entries, fetch, aliases = _open(checkpoint_dir, tag, exclude_frozen_parameters)
    out: OrderedDict[str, Any] = OrderedDict()
    shared: dict[str, Any] = {}
    for name, dtype, shape in entries:
        real = aliases.get(name, name)
        if real not in shared:
            shared[real] = LazyTensor(functools.partial(fetch, real), dtype, shape)
        out[name] = shared[real]
    return out if lazy_mode else to_torch_tensor(out)


def to_torch_tensor(state_dict: dict[str, Any], return_empty_tensor: bool = False) -> dict:
    """Assemble the :class:`LazyTensor` values of ``state_dict`` (shared ones once);
    ``return_empty_tensor``: empty tensors of the right shape and dtype instead."""
    done: dict[int, torch.Tensor] = {}
    out: OrderedDict[str, Any] = OrderedDict()
    for name, value in state_dict.items():
        if not isinstance(value, LazyTensor):
            out[name] = value
            continue
        if id(value) not in done:
            done[id(value)] = (
                torch.empty(value.shape, dtype=value.dtype)
                if return_empty_tensor
                else value.contiguous()
            )
        out[name] = done[id(value)]
    return out


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str,
    output_dir: str,
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> list[str]:
    """Write the checkpoint's fp32 weights into ``output_dir``: ``model.safetensors``, or
    shards of at most ``max_shard_size`` plus ``model.safetensors.index.json``; returns
    the files written. Always safetensors (``safe_serialization=False`` is DeepSpeed's
    pickle format, which zeroshard does not write: a warning says so)."""
    from zeroshard.checkpoint.export import size_bytes, write_weights

    if not safe_serialization:
        log.warning(
            "zeroshard: convert_zero_checkpoint_to_fp32_state_dict(safe_serialization=False) "
            "would write pytorch_model.bin (a pickle); zeroshard writes model.safetensors "
            "instead (transformers' from_pretrained and safetensors.torch.load_file read it)"
        )
    limit = size_bytes(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    entries, fetch, aliases = _open(checkpoint_dir, tag, exclude_frozen_parameters)
    output_dir = os.fspath(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    return write_weights(
        output_dir, entries, lambda name: fetch(aliases.get(name, name)), max_shard_bytes=limit
    )


def load_state_dict_from_zero_checkpoint(
    model: _M, checkpoint_dir: str, tag: str | None = None
) -> _M:
    """Load the checkpoint's fp32 weights into ``model`` (``strict=False``, as
    DeepSpeed's) and return it.

    A model that no engine manages is moved to the CPU first, as DeepSpeed's does. The
    parameters of a model a live engine manages are written in place through the engine
    (``GatheredParameters(..., modifier_rank=0)``): the model stays where it is and the
    engine's shards and masters take the values, so it keeps training; every rank of
    the engine must call it then (collective)."""
    from zeroshard.zero import GatheredParameters
    from zeroshard.zero.params.gathered import owner_of

    log.info("zeroshard: reading the fp32 weights of %s", checkpoint_dir)
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    params = list(model.parameters())
    if not any(owner_of(p) is not None for p in params):
        model = model.cpu()
        model.load_state_dict(state, strict=False)
        return model
    with GatheredParameters(params, modifier_rank=0), torch.no_grad():
        own = model.state_dict(keep_vars=True)
        for name, value in state.items():
            target = own.get(name)
            if target is None:
                continue
            if tuple(target.shape) != tuple(value.shape):
                raise ArgumentError(
                    f"load_state_dict_from_zero_checkpoint: {name} has shape "
                    f"{tuple(value.shape)} in {checkpoint_dir}, {tuple(target.shape)} in the model"
                )
            target.copy_(value)
    return model


def main(argv: list[str] | None = None) -> int:
    """The script entry, with DeepSpeed's ``zero_to_fp32.py`` arguments."""
    parser = argparse.ArgumentParser(
        description="whole fp32 weights (safetensors) from a zeroshard checkpoint"
    )
    parser.add_argument("checkpoint_dir", help="the checkpoint folder, e.g. path/checkpoint-12")
    parser.add_argument("output_dir", help="the folder for the safetensors files")
    parser.add_argument(
        "--max_shard_size", default="5GB", help="shard above this size (e.g. 5GB, 500MiB)"
    )
    parser.add_argument(
        "--safe_serialization",
        action="store_true",
        help="accepted for DeepSpeed's command line: the output is always safetensors",
    )
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag, e.g. global_step1")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true", help="log at debug level")
    args = parser.parse_args(argv)
    if args.debug:
        logging.basicConfig(level=logging.DEBUG)
    from zeroshard.checkpoint.load import CheckpointError

    try:
        paths = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir,
            args.output_dir,
            max_shard_size=args.max_shard_size,
            safe_serialization=True,
            tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters,
        )
    except CheckpointError as exc:
        print(f"zero_to_fp32: {exc}")
        return 2
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
