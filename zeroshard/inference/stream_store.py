"""Where ZeRO-Inference keeps the weights it streams (``streaming.py``), and its config.

* :class:`StreamConfig` / :func:`stream_config`: DeepSpeed's ``zero`` section (stage 3,
  ``offload_param``) read into a frozen config; every key wired, refused or named as
  meaning nothing here.
* :class:`SwapSource`: every distinct parameter in one swap file of a private
  directory under ``nvme_path`` (``offload/nvme.py``: aligned ``O_DIRECT`` reads and
  writes), at aligned offsets.
* :class:`MemorySource`: the same layout in one host buffer (pinned when it feeds a GPU).
* :func:`safetensors_init`: fills a unit from a safetensors file or directory (each
  tensor read alone, memory-mapped), so a model built on ``meta`` goes from an export to
  the swap file one layer at a time.

No communication.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.inference.config import InferenceError
from zeroshard.offload.nvme import ALIGN, SwapSpace, aligned_empty, round_up

DEVICES = ("cpu", "nvme")


@dataclass(frozen=True, kw_only=True)
class StreamConfig:
    """Where the weights live between uses (DeepSpeed's ``zero.offload_param``)."""

    device: str = "nvme"  # "cpu" | "nvme"
    nvme_path: str | None = None  # the swap directory's parent (nvme)
    buffer_count: int = 5  # unit buffers in RAM: the one computing + those read ahead
    pin_memory: bool = True  # pinned host buffers when the compute device is a GPU

    def __post_init__(self) -> None:
        where = "zero.offload_param"
        if self.device not in DEVICES:
            raise InferenceError(f"{where}.device: {self.device!r} is not one of {DEVICES}")
        if self.device == "nvme" and not self.nvme_path:
            raise InferenceError(f'{where}.nvme_path: needed with "device": "nvme"')
        if self.buffer_count < 2:
            raise InferenceError(
                f"{where}.buffer_count: {self.buffer_count}; streaming needs at least 2 "
                "(one unit computing while the next is read)"
            )


_OFFLOAD_KEYS = {"device", "nvme_path", "buffer_count", "pin_memory", "buffer_size", "max_in_cpu"}
# zero-section keys that shape stage-3 training gathers; streaming reads whole layers
_INERT_ZERO = {
    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "prefetch_bucket_size",
    "param_persistence_threshold", "max_live_parameters", "max_reuse_distance",
    "contiguous_gradients", "overlap_comm", "reduce_bucket_size", "sub_group_size",
}  # fmt: skip


def stream_config(zero: dict) -> StreamConfig:
    """A :class:`StreamConfig` from DeepSpeed's ZeRO-Inference section (``init_inference``'s
    ``zero``; the same keys as ``zero_optimization`` in a training config): ``stage`` 3 and
    ``offload_param`` ``{"device": "cpu" | "nvme", "nvme_path", "buffer_count",
    "pin_memory"}``. ``buffer_size`` and ``max_in_cpu`` are accepted with a note (buffers
    are sized to the largest layer); the stage-3 gather tuning keys mean nothing here."""
    if not isinstance(zero, dict):
        raise InferenceError(f"zero: expected an object, got {type(zero).__name__}")
    unknown = set(zero) - {"stage", "offload_param"} - _INERT_ZERO
    if unknown:
        raise InferenceError(
            f"zero.{sorted(unknown)[0]}: not a ZeRO-Inference key; weight streaming reads "
            "zero.stage (3) and zero.offload_param"
        )
    if zero.get("stage") != 3:
        raise InferenceError(
            f"zero.stage: ZeRO-Inference streams weights at stage 3, got {zero.get('stage')!r}"
        )
    off = zero.get("offload_param")
    if not isinstance(off, dict) or off.get("device") in (None, "none"):
        raise InferenceError(
            'zero.offload_param: say where the weights live, {"device": "cpu"} or '
            '{"device": "nvme", "nvme_path": "/local_nvme"}'
        )
    unknown = set(off) - _OFFLOAD_KEYS
    if unknown:
        raise InferenceError(f"zero.offload_param.{sorted(unknown)[0]}: not an offload_param key")
    for k in sorted(set(zero) & _INERT_ZERO) + [
        f"offload_param.{k}" for k in ("buffer_size", "max_in_cpu") if k in off
    ]:
        print(f"zeroshard: zero.{k} means nothing to weight streaming (buffers hold whole layers)")
    return StreamConfig(
        device=off["device"],
        nvme_path=off.get("nvme_path"),
        buffer_count=int(off.get("buffer_count", 5)),
        pin_memory=bool(off.get("pin_memory", True)),
    )


class SwapSource:
    """Every distinct parameter in one swap file, at aligned offsets."""

    def __init__(self, space: SwapSpace, nbytes: int) -> None:
        self.space = space
        self.file = space.file("weights", max(nbytes, ALIGN))

    def write(self, offset: int, data: torch.Tensor) -> None:
        n = data.numel() * data.element_size()
        buf = aligned_empty(round_up(n))
        buf[:n].copy_(data.detach().reshape(-1).view(torch.uint8))
        buf[n:].zero_()
        self.file.write(buf, offset)

    def read(self, offset: int, out: torch.Tensor) -> None:
        self.file.read(out, offset)

    def close(self) -> None:
        self.space.close()


class MemorySource:
    """Every distinct parameter in one host buffer (pinned when feeding a GPU)."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.buf = torch.empty(max(nbytes, ALIGN), dtype=torch.uint8, pin_memory=pin)

    def write(self, offset: int, data: torch.Tensor) -> None:
        n = data.numel() * data.element_size()
        self.buf[offset : offset + n].copy_(data.detach().reshape(-1).view(torch.uint8))

    def read(self, offset: int, out: torch.Tensor) -> None:
        out.copy_(self.buf[offset : offset + out.numel()])

    def close(self) -> None:
        self.buf = torch.empty(0, dtype=torch.uint8)


# -- a unit's weights from safetensors files ------------------------------------------------


def safetensors_files(path: str) -> list[str]:
    """The safetensors files at ``path``: the file itself, or a directory's sharded set
    (``model.safetensors.index.json``), ``model.safetensors``, or every ``*.safetensors``."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such safetensors file or directory")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    found = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(
            f"{path}: no safetensors files (streaming reads weights from a safetensors "
            "export; write one with `zeroshard convert CKPT OUT` or save_pretrained)"
        )
    return [os.path.join(path, n) for n in found]


def first_holders(units: list[tuple[str, nn.Module]]) -> dict[str, str]:
    """Full name -> unit name of each distinct parameter's first holder (the one whose
    values are stored; a tied parameter's later holders read the same bytes)."""
    seen: set[int] = set()
    out = {}
    for uname, m in units:
        for pname, p in m.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out[f"{uname}.{pname}" if uname else pname] = uname
    return out


def safetensors_init(
    path: str, units: list[tuple[str, nn.Module]]
) -> Callable[[str, nn.Module], None]:
    """``init(unit_name, module)`` for ``stream_weights`` that copies each parameter of a
    unit from the safetensors file(s) at ``path`` (by full name, each tensor read alone).
    Checks first that every parameter whose values are stored (:func:`first_holders`:
    tied copies excepted) is in the files, and that shapes agree, naming the tensor."""
    from safetensors import safe_open

    files = safetensors_files(path)
    where: dict[str, tuple[str, list[int]]] = {}
    for f in files:
        with safe_open(f, framework="pt") as h:
            for k in h.keys():  # noqa: SIM118  (safe_open is not iterable)
                where[k] = (f, list(h.get_slice(k).get_shape()))
    named = {f"{u}.{n}" if u else n: p for u, m in units for n, p in m.named_parameters()}
    for name in first_holders(units):
        if name not in where:
            raise KeyError(f"{path}: no tensor {name!r} (the model's parameter) in {files}")
        if where[name][1] != list(named[name].shape):
            raise InferenceError(
                f"{path}: tensor {name!r} has shape {where[name][1]}, the model's parameter "
                f"{list(named[name].shape)}"
            )

    def init(unit_name: str, module: nn.Module) -> None:
        for pname, p in module.named_parameters():
            name = f"{unit_name}.{pname}" if unit_name else pname
            if name in where:
                with safe_open(where[name][0], framework="pt") as h:
                    p.copy_(h.get_tensor(name))

    return init


def empty_model_from(path: str) -> nn.Module:
    """The model a safetensors export at ``path`` describes (its ``zeroshard_model``
    metadata), with its parameters on the meta device (buffers real), ready to be
    streamed from ``path`` by ``init_inference(model, {"checkpoint": path, "zero": ...})``.
    A transformers model is built under accelerate's ``init_empty_weights()``."""
    from zeroshard.checkpoint.model_config import build_model
    from zeroshard.checkpoint.sources import is_checkpoint
    from zeroshard.inference.weights import model_description

    if is_checkpoint(path):
        raise InferenceError(
            f"{path}: a zeroshard checkpoint; weights stream from a safetensors export: "
            f"write one with `zeroshard convert {path} OUT` and pass OUT"
        )
    desc = model_description(path)  # recorded, or a Hugging Face config.json beside it
    if desc.get("class") == "transformers":
        try:
            from accelerate import init_empty_weights
        except ImportError as exc:
            raise InferenceError(
                "streaming a transformers model builds it with empty parameters through "
                "accelerate's init_empty_weights(): pip install accelerate"
            ) from exc
        with init_empty_weights():
            return build_model(desc, path)
    with torch.device("meta"):
        return build_model(desc, path)
