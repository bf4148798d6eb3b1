"""Periodic model averaging (Su & Chen 2015, Sec. 2): every K minibatches each rank's
parameters are replaced by the mean over ranks, computed with ONE allreduce over one flat
buffer. This module only sees an injected communicator.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from labavg.comm.base import Communicator


def flatten_parameters(modules: list[nn.Module]) -> torch.Tensor:
    """Move every parameter of `modules` into one flat contiguous buffer and return it.

    Afterwards each parameter is a view into the buffer, so averaging needs no gather or
    scatter copies: one allreduce on the buffer updates the model in place. Gradients are
    untouched. The buffer takes the dtype and device of the first parameter.
    """
    params = [p for m in modules for p in m.parameters()]
    if not params:
        raise ValueError("nothing to flatten: the modules have no parameters")
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        n = p.numel()
        p.data = flat[offset : offset + n].view_as(p)
        offset += n
    return flat


@dataclass(frozen=True)
class AverageStats:
    """One averaging round seen from one rank.

    `divergence` is this rank's RMS distance from the average relative to the RMS of the
    average, measured just before averaging. `finite` is False when some rank's parameters
    were not finite: then nobody's parameters were changed.
    """

    divergence: float
    comm_seconds: float
    finite: bool = True


def average_parameters(flat: torch.Tensor, comm: Communicator) -> AverageStats:
    """Replace `flat` on every rank with the mean over ranks (in place)."""
    if comm.size == 1:
        return AverageStats(divergence=0.0, comm_seconds=0.0)
    before = flat.clone()
    start = time.perf_counter()
    comm.allreduce_mean(flat)
    seconds = time.perf_counter() - start
    avg_norm = torch.linalg.vector_norm(flat).item()
    dist = torch.linalg.vector_norm(before - flat).item()
    divergence = dist / avg_norm if avg_norm > 0 else 0.0
    return AverageStats(divergence=divergence, comm_seconds=seconds)


def broadcast_parameters(flat: torch.Tensor, comm: Communicator, root: int = 0) -> None:
    """Give every rank `root`'s parameters, so all ranks start from the same model."""
    if comm.size > 1:
        comm.broadcast(flat, root=root)
