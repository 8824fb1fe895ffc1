"""Is what a checkpoint's files hold what was saved? Checksums, non-finite values, and
the ranges of the manifest's values. No communication (``load.py`` splits the files
across ranks and exchanges the outcome).

Every rank file records the CRC-32 of each tensor in its header, and the manifest
records the CRC-32 of each file's header (``safetensors_io``), so one pass over a file
checks every byte: a flipped bit in a tensor names that tensor; offsets edited in a
header (two tensors swapped) fail the header's CRC and name the tensors whose bytes no
longer match. ``verify=False`` skips the checksums (the pass reads every byte); the
non-finite scan rides on the same pass unless ``allow_nonfinite``.
"""

from __future__ import annotations

import math
import zlib

import torch

from zeroshard import ZeroshardError
from zeroshard.checkpoint.format import CheckpointError
from zeroshard.checkpoint.safetensors_io import DTYPES, header_checksums

_CHUNK = 16 << 20  # bytes read at a time (a multiple of every element size)
_FLOAT8 = {n for n in ("F8_E4M3", "F8_E5M2") if n in DTYPES}


class IntegrityError(ZeroshardError, ValueError):
    """A file whose bytes are not what was saved, or hold non-finite values."""


def _names(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def scan_file(
    fpath: str,
    header: dict,
    raw_header: bytes,
    header_crc: int | None,
    *,
    verify: bool = True,
    allow_nonfinite: bool = False,
) -> None:
    """Read every tensor of one safetensors file once: compare its CRC-32 with the one
    the header records (and the header's with ``header_crc``, the manifest's) when
    ``verify``; count non-finite values in floating tensors unless ``allow_nonfinite``.
    Raises :class:`IntegrityError` naming the file and the tensors."""
    check_crc = verify and header_crc is not None
    check_finite = not allow_nonfinite
    if not (check_crc or check_finite):
        return
    recorded = header_checksums(header) if check_crc else None
    if check_crc and recorded is None:
        raise IntegrityError(
            f"{fpath}: the header records no checksums (the manifest says it does)"
        )
    header_ok = not check_crc or zlib.crc32(raw_header) == header_crc
    spans = sorted(
        (v["data_offsets"][0], v["data_offsets"][1], k)
        for k, v in header.items()
        if k != "__metadata__"
    )
    start = 8 + len(raw_header)
    bad_crc, nonfinite = [], []
    buf = bytearray(_CHUNK)
    with open(fpath, "rb") as f:
        for a, b, name in spans:
            dtype = header[name]["dtype"]
            floating = check_finite and DTYPES[dtype].is_floating_point
            if not (check_crc or floating):
                continue
            f.seek(start + a)
            crc, count, left = 0, 0, b - a
            while left:
                n = f.readinto(memoryview(buf)[: min(left, _CHUNK)])
                if not n:
                    raise IntegrityError(f"{fpath}: truncated inside tensor {name!r}")
                chunk = memoryview(buf)[:n]
                if check_crc:
                    crc = zlib.crc32(chunk, crc)
                if floating:
                    count += _count_nonfinite(chunk, dtype)
                left -= n
            if recorded is not None and crc != recorded.get(name):
                bad_crc.append(name)
            if count:
                nonfinite.append(f"{name!r} ({count} of {header[name]['shape']})")
    if not header_ok:
        what = (
            f"and tensor(s) {_names(bad_crc)} do not match their checksums"
            if bad_crc
            else "though every tensor matches the checksum it lists"
        )
        raise IntegrityError(
            f"{fpath}: the header's checksum differs from the manifest's (the header was "
            f"changed after the save: offsets, dtypes or shapes), {what}"
        )
    if bad_crc:
        raise IntegrityError(
            f"{fpath}: tensor(s) {_names(bad_crc)} do not match their checksums: the bytes "
            "changed after the save (a corrupt file); load with verify=False "
            "(zeroshard convert --no-verify) to skip this check"
        )
    if nonfinite:
        raise IntegrityError(
            f"{fpath}: non-finite values (NaN or inf) in tensor(s) {', '.join(nonfinite[:4])}"
            f"{' and more' if len(nonfinite) > 4 else ''}; load with allow_nonfinite=True "
            "(zeroshard convert --allow-nonfinite) to accept them"
        )


def _count_nonfinite(chunk: memoryview, dtype: str) -> int:
    t = torch.frombuffer(chunk, dtype=DTYPES[dtype])
    if dtype in _FLOAT8:
        t = t.float()
    # fast path: NaN and inf propagate through a sum (a finite sum proves every value
    # finite; ~20x faster than isfinite); an overflowing sum falls through to the count
    if math.isfinite(t.sum(dtype=torch.float32).item()):
        return 0
    return int(t.numel() - torch.isfinite(t).sum().item())


# -- the manifest's values --------------------------------------------------------------


def _int(value, what: str, minimum: int = 0) -> int:
    if type(value) is not int or value < minimum:
        raise CheckpointError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def _number(value, what: str, minimum: float | None = None, *, above: bool = False) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise CheckpointError(f"{what} must be a finite number, got {value!r}")
    if minimum is not None and (value <= minimum if above else value < minimum):
        raise CheckpointError(f"{what} must be {'>' if above else '>='} {minimum}, got {value!r}")
    return float(value)


def _no_nan(obj, what: str) -> None:
    """No NaN anywhere in a JSON value (inf is allowed: schedulers start best = inf)."""
    if isinstance(obj, float) and math.isnan(obj):
        raise CheckpointError(f"{what} is NaN")
    if isinstance(obj, dict):
        for k, v in obj.items():
            _no_nan(v, f"{what}[{k!r}]")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _no_nan(v, f"{what}[{i}]")


#: ranges of the optimizer hyperparameters a checkpoint restores: (minimum, strictly above)
_GROUP_RANGES = {
    "lr": (0.0, False),
    "weight_decay": (0.0, False),
    "eps": (0.0, True),
    "momentum": (0.0, False),
    "dampening": (0.0, False),
    "step": (0.0, False),
}


def check_values(m: dict) -> None:
    """Range checks of every manifest value a load restores; raises ValueError naming
    the key and the value (the caller adds the file)."""
    _int(m.get("version"), "version", 1)
    world = _int(m["world_size"], "world_size", 1)
    if world != len(m["files"]):
        raise CheckpointError(f"world_size {world} but {len(m['files'])} files listed")
    stage = _int(m.get("zero_stage", 0), "zero_stage")
    if stage > 3:
        raise CheckpointError(f"zero_stage must be 0-3, got {stage}")
    if m.get("compute_dtype", "F32") not in DTYPES:
        raise CheckpointError(f"compute_dtype {m.get('compute_dtype')!r} is not a dtype")
    for key, value in m["counters"].items():
        _int(value, f"counters.{key}")
    for i, group in enumerate(m["optimizer"]["groups"]):
        if not isinstance(group, dict):
            raise CheckpointError(f"optimizer.groups[{i}] must be an object")
        for key, value in group.items():
            what = f"optimizer.groups[{i}].{key}"
            values = value if isinstance(value, list) else [value]  # betas, eps pairs
            for j, v in enumerate(values):
                at = f"{what}[{j}]" if isinstance(value, list) else what
                if key in _GROUP_RANGES:
                    low, above = _GROUP_RANGES[key]
                    _number(v, at, low, above=above)
                elif key == "betas" and _number(v, at, 0.0) >= 1.0:
                    raise CheckpointError(f"{at} must be < 1, got {v!r}")
                elif isinstance(v, float) and not math.isfinite(v):
                    raise CheckpointError(f"{at} must be finite, got {v!r}")
    scaler = m["loss_scaler"]
    if "scale" in scaler:
        _number(scaler["scale"], "loss_scaler.scale", 0.0, above=True)
    for key, low in (("cur_hysteresis", 0), ("iteration", 0), ("last_overflow_iter", -1)):
        if key in scaler:
            _int(scaler[key], f"loss_scaler.{key}", low)
    _no_nan(m.get("scheduler"), "scheduler")
    for e in m["files"]:
        if "header_crc32" in e:
            _int(e["header_crc32"], f"files[{e['name']!r}].header_crc32")


def check_order(fpath: str, header: dict) -> None:
    """zeroshard writes each rank file's tensors in the order its header lists them, so
    their offsets rise in that order; two tensors whose offsets were exchanged break it
    (caught without reading the data, as ``verify=False`` would not)."""
    prev_name, prev_end = None, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        a, b = entry["data_offsets"]
        if a < prev_end:
            raise IntegrityError(
                f"{fpath}: tensor {name!r} is stored at bytes [{a}, {b}), before {prev_name!r} "
                "which the header lists first: the header's offsets were edited"
            )
        prev_name, prev_end = name, b


def check_save_id(fpath: str, header: dict, manifest: dict) -> None:
    """The file was written by the save that wrote the manifest (never a mix of two)."""
    want = manifest.get("save_id")
    if want is None:
        return
    got = (header.get("__metadata__") or {}).get("zs_save")
    if got != want:
        raise IntegrityError(
            f"{fpath}: written by save {got!r}, but the manifest is save {want!r}: the "
            "directory mixes the files of two saves"
        )
