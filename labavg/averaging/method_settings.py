"""The built-in averaging methods' own tables, [averaging.bmuf] and [averaging.diloco]
(labavg.averaging.methods runs them; labavg.averaging.registry declares them with these). Apart
from labavg.averaging.settings because the registry reads them and that section reads the
registry. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from labavg.base.settings import FINITE_POSITIVE, real, setting


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
