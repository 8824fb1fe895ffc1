"""The launcher's look at the script's config, before any worker starts. No collectives.

``zeroshard run`` finds the DeepSpeed config on the script's command line and checks it
once, in the launcher, so that a typo costs one short report instead of a traceback per
rank after every worker has imported torch and joined the rendezvous:

* ``--deepspeed_config PATH`` (DeepSpeed): always checked, a missing file included;
* ``--deepspeed PATH`` (Hugging Face's spelling) when PATH ends in ``.json``;
* ``--config PATH`` when PATH ends in ``.json``, exists and reads as a DeepSpeed config
  (a JSON object with one of its batch keys or ``zero_optimization``): scripts use
  ``--config`` for their own files too, which are theirs to check.

``PATH`` may follow the flag or be joined to it with ``=``. The check is
:func:`zeroshard.config.check_config_file`: every key (with did-you-mean), features not
built, the rules that need no world size; ``"auto"`` is left to the Hugging Face
integration and the batch-size rule to ``initialize``, which knows the mesh. It imports
the config schema only (no torch): about 0.2 s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# top-level keys that say a --config file is a DeepSpeed config
_DEEPSPEED_KEYS = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "zero_optimization",
    }
)


@dataclass(frozen=True)
class ConfigArg:
    """A config path found on the script's command line, and the flag that gave it."""

    flag: str
    path: str


def find_config_arg(script_args: list[str]) -> ConfigArg | None:
    """The DeepSpeed config the script will read, as its command line names it."""
    found: ConfigArg | None = None
    for i, arg in enumerate(script_args):
        flag, eq, value = arg.partition("=")
        if not eq:
            following = script_args[i + 1] if i + 1 < len(script_args) else ""
            value = "" if following.startswith("-") else following
        if not value:
            continue
        if flag == "--deepspeed_config":
            return ConfigArg(flag, value)
        if found is not None or not value.endswith(".json"):
            continue
        if flag == "--deepspeed" or (flag == "--config" and _looks_like_deepspeed(value)):
            found = ConfigArg(flag, value)
    return found


def _looks_like_deepspeed(path: str) -> bool:
    try:
        from zeroshard.config.jsonc import loads_relaxed

        data = loads_relaxed(Path(path).read_text(encoding="utf-8-sig"), path)
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(data, dict) and bool(_DEEPSPEED_KEYS & set(data))


def check_script_config(script_args: list[str]) -> list[str]:
    """The launcher's report on the script's config: [] when it is fine or none is
    found, else the lines to print (every problem of the file at once)."""
    arg = find_config_arg(script_args)
    if arg is None:
        return []
    from zeroshard.config import ConfigError, check_config_file

    try:
        check_config_file(arg.path)
    except ConfigError as err:
        text = str(err)
        if len(err.errors) == 1 and not text.startswith(arg.path):
            text = f"{arg.path}: {text}"
        lines = text.splitlines()
        return [
            f"zeroshard: error: {lines[0]}",
            *lines[1:],
            f"zeroshard: no worker started (the config of {arg.flag}; "
            "--no-config-check starts them anyway)",
        ]
    return []
