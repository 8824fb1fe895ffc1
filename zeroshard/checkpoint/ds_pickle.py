"""Reading DeepSpeed's pickled ``.pt`` files without running any of their code.

Every file goes through ``torch.load(weights_only=True)``: torch's restricted unpickler
builds tensors and plain containers only. DeepSpeed 0.19.8 also pickles four objects of
its own into a ZeRO checkpoint (read from the files it writes, stages 1-3, fp32/bf16/fp16):

* ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` / ``DynamicLossScaler``: the loss
  scaler object itself (``optimizer_state_dict["loss_scaler"]``);
* ``deepspeed.runtime.zero.config.ZeroStageEnum``: the stage (an ``IntEnum``);
* ``deepspeed.utils.tensor_fragment.fragment_address``: where each parameter starts in a
  rank's partition (``param_slice_mappings``, a dataclass of two ints).

Each is unpickled into a stand-in of ours registered under DeepSpeed's qualified name
(torch's ``safe_globals``), which keeps only the named plain fields it expects and no
behaviour; DeepSpeed is never imported. Any other global is refused by name, with the
file. No communication.
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from typing import Any, ClassVar

import torch

from zeroshard.checkpoint.format import CheckpointError


class _StandIn:
    """Plain fields of a DeepSpeed object, as pickled; nothing else is kept."""

    FIELDS: ClassVar[dict[str, tuple[type, ...]]] = {}

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = state[0] or {}
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"{type(self).__name__}: state is not a dict")
        for key, value in state.items():
            kinds = self.FIELDS.get(key)
            if kinds is not None and (value is None or isinstance(value, kinds)):
                setattr(self, key, value)

    def fields(self) -> dict[str, Any]:
        return dict(vars(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.fields()})"


class LossScalerState(_StandIn):
    """DeepSpeed's ``LossScaler`` / ``DynamicLossScaler`` (fields only)."""

    FIELDS: ClassVar[dict[str, tuple[type, ...]]] = {
        "cur_scale": (int, float),
        "dynamic": (bool,),
        "cur_iter": (int,),
        "last_overflow_iter": (int,),
        "scale_factor": (int, float),
        "scale_window": (int,),
        "min_scale": (int, float),
        "delayed_shift": (int,),
        "cur_hysteresis": (int,),
        "consecutive_hysteresis": (bool,),
        "raise_error_at_min_scale": (bool,),
        "dtype": (torch.dtype,),
    }


class FragmentAddress(_StandIn):
    """DeepSpeed's ``fragment_address`` (numel, start)."""

    FIELDS: ClassVar[dict[str, tuple[type, ...]]] = {"numel": (int,), "start": (int,)}


class ZeroStage(int):
    """DeepSpeed's ``ZeroStageEnum`` member: its value (0-3)."""


STAND_INS: dict[str, type] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScalerState,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": LossScalerState,
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStage,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
}

_GLOBAL = re.compile(r"GLOBAL (\S+)")


def _allowed() -> list:
    return [(cls, name) for name, cls in STAND_INS.items()]


def load_pt(path: str) -> Any:
    """The object pickled in DeepSpeed file ``path``, read with the restricted unpickler
    (memory-mapped when the file is in torch's zip format). Raises
    :class:`CheckpointError` naming the file: unreadable, corrupt, or pickling a global
    that is not plain data (named)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing")
    mmap = zipfile.is_zipfile(path)
    try:
        with torch.serialization.safe_globals(_allowed()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        found = _GLOBAL.search(str(exc))
        if found:
            name = found.group(1)
            raise CheckpointError(
                f"{path}: pickles {name}, which is not plain data and not one of DeepSpeed's "
                f"own types zeroshard reads ({', '.join(sorted(STAND_INS))}); refused (the "
                "file's code is never run)"
            ) from exc
        why = "refused by the restricted unpickler" if mmap else "corrupt or truncated?"
        raise CheckpointError(
            f"{path}: not a torch file zeroshard can read ({why}): "
            f"{str(exc).splitlines()[0] if str(exc) else exc!r}"
        ) from exc
    except (RuntimeError, EOFError, ValueError, OSError, zipfile.BadZipFile) as exc:
        raise CheckpointError(
            f"{path}: not a readable torch file (corrupt or truncated?): "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from exc


def check_zip(path: str) -> None:
    """Compare every member of a torch zip file with the CRC-32 the archive records
    (the checksums DeepSpeed's files carry). Reads every byte once."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: corrupt zip archive: {exc}") from exc
    if bad is not None:
        raise CheckpointError(
            f"{path}: member {bad!r} does not match the CRC-32 the archive records (the "
            "bytes changed after the save: a corrupt file); load with verify=False to skip"
        )
