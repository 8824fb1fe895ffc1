"""Streaming safetensors files: write tensor by tensor, read slices. No communication.

The safetensors format is a little-endian u64 header length, a JSON header (name ->
dtype, shape, byte offsets; plus string metadata), then raw little-endian tensor bytes.
Knowing every name, dtype and shape up front, :class:`StreamWriter` writes the header
first and then each tensor as it becomes available, so peak memory is one tensor, not
the file. Reading goes through the ``safetensors`` package (memory-mapped slices, no
pickle anywhere).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Sequence

import torch

DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
if hasattr(torch, "float8_e4m3fn"):
    DTYPE_NAMES[torch.float8_e4m3fn] = "F8_E4M3"
    DTYPE_NAMES[torch.float8_e5m2] = "F8_E5M2"
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class StreamWriter:
    """Write a safetensors file whose tensors arrive one at a time, in the declared order.

    Args:
        path: the file to create.
        entries: ``(name, dtype, shape)`` of every tensor, in write order.
        metadata: string key/values stored in the header.
    """

    def __init__(
        self,
        path: str,
        entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        header: dict = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        self._order: list[tuple[str, int]] = []
        for name, dtype, shape in entries:
            if name in header:
                raise ValueError(f"{path}: duplicate tensor name {name!r}")
            nbytes = math.prod(shape) * dtype_size(dtype)
            header[name] = {
                "dtype": DTYPE_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._order.append((name, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path = path
        self._f = open(path, "wb")  # noqa: SIM115  (closed by close())
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)
        self._next = 0
        self._declared = {name: header[name] for name, _ in self._order}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expect, nbytes = self._order[self._next]
        if name != expect:
            raise ValueError(f"{self.path}: expected tensor {expect!r} next, got {name!r}")
        decl = self._declared[name]
        if list(tensor.shape) != decl["shape"] or DTYPE_NAMES[tensor.dtype] != decl["dtype"]:
            raise ValueError(f"{self.path}: tensor {name!r} does not match its declaration")
        # a private copy: .numpy() pins its storage's size, which must not happen to
        # buffers zeroshard later resizes (stage-3 unit buffers)
        data = tensor.detach().cpu().reshape(-1).clone().view(torch.uint8).numpy()
        if data.nbytes != nbytes:
            raise ValueError(
                f"{self.path}: tensor {name!r} has {data.nbytes} bytes, expected {nbytes}"
            )
        self._f.write(memoryview(data))
        self._next += 1

    def close(self) -> None:
        """Check every declared tensor was written, then flush and fsync."""
        if self._next != len(self._order):
            self._f.close()
            raise ValueError(
                f"{self.path}: {len(self._order) - self._next} declared tensors not written"
            )
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


def read_header(path: str) -> dict:
    """The JSON header of a safetensors file (checks it is complete)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: truncated (no safetensors header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"{path}: truncated header")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"{path}: corrupt safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
    try:
        end = max(
            (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0
        )
    except (KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"{path}: corrupt safetensors header ({exc!r})") from exc
    if 8 + n + end > size:
        raise ValueError(f"{path}: truncated ({size} bytes, the header needs {8 + n + end})")
    return header
