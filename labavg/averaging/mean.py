"""Periodic model averaging (Su & Chen 2015, Sec. 2): every K minibatches each rank's
parameters are replaced by the mean over ranks, computed with ONE allreduce over one flat
buffer (or one run of a reduce algorithm over it, labavg.comm.reduce). This module only sees
an injected communicator.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from labavg.comm.base import Communicator, Done
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

    `divergence` is the ranks' RMS distance from the average relative to the RMS of the
    average, measured just before averaging: sqrt(mean over the finite ranks of
    ||W_i - W̄||²) / ||W̄||, the same on every finite rank, and each rank's own distance when
    two average (docs/averaging.md, "What a round costs"); 0 on a rank left out. `dropped`
    counts the ranks whose parameters were not finite and were left out of the mean (they take
    the average like everyone else); `finite` says whether this rank was one of them. `stop` is
    True when any rank asked to stop. `bytes_sent` is the size of the parameter buffer this
    rank put into the round's allreduce (4 x parameters in float32; 0 when nothing was
    averaged), or of its compressed change with a lossy payload
    (labavg.averaging.payload.payload_bytes), not counting the 24-byte control exchange: what
    a reduce algorithm or the allgather puts on the wire is a multiple of it.

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


# Squares are summed in float32 over rows of this many values, the rows' sums in float64: one
# pass like a dot product's, several times more precise than one (docs/averaging.md).
NORM_ROW = 128


def squared_norm(flat: torch.Tensor) -> float:
    """||flat||² in one pass, with no temporary of the buffer's size.

    Not finite exactly when a value of `flat` is not (or when a row's sum overflows float32,
    for values beyond about 1e17), so it doubles as the finiteness check (`finite_norm`).
    """
    whole = flat.numel() // NORM_ROW * NORM_ROW
    rows = torch.linalg.vector_norm(flat[:whole].view(-1, NORM_ROW), dim=1).double()
    tail = flat[whole:].double()
    return float(rows.dot(rows) + tail.dot(tail))


def finite_norm(flat: torch.Tensor) -> tuple[bool, float]:
    """(every value of `flat` is finite, ||flat||²) from one pass over it."""
    norm = squared_norm(flat)
    if math.isfinite(norm):
        return True, norm
    # A non-finite norm with finite values is an overflow: the exact check decides.
    return bool(torch.isfinite(flat).all()), norm


def agree(flat: torch.Tensor, comm: Communicator, stop: bool = False) -> tuple[bool, int, bool]:
    """(this rank's parameters are finite, how many ranks' are not, whether any wants to stop):
    the numbers every round exchanges, with the backend's own allreduce."""
    finite, _ = finite_norm(flat)
    control = _control(flat, finite, stop, 0.0)
    comm.allreduce_mean(control)
    return finite, round(control[0].item() * comm.size), control[1].item() > 0


def _control(flat: torch.Tensor, finite: bool, stop: bool, norm: float) -> torch.Tensor:
    # float64: the norms summed over ranks must keep the digits the divergence subtracts.
    return torch.tensor([0.0 if finite else 1.0, 1.0 if stop else 0.0, norm if finite else 0.0],
                        dtype=torch.float64, device=flat.device)


def average_parameters(
    flat: torch.Tensor,
    comm: Communicator,
    *,
    stop: bool = False,
    fallback: torch.Tensor | None = None,
    reduce: str = "allreduce",
) -> AverageStats:
    """Replace `flat` on every rank with the mean over ranks (in place).

    Besides the parameters, the ranks exchange three numbers (one tiny allreduce): how many of
    them hold non-finite parameters, whether any wants to stop, and the sum of their squared
    norms, for the divergence. A non-finite rank contributes zeros and the mean is taken over
    the finite ranks, so one diverged worker never poisons the averaged model. If no rank is
    finite, every rank restores `fallback` (the previous average) when given, else
    FloatingPointError is raised on every rank.

    Each rank knows its own finiteness before the mean, so the three numbers need not come
    first: with the backend's allreduce they travel in a non-blocking allreduce started just
    before it and waited for after it (one wait for both, where a second blocking collective
    costs a second meeting of the ranks). `reduce` picks how the parameters' mean is computed
    (labavg.comm.reduce.ALGORITHMS); with another algorithm than the backend's the numbers go
    first, through the backend's allreduce: their sum decides what every rank does next, so
    it must not wait on the algorithm it guards. Nothing of the buffer's size is allocated or
    copied (docs/averaging.md, "What a round costs").
    """
    start = time.perf_counter()
    finite, norm = finite_norm(flat)
    control = _control(flat, finite, stop, norm)
    overlapped = False
    if comm.size > 1 and reduce == "allreduce":
        pending = comm.iallreduce_mean(control)
        # An elastic communicator's reduction is a round of its own, done at once: there the
        # numbers come first, as with the algorithms, and its rounds stay as they were.
        overlapped = not isinstance(pending, Done)
    else:
        comm.allreduce_mean(control)
    # An elastic communicator's size is that of its latest reduction: the numbers' here.
    members = comm.size
    if overlapped:
        if not finite:
            flat.zero_()
        comm.allreduce_mean(flat)
        pending.wait()
    dropped, agreed_stop = round(control[0].item() * members), control[1].item() > 0
    if dropped == members:
        if fallback is None:
            raise FloatingPointError("the parameters of every rank are non-finite")
        flat.copy_(fallback)
        return AverageStats(0.0, time.perf_counter() - start, finite, dropped, agreed_stop)
    if members == 1:
        return AverageStats(0.0, time.perf_counter() - start, finite, dropped, agreed_stop)
    if not overlapped:
        if not finite:
            flat.zero_()
        reduce_mean(comm, flat, reduce)
    if dropped:
        flat.mul_(comm.size / (comm.size - dropped))
    seconds = time.perf_counter() - start
    divergence = 0.0
    if finite:
        divergence = _divergence(control[2].item() * members, comm.size - dropped, flat)
    return AverageStats(divergence, seconds, finite, dropped, agreed_stop,
                        flat.numel() * flat.element_size())


def _divergence(norms: float, ranks: int, average: torch.Tensor) -> float:
    """sqrt(mean_i ||W_i - W̄||²) / ||W̄|| from sum_i ||W_i||² over the `ranks` averaged:
    sum_i ||W_i - W̄||² = sum_i ||W_i||² - n ||W̄||² when W̄ is their mean."""
    average_norm = squared_norm(average)
    if average_norm == 0:
        return 0.0
    # Rounding can take a tiny difference below zero: the ranks then agree to the digits kept.
    return math.sqrt(max(norms / ranks - average_norm, 0.0) / average_norm)


def broadcast_parameters(flat: torch.Tensor, comm: Communicator, root: int = 0) -> None:
    """Give every rank `root`'s parameters, so all ranks start from the same model."""
    if comm.size > 1:
        comm.broadcast(flat, root=root)
