"""Declaring settings, and reading the declarations: a setting is a dataclass field whose
metadata (`setting`) holds its help text, its rule (choices, bounds) and, for the common ones,
its command-line flag. A section is a dataclass of settings; it lives next to the code it
configures, and may tie its fields together in a `problem(prefix)` method (the first broken
cross-field rule, named with the section's dotted prefix, or None). A composite holds sections
as fields, or as a `sections=` field: a mapping of named sections whose names are chosen at run
time (each a table of its own in TOML).

This module knows no section, and no values from outside: `first_problem` checks every field's
rule, then every section's `problem`; `field_of` and `type_of` find a dotted key's declaration,
`flags` lists the flags. Turning plain values (TOML, config.json, `--set`) into settings and
back is labavg.base.settings. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


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


def type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def named_tables(cls: type) -> dict[str, tuple[str, type]]:
    """The named sections of `cls`'s `sections=` fields: table name -> (field, dataclass)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("sections"):
            out.update({name: (f.name, section) for name, section in f.metadata["sections"]().items()})
    return out


def table_keys(cls: type) -> list[str]:
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


def _rule_problem(obj: Any, prefix: str) -> tuple[str, str] | None:
    for f in dataclasses.fields(obj):
        rule, value = f.metadata.get("rule"), getattr(obj, f.name)
        if rule is not None and value is not None and not rule.ok(value):
            return prefix + f.name, bad(prefix + f.name, rule.text, value)
    return None


def first_broken(obj: Any, prefix: str = "") -> tuple[str | None, str] | None:
    """(dotted key, message) of the first broken rule of `obj` and its sections, or None;
    the key is None for a section's `problem`, which ties several keys together.

    Single values first, in every section: a cross-field message about a value that is
    itself bad would point at the wrong key. Then each section's own `problem`."""
    sections = list(sections_of(obj, prefix))
    for section, at in sections:
        found = _rule_problem(section, at)
        if found is not None:
            return found
    for section, at in sections:
        check = getattr(section, "problem", None)
        problem = check(at) if check is not None else None
        if problem is not None:
            return None, problem
    return None


def first_problem(obj: Any, prefix: str = "") -> str | None:
    """The message of `first_broken`, or None."""
    found = first_broken(obj, prefix)
    return None if found is None else found[1]


def section_class(cls: type, part: str) -> type:
    """The class of table `part` of `cls`; KeyError when `cls` has no such key, or is a value
    (`lr.x`: lr is a float, not a table)."""
    if not dataclasses.is_dataclass(cls):
        raise KeyError(part)
    tables = named_tables(cls)
    if part in tables:
        return tables[part][1]
    return type_hints(cls)[part]


def field_of(cls: type, dotted: str) -> dataclasses.Field:
    """The dataclass field of a dotted key of `cls` (`model.hidden_dim`); KeyError or
    StopIteration when there is none."""
    *parents, leaf = dotted.split(".")
    for part in parents:
        cls = section_class(cls, part)
    if not dataclasses.is_dataclass(cls):
        raise KeyError(leaf)
    return next(f for f in dataclasses.fields(cls)
                if f.name == leaf and not f.metadata.get("sections"))


def type_of(cls: type, dotted: str) -> Any:
    """The type hint of a dotted key of `cls` (`model.hidden_dim`: int)."""
    *parents, leaf = dotted.split(".")
    for part in parents:
        cls = section_class(cls, part)
    if not dataclasses.is_dataclass(cls):
        raise KeyError(leaf)
    return type_hints(cls)[leaf]


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
        hints = type_hints(cls)
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
