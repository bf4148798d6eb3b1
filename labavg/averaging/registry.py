"""The averaging methods a run can choose: each one class, registered once.

A method is an `Averager` subclass (labavg.averaging.methods) that declares, as class
attributes, its `method` name (the `averaging` setting), its `settings` section (a dataclass
read from the `[<method>]` table, or None), its `help` line, its `label` and `short` names for
the report's tables, and the `outer_bytes_per_parameter` of state it keeps besides the model
(the memory model). `@register` adds it here; from then on the settings schema, the CLI's
flags, the dashboard's form, `labavg info` and the Beyond tables know it.

This module imports no torch: the built-in methods (which do) are imported the first time
the registry is read (`methods`), not when the settings are imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

METHODS: dict[str, Any] = {}
_BUILT_IN = "labavg.averaging.methods"


def register(cls: Any) -> Any:
    """Add averaging method `cls` under its `method` name (a class decorator)."""
    name = cls.method
    if METHODS.get(name, cls) is not cls:
        raise ValueError(f"averaging method {name!r} is already registered "
                         f"({METHODS[name].__qualname__})")
    METHODS[name] = cls
    return cls


def unregister(name: str) -> None:
    """Forget method `name` (a test's toy method)."""
    del METHODS[name]


def methods() -> dict[str, Any]:
    """Every registered method by name, the built-in ones first."""
    importlib.import_module(_BUILT_IN)  # registers model, bmuf and diloco once
    return METHODS


def method_names() -> tuple[str, ...]:
    return tuple(methods())


def method_sections() -> dict[str, type]:
    """The settings section of each method that has one, by method name (its TOML table)."""
    return {name: cls.settings for name, cls in methods().items() if cls.settings is not None}


class MethodTable(Mapping[str, Any]):
    """A live table of the registered methods: name -> `what(method class)`, in registration
    order; a method registered later is in it too (for the tables that list methods)."""

    def __init__(self, what: Callable[[Any], Any]) -> None:
        self._what = what

    def __getitem__(self, name: str) -> Any:
        return self._what(methods()[name])

    def __iter__(self) -> Iterator[str]:
        return iter(list(methods()))

    def __len__(self) -> int:
        return len(methods())
