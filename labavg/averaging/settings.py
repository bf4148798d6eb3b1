"""The averaging layer's settings: what a round sends (labavg.averaging.payload), whether it
overlaps compute (labavg.averaging.overlap), the [hierarchy] section
(labavg.averaging.hierarchy), the built-in methods' sections ([bmuf], [diloco];
labavg.averaging.methods) and the plan the factory builds a run's averager from. Imports no
torch: the registry (labavg.averaging.registry) declares the methods with these sections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from labavg.base.settings import FINITE_POSITIVE, integer, real, setting

# What a round sends (labavg.averaging.payload, docs/averaging.md): the fp32 parameters (the paper), or
# their change since the last round in 16 bits or as integer codes of PAYLOAD_BITS bits.
PAYLOADS = ("fp32", "bf16", "fp16", "int")
PAYLOAD_BITS = (4, 8, 16)
# Whether a round's mean runs while the next minibatches compute (labavg.averaging.overlap).
OVERLAP = ("none", "eager", "streaming")


@dataclass(frozen=True)
class BMUFConfig:
    """Blockwise model-update filtering (Chen & Huo 2016; labavg.averaging.methods.BMUFAverager,
    docs/averaging.md): the [bmuf] table.

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
    momentum on the outer gradient, the global model minus the average: the [diloco] table
    (labavg.averaging.methods.DiLoCoAverager)."""

    outer_lr: float = setting(0.7, "outer learning rate (1 with momentum 0: plain averaging)",
                              FINITE_POSITIVE)
    momentum: float = setting(0.9, "outer momentum", real(0, 1, high_open=True))
    nesterov: bool = setting(True, "Nesterov outer momentum (torch.optim.SGD's form)")


@dataclass(frozen=True)
class HierarchyConfig:
    """Hierarchical averaging (labavg.averaging.hierarchy.HierarchicalAverager, docs/averaging.md): the
    ranks of a node average every K minibatches (`average_every`), all ranks every `every`."""

    every: int = setting(0, "minibatches between averaging rounds across nodes, a multiple of "
                         "average_every (0: no hierarchy, every round across all ranks)", integer(0))
    node_size: int = setting(0, "ranks per node (0: the ranks sharing a host's memory; inproc "
                             "needs a number)", integer(0))

    def problem_with(self, k: int, k_name: str, backend: str, size: int | None) -> str | None:
        """What is wrong with these settings for a run averaging every `k` minibatches
        (`k_name` says where K comes from) on `backend` with `size` ranks (None: not known
        yet), or None."""
        if self.every % k:
            return f"hierarchy.every = {self.every} is not a multiple of {k_name}"
        if self.node_size == 0 and backend == "inproc":
            return ("hierarchy.node_size = 0 (the hosts' shared-memory groups) cannot be told on "
                    "backend 'inproc', whose ranks are threads of one process: set "
                    "hierarchy.node_size")
        if size is not None and self.node_size > 0 and size % self.node_size:
            return f"hierarchy.node_size = {self.node_size} does not divide the {size} ranks"
        return None


@dataclass(frozen=True)
class AveragingPlan:
    """What `labavg.averaging.factory.make_averager` builds a run's averager from: the plain
    values of the run's settings, and the chosen method's own section (None for a method
    without one)."""

    method: str
    every: int  # K
    reduce: str = "allreduce"
    payload: str = "fp32"
    bits: int = 8
    error_feedback: bool = True
    method_settings: Any = None
    hierarchy: HierarchyConfig = HierarchyConfig()
    overlap: str = "none"
    fragments: int = 1  # overlap = streaming: fragments of the model, one synced per round
