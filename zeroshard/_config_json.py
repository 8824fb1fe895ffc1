"""Reading a DeepSpeed config file: JSON plus the relaxations people rely on.

Private helper of :mod:`zeroshard.config`. DeepSpeed reads config files with ``hjson``,
so configs in the wild carry comments and trailing commas. We accept, outside strings:

* ``// line`` and ``# line`` comments, and ``/* block */`` comments;
* a trailing comma before ``}`` or ``]``.

Everything else must be strict JSON. Comments and trailing commas are blanked out in place
(newlines kept), so a parse error still points at the right line and column of the file.
Duplicate keys are an error, as in DeepSpeed.
"""

from __future__ import annotations

import json
import os
from typing import Any

from zeroshard._config_fields import ConfigError


def read_config_file(path: str | os.PathLike[str]) -> Any:
    """Parse the config file at ``path``; every problem is a ConfigError naming the file
    (and ``file:line:column`` for syntax errors)."""
    name = os.fspath(path)
    if not os.path.exists(name):
        raise ConfigError(name, "config file not found")
    if os.path.isdir(name):
        raise ConfigError(name, "is a directory, expected a JSON config file")
    try:
        with open(name, encoding="utf-8-sig") as handle:
            text = handle.read()
    except UnicodeDecodeError as err:
        raise ConfigError(name, f"not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise ConfigError(name, f"cannot read config file: {err.strerror or err}") from None
    return loads_relaxed(text, name)


def loads_relaxed(text: str, source: str = "<string>") -> Any:
    """Parse JSON text with comments and trailing commas allowed (see module docstring)."""
    cleaned = _blank_trailing_commas(_blank_comments(text, source))
    try:
        return json.loads(cleaned, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{source}:{err.lineno}:{err.colno}", f"invalid JSON: {err.msg}"
        ) from None
    except _DuplicateKey as err:
        # json does not tell where the object was; find the key's second occurrence.
        line = _line_of_second(cleaned, json.dumps(err.key))
        where = f"{source}:{line}" if line else source
        raise ConfigError(where, f"duplicate key {err.key!r} in one object") from None


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _line_of_second(text: str, quoted_key: str) -> int | None:
    first = text.find(quoted_key)
    second = text.find(quoted_key, first + 1) if first >= 0 else -1
    return text.count("\n", 0, second) + 1 if second >= 0 else None


def _blank_comments(text: str, source: str) -> str:
    """Replace comments outside strings by spaces, keeping every newline."""
    out = list(text)
    i, n = 0, len(text)
    in_string = False
    while i < n:
        ch = text[i]
        if in_string:
            if ch == "\\":
                i += 2
                continue
            if ch == '"':
                in_string = False
            i += 1
            continue
        if ch == '"':
            in_string = True
            i += 1
        elif ch == "#" or text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out[i:end] = " " * (end - i)
            i = end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            if end < 0:
                line = text.count("\n", 0, i) + 1
                raise ConfigError(f"{source}:{line}", "unterminated /* comment")
            for j in range(i, end + 2):
                if out[j] != "\n":
                    out[j] = " "
            i = end + 2
        else:
            i += 1
    return "".join(out)


def _blank_trailing_commas(text: str) -> str:
    """Replace a comma that is followed (after whitespace) by ``}`` or ``]`` by a space."""
    out = list(text)
    in_string = False
    last_comma = -1  # position of a comma seen outside strings, not yet followed by a value
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if in_string:
            if ch == "\\":
                i += 2
                continue
            if ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
            last_comma = -1
        elif ch == ",":
            last_comma = i
        elif ch in "}]":
            if last_comma >= 0:
                out[last_comma] = " "
            last_comma = -1
        elif not ch.isspace():
            last_comma = -1
        i += 1
    return "".join(out)
