"""Streaming safetensors files: write tensor by tensor, read slices. No communication.

The safetensors format is a little-endian u64 header length, a JSON header (name ->
dtype, shape, byte offsets; plus string metadata), then raw little-endian tensor bytes.
Knowing every name, dtype and shape up front, :class:`StreamWriter` writes the header
first and then each tensor as it becomes available, so peak memory is one tensor, not
the file. Reading goes through the ``safetensors`` package (memory-mapped slices, no
pickle anywhere).

Checksums (``StreamWriter(..., checksums=True)``): the CRC-32 of every tensor's bytes is
stored in the header's metadata under ``zs_crc32`` (a JSON object, name -> 8 hex
digits). The header is written first with zeros in their place and rewritten in place
once every tensor is written (same length), and ``close()`` returns the CRC-32 of the
final header bytes, which the caller records elsewhere (the checkpoint manifest): the
header's CRC covers the offsets, dtypes, shapes and the tensors' CRCs, so the pair
covers every byte of the file. CRC-32 (zlib) runs at ~2.3 GB/s on one core here,
faster than the other hashes the standard library has (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from collections.abc import Sequence

import torch

from zeroshard import ZeroshardError

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
#: metadata key of the per-tensor CRC-32s (see the module docstring)
CRC_KEY = "zs_crc32"
_NO_CRC = "00000000"


class SafetensorsError(ZeroshardError, ValueError):
    """A safetensors file that is not well-formed (truncated, a corrupt header, a bad
    tensor entry), or a write that breaks its declaration."""


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class StreamWriter:
    """Write a safetensors file whose tensors arrive one at a time, in the declared order.

    Args:
        path: the file to create.
        entries: ``(name, dtype, shape)`` of every tensor, in write order.
        metadata: string key/values stored in the header.
        checksums: record each tensor's CRC-32 in the header; ``close()`` then returns
            the CRC-32 of the final header.
    """

    def __init__(
        self,
        path: str,
        entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        metadata: dict[str, str] | None = None,
        checksums: bool = False,
    ) -> None:
        header: dict = {}
        meta = {str(k): str(v) for k, v in (metadata or {}).items()}
        self._crcs: dict[str, str] | None = None
        if checksums:
            self._crcs = {name: _NO_CRC for name, _, _ in entries}
            meta[CRC_KEY] = json.dumps(self._crcs, separators=(",", ":"))
        if meta:
            header["__metadata__"] = meta
        offset = 0
        self._order: list[tuple[str, int]] = []
        for name, dtype, shape in entries:
            if name in header:
                raise SafetensorsError(f"{path}: duplicate tensor name {name!r}")
            nbytes = math.prod(shape) * dtype_size(dtype)
            header[name] = {
                "dtype": DTYPE_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._order.append((name, nbytes))
            offset += nbytes
        self._header = header
        raw = self._header_bytes()
        self.path = path
        self._f = open(path, "wb")  # noqa: SIM115  (closed by close())
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)
        self._header_len = len(raw)
        self._next = 0
        self._declared = {name: header[name] for name, _ in self._order}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expect, nbytes = self._order[self._next]
        if name != expect:
            raise SafetensorsError(f"{self.path}: expected tensor {expect!r} next, got {name!r}")
        decl = self._declared[name]
        if list(tensor.shape) != decl["shape"] or DTYPE_NAMES[tensor.dtype] != decl["dtype"]:
            raise SafetensorsError(f"{self.path}: tensor {name!r} does not match its declaration")
        # a private copy: .numpy() pins its storage's size, which must not happen to
        # buffers zeroshard later resizes (stage-3 unit buffers)
        data = tensor.detach().cpu().reshape(-1).clone().view(torch.uint8).numpy()
        if data.nbytes != nbytes:
            raise SafetensorsError(
                f"{self.path}: tensor {name!r} has {data.nbytes} bytes, expected {nbytes}"
            )
        view = data.data  # a memoryview of the bytes
        if self._crcs is not None:
            self._crcs[name] = f"{zlib.crc32(view):08x}"
        self._f.write(view)
        self._next += 1

    def _header_bytes(self) -> bytes:
        if self._crcs is not None:
            self._header["__metadata__"][CRC_KEY] = json.dumps(self._crcs, separators=(",", ":"))
        raw = json.dumps(self._header, separators=(",", ":")).encode()
        return raw + b" " * (-len(raw) % 8)

    def close(self) -> int | None:
        """Check every declared tensor was written, write the final header (with
        ``checksums``), flush and fsync. Returns the header's CRC-32 (with
        ``checksums``, else None)."""
        try:
            if self._next != len(self._order):
                raise SafetensorsError(
                    f"{self.path}: {len(self._order) - self._next} declared tensors not written"
                )
            crc = None
            if self._crcs is not None:
                raw = self._header_bytes()
                if len(raw) != self._header_len:  # fixed-width digits: cannot happen
                    raise AssertionError(f"{self.path}: the header changed length")
                self._f.seek(8)
                self._f.write(raw)
                crc = zlib.crc32(raw)
            self._f.flush()
            os.fsync(self._f.fileno())
        finally:
            self._f.close()
        return crc

    def abort(self) -> None:
        """Close without completing (the caller removes the file)."""
        if not self._f.closed:
            self._f.close()


def read_header(path: str) -> dict:
    """The JSON header of a safetensors file (checks it is complete)."""
    return read_header_raw(path)[0]


def read_header_raw(path: str) -> tuple[dict, bytes]:
    """(the JSON header, its raw bytes) of a safetensors file; checks that the tensors
    tile the data section exactly (no overlap, no gap, nothing missing or trailing) and
    that each one's byte count fits its dtype and shape."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: truncated (no safetensors header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise SafetensorsError(f"{path}: truncated header")
        raw = f.read(n)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as exc:
            raise SafetensorsError(f"{path}: corrupt safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: corrupt safetensors header (not a JSON object)")
    spans = []
    for k, v in header.items():
        if k == "__metadata__":
            continue
        offsets = v.get("data_offsets") if isinstance(v, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int and o >= 0 for o in offsets)
        ):
            raise SafetensorsError(f"{path}: corrupt safetensors header (tensor {k!r}: {v!r})")
        spans.append((offsets[0], offsets[1], k))
    spans.sort()
    end = spans[-1][1] if spans else 0
    if 8 + n + end > size:
        raise SafetensorsError(f"{path}: truncated ({size} bytes, the header needs {8 + n + end})")
    _check_layout(path, header, spans, size - 8 - n)
    return header, raw


def _check_layout(path: str, header: dict, spans: list, data_bytes: int) -> None:
    at, prev = 0, None
    for a, b, name in spans:
        entry = header[name]
        if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {name!r}: unknown dtype {entry.get('dtype')!r}")
        shape = entry.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise SafetensorsError(f"{path}: tensor {name!r}: bad shape {shape!r}")
        want = math.prod(shape) * dtype_size(DTYPES[entry["dtype"]])
        if b - a != want:
            raise SafetensorsError(
                f"{path}: tensor {name!r}: data_offsets [{a}, {b}) hold {b - a} bytes, "
                f"{entry['dtype']} {shape} needs {want}"
            )
        if a < at:
            raise SafetensorsError(f"{path}: tensor {name!r} at [{a}, {b}) overlaps {prev!r}")
        if a > at:
            raise SafetensorsError(f"{path}: a gap of {a - at} bytes before tensor {name!r} at {a}")
        at, prev = b, name
    if at != data_bytes:
        raise SafetensorsError(
            f"{path}: the tensors end at byte {at} of a {data_bytes}-byte data section "
            "(trailing bytes)"
        )


def header_checksums(header: dict) -> dict[str, int] | None:
    """The per-tensor CRC-32s a checksummed header records (None if it has none)."""
    text = (header.get("__metadata__") or {}).get(CRC_KEY)
    if text is None:
        return None
    crcs = json.loads(text)
    if not isinstance(crcs, dict):
        raise SafetensorsError(f"{CRC_KEY} is not a JSON object")
    return {str(k): int(v, 16) for k, v in crcs.items()}
