"""Reading a DeepSpeed config file: JSON plus the relaxations people rely on.

Used by :mod:`zeroshard.config`. DeepSpeed reads config files with ``hjson``,
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
import re
from collections.abc import Callable
from typing import Any

from zeroshard import ZeroshardError
from zeroshard.config.schema import ConfigError


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
    cleaned = _TRAILING_COMMA.sub(_blank(source), _COMMENT.sub(_blank(source), text))
    try:
        return json.loads(cleaned, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as err:
        where = f"{source}:{err.lineno}:{err.colno}"
        raise ConfigError(where, f"invalid JSON: {err.msg}") from None
    except _DuplicateKey as err:
        # json does not tell where the object was; find the key's second occurrence.
        quoted = json.dumps(err.key)
        second = cleaned.find(quoted, cleaned.find(quoted) + 1)
        where = f"{source}:{cleaned.count(chr(10), 0, second) + 1}" if second >= 0 else source
        raise ConfigError(where, f"duplicate key {err.key!r} in one object") from None


# Matched left to right, so that a string is skipped whole: comments (an unterminated
# /* alone), then commas followed by } or ] once the comments are blank.
_STRING = r'"(?:\\.|[^"\\])*"'
_COMMENT = re.compile(_STRING + r"|//[^\n]*|#[^\n]*|/\*.*?\*/|/\*", re.DOTALL)
_TRAILING_COMMA = re.compile(_STRING + r"|,(?=\s*[}\]])")


def _blank(source: str) -> Callable[[re.Match[str]], str]:
    """A substitution that keeps strings and blanks the rest, newlines kept (so that
    errors keep their line and column)."""

    def blank(match: re.Match[str]) -> str:
        token = match.group()
        if token.startswith('"'):
            return token
        if token == "/*":
            line = match.string.count("\n", 0, match.start()) + 1
            raise ConfigError(f"{source}:{line}", "unterminated /* comment")
        return re.sub(r"[^\n]", " ", token)

    return blank


class _DuplicateKey(ZeroshardError):
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
