"""The config schema: :func:`key` fields, and the one reader that walks them, for
:mod:`zeroshard.config` and the inference config; no collectives, no devices.

A section is a frozen kw_only dataclass (a :class:`Section`) whose fields are made with
:func:`key`; a field's metadata is its whole schema: JSON name (``under`` a sub-object
such as ``params``), aliases, range, choices, doc and status. :func:`read_section` reads
a JSON object into a section, recursively, collecting every problem before one
:class:`ConfigError` reports them all; :func:`schema_keys` lists every key. Rules:

* unknown keys are errors, with "did you mean" or the section the key belongs to (or
  the section's ``UNKNOWN`` text: why it reads no other key);
* booleans must be JSON booleans; whole numbers may be integral floats (``5e8``), never
  strings; a field typed ``object`` takes any JSON value as given; choices match
  case-insensitively and come back in their canonical spelling;
* ``null`` is taken where the field is optional (``X | None``), or ``nullable`` (null
  then means the default); two names of one setting (key and alias) is an error;
* ``"auto"`` is an error: only the Hugging Face integration fills it in, before reading
  (except at keys marked ``auto``, where it means the default: zeroshard chooses).

Every key has a status: wired (the code uses it), :func:`NOT_BUILT` (refused when set) or
:func:`INERT` (means nothing here, for the reason given; reported at start-up).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import operator
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, field
from typing import Any, NamedTuple

from zeroshard import ZeroshardError

AUTO = "auto"


class ConfigError(ZeroshardError, ValueError):
    """An invalid config. With one problem, ``str(err)`` starts with the dotted key path of
    the problem: ``path`` is that key path (for file-level problems, the file name),
    ``problem`` the rest. ``ConfigError("a.b: problem")`` (one string) is split at the
    first ``": "``.

    A config read finds every problem of its keys at once: ``errors`` holds them, one
    ConfigError each (``(err,)`` when there is one); with several, ``path`` and ``problem``
    are the first's and ``str(err)`` reads "N problems in WHERE:" and then one line per
    distinct problem, naming every key that has it.
    """

    def __init__(
        self, path: str, problem: str | None = None, *, others: tuple[ConfigError, ...] = (), where: str = ""
    ) -> None:  # fmt: skip
        if problem is None:
            path, _, problem = path.partition(": ") if ": " in path else ("", "", path)
        self.path, self.problem, self.where = path, problem, where
        self._others = tuple(others)
        first = f"{path}: {problem}" if path else problem
        if not self._others:
            super().__init__(first)
            return
        # one line per distinct problem, naming every key that has it
        keys: dict[str, list[str]] = {}
        for err in (self, *self._others):
            keys.setdefault(err.problem, []).append(err.path)
        lines = [", ".join(p for p in paths if p) + ": " + problem if any(paths) else problem for problem, paths in keys.items()]  # fmt: skip
        head = f"{1 + len(self._others)} problems in {where or 'the config'}:"
        super().__init__("\n".join([head, *(f"  {line}" for line in lines)]))

    @property
    def errors(self) -> tuple[ConfigError, ...]:
        """Every problem found, each a one-problem ConfigError (this one's first)."""
        return (ConfigError(self.path, self.problem), *self._others) if self._others else (self,)

    @classmethod
    def combine(cls, errors: list[ConfigError], where: str = "") -> ConfigError:
        """One ConfigError reporting ``errors`` (non-empty), in the order found."""
        flat = [one for err in errors for one in err.errors]
        first = flat[0]
        return cls(first.path, first.problem, others=tuple(flat[1:]), where=where)

    def __reduce__(self) -> tuple[Any, ...]:  # keep it picklable across processes
        return (_rebuild, (type(self), self.path, self.problem, self._others, self.where))


def _rebuild(cls: type, path: str, problem: str, others: tuple, where: str) -> ConfigError:
    return cls(path, problem, others=others, where=where)


ConfigError.__module__ = "zeroshard.config"  # its public home, for tracebacks


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def describe(value: Any) -> str:
    """A short rendering of a JSON value with its type, for error messages."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else f"{str(value).lower()} (a boolean)"
    if isinstance(value, (int, float)):
        return f"{value!r} (a number)"
    if isinstance(value, str):
        return f"{value if len(value) <= 40 else value[:37] + '...'!r} (a string)"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} item{'s' if len(value) != 1 else ''}"
    return "an object {...}" if isinstance(value, Mapping) else repr(value)


def check(condition: bool, path: str, problem: str) -> None:
    """Raise ``ConfigError(path, problem)`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(path, problem)


@contextmanager
def prefixed(prefix: str) -> Iterator[None]:
    """Re-raise a ConfigError from inside (a section's ``__post_init__``, which knows only
    its own field names) under the section's key path."""
    try:
        yield
    except ConfigError as err:
        raise ConfigError(join(prefix, err.path), err.problem) from None


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def suggest(name: str, known: list[str]) -> str | None:
    """The known name closest to a misspelled ``name``, if any is close enough."""
    same = [k for k in known if k.lower() == name.lower()]
    close = same or difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return close[0] if close else None


# -- what a key is -----------------------------------------------------------------------
@dataclass(frozen=True)
class Status:
    """Wired, refused as not built, or inert. ``when(value)`` says whether a given value
    triggers the refusal or the inert report; None means "differs from the default"."""

    kind: str  # "wired" | "not built" | "inert"
    text: str = ""  # the feature (not built) or the reason it means nothing (inert)
    when: Callable[[Any], bool] | None = None


WIRED = Status("wired")


def NOT_BUILT(feature: str, when: Callable[[Any], bool] | None = None) -> Status:
    """Refused at load with "<key>: <feature> is not built yet in zeroshard"."""
    return Status("not built", feature, when)


def INERT(reason: str, when: Callable[[Any], bool] | None = None) -> Status:
    """Accepted, means nothing in zeroshard for ``reason``; reported once at start-up."""
    return Status("inert", reason, when)


_NO = object()
_BOUNDS = {"min": (">=", operator.ge), "above": (">", operator.gt)}
_BOUNDS |= {"max": ("<=", operator.le), "below": ("<", operator.lt)}


@dataclass(frozen=True)
class Key:
    doc: str
    name: str | None = None  # JSON name (default: the field's), dotted = in sub-objects
    under: str | None = None  # the sub-object holding it, e.g. "params"
    aliases: tuple[str, ...] = ()  # other names of the same setting
    min: float | None = None
    max: float | None = None
    above: float | None = None
    below: float | None = None
    choices: tuple[Any, ...] | Mapping[str, str] | None = None  # Mapping: spelling -> value
    nullable: bool = False  # null means the default
    status: Status = WIRED
    only: tuple[str, ...] | None = None  # exists only for these values of the section's type
    check: Callable[[Any, str], None] | None = None  # extra check of the raw JSON value
    infinity: Any = _NO  # what +Infinity stands for (default: not accepted)
    auto: bool = False  # "auto" means the default (zeroshard chooses), not an error

    @property
    def canonical_choices(self) -> tuple[Any, ...]:
        choices = self.choices or ()
        return tuple(dict.fromkeys(choices.values())) if isinstance(choices, Mapping) else choices


def key(default: Any = MISSING, status: Status = WIRED, *, doc: str, factory: Any = MISSING, **meta: Any) -> Any:  # fmt: skip
    """A section field that is a config key; ``meta`` are :class:`Key`'s fields."""
    metadata = {"key": Key(doc=doc, status=status, **meta)}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


class Spec(NamedTuple):
    """One key field of a section class, resolved."""

    attr: str
    key: Key
    type: Any  # the annotation without None
    optional: bool  # the annotation admits None
    default: Any  # MISSING when required
    path: tuple[str, ...]  # JSON names from the section, e.g. ("params", "lr")


def specs(cls: type) -> tuple[Spec, ...]:
    """The keyed fields of section class ``cls`` (cached per class)."""
    return _specs(cls)


@functools.cache
def _specs(cls: type) -> tuple[Spec, ...]:
    hints, out = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        if "key" in f.metadata:
            k, tp = f.metadata["key"], hints[f.name]
            args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else ()  # fmt: skip
            if type(None) in args:
                tp = functools.reduce(operator.or_, [a for a in args if a is not type(None)])
            path = ((k.under + ".") if k.under else "") + (k.name or f.name)
            default = f.default if f.default_factory is MISSING else f.default_factory()
            out.append(Spec(f.name, k, tp, type(None) in args, default, tuple(path.split("."))))
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class Section:
    """Base of the config sections: ranges and choices hold however a section is built."""

    def __post_init__(self) -> None:
        for s in specs(type(self)):
            value = getattr(self, s.attr)
            if value is not None and not isinstance(value, (Section, Mapping)):
                check_value(s.key, value, s.attr)


def check_value(k: Key, value: Any, path: str) -> None:
    """The range and choice rules of ``k`` (on each item of a list)."""
    if isinstance(value, (list, tuple)):
        for item in value:
            check_value(k, item, path)
        return
    choices = k.canonical_choices
    check(not choices or value in choices, path, f"expected one of {_listed(choices)}, got {value!r}")  # fmt: skip
    bounds = [(op, bound, ok) for name, (op, ok) in _BOUNDS.items() if (bound := getattr(k, name)) is not None]  # fmt: skip
    if is_number(value) and not all(ok(value, bound) for _, bound, ok in bounds):
        rule = " and ".join(f"{op} {bound:g}" for op, bound, _ in bounds)
        raise ConfigError(path, f"must be {rule}, got {value!r}")


def _listed(choices: Any) -> str:
    return ", ".join(repr(c) for c in choices)


# -- reading -------------------------------------------------------------------------------
@dataclass
class Reading:
    """One read of a config: the schema root (for "belongs under" hints), the keys found
    refused (not built) or inert, as ``(dotted path, feature or reason)``, and the
    problems found so far (every one is collected; the outermost :func:`read_section`
    raises them together).

    ``refuse_not_built``: a key asking for a feature that is not built is a problem (else
    only listed); ``auto_ok``: "auto" anywhere is a value to be filled in (a check made
    before the Hugging Face integration fills the values in): the key is left out, and
    its section's cross-key checks are not made."""

    root: type
    not_built: list[tuple[str, str]] = field(default_factory=list)
    inert: list[tuple[str, str]] = field(default_factory=list)
    errors: list[ConfigError] = field(default_factory=list)
    where: str = ""  # what is read, for the message of several problems (a file name)
    refuse_not_built: bool = False
    auto_ok: bool = False
    depth: int = 0  # nesting of read_section calls: the outermost raises
    bad_keys: int = 0  # problems that make a section's cross-key checks a guess

    @contextmanager
    def collecting(self) -> Iterator[None]:
        """Record a ConfigError raised inside instead of letting it propagate."""
        try:
            yield
        except ConfigError as err:
            self.errors.append(err)
            self.bad_keys += 1


class _SectionFailed(ZeroshardError):
    """A nested section had problems (recorded in the Reading): its parent leaves the key
    out and goes on reading its other keys. Never leaves :func:`read_section`."""


def read_section(cls: type, data: Any, path: str, reading: Reading | None = None, **extra: Any) -> Any:  # fmt: skip
    """Read the JSON object ``data`` found at dotted ``path`` into the section ``cls``
    (``extra``: constructor arguments that are not keys). None when the reading's
    ``auto_ok`` left keys to be filled in.

    Every problem is found before one :class:`ConfigError` reports them all: each key is
    read on its own (an unknown key, a bad value, a bad nested section do not stop the
    others). Checks that relate several keys (a section's ``__post_init__``, such as the
    batch-size rule) run only on a section whose keys read cleanly: judged on a guess,
    they would report problems the user does not have."""
    reading = reading or Reading(cls)
    reading.depth += 1
    failed = False
    try:
        section = _read_section(cls, data, path, reading, extra)
    except _SectionFailed:
        failed = True
    finally:
        reading.depth -= 1
    if reading.depth == 0 and reading.errors:
        raise ConfigError.combine(reading.errors, reading.where) from None
    if failed:
        if reading.depth == 0:  # no problem, but values to be filled in ("auto")
            return None
        raise _SectionFailed
    return section


def _read_section(cls: type, data: Any, path: str, reading: Reading, extra: dict[str, Any]) -> Any:  # fmt: skip
    bad_before = reading.bad_keys
    if not isinstance(data, Mapping):
        with reading.collecting():
            raise ConfigError(path or "config", f"expected an object {{...}}, got {describe(data)}")  # fmt: skip
        raise _SectionFailed
    values: dict[str, Any] = {}
    given: dict[str, str] = {}  # attr -> the dotted path written in the config

    def read(s: Spec, obj: Mapping[str, Any]) -> None:
        where = join(path, ".".join(s.path[:-1]))
        names = [n for n in (s.path[-1], *s.key.aliases) if n in obj]
        if len(names) > 1:
            problem = f"'{names[1]}' and '{names[0]}' name the same setting (canonical name '{s.path[-1]}'); give only one of them"  # fmt: skip
            raise ConfigError(join(where, names[1]), problem)
        if not names:
            hint = f"; one of {', '.join(map(str, s.key.choices or ()))}" if s.key.choices else ""
            check(s.default is not MISSING, join(where, s.path[-1]), f"required{hint}")
            return
        at = given[s.attr] = join(where, names[0])
        try:
            value = _value(s, obj[names[0]], at, reading)
        except _SectionFailed:
            return  # its problems are recorded
        values[s.attr] = value
        status = s.key.status
        if status.kind != "wired" and (status.when(value) if status.when else value != s.default):
            if status.kind == "inert":
                reading.inert.append((at, status.text))
                return
            reading.not_built.append((at, status.text))
            if reading.refuse_not_built:  # a problem, but the value is read: keep checking
                reading.errors.append(ConfigError(at, f"{status.text} is not built yet in zeroshard"))  # fmt: skip

    # the section's type first: keys marked `only` exist for some types only (a bad type:
    # its parameters cannot be judged, so the section stops at that one problem)
    kind_spec = next((s for s in specs(cls) if s.path == ("type",)), None)
    if kind_spec is not None:
        with reading.collecting():
            read(kind_spec, data)
        if reading.bad_keys > bad_before:
            raise _SectionFailed
    kind = values.get("type")
    applies = [s for s in specs(cls) if s.key.only is None or kind in s.key.only]
    objects: dict[tuple[str, ...], Any] = {(): data}  # JSON objects by names, e.g. ("params",)
    for prefix in dict.fromkeys(s.path[:depth] for s in applies for depth in range(1, len(s.path))):  # fmt: skip
        sub = (objects[prefix[:-1]] or {}).get(prefix[-1])
        objects[prefix] = sub if isinstance(sub, Mapping) else None
        with reading.collecting():
            check(sub is None or isinstance(sub, Mapping), join(path, ".".join(prefix)), f"expected an object {{...}}, got {describe(sub)}")  # fmt: skip
    for prefix, obj in objects.items():
        for name in obj or ():
            with reading.collecting():
                _check_known(cls, name, prefix, path, applies, kind, reading.root)
    for s in applies:
        if s is not kind_spec and objects[s.path[:-1]] is not None:
            with reading.collecting():
                read(s, objects[s.path[:-1]])
    if reading.bad_keys > bad_before:
        raise _SectionFailed  # the cross-key checks below would judge a guess
    with reading.collecting():
        compat = getattr(cls, "json_compat", None)  # it names keys by their whole path
        if compat is not None:
            values = compat(values, given, lambda at, reason: reading.inert.append((at, reason)))
        with prefixed(path):
            return cls(**values, **extra)
    raise _SectionFailed


def _value(s: Spec, value: Any, at: str, reading: Reading) -> Any:
    if isinstance(value, str) and value == AUTO:
        if s.key.auto:
            return s.default
        if reading.auto_ok:  # to be filled in: the section's cross-key checks would guess
            reading.bad_keys += 1
            raise _SectionFailed
        raise ConfigError(at, "'auto' is filled in only by the Hugging Face integration; give a value here (or pass one as load_config(..., auto_values={...}))")  # fmt: skip
    if value is None:
        check(s.optional or s.key.nullable, at, "expected a value, got null")
        return None if s.optional else s.default
    if s.key.check is not None:
        s.key.check(value, at)
    out = _convert(s.type, value, at, s.key, reading)
    if not isinstance(out, Section):
        check_value(s.key, out, at)
    return out


def _convert(tp: Any, value: Any, at: str, k: Key, reading: Reading) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return read_section(tp, value, at, reading)
    if k.choices is not None:
        return _choice(value, at, k)
    if tp is bool:
        check(isinstance(value, bool), at, f"expected true or false, got {describe(value)}")
    elif tp is int:
        if k.infinity is not _NO and is_number(value) and value == math.inf:
            return k.infinity
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        check(is_number(value) and isinstance(value, int), at, f"expected a whole number, got {describe(value)}")  # fmt: skip
    elif tp is float:
        check(is_number(value), at, f"expected a number, got {describe(value)}")
        check(math.isfinite(value), at, f"expected a finite number, got {value!r}")
        value = float(value)
    elif tp is str:
        check(isinstance(value, str), at, f"expected a string, got {describe(value)}")
    elif origin is tuple:  # a fixed number of numbers, e.g. Adam's betas
        ok = isinstance(value, list) and len(value) == len(args) and all(map(is_number, value))
        check(ok, at, f"expected a list of {len(args)} numbers, got {describe(value)}")
        value = tuple(_convert(float, v, at, k, reading) for v in value)
    elif origin is list:
        check(isinstance(value, list), at, f"expected a list, got {describe(value)}")
        value = [_convert(args[0], v, at, k, reading) for v in value]
    elif tp is object:  # any JSON value, kept as given (a setting of a feature not built)
        pass
    elif origin is dict:  # a section zeroshard keeps as given
        check(isinstance(value, Mapping), at, f"expected an object {{...}}, got {describe(value)}")
        value = dict(value)
    else:  # float | list[float]: one number, or one per parameter group
        listed = [a for a in args if typing.get_origin(a) is list]
        pick = listed[0] if listed and isinstance(value, list) else args[0]
        value = _convert(pick, value, at, k, reading)
    return value


def _choice(value: Any, at: str, k: Key) -> Any:
    table = dict(k.choices) if isinstance(k.choices, Mapping) else {c: c for c in k.choices or ()}
    if isinstance(value, str):
        for spelling, result in table.items():
            if isinstance(spelling, str) and spelling.lower() == value.lower():
                return result
    elif is_number(value) and value in table:
        return table[value]
    canonical = k.canonical_choices
    close = suggest(value, [c for c in canonical if isinstance(c, str)]) if isinstance(value, str) else None  # fmt: skip
    hint = f"; did you mean {close!r}?" if close else ""
    raise ConfigError(at, f"expected one of {_listed(canonical)}, got {describe(value)}{hint}")


def _check_known(cls, name, prefix, path, applies, kind, root) -> None:
    """An unknown ``name`` in the JSON object at ``prefix`` is an error, with a hint."""
    where = join(path, ".".join(prefix))
    check(isinstance(name, str), where or "config", f"keys must be strings, got {name!r}")
    level = len(prefix)
    here = [s for s in applies if s.path[:level] == prefix]
    known = {s.path[level] for s in here}
    known |= {alias for s in here if len(s.path) == level + 1 for alias in s.key.aliases}
    if name in known:
        return
    at, hint = join(where, name), getattr(cls, "HINTS", {}).get(".".join((*prefix, name)))
    if hint is None and any(s.path == (*prefix, name) for s in specs(cls)):
        takes = ", ".join(s.path[-1] for s in applies if s.path[:-1] == prefix)
        hint = f"'{name}' is not a parameter of {kind} (which takes {takes})"
    homes = [p for p in _homes(root).get(name, ()) if p != where]
    if hint is None and homes:
        hint = f"it belongs under {' or '.join(repr(p) for p in homes[:3])}"
    if hint is not None:
        raise ConfigError(at, f"unknown key here; {hint}")
    close = suggest(name, sorted(known))
    if close:
        raise ConfigError(at, f"unknown key; did you mean '{close}'?")
    if getattr(cls, "UNKNOWN", None):  # the section says why nothing else is read
        raise ConfigError(at, f"unknown key; {cls.UNKNOWN}")
    listing = f" (known keys: {', '.join(sorted(known))})" if len(known) <= 14 else ""
    raise ConfigError(at, f"unknown key{listing}")


# -- the schema as a list ------------------------------------------------------------------
class KeyInfo(NamedTuple):
    """One key a section accepts, with its effective status (a key inside a refused or
    inert section shares that section's status)."""

    path: str  # dotted, canonical names
    spec: Spec
    status: Status
    section: type


def schema_keys(cls: type, prefix: str = "", inherited: Status = WIRED) -> Iterator[KeyInfo]:
    for s in specs(cls):
        path = join(prefix, ".".join(s.path))
        status = s.key.status if s.key.status.kind != "wired" else inherited
        yield KeyInfo(path, s, status, cls)
        if isinstance(s.type, type) and dataclasses.is_dataclass(s.type):
            yield from schema_keys(s.type, path, status)


@functools.cache
def _homes(root: type) -> dict[str, tuple[str, ...]]:
    """Key name -> the sections (dotted paths) that have a key of that name."""
    homes: dict[str, list[str]] = {}
    for info in schema_keys(root):
        parent, _, name = info.path.rpartition(".")
        for n in (name, *info.spec.key.aliases):
            homes.setdefault(n, []).append(parent)
    return {n: tuple(dict.fromkeys(p for p in parents if p)) for n, parents in homes.items()}
