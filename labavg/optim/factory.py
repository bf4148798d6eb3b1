"""Builds an optimizer from its name (the CLI's --optimizer)."""

from __future__ import annotations

from typing import Any

from torch import nn

from labavg.optim.settings import OPTIMIZERS
from labavg.base.errors import UserError
from labavg.optim.base import Optimizer


def make_optimizer(name: str, model: nn.Module, **kw: Any) -> Optimizer:
    """`SGD` for "sgd", `NGSGD` for "ngsgd"; `kw` goes to its constructor."""
    if name == "sgd":
        from labavg.optim.sgd import SGD

        return SGD(model, **kw)
    if name == "ngsgd":
        from labavg.optim.ngsgd import NGSGD

        return NGSGD(model, **kw)
    raise UserError(f"unknown optimizer {name!r}; choose one of: {', '.join(OPTIMIZERS)}")
