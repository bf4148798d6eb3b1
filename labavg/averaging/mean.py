"""Periodic model averaging (Su & Chen 2015, Sec. 2): every K minibatches each rank's
parameters are replaced by the mean over ranks, computed with ONE allreduce over one flat
buffer (or one run of a reduce algorithm over it, labavg.comm.reduce). This module only sees
an injected communicator.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from labavg.comm.base import Communicator
from labavg.comm.reduce import reduce_mean


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
    average, measured just before averaging. `dropped` counts the ranks whose parameters were
    not finite and were left out of the mean (they take the average like everyone else);
    `finite` says whether this rank was one of them. `stop` is True when any rank asked to stop.
    `bytes_sent` is the size of the parameter buffer this rank put into the round's allreduce
    (4 x parameters in float32; 0 when nothing was averaged), or of its compressed change with
    a lossy payload (labavg.averaging.payload.payload_bytes), not counting the 16-byte control exchange:
    what a reduce algorithm or the allgather puts on the wire is a multiple of it.

    The rest is zero (False) for a blocking round across all ranks. `within_node` marks a round
    among this rank's node only (labavg.averaging.hierarchy). An overlapped round
    (labavg.averaging.overlap) says what its non-blocking mean cost: `overlap_seconds`, the part
    of `comm_seconds` spent on it (waiting for the one in flight, the control allreduce and the
    start of the next), and `overlap_bytes`, the part of `bytes_sent` started non-blocking;
    `wait_seconds` is the time inside the wait alone and `in_flight_seconds` the wall time from
    the start of that mean to the end of its wait, the minibatches computed meanwhile included.
    """

    divergence: float
    comm_seconds: float
    finite: bool = True
    dropped: int = 0
    stop: bool = False
    bytes_sent: int = 0
    within_node: bool = False
    overlap_seconds: float = 0.0
    overlap_bytes: int = 0
    wait_seconds: float = 0.0
    in_flight_seconds: float = 0.0


def agree(flat: torch.Tensor, comm: Communicator, stop: bool = False) -> tuple[bool, int, bool]:
    """(this rank's parameters are finite, how many ranks' are not, whether any wants to stop):
    the two numbers every round exchanges first, with the backend's own allreduce."""
    finite = bool(torch.isfinite(flat).all())
    control = torch.tensor([0.0 if finite else 1.0, 1.0 if stop else 0.0], dtype=torch.float64)
    comm.allreduce_mean(control)
    return finite, round(control[0].item() * comm.size), control[1].item() > 0


def average_parameters(
    flat: torch.Tensor,
    comm: Communicator,
    *,
    stop: bool = False,
    fallback: torch.Tensor | None = None,
    reduce: str = "allreduce",
) -> AverageStats:
    """Replace `flat` on every rank with the mean over ranks (in place).

    Before the parameters, the ranks exchange two numbers (one tiny allreduce): how many of
    them hold non-finite parameters, and whether any wants to stop. A non-finite rank
    contributes zeros and the mean is taken over the finite ranks, so one diverged worker
    never poisons the averaged model. If no rank is finite, every rank restores `fallback`
    (the previous average) when given, else FloatingPointError is raised on every rank.

    `reduce` picks how the parameters' mean is computed (labavg.comm.reduce.ALGORITHMS). The
    two numbers always go through the backend's own allreduce: 16 bytes, where any algorithm
    costs its latency alone, and their sum decides what every rank does next, so it must not
    wait on the algorithm it guards.
    """
    start = time.perf_counter()
    finite, dropped, agreed_stop = agree(flat, comm, stop)
    if dropped == comm.size:
        if fallback is None:
            raise FloatingPointError("the parameters of every rank are non-finite")
        flat.copy_(fallback)
        return AverageStats(0.0, time.perf_counter() - start, finite, dropped, agreed_stop)
    if comm.size == 1:
        return AverageStats(0.0, time.perf_counter() - start, finite, dropped, agreed_stop)
    if not finite:
        flat.zero_()
    before = flat.clone()
    reduce_mean(comm, flat, reduce)
    if dropped:
        flat.mul_(comm.size / (comm.size - dropped))
    seconds = time.perf_counter() - start
    divergence = 0.0
    if finite:
        avg_norm = torch.linalg.vector_norm(flat).item()
        dist = torch.linalg.vector_norm(before - flat).item()
        divergence = dist / avg_norm if avg_norm > 0 else 0.0
    return AverageStats(divergence, seconds, finite, dropped, agreed_stop,
                        flat.numel() * flat.element_size())


def broadcast_parameters(flat: torch.Tensor, comm: Communicator, root: int = 0) -> None:
    """Give every rank `root`'s parameters, so all ranks start from the same model."""
    if comm.size > 1:
        comm.broadcast(flat, root=root)
