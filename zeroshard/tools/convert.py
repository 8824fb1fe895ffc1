"""`zeroshard convert CKPT_DIR OUT`: a checkpoint to consolidated safetensors weights.

CKPT_DIR is a zeroshard checkpoint (a tag directory, a directory with ``latest``, or
with ``--tag TAG`` the tag directory in it, as DeepSpeed's ``zero_to_fp32.py --tag``),
or safetensors weights: a Hugging Face folder (``save_pretrained``,
``Trainer.save_model``, a Trainer's ``checkpoint-N``; sharded with its index too),
re-written cast (``--dtype``) and resharded (``--max-shard-size``) with the model's
config recorded for ``zeroshard generate`` (and ``config.json`` copied into a folder
OUT). What a path must hold is in ``zeroshard/checkpoint/sources.py``; a path holding
none of it is named with what is missing, in one line.

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

from zeroshard import ArgumentError


def parse_size(text: str) -> int:
    from zeroshard.checkpoint.export import size_bytes  # torch: imported when parsed

    try:
        return size_bytes(text)
    except ArgumentError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0]
    parser.add_argument(
        "ckpt_dir",
        help="a checkpoint tag directory, a directory with 'latest' (zeroshard's or "
        "DeepSpeed's), or a Hugging Face folder",
    )
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
    from zeroshard.checkpoint.ds_files import deepspeed_path
    from zeroshard.checkpoint.export import DTYPE_ARGS, export_checkpoint, export_safetensors
    from zeroshard.checkpoint.load import CheckpointError

    dtype = DTYPE_ARGS.get(args.dtype)
    try:
        hf_folder = (
            args.tag is None
            and not args.deepspeed
            and not sources.is_checkpoint(args.ckpt_dir)
            and deepspeed_path(args.ckpt_dir, None) is None
        )
        if hf_folder:
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
                deepspeed=args.deepspeed,
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
