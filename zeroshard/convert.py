"""`zeroshard convert CKPT_DIR OUT`: a checkpoint to consolidated safetensors weights.

CKPT_DIR may be a DeepSpeed ZeRO-0/1/2/3 checkpoint (detected, or required with
``--from-deepspeed``): its fp32 weights, frozen parameters, buffers and tied names are
written as DeepSpeed's ``zero_to_fp32`` would, but its ``.pt`` files are read with torch's
restricted unpickler (no code runs; anything but plain data is refused by name).

Streams tensor by tensor (peak memory about one tensor). OUT ending in
``.safetensors`` is one file; otherwise a directory, sharded above ``--max-shard-size``
with a Hugging Face style ``model.safetensors.index.json``. Every file of the checkpoint
is checked first (checksums, unless ``--no-verify``; non-finite values, unless
``--allow-nonfinite``; the manifest against the files: every tensor listed, present and
tiled exactly, with the shape the files recorded); a bad checkpoint or an unwritable
OUT exits with status 2,
naming the file (and tensor), and leaves no ``.partial`` file.
"""

from __future__ import annotations

import argparse
import re

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0]
    parser.add_argument("ckpt_dir", help="a checkpoint tag directory, or a directory with 'latest'")
    parser.add_argument(
        "--from-deepspeed",
        dest="deepspeed",
        action="store_true",
        default=None,
        help="CKPT_DIR must be a DeepSpeed checkpoint (detected without this flag too)",
    )
    parser.add_argument("out", help="output .safetensors file, or a directory")
    parser.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="cast floating tensors (default: fp32 masters / saved dtype)",
    )
    parser.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=None,
        help="split into several files above this size (directory output)",
    )
    parser.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip comparing every tensor with the checksums recorded at save time (a "
        "DeepSpeed checkpoint: the CRC-32 of every zip member)",
    )
    parser.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="accept NaN/inf values in the checkpoint (refused by default)",
    )


def main(args: argparse.Namespace) -> int:
    from zeroshard.checkpoint.export import DTYPE_ARGS, export_checkpoint
    from zeroshard.checkpoint.load import CheckpointError

    try:
        paths = export_checkpoint(
            args.ckpt_dir,
            args.out,
            DTYPE_ARGS.get(args.dtype),
            args.max_shard_size,
            verify=args.verify,
            allow_nonfinite=args.allow_nonfinite,
            deepspeed=args.deepspeed,
        )
    except CheckpointError as exc:
        print(f"zeroshard convert: {exc}")
        return 2
    except OSError as exc:  # OUT not writable, disk full, ...
        print(f"zeroshard convert: cannot write {args.out}: {exc}")
        return 2
    for p in paths:
        print(p)
    return 0
