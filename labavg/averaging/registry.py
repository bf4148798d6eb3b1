"""The averaging methods a run can choose, declared apart from the classes that run them.

A method's declaration (`Method`) is what the rest of the house shows of it: its `method`
name (the `averaging.method` setting), its `settings` section (a dataclass read from the
`[averaging.<method>]` table, or None), its `help` line, its `label` and `short` names for
the report's tables, and the `outer_bytes_per_parameter` of state it keeps besides the model
(the memory model). The
settings schema, the CLI's flags and help, the dashboard's form, `labavg info` and the Beyond
tables read only declarations; the class, an `Averager` subclass that imports torch, is looked
up when an averager is made (`labavg.averaging.factory`). So the command line can list, check
and refuse settings without importing torch (tests/test_startup.py).

The built-in methods are declared below by the module and class that implement them. A new
method is one class with those names as class attributes, added with `@register`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from labavg.averaging.method_settings import BMUFConfig, DiLoCoConfig


@dataclass(frozen=True)
class Method:
    """One averaging method as the schema, CLI and tables see it; `where` is its class, or
    "module:Class" for a class imported only when an averager is made."""

    method: str
    help: str
    where: str | type
    settings: type | None = None
    label: str = ""
    short: str = ""
    outer_bytes_per_parameter: int = 0

    def averager_class(self) -> type:
        """The class that runs this method (importing its module, and torch, the first time)."""
        if not isinstance(self.where, str):
            return self.where
        module, _, name = self.where.partition(":")
        return getattr(importlib.import_module(module), name)

    def names(self, cls: type) -> bool:
        """Whether `cls` is this method's class (without importing a declared one)."""
        return self.where is cls or self.where == f"{cls.__module__}:{cls.__qualname__}"


_HERE = "labavg.averaging.methods"
# The built-in methods, in the order the tables list them.
METHODS: dict[str, Method] = {m.method: m for m in (
    Method("model", "plain average, the paper", f"{_HERE}:Averager",
           label="model (the paper's)", short="model"),
    Method("bmuf", "block momentum, [averaging.bmuf] table", f"{_HERE}:BMUFAverager", BMUFConfig,
           "BMUF", "BMUF", outer_bytes_per_parameter=2 * 4),  # the filtered update, the block's
    Method("diloco", "outer Nesterov SGD, [averaging.diloco] table", f"{_HERE}:DiLoCoAverager",
           DiLoCoConfig, "DiLoCo", "DiLoCo",
           outer_bytes_per_parameter=2 * 4),  # the momentum and the outer gradient
)}


def register(cls: Any) -> Any:
    """Add averaging method `cls` under its `method` name (a class decorator), declared by its
    class attributes `help` and, optionally, `settings`, `label`, `short` and
    `outer_bytes_per_parameter`."""
    name = cls.method
    known = METHODS.get(name)
    if known is not None and not known.names(cls):
        where = known.where if isinstance(known.where, str) else known.where.__qualname__
        raise ValueError(f"averaging method {name!r} is already registered ({where})")
    if known is None:
        METHODS[name] = Method(name, cls.help, cls, getattr(cls, "settings", None),
                               getattr(cls, "label", name), getattr(cls, "short", name),
                               getattr(cls, "outer_bytes_per_parameter", 0))
    return cls


def unregister(name: str) -> None:
    """Forget method `name` (a test's toy method)."""
    del METHODS[name]


def methods() -> dict[str, Method]:
    """Every registered method's declaration by name, the built-in ones first."""
    return METHODS


def method_names() -> tuple[str, ...]:
    return tuple(METHODS)


def method_sections() -> dict[str, type]:
    """The settings section of each method that has one, by method name (its TOML table)."""
    return {name: m.settings for name, m in METHODS.items() if m.settings is not None}


class MethodTable(Mapping[str, Any]):
    """A live table of the registered methods: name -> `what(declaration)`, in registration
    order; a method registered later is in it too (for the tables that list methods)."""

    def __init__(self, what: Callable[[Method], Any]) -> None:
        self._what = what

    def __getitem__(self, name: str) -> Any:
        return self._what(METHODS[name])

    def __iter__(self) -> Iterator[str]:
        return iter(list(METHODS))

    def __len__(self) -> int:
        return len(METHODS)
