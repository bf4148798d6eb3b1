"""JSON files read back as untrusted input: a file may be damaged (a crash mid-copy, a disk
error, a hand edit) or hostile. `load_json` turns every way a file can be bad into one
UserError naming the file; `check_fields` names the first field of the wrong type, so that
a reader formats only values of the type it expects. `strict_json` is JSON for other
programs: no bare NaN or Infinity, which Python writes and strict parsers refuse.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from labavg.base.errors import UserError

# The files read this way are a few kilobytes; anything far larger is not one (nor read whole).
MAX_BYTES = 16 << 20
# They nest three levels; deeper nesting is refused before the parser recurses.
MAX_DEPTH = 32


class DamagedFile(UserError):
    """A JSON file that cannot be used; the message names the file (and the field)."""


def load_json(path: Path) -> Any:
    """The JSON value in `path`; FileNotFoundError when it is missing, DamagedFile when it
    cannot be read or is not JSON of sane size and depth."""
    path = Path(path)
    try:
        # Non-blocking, so that a FIFO planted in its place is refused instead of waited on.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise DamagedFile(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            kind = "a directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "not a regular file"
            raise DamagedFile(f"{path}: {kind}, not a JSON file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise DamagedFile(f"cannot read {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        raise DamagedFile(f"{path}: larger than {MAX_BYTES >> 20} MB, not one labavg writes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DamagedFile(f"{path}: binary data, not JSON (byte {exc.start} is "
                          f"{data[exc.start]:#04x})") from None
    if nesting_depth(text) > MAX_DEPTH:
        raise DamagedFile(f"{path}: JSON nested more than {MAX_DEPTH} levels deep, "
                          f"not one labavg writes")
    try:
        return json.loads(text)
    except ValueError as exc:
        raise DamagedFile(f"{path}: not valid JSON ({exc})") from None


def nesting_depth(text: str) -> int:
    """The deepest bracket nesting of a JSON text (brackets inside strings count too: an
    over-estimate only refuses files no run writes)."""
    depth = deepest = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                break
        elif ch in "]}":
            depth -= 1
    return deepest


NUMBER = "a number"
INT = "an integer"
TEXT = "a string"
PAIR = "a list of two numbers"
PAIRS = "a list of pairs of numbers"
OBJECT = "an object"
FLAG = "true or false"
INTS = "a list of integers"
NUMBERS_BY_NAME = "an object of numbers"  # each of its fields checked as NUMBER, by name


def _is(value: Any, kind: str) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == NUMBER:
        return number
    if kind == INT:  # 5.0 is one; an int of 400 digits too, and no float holds it
        return number and (isinstance(value, int) or value.is_integer())
    if kind == TEXT:
        return isinstance(value, str)
    if kind == FLAG:
        return isinstance(value, bool)
    if kind in (OBJECT, NUMBERS_BY_NAME):
        return isinstance(value, dict)
    if kind == PAIRS:
        return isinstance(value, list) and all(_is(v, PAIR) for v in value)
    if kind == INTS:
        return isinstance(value, list) and all(_is(v, INT) for v in value)
    return (isinstance(value, list) and len(value) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value))


def _type_name(value: Any) -> str:
    names = {str: "a string", list: "a list", dict: "an object", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return names.get(type(value), type(value).__name__)


def check_fields(values: Any, fields: dict[str, str], path: Path, what: str,
                 prefix: str = "") -> dict[str, Any]:
    """`values` if it is an object whose named fields (dotted for nested ones) have their
    types; DamagedFile naming the file and the first bad field (after `prefix`) otherwise."""
    if not isinstance(values, dict):
        raise DamagedFile(f"{path}: not a labavg {what} (JSON holding {_type_name(values)}, "
                          f"expected an object)")
    for dotted, kind in fields.items():
        value: Any = values
        for part in dotted.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if kind == NUMBERS_BY_NAME and isinstance(value, dict):
            check_fields(value, {k: NUMBER for k in value}, path, what, f"{dotted}.")
            continue
        if value is not None and not _is(value, kind):
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            raise DamagedFile(f"{path}: field {prefix + dotted!r} is {_type_name(value)} ({shown}), "
                              f"expected {kind}")
    return values




def strict_json(value: Any, **kwargs: Any) -> str:
    """`value` as JSON any parser reads: a NaN or infinite number (a diverged run's loss, a
    damaged file's figure) is null."""
    return json.dumps(_finite(value), allow_nan=False, **kwargs)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value
