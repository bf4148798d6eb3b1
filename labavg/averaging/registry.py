"""The averaging methods a run can choose: each one class and one declaration here.

A method is
- its class, an `Averager` subclass (labavg.averaging.methods, or a module of its own) that
  imports torch and is imported only when an averager is made (labavg.averaging.factory);
- its declaration, one `Method(...)` entry of METHODS below, with the dataclass of its
  `[averaging.<method>]` table above it when it has settings. Nothing here imports torch.

The declaration is all the rest of the house reads of a method, so that the command line can
list, check and refuse settings without importing torch (tests/test_startup.py):
- `method`, the `averaging.method` setting's value, and the choices of `--averaging`;
- `help`, its line in `labavg train --help`;
- `settings`, the dataclass of its table: the schema's `[averaging.<method>]`, `--set
  averaging.<method>.<key>=...`, `cfg.averaging.table()`, and the class's `config` argument;
- `knob`, the field of that table the dashboard's method box sets (dashboard.settings), or
  None: the box is greyed out for it;
- `label` and `short`, its names in the report's tables (Beyond), and
  `outer_bytes_per_parameter`, the state it keeps besides the model (estimate_memory);
- `where`, its class as "module:Class".

A method kept outside labavg (a notebook's, a test's toy) may instead declare the same names
as class attributes and decorate its class with `@register`; it is then known to the process
that imported it (docs/averaging.md, "Adding a method").
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from labavg.base.schema import FINITE_POSITIVE, real, setting


@dataclass(frozen=True)
class Method:
    """One averaging method as the schema, CLI, dashboard and tables see it (module
    docstring); `where` is its class, or "module:Class" for a class imported only when an
    averager is made."""

    method: str
    help: str
    where: str | type
    settings: type | None = None
    knob: str | None = None
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

    def knob_key(self) -> str | None:
        """The dotted setting of the dashboard's method box for this method, or None."""
        return None if self.knob is None else f"averaging.{self.method}.{self.knob}"


@dataclass(frozen=True)
class BMUFConfig:
    """Blockwise model-update filtering (Chen & Huo 2016; labavg.averaging.methods.BMUFAverager,
    docs/averaging.md): the [averaging.bmuf] table.

    Each round's change of the averaged model is filtered with block momentum before it is
    applied; a steady change is amplified by block_lr / (1 - momentum) in the long run, which
    is N, the factor plain averaging divides the workers' summed progress by, when momentum is
    1 - 1/N. The default 0.9 is that for N = 10, between the 2 and 32 workers a lab runs. The
    gain does what Su & Chen's N x learning rate does (lr_scaling = "linear"): with both, the
    factors multiply (docs/averaging.md).
    """

    momentum: float = setting(0.9, "block momentum (0: plain averaging; 1 - 1/ranks gives a "
                              "long-run gain of ranks)", real(0, 1, high_open=True))
    block_lr: float = setting(1.0, "block learning rate: the share of each round's change "
                              "applied", FINITE_POSITIVE)
    nesterov: bool = setting(True, "Nesterov block momentum: workers start each block from the "
                             "global model plus momentum x the filtered update")


@dataclass(frozen=True)
class DiLoCoConfig:
    """DiLoCo's outer optimizer (Douillard et al. 2023, the paper's values): SGD with Nesterov
    momentum on the outer gradient, the global model minus the average: the [averaging.diloco] table
    (labavg.averaging.methods.DiLoCoAverager)."""

    outer_lr: float = setting(0.7, "outer learning rate (1 with momentum 0: plain averaging)",
                              FINITE_POSITIVE)
    momentum: float = setting(0.9, "outer momentum", real(0, 1, high_open=True))
    nesterov: bool = setting(True, "Nesterov outer momentum (torch.optim.SGD's form)")


_HERE = "labavg.averaging.methods"
# The built-in methods, in the order the tables list them.
METHODS: dict[str, Method] = {m.method: m for m in (
    Method("model", "plain average, the paper", f"{_HERE}:Averager",
           label="model (the paper's)", short="model"),
    Method("bmuf", "block momentum, [averaging.bmuf] table", f"{_HERE}:BMUFAverager", BMUFConfig,
           "momentum", "BMUF", "BMUF",
           outer_bytes_per_parameter=2 * 4),  # the filtered update, the block's starting model
    Method("diloco", "outer Nesterov SGD, [averaging.diloco] table", f"{_HERE}:DiLoCoAverager",
           DiLoCoConfig, "momentum", "DiLoCo", "DiLoCo",
           outer_bytes_per_parameter=2 * 4),  # the momentum and the outer gradient
)}


def register(cls: Any) -> Any:
    """Add averaging method `cls` under its `method` name (a class decorator, for a method
    kept outside labavg), declared by its class attributes `help` and, optionally,
    `settings`, `knob`, `label`, `short` and `outer_bytes_per_parameter`."""
    name = cls.method
    known = METHODS.get(name)
    if known is not None and not known.names(cls):
        where = known.where if isinstance(known.where, str) else known.where.__qualname__
        raise ValueError(f"averaging method {name!r} is already registered ({where})")
    if known is None:
        METHODS[name] = Method(name, cls.help, cls, getattr(cls, "settings", None),
                               getattr(cls, "knob", None), getattr(cls, "label", name),
                               getattr(cls, "short", name),
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
