"""Settings from and to plain values: `from_dict` builds a settings dataclass (declared with
labavg.base.schema) from nested plain values (TOML, config.json) and `to_dict` turns it back,
`load_toml` reads a file, `with_overrides` replaces dotted keys (`--set`, a form's boxes), and
`check_value` judges one value for one key. Files are parsed, never executed. Errors are
UserErrors naming the file or key.

A settings object built here remembers where each of its values was read from (`sources_of`:
the file, the flag, `--set KEY=VALUE`), so that validation, which runs once on the merged
settings, names the file or flag of the value it refuses (`first_named_problem`, `named`).
Imports no torch.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
import types
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from labavg.base.errors import UserError
from labavg.base.schema import (bad, field_of, first_broken, first_problem, named_tables,
                                section_class, table_keys, type_hints, type_of)

# Where a built settings object keeps the sources of its values: not a field, so that to_dict,
# config.json and equality never see it.
_SOURCES = "_labavg_sources"


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
    hints, tables = type_hints(cls), named_tables(cls)
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
                            f"{', '.join(table_keys(cls))}")
    try:
        built = cls(**kwargs)
    except ValueError as exc:  # a dataclass's own check
        problem = first_problem(_unchecked(cls, kwargs), prefix)
        if problem is not None:
            raise UserError(f"{source}: {problem}") from None
        raise UserError(f"{source}: {prefix[:-1] or 'settings'}: {exc}") from None
    if not prefix:
        _remember(built, {key: source for key in _leaves(values)})
    return built


def _moved(cls: type, key: str, value: Any) -> str | None:
    """Where key `key` of `cls` (a class declaring `MOVED`, a ClassVar of old key -> new
    dotted key) went, or None: a key that is still a section's name moved only when its
    value is not a table (an earlier labavg's `averaging = "bmuf"`)."""
    new = getattr(cls, "MOVED", {}).get(key)
    current = key in {f.name for f in dataclasses.fields(cls)}
    if new is None or (current and isinstance(type_hints(cls)[key], type)
                       and dataclasses.is_dataclass(type_hints(cls)[key])
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


def with_overrides(cfg: Any, overrides: dict[str, Any],
                   sources: Mapping[str, str] | None = None) -> Any:
    """Return a copy of `cfg` with dotted keys (`model.hidden_dim`) replaced by values.

    `sources` names where each key was given ("--lr", "--set lr=1"): an error about a key
    names it, and the copy remembers it for validation (`sources_of`); a key given without
    one forgets where its old value came from."""
    values, given = to_dict(cfg), sources_of(cfg)
    for dotted, value in overrides.items():
        source = (sources or {}).get(dotted)
        node = values
        *parents, leaf = dotted.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise UserError(_at(source, _unknown_setting(cfg, dotted)))
            node = node[part]
        if leaf not in node:
            raise UserError(_at(source, _unknown_setting(cfg, dotted)))
        _check_type(type(cfg), dotted, value, source)
        node[leaf] = value
        given = {k: v for k, v in given.items() if k != dotted and not k.startswith(dotted + ".")}
        if source is not None:
            given.update({key: source for key in _leaves({dotted: value})})
    out = from_dict(type(cfg), values, "settings")
    _remember(out, given)
    return out


def _check_type(cls: type, dotted: str, value: Any, source: str | None) -> None:
    """UserError (naming `source`, when known) unless `value` has the type of key `dotted` of
    `cls` (a table's keys, types and values for a table)."""
    *parents, leaf = dotted.split(".")
    for part in parents:
        cls = section_class(cls, part)
    hint = section_class(cls, leaf)
    try:
        if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
            from_dict(hint, value, source or "-", dotted + ".")
        else:
            coerce(value, hint, source or "-", dotted)
    except UserError as exc:
        if source is not None:
            raise
        raise UserError(str(exc).removeprefix("-: ")) from None


def _at(source: str | None, message: str) -> str:
    return message if source is None else f"{source}: {message}"


def _leaves(values: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """The dotted keys of the values (not tables) in nested plain values."""
    for key, value in values.items():
        if isinstance(value, Mapping):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield prefix + str(key)


def _remember(obj: Any, sources: dict[str, str]) -> None:
    object.__setattr__(obj, _SOURCES, sources)


def sources_of(cfg: Any) -> dict[str, str]:
    """Where each value of `cfg` was read from, by dotted key ({"lr": "run.toml", "epochs":
    "--epochs"}); a value left at its default or set by code has none."""
    return dict(getattr(cfg, _SOURCES, {}))


def named(cfg: Any, message: str, key: str | None = None) -> str:
    """`message` about setting `key` of `cfg` after the file or flag its value came from; for
    a message about several settings (key None), after the sources of those it names."""
    found = sources_of(cfg)
    keys = [key] if key is not None else [
        k for k in found if re.search(rf"(?<![\w.]){re.escape(k)}(?![\w]|\.\w)", message)]
    where = list(dict.fromkeys(found[k] for k in keys if k in found))
    return f"{', '.join(where)}: {message}" if where else message


def first_named_problem(cfg: Any) -> str | None:
    """The first broken rule of `cfg` (schema.first_broken), named with where its value came
    from; None when every value is good."""
    found = first_broken(cfg)
    return None if found is None else named(cfg, found[1], found[0])


def _unknown_setting(cfg: Any, dotted: str) -> str:
    """The message for a dotted key `cfg` has not: where it moved, when it has."""
    cls, parts = type(cfg), dotted.split(".")
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(cls):  # `lr.x`: a path through a value
            return f"unknown setting {dotted!r}: {'.'.join(parts[:i])} is a value, not a table"
        new = getattr(cls, "MOVED", {}).get(part)
        if new is not None and part not in {f.name for f in dataclasses.fields(cls)}:
            where = ".".join(parts[:i] + [new] + parts[i + 1:])
            try:
                field_of(type(cfg), where)
            except (KeyError, StopIteration):  # moved twice: a moved table's renamed key
                return _unknown_setting(cfg, where).replace(repr(where), repr(dotted))
            return f"setting {dotted!r} has moved: it is now {where!r}"
        try:
            cls = section_class(cls, part)
        except KeyError:
            break
    return f"unknown setting {dotted!r}"


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
