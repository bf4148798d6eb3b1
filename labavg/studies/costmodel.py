"""Speedup cost model for periodic model averaging (Su & Chen 2015, arXiv:1507.01239).

One epoch on p ranks = local SGD on frames/p frames + one Allreduce of all parameters every K
minibatches. Communication follows the alpha-beta (latency-bandwidth) model of Thakur,
Rabenseifner & Gropp, "Optimization of collective communication operations in MPICH" (IJHPCA
2005); compute is the 1-rank time per minibatch, slowed by a constant factor and a fixed
per-epoch overhead once more than one rank runs. `predict` applies the model to a labavg run's
own costs; fitting its free parameters to measurements (the paper's timing table, allreduce
times of a link) is labavg.studies.costfit. See docs/cost-model.md for the equations, fitted
values and assumptions.

Pure functions and frozen dataclasses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Literal, Sequence

from labavg.base.errors import UserError
from labavg.jobs.run_json import RunSummary, as_summary

Algorithm = Literal["ring", "recursive_doubling", "rabenseifner"]
ALGORITHMS: tuple[Algorithm, ...] = ("ring", "recursive_doubling", "rabenseifner")


# --------------------------------------------------------------------------- allreduce


def _is_pow2(p: int) -> bool:
    return p & (p - 1) == 0


def allreduce_coefficients(p: int, n_bytes: float,
                           algorithm: Algorithm = "rabenseifner") -> tuple[float, float]:
    """(a, b) such that one allreduce of `n_bytes` over `p` ranks takes a*alpha + b*beta seconds.

    alpha: seconds per message (latency); beta: seconds per byte (1 / bandwidth). The local
    reduction term (gamma) is left out: summing floats is far faster than moving them.
      ring:                2(p-1) alpha + 2(p-1)/p n beta
      recursive doubling:  lg p alpha + n lg p beta
      rabenseifner:        2 lg p alpha + 2(p-1)/p n beta  (reduce-scatter by recursive
                           halving, then allgather by recursive doubling)
    For p not a power of two, recursive doubling and Rabenseifner first fold the extra ranks
    onto their neighbours and send the result back at the end (MPICH's
    allreduce_intra_recursive_doubling.c / allreduce_intra_reduce_scatter_allgather.c): two more
    messages of n bytes on top of the cost for the largest power of two p' <= p.
    """
    if p < 1:
        raise UserError(f"ranks must be >= 1, got p={p}")
    if n_bytes < 0:
        raise UserError(f"n_bytes must be >= 0, got {n_bytes}")
    if algorithm not in ALGORITHMS:
        raise UserError(f"unknown allreduce algorithm {algorithm!r}; choose one of {ALGORITHMS}")
    if p == 1:
        return 0.0, 0.0
    if algorithm == "ring":
        return 2.0 * (p - 1), 2.0 * (p - 1) / p * n_bytes
    p2 = 1 << (p.bit_length() - 1)
    lg = math.log2(p2)
    fold = (0.0, 0.0) if _is_pow2(p) else (2.0, 2.0 * n_bytes)
    if algorithm == "recursive_doubling":
        return lg + fold[0], n_bytes * lg + fold[1]
    return 2.0 * lg + fold[0], 2.0 * (p2 - 1) / p2 * n_bytes + fold[1]


def allreduce_seconds(p: int, n_bytes: float, alpha: float, beta: float,
                      algorithm: Algorithm = "rabenseifner") -> float:
    """Alpha-beta time of one allreduce of `n_bytes` over `p` ranks (see allreduce_coefficients)."""
    a, b = allreduce_coefficients(p, n_bytes, algorithm)
    return a * alpha + b * beta


@dataclass(frozen=True)
class Network:
    """Latency alpha (s per message) and inverse bandwidth beta (s per byte) of an interconnect."""

    name: str
    alpha: float
    beta: float


# Assumptions, not measurements (docs/cost-model.md): MPI over TCP on 10 GbE reaches ~1.1 GB/s
# of the 1.25 GB/s line rate with ~50 us per message; an EDR InfiniBand-like fabric (100 Gb/s)
# ~11 GB/s with ~2 us per message.
TEN_GBE = Network("10GbE", alpha=50e-6, beta=1.0 / 1.1e9)
INFINIBAND = Network("InfiniBand-EDR-like", alpha=2e-6, beta=1.0 / 11e9)


# --------------------------------------------------------------------------- epoch time


@dataclass(frozen=True)
class EpochTime:
    """Seconds of one epoch on one rank: local compute plus averaging; total is their sum."""

    ranks: int
    compute_s: float
    comm_s: float
    rounds: float

    @property
    def total_s(self) -> float:
        """Wall-clock seconds of the epoch (compute and communication do not overlap)."""
        return self.compute_s + self.comm_s


def epoch_time(p: int, frames_per_epoch: float, minibatch: int, K: int,
               compute_per_minibatch_s: float, allreduce_s: float, *,
               parallel_slowdown: float = 0.0, fixed_overhead_s: float = 0.0) -> EpochTime:
    """Time of one epoch of `frames_per_epoch` frames on `p` ranks, averaging every `K` minibatches.

    Each rank runs frames/(p*minibatch) minibatches and frames/(p*minibatch*K) allreduces of
    `allreduce_s` seconds each (the allreduce time AT p ranks). Counts are kept fractional: on a
    real corpus there are thousands of rounds per epoch, so rounding is noise. For p > 1 the
    compute is multiplied by (1 + parallel_slowdown) and `fixed_overhead_s` is added: the
    per-rank cost of running in parallel (MPI process, shared PCIe/host, stragglers) and a part
    of the epoch that does not shrink with p. One rank runs plain SGD: no averaging at all.
    """
    if p < 1 or minibatch < 1 or K < 1:
        raise UserError(f"ranks, minibatch and K must be >= 1, got p={p}, minibatch={minibatch}, "
                        f"K={K}")
    steps = frames_per_epoch / (p * minibatch)
    if p == 1:
        return EpochTime(1, steps * compute_per_minibatch_s, 0.0, 0.0)
    rounds = steps / K
    compute = steps * compute_per_minibatch_s * (1.0 + parallel_slowdown) + fixed_overhead_s
    return EpochTime(p, compute, rounds * allreduce_s, rounds)


def speedup(p: int, frames_per_epoch: float, minibatch: int, K: int,
            compute_per_minibatch_s: float, allreduce_s: float, *,
            parallel_slowdown: float = 0.0, fixed_overhead_s: float = 0.0) -> float:
    """Wall-clock epoch time of one rank (plain SGD) over that of `p` ranks, comm included.

    The definition that reproduces Su & Chen's quoted speedups: read their "training time" as
    the whole epoch with the communication column a part of it, speedup = train(1) / train(N)
    (254.5 / 27.3 = 9.32; adding comm on top gives 8.05). Inferred, see docs/cost-model.md.
    """
    one = epoch_time(1, frames_per_epoch, minibatch, K, compute_per_minibatch_s, 0.0)
    many = epoch_time(p, frames_per_epoch, minibatch, K, compute_per_minibatch_s, allreduce_s,
                      parallel_slowdown=parallel_slowdown, fixed_overhead_s=fixed_overhead_s)
    return one.total_s / many.total_s


def dnn_num_params(input_dim: int, hidden: int, num_hidden: int, num_pdfs: int) -> int:
    """Weights and biases of a fully connected DNN input -> num_hidden x hidden -> num_pdfs."""
    return (input_dim * hidden + hidden + (num_hidden - 1) * (hidden * hidden + hidden)
            + hidden * num_pdfs + num_pdfs)


# --------------------------------------------------------------------------- labavg's own runs


@dataclass(frozen=True)
class MeasuredCosts:
    """Per-unit costs measured by a labavg run (one rank's view, rank 0)."""

    compute_per_minibatch_s: float
    allreduce_s: float  # per averaging round, at `ranks` ranks on the measuring machine
    num_params: int
    minibatch: int
    ranks: int
    frames_per_epoch: float
    bytes_per_param: int = 4  # labavg averages float32 parameters

    @property
    def n_bytes(self) -> float:
        """Bytes moved by one averaging allreduce (the flat parameter buffer)."""
        return float(self.num_params * self.bytes_per_param)


def from_summary(summary: RunSummary | Mapping[str, Any]) -> MeasuredCosts:
    """MeasuredCosts of a labavg run from its summary (labavg.jobs.run_json.RunSummary, or
    summary.json's object).

    compute per minibatch = compute_seconds / steps; allreduce = comm_seconds / averaging_rounds;
    frames per epoch = frames_trained / epochs (all ranks; short if the run stopped early).
    """
    s = as_summary(summary)
    need = {"compute_seconds": s.compute_seconds, "comm_seconds": s.comm_seconds,
            "steps": s.steps, "averaging_rounds": s.averaging_rounds,
            "num_params": s.num_params, "minibatch": s.minibatch, "ranks": s.ranks}
    missing = [k for k, v in need.items() if v is None]
    if missing:
        raise UserError(f"summary.json lacks {missing}: not a finished labavg run summary")
    steps, rounds = int(s.steps), int(s.averaging_rounds)
    if steps < 1:
        raise UserError(f"summary.json: steps={steps}, need at least one minibatch to measure "
                        "compute")
    if int(s.ranks) > 1 and rounds < 1:
        raise UserError(f"summary.json: averaging_rounds={rounds} with ranks={s.ranks}: "
                        "no allreduce was measured")
    ranks, minibatch = int(s.ranks), int(s.minibatch)
    frames = s.frames_trained or steps * minibatch * ranks
    epochs = s.epochs or 1
    return MeasuredCosts(
        compute_per_minibatch_s=float(s.compute_seconds) / steps,
        allreduce_s=float(s.comm_seconds) / max(rounds, 1),
        num_params=int(s.num_params),
        minibatch=minibatch,
        ranks=ranks,
        frames_per_epoch=float(frames) / float(epochs),
    )


@dataclass(frozen=True)
class Prediction:
    """Predicted epoch time, speedup and parallel efficiency for one (ranks, K, network)."""

    ranks: int
    K: int
    network: str
    compute_s: float
    comm_s: float
    speedup: float

    @property
    def total_s(self) -> float:
        """Predicted wall-clock seconds per epoch."""
        return self.compute_s + self.comm_s

    @property
    def efficiency(self) -> float:
        """Speedup / ranks (1 = ideal)."""
        return self.speedup / self.ranks


def predict(measured: MeasuredCosts, ranks: Sequence[int], *, Ks: Sequence[int] = (10, 20),
            network: Network = TEN_GBE, algorithm: Algorithm = "rabenseifner",
            local_overhead_s: float | None = None, parallel_slowdown: float = 0.0,
            fixed_overhead_s: float = 0.0) -> list[Prediction]:
    """Predict labavg's speedup on `network` for each p in `ranks` and K in `Ks`.

    One averaging round at p ranks costs local_overhead_s + allreduce_seconds(p, n_bytes, network).
    local_overhead_s defaults to the measured allreduce seconds per round: on one machine that is
    the flattening, the control allreduce and waiting for the slowest rank, which a cluster pays
    too (an over-estimate when the measuring run exchanged data between processes, since that
    exchange is then counted twice). The baseline is one rank running plain SGD.
    """
    local = measured.allreduce_s if local_overhead_s is None else local_overhead_s
    if local < 0 or any(p < 1 for p in ranks) or any(k < 1 for k in Ks):
        raise UserError(f"need local_overhead_s >= 0 and ranks, K >= 1; got {local}, "
                        f"{list(ranks)}, {list(Ks)}")
    out = []
    for K in Ks:
        base = epoch_time(1, measured.frames_per_epoch, measured.minibatch, K,
                          measured.compute_per_minibatch_s, 0.0)
        for p in ranks:
            a_s = 0.0 if p == 1 else local + allreduce_seconds(p, measured.n_bytes, network.alpha,
                                                               network.beta, algorithm)
            e = epoch_time(p, measured.frames_per_epoch, measured.minibatch, K,
                           measured.compute_per_minibatch_s, a_s,
                           parallel_slowdown=parallel_slowdown, fixed_overhead_s=fixed_overhead_s)
            out.append(Prediction(p, K, network.name, e.compute_s, e.comm_s,
                                  base.total_s / e.total_s))
    return out
