"""The `zeroshard` command: a table of subcommands, each a module of ``zeroshard/tools/``.

To add a subcommand, write ``zeroshard/tools/<name>.py`` with ``add_arguments(parser)`` and
``main(args) -> int | None``, and add one row to `SUBCOMMANDS`. Modules are imported only
when their subcommand runs, so one broken subcommand cannot break the others.

An invocation whose first word is not a subcommand is DeepSpeed-style launcher usage
(``zeroshard --num_gpus 2 train.py --deepspeed ds_config.json``), handled by `launcher`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": (
        "zeroshard.tools.launch.launcher",
        "start training processes on this node (over torchrun)",
    ),
    "report": ("zeroshard.tools.report", "print the environment report (like ds_report)"),
    "convert": ("zeroshard.tools.convert", "consolidate a checkpoint into safetensors weights"),
    "estimate": (
        "zeroshard.tools.estimate",
        "per-rank memory for each stage / offload / precision",
    ),
    "plan": (
        "zeroshard.tools.plan",
        "the layout that fits the device with the least communication",
    ),
    "generate": (
        "zeroshard.tools.generate",
        "text from a checkpoint (int8/int4, KV cache, --nproc: tensor parallel)",
    ),
    "plot": ("zeroshard.tools.plot", "PNG charts of a run's CSV and metrics files (matplotlib)"),
}


def version() -> str:
    """The installed zeroshard version."""
    from importlib import metadata

    try:
        return metadata.version("zeroshard")
    except metadata.PackageNotFoundError:
        return "unknown"


def _top_parser() -> argparse.ArgumentParser:
    rows = "\n".join(f"  {name:<10} {text}" for name, (_, text) in SUBCOMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="zeroshard",
        usage="zeroshard <command> [options]  |  zeroshard [launcher options] script.py ...",
        description=f"commands:\n{rows}\n\n`zeroshard <command> --help` describes one.",
        epilog="Without a command, the arguments are DeepSpeed launcher options, e.g.\n"
        "  zeroshard --num_gpus 2 train.py --deepspeed ds_config.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-V", "--version", action="version", version=f"zeroshard {version()}")
    return parser


def _run_module(module_name: str, prog: str, argv: Sequence[str], **kwargs) -> int:
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=prog, allow_abbrev=False)
    module.add_arguments(parser, **kwargs)
    code = module.main(parser.parse_args(list(argv)))
    return int(code or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `zeroshard` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "-V", "--version"):
        _top_parser().parse_args(argv or ["--help"])
        return 0
    if argv[0] in SUBCOMMANDS:
        module_name, _ = SUBCOMMANDS[argv[0]]
        return _run_module(module_name, f"zeroshard {argv[0]}", argv[1:])
    return _run_module("zeroshard.tools.launch.launcher", "zeroshard", argv, deepspeed_style=True)


if __name__ == "__main__":
    sys.exit(main())
