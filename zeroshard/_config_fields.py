"""Path-aware, typed reading of one JSON object of a DeepSpeed-style config.

Private helper of :mod:`zeroshard.config`. Every problem becomes a :class:`ConfigError`
whose message starts with the dotted key path, e.g.
``zero_optimization.stage: expected one of 0, 1, 2, 3, got 4``.

Conventions shared by every getter:

* a missing key, or the string ``"auto"`` (Hugging Face's Trainer writes ``"auto"`` for
  values it fills in itself), gives the field's default;
* ``null`` is accepted only where the field is optional (``nullable=True``);
* booleans must be JSON ``true``/``false`` -- ``0``/``1`` and ``"true"`` are rejected, so a
  typo like ``"enabled": "yes"`` cannot silently mean something;
* whole numbers may be written as integral floats (``5e8``), never as strings.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

AUTO = "auto"
"""The placeholder value Hugging Face's DeepSpeed integration fills in."""


class ConfigError(ValueError):
    """An invalid config. ``str(err)`` always starts with the dotted key path of the problem.

    ``path`` is that key path (for file-level problems, the file name), ``problem`` the rest.
    ``ConfigError("a.b: problem")`` (one string) is split at the first ``": "``.
    """

    def __init__(self, path: str, problem: str | None = None) -> None:
        if problem is None:
            path, _, problem = path.partition(": ") if ": " in path else ("", "", path)
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {problem}" if path else problem)

    def __reduce__(self) -> tuple[Any, ...]:  # keep it picklable across processes
        return (type(self), (self.path, self.problem))

    def under(self, prefix: str) -> ConfigError:
        """The same problem, with ``prefix`` put in front of its key path."""
        return type(self)(join(prefix, self.path), self.problem)


# ConfigError is public as zeroshard.config.ConfigError; say so in tracebacks.
ConfigError.__module__ = "zeroshard.config"


def join(prefix: str, key: str) -> str:
    """Dotted key path ``prefix.key`` (just ``key`` at the top level)."""
    return f"{prefix}.{key}" if prefix else key


def describe(value: Any) -> str:
    """A short rendering of a JSON value with its type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, (int, float)):
        return f"{value!r} (a number)"
    if isinstance(value, str):
        text = value if len(value) <= 40 else value[:37] + "..."
        return f"{text!r} (a string)"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} item{'s' if len(value) != 1 else ''}"
    if isinstance(value, Mapping):
        return "an object {...}"
    return f"{value!r} (a {type(value).__name__})"


def suggest(key: str, known: Iterable[str]) -> str | None:
    """The known key closest to a misspelled ``key``, if any is close enough."""
    known = list(known)
    for candidate in known:
        if candidate.lower() == key.lower():
            return candidate
    matches = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return matches[0] if matches else None


def check(condition: bool, path: str, problem: str) -> None:
    """Raise ``ConfigError(path, problem)`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(path, problem)


@contextmanager
def prefixed(prefix: str) -> Iterator[None]:
    """Re-raise a ConfigError from inside (e.g. a section's ``__post_init__``, which knows
    only its own field names) under the section's key path."""
    try:
        yield
    except ConfigError as err:
        raise err.under(prefix) from None


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Fields:
    """One JSON object found at dotted ``path``; rejects keys not in ``known``.

    ``hints`` maps a key that does not belong here to a sentence saying where it belongs
    (``"it belongs under 'zero_optimization'"``), used instead of a spelling suggestion.
    """

    def __init__(
        self,
        data: Any,
        path: str,
        known: Iterable[str],
        *,
        hints: Mapping[str, str] | None = None,
    ) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(path or "config", f"expected an object {{...}}, got {describe(data)}")
        known = tuple(known)
        for key in data:
            if not isinstance(key, str):
                raise ConfigError(path or "config", f"keys must be strings, got {key!r}")
            if key not in known:
                raise unknown_key(join(path, key), key, known, (hints or {}).get(key))
        self.data: Mapping[str, Any] = data
        self.path = path

    # -- plumbing ---------------------------------------------------------------------
    def at(self, key: str) -> str:
        """Dotted path of ``key`` in this object."""
        return join(self.path, key)

    def has(self, key: str) -> bool:
        return key in self.data

    def get(self, key: str, default: Any = None) -> Any:
        """The raw JSON value (no checks)."""
        return self.data.get(key, default)

    def _given(self, key: str, nullable: bool) -> tuple[bool, Any]:
        """(True, value) when ``key`` holds a real value; (False, None) when the default
        applies (missing, ``"auto"``, or ``null`` where allowed)."""
        if key not in self.data:
            return False, None
        value = self.data[key]
        if isinstance(value, str) and value == AUTO:
            return False, None
        if value is None:
            if nullable:
                return False, None
            raise ConfigError(self.at(key), "expected a value, got null")
        return True, value

    def pick(self, canonical: str, *aliases: str) -> str:
        """The one of ``canonical`` and its ``aliases`` present here (``canonical`` when
        none is); giving two names for the same setting is an error."""
        present = [k for k in (canonical, *aliases) if k in self.data]
        if len(present) > 1:
            raise ConfigError(
                self.at(present[1]),
                f"'{present[1]}' and '{present[0]}' name the same setting "
                f"(canonical name '{canonical}'); give only one of them",
            )
        return present[0] if present else canonical

    # -- typed getters ----------------------------------------------------------------
    def boolean(self, key: str, default: bool | None, *, nullable: bool = False) -> Any:
        given, value = self._given(key, nullable)
        if not given:
            return default
        if not isinstance(value, bool):
            raise ConfigError(self.at(key), f"expected true or false, got {describe(value)}")
        return value

    def integer(
        self,
        key: str,
        default: int | None,
        *,
        minimum: int | None = None,
        maximum: int | None = None,
        nullable: bool = False,
    ) -> Any:
        given, value = self._given(key, nullable)
        if not given:
            return default
        return as_integer(value, self.at(key), minimum=minimum, maximum=maximum)

    def number(
        self,
        key: str,
        default: float | None,
        *,
        minimum: float | None = None,
        maximum: float | None = None,
        above: float | None = None,
        nullable: bool = False,
    ) -> Any:
        given, value = self._given(key, nullable)
        if not given:
            return default
        return as_number(value, self.at(key), minimum=minimum, maximum=maximum, above=above)

    def string(
        self,
        key: str,
        default: str | None,
        *,
        choices: Iterable[str] | None = None,
        nullable: bool = False,
    ) -> Any:
        """A string; with ``choices``, matched case-insensitively and returned in the
        spelling ``choices`` uses."""
        given, value = self._given(key, nullable)
        if not given:
            return default
        if not isinstance(value, str):
            raise ConfigError(self.at(key), f"expected a string, got {describe(value)}")
        if choices is None:
            return value
        return as_choice(value, self.at(key), choices)

    def section(self, key: str) -> Any:
        """A nested object, or None when missing or null."""
        value = self.data.get(key)
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise ConfigError(self.at(key), f"expected an object {{...}}, got {describe(value)}")
        return value


def unknown_key(path: str, key: str, known: Iterable[str], hint: str | None = None) -> ConfigError:
    if hint:
        return ConfigError(path, f"unknown key here; {hint}")
    close = suggest(key, known)
    if close:
        return ConfigError(path, f"unknown key; did you mean '{close}'?")
    known = sorted(known)
    listing = f" (known keys: {', '.join(known)})" if len(known) <= 14 else ""
    return ConfigError(path, f"unknown key{listing}")


def as_integer(
    value: Any, path: str, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(path, f"expected a whole number, got {describe(value)}")
    _check_range(value, path, minimum, maximum, None)
    return value


def as_number(
    value: Any,
    path: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
) -> float:
    if not is_number(value):
        raise ConfigError(path, f"expected a number, got {describe(value)}")
    if not math.isfinite(value):
        raise ConfigError(path, f"expected a finite number, got {value!r}")
    _check_range(value, path, minimum, maximum, above)
    return float(value)


def as_choice(value: Any, path: str, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if isinstance(value, str):
        for choice in choices:
            if choice.lower() == value.lower():
                return choice
    listed = ", ".join(repr(c) for c in choices)
    close = suggest(value, choices) if isinstance(value, str) else None
    hint = f"; did you mean {close!r}?" if close else ""
    raise ConfigError(path, f"expected one of {listed}, got {describe(value)}{hint}")


def _check_range(
    value: float,
    path: str,
    minimum: float | None,
    maximum: float | None,
    above: float | None,
) -> None:
    if minimum is not None and value < minimum:
        raise ConfigError(path, f"must be >= {minimum}, got {value!r}")
    if above is not None and value <= above:
        raise ConfigError(path, f"must be > {above}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(path, f"must be <= {maximum}, got {value!r}")
