"""`zeroshard convert CKPT_DIR OUT`: a checkpoint to consolidated safetensors weights.

CKPT_DIR is a zeroshard checkpoint (a tag directory, a directory with ``latest``, or
with ``--tag TAG`` the tag directory in it, as DeepSpeed's ``zero_to_fp32.py --tag``),
or safetensors weights: a Hugging Face folder (``save_pretrained``,
``Trainer.save_model``, a Trainer's ``checkpoint-N``; sharded with its index too),
re-written cast (``--dtype``) and resharded (``--max-shard-size``) with the model's
config recorded for ``zeroshard generate`` (and ``config.json`` copied into a folder
OUT). What a path must hold is in ``zeroshard/checkpoint/sources.py``; a path holding
none of it is named with what is missing, in one line.

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
    parser.add_argument(
        "ckpt_dir",
        help="a checkpoint tag directory, a directory with 'latest', or a Hugging Face folder",
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
        help="skip comparing every tensor with the checksums recorded at save time",
    )
    parser.add_argument(
        "--tag",
        default=None,
        help="the tag directory in CKPT_DIR to convert (default: the one 'latest' names)",
    )
    parser.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="accept NaN/inf values in the checkpoint (refused by default)",
    )


def main(args: argparse.Namespace) -> int:
    from zeroshard.checkpoint import sources
    from zeroshard.checkpoint.export import DTYPE_ARGS, export_checkpoint, export_safetensors
    from zeroshard.checkpoint.load import CheckpointError

    dtype = DTYPE_ARGS.get(args.dtype)
    try:
        if args.tag is None and not sources.is_checkpoint(args.ckpt_dir):
            paths = export_safetensors(
                args.ckpt_dir,
                args.out,
                dtype,
                args.max_shard_size,
                allow_nonfinite=args.allow_nonfinite,
            )
        else:
            paths = export_checkpoint(
                args.ckpt_dir,
                args.out,
                dtype,
                args.max_shard_size,
                verify=args.verify,
                allow_nonfinite=args.allow_nonfinite,
                tag=args.tag,
            )
    except (CheckpointError, ValueError) as exc:  # (a bad config.json: ModelConfigError)
        print(f"zeroshard convert: {exc}")
        return 2
    except OSError as exc:  # OUT not writable, disk full, ...
        print(f"zeroshard convert: cannot write {args.out}: {exc}")
        return 2
    for p in paths:
        print(p)
    return 0
