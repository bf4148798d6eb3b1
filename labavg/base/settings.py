"""Settings machinery: declared once as dataclass fields, read from TOML, flags and `--set`.

A setting is a dataclass field whose metadata (`setting`) holds its help text, its rule
(choices, bounds) and, for the common ones, its command-line flag. A section is a dataclass of
settings; it lives next to the code it configures, and may tie its fields together in a
`problem(prefix)` method (the first broken cross-field rule, named with the section's dotted
prefix, or None). A composite holds sections as fields, or as a `sections=` field: a mapping
of named sections whose names are chosen at run time (each a table of its own in TOML).

This module knows no section. `first_problem` checks every field's rule, then every
section's `problem`; `from_dict` builds a dataclass from plain values (TOML, config.json),
`to_dict` turns it back, `with_overrides` replaces dotted keys, `flags` lists the flags.
Files are parsed, never executed. This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labavg.base.errors import UserError

SEED_LIMIT = 2**32  # numpy's SeedSequence refuses negatives; 32 bits as Kaldi's --srand


class Rule:
    """What a setting must be. A rule keeps its choices and bounds, so that a form (the
    dashboard) can offer exactly what validation accepts. `text` and `choices` may be given
    as functions, for choices that are registered at run time (the averaging methods)."""

    def __init__(self, ok: Callable[[Any], bool], text: str | Callable[[], str],
                 choices: tuple[str, ...] | Callable[[], tuple[str, ...]] | None = None,
                 low: float | None = None, high: float | None = None, low_open: bool = False,
                 high_open: bool = False) -> None:
        self.ok = ok
        self._text, self._choices = text, choices
        self.low, self.high, self.low_open, self.high_open = low, high, low_open, high_open

    @property
    def text(self) -> str:
        """The words after "must be"."""
        return self._text() if callable(self._text) else self._text

    @property
    def choices(self) -> tuple[str, ...] | None:
        return self._choices() if callable(self._choices) else self._choices


def integer(low: int, high: int | None = None, text: str | None = None) -> Rule:
    if text is None:
        text = "positive" if (low, high) == (1, None) else (
            f">= {low}" if high is None else f"in {low}..{high}")
    return Rule(lambda v: v >= low and (high is None or v <= high), text, low=low, high=high)


def real(low: float | None = None, high: float | None = None, *, low_open: bool = False,
         high_open: bool = False, text: str | None = None) -> Rule:
    def ok(v: float) -> bool:
        if not math.isfinite(v):
            return False
        if low is not None and (v <= low if low_open else v < low):
            return False
        return high is None or (v < high if high_open else v <= high)

    if text is None:
        if low == 0 and low_open and high is None:
            text = "positive and finite"
        elif high is None:
            text = f"finite and >= {low}" if low is not None else "finite"
        else:
            text = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    return Rule(ok, text, low=low, high=high, low_open=low_open, high_open=high_open)


def one_of(choices: tuple[str, ...] | Callable[[], tuple[str, ...]]) -> Rule:
    """One of `choices` (a tuple, or a function giving the choices registered so far)."""
    def now() -> tuple[str, ...]:
        return choices() if callable(choices) else choices

    return Rule(lambda v: v in now(), lambda: f"one of {', '.join(now())}", choices=now)


NONEMPTY = Rule(lambda v: bool(v.strip()) and "\0" not in v, "a non-empty path")
POSITIVE = integer(1)
SEED = integer(0, SEED_LIMIT - 1)
FINITE_POSITIVE = real(0, low_open=True)


def setting(default: Any = dataclasses.MISSING, help: str = "", rule: Rule | None = None, *,
            flag: str | None = None, factory: Callable[[], Any] | None = None,
            sections: Callable[[], Mapping[str, type]] | None = None) -> Any:
    """A dataclass field with its help text, its rule and its command-line flag as metadata.

    `sections` makes the field a mapping of named sections: the function gives the names
    that may appear and each one's dataclass; each is a table of its own in TOML and in
    `to_dict`, at the place of this field."""
    metadata = {"help": help, "rule": rule, "flag": flag, "sections": sections}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def bad(key: str, text: str, value: Any) -> str:
    return f"{key} must be {text}; got {value!r}"


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _tables(cls: type) -> dict[str, tuple[str, type]]:
    """The named sections of `cls`'s `sections=` fields: table name -> (field, dataclass)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("sections"):
            out.update({name: (f.name, section) for name, section in f.metadata["sections"]().items()})
    return out


def _keys(cls: type) -> list[str]:
    """The keys a table of `cls` may hold, in declaration order."""
    keys = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("sections"):
            keys += list(f.metadata["sections"]())
        else:
            keys.append(f.name)
    return keys


def named_sections(cls: type, given: Mapping[str, Any], name: str) -> dict[str, Any]:
    """`given` sections of field `name` of `cls`, every known one present (defaults filled),
    in the order its `sections` function gives them."""
    known = next(f for f in dataclasses.fields(cls) if f.name == name).metadata["sections"]()
    return {key: given[key] if key in given else section() for key, section in known.items()}


def sections_of(obj: Any, prefix: str = "") -> Iterator[tuple[Any, str]]:
    """`obj` and every section inside it, each with its dotted prefix, outermost first."""
    yield obj, prefix
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get("sections"):
            for name, section in value.items():
                yield from sections_of(section, f"{prefix}{name}.")
        elif dataclasses.is_dataclass(value):
            yield from sections_of(value, f"{prefix}{f.name}.")


def _rule_problem(obj: Any, prefix: str) -> str | None:
    for f in dataclasses.fields(obj):
        rule, value = f.metadata.get("rule"), getattr(obj, f.name)
        if rule is not None and value is not None and not rule.ok(value):
            return bad(prefix + f.name, rule.text, value)
    return None


def first_problem(obj: Any, prefix: str = "") -> str | None:
    """The first broken rule of `obj` and its sections, or None.

    Single values first, in every section: a cross-field message about a value that is
    itself bad would point at the wrong key. Then each section's own `problem`."""
    sections = list(sections_of(obj, prefix))
    for section, at in sections:
        problem = _rule_problem(section, at)
        if problem is not None:
            return problem
    for section, at in sections:
        check = getattr(section, "problem", None)
        problem = check(at) if check is not None else None
        if problem is not None:
            return problem
    return None


def _coerce_scalar(value: Any, hint: Any, source: str, key: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an integer literal beyond any float
                raise UserError(f"{source}: {key}: an integer of {value.bit_length()} bits is too "
                                "large for a number") from None
    elif hint is str:
        if isinstance(value, str):
            return value
    elif dataclasses.is_dataclass(hint):
        if isinstance(value, dict):
            return from_dict(hint, value, source, key + ".")
        raise UserError(f"{source}: {key}: expected a table of settings, got {value!r}")
    else:
        return value
    name = getattr(hint, "__name__", str(hint))
    raise UserError(f"{source}: {key}: {value!r} is not a valid {name}")


def coerce(value: Any, hint: Any, source: str, key: str) -> Any:
    """Check a parsed value against a dataclass field's type hint (ints widen to floats)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, source, key)
            except UserError:
                continue
        names = " or ".join(getattr(a, "__name__", str(a)) for a in args)
        raise UserError(f"{source}: {key}: {value!r} is not a valid value (expected {names})")
    return _coerce_scalar(value, hint, source, key)


def _unchecked(cls: type, kwargs: Mapping[str, Any]) -> Any:
    """An instance of `cls` with `kwargs` over its defaults, its __post_init__ not run: what a
    section that refuses bad values when built holds, for `first_problem` to name them."""
    obj = object.__new__(cls)
    for f in dataclasses.fields(cls):
        if f.name in kwargs:
            value = kwargs[f.name]
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = f.default
        object.__setattr__(obj, f.name, value)
    return obj


def from_dict(cls: type, values: Any, source: str, prefix: str = "") -> Any:
    """Build `cls` from nested plain values, naming `source` in every error.

    Only the types are checked here, so that a caller can build first and validate later
    (`first_problem`); a section that refuses bad values when built (a ValueError from its
    __post_init__) is refused in the words of its rules."""
    if not isinstance(values, Mapping):
        where = f"{source}: {prefix[:-1]}" if prefix else source
        raise UserError(f"{where}: expected a table of settings, got {values!r}"[:300])
    hints, tables = _hints(cls), _tables(cls)
    plain = {f.name for f in dataclasses.fields(cls) if not f.metadata.get("sections")}
    _refuse_moved(cls, values, source, prefix)
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if key in tables:
            name, section = tables[key]
            kwargs.setdefault(name, {})[key] = coerce(value, section, source, prefix + key)
        elif key in plain:
            kwargs[key] = coerce(value, hints[key], source, prefix + key)
        else:
            raise UserError(f"{source}: unknown key {prefix}{key}; known keys: "
                            f"{', '.join(_keys(cls))}")
    try:
        return cls(**kwargs)
    except ValueError as exc:  # a dataclass's own check
        problem = first_problem(_unchecked(cls, kwargs), prefix)
        if problem is not None:
            raise UserError(f"{source}: {problem}") from None
        raise UserError(f"{source}: {prefix[:-1] or 'settings'}: {exc}") from None


def _moved(cls: type, key: str, value: Any) -> str | None:
    """Where key `key` of `cls` (a class declaring `MOVED`, a ClassVar of old key -> new
    dotted key) went, or None: a key that is still a section's name moved only when its
    value is not a table (an earlier labavg's `averaging = "bmuf"`)."""
    new = getattr(cls, "MOVED", {}).get(key)
    current = key in {f.name for f in dataclasses.fields(cls)}
    if new is None or (current and isinstance(_hints(cls)[key], type)
                       and dataclasses.is_dataclass(_hints(cls)[key])
                       and isinstance(value, Mapping)):
        return None
    return new


def _refuse_moved(cls: type, values: Mapping[str, Any], source: str, prefix: str) -> None:
    """UserError in one line naming every key of `values` that has moved, and where to."""
    moved = [(key, new) for key, value in values.items()
             if (new := _moved(cls, key, value)) is not None]
    if moved:
        where = ", ".join(f"{prefix}{key} is now {prefix}{new}" for key, new in moved)
        raise UserError(f"{source}: settings have moved: {where}")


def load_toml(cls: type, path: str | Path) -> Any:
    """Parse a TOML file into `cls`. Errors name the file, and the line for syntax."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise UserError(f"{path}: line {line}: not UTF-8 (byte {raw[exc.start]:#04x}); "
                        "TOML files are UTF-8") from None
    try:
        values = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: not valid TOML: {exc}") from None
    return from_dict(cls, values, str(path))


def to_dict(obj: Any) -> dict[str, Any]:
    """Plain nested dict of a settings dataclass (JSON and TOML friendly, Nones kept); named
    sections become tables of their own at their field's place."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get("sections"):
            out.update({name: to_dict(section) for name, section in value.items()})
        elif dataclasses.is_dataclass(value):
            out[f.name] = to_dict(value)
        else:
            out[f.name] = value
    return out


def with_overrides(cfg: Any, overrides: dict[str, Any]) -> Any:
    """Return a copy of `cfg` with dotted keys (`model.hidden_dim`) replaced by values."""
    values = to_dict(cfg)
    for dotted, value in overrides.items():
        node = values
        *parents, leaf = dotted.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise UserError(_unknown_setting(cfg, dotted))
            node = node[part]
        if leaf not in node:
            raise UserError(_unknown_setting(cfg, dotted))
        node[leaf] = value
    return from_dict(type(cfg), values, "command line")


def _unknown_setting(cfg: Any, dotted: str) -> str:
    """The message for a dotted key `cfg` has not: where it moved, when it has."""
    cls, parts = type(cfg), dotted.split(".")
    for i, part in enumerate(parts):
        new = getattr(cls, "MOVED", {}).get(part)
        if new is not None and part not in {f.name for f in dataclasses.fields(cls)}:
            where = ".".join(parts[:i] + [new] + parts[i + 1:])
            try:
                field_of(type(cfg), where)
            except (KeyError, StopIteration):  # moved twice: a moved table's renamed key
                return _unknown_setting(cfg, where).replace(repr(where), repr(dotted))
            return f"setting {dotted!r} has moved: it is now {where!r}"
        try:
            cls = _section_class(cls, part)
        except KeyError:
            break
    return f"unknown setting {dotted!r}"


def _section_class(cls: type, part: str) -> type:
    tables = _tables(cls)
    if part in tables:
        return tables[part][1]
    return _hints(cls)[part]


def field_of(cls: type, dotted: str) -> dataclasses.Field:
    """The dataclass field of a dotted key of `cls` (`model.hidden_dim`); KeyError or
    StopIteration when there is none."""
    *parents, leaf = dotted.split(".")
    for part in parents:
        cls = _section_class(cls, part)
    return next(f for f in dataclasses.fields(cls)
                if f.name == leaf and not f.metadata.get("sections"))


def type_of(cls: type, dotted: str) -> Any:
    """The type hint of a dotted key of `cls` (`model.hidden_dim`: int)."""
    *parents, leaf = dotted.split(".")
    for part in parents:
        cls = _section_class(cls, part)
    return _hints(cls)[leaf]


def check_value(cls: type, key: str, value: Any) -> str | None:
    """What is wrong with `value` for the one setting `key` (dotted) of `cls`, or None.

    The words are validation's: "ranks must be positive; got 0". Only the setting's own
    rule is checked; what ties settings together needs the whole config. For a form that
    checks each box as it is typed."""
    try:
        f = field_of(cls, key)
    except (KeyError, StopIteration):
        return f"unknown setting {key!r}"
    hint = type_of(cls, key)
    rule = f.metadata["rule"]
    if value is None:
        if type(None) in typing.get_args(hint):
            return None
        return bad(key, rule.text, value) if rule is not None else f"{key} needs a value"
    try:
        value = coerce(value, hint, "setting", key)
    except UserError as exc:
        return str(exc).removeprefix("setting: ")
    if rule is not None and not rule.ok(value):
        return bad(key, rule.text, value)
    return None


@dataclass(frozen=True)
class Flag:
    """A command-line flag, generated from a setting's metadata."""

    flag: str
    key: str  # dotted key
    kind: type  # int, float, str; bool for a switch (store_true)
    help: str


def flags(cls: type) -> list[Flag]:
    """The flags of every setting of `cls` (and its sections) that declares one, in
    declaration order."""
    out: list[Flag] = []

    def walk(cls: type, prefix: str) -> None:
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            if f.metadata.get("sections"):
                for name, section in f.metadata["sections"]().items():
                    walk(section, f"{prefix}{name}.")
            elif dataclasses.is_dataclass(hint):
                walk(hint, f"{prefix}{f.name}.")
            elif f.metadata.get("flag"):
                kind = next(a for a in typing.get_args(hint) or (hint,) if a is not type(None))
                rule = f.metadata["rule"]
                text = f.metadata["help"]
                if rule is not None and rule.choices:
                    text += ": " + " | ".join(rule.choices)
                out.append(Flag(f.metadata["flag"], prefix + f.name, kind, text))

    walk(cls, "")
    return out
