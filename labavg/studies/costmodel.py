"""Speedup cost model for periodic model averaging (Su & Chen 2015, arXiv:1507.01239).

One epoch on p ranks = local SGD on frames/p frames + one Allreduce of all parameters every K
minibatches. Communication follows the alpha-beta (latency-bandwidth) model of Thakur,
Rabenseifner & Gropp, "Optimization of collective communication operations in MPICH" (IJHPCA
2005); compute is the 1-rank time per minibatch, slowed by a constant factor and a fixed
per-epoch overhead once more than one rank runs. `fit_paper_table` fits the free parameters to
the paper's measured times; `fit_network` fits alpha and beta of a link to measured allreduce
times (benchmarks/bench_network.py); `predict` applies the model to a labavg run's own costs.
See docs/cost-model.md for the equations, fitted values and assumptions.

Pure functions and frozen dataclasses; numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import numpy as np

from labavg.base.errors import UserError

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


@dataclass(frozen=True)
class LinkSample:
    """One measured allreduce: `ranks` ranks, `n_bytes` per rank, median `seconds`."""

    ranks: int
    n_bytes: float
    seconds: float


@dataclass(frozen=True)
class LinkFit:
    """A Network fitted to measured allreduce times, and each sample next to the fit."""

    network: Network
    algorithm: Algorithm
    samples: tuple[LinkSample, ...]

    def fitted_seconds(self, sample: LinkSample) -> float:
        """The fitted model's time for `sample`'s ranks and bytes."""
        return allreduce_seconds(sample.ranks, sample.n_bytes, self.network.alpha,
                                 self.network.beta, self.algorithm)

    @property
    def errors_pct(self) -> tuple[float, ...]:
        """(fitted - measured) / measured per sample, in percent."""
        return tuple(100.0 * (self.fitted_seconds(s) - s.seconds) / s.seconds for s in self.samples)

    @property
    def rms_error_pct(self) -> float:
        """Root mean square of `errors_pct`."""
        errors = self.errors_pct
        return math.sqrt(sum(e * e for e in errors) / len(errors))

    @property
    def max_error_pct(self) -> float:
        """Largest |error| in percent."""
        return max(abs(e) for e in self.errors_pct)


def fit_network(name: str, samples: Sequence[LinkSample],
                algorithm: Algorithm = "rabenseifner") -> LinkFit:
    """alpha and beta of a link from measured allreduce times, by least squares.

    Each sample gives one equation `a(p, n) alpha + b(p, n) beta = seconds` with the
    coefficients of `allreduce_coefficients`; rows are divided by the measured time, so the
    fit minimises relative error (a 4 KB and a 32 MB allreduce count alike), and alpha, beta
    are kept >= 0. Needs samples at two or more distinct byte counts with p > 1.
    """
    samples = tuple(samples)
    if any(s.ranks < 2 or s.n_bytes < 0 or not s.seconds > 0 for s in samples):
        raise UserError("each sample needs ranks >= 2, n_bytes >= 0 and seconds > 0")
    if len({(s.ranks, s.n_bytes) for s in samples}) < 2:
        raise UserError(f"need samples at two or more sizes to fit alpha and beta, got "
                        f"{len(samples)}")
    coef = np.array([allreduce_coefficients(s.ranks, s.n_bytes, algorithm) for s in samples])
    seconds = np.array([s.seconds for s in samples])
    alpha, beta = _nonneg_lstsq(coef / seconds[:, None], np.ones_like(seconds))
    return LinkFit(Network(name, float(alpha), float(beta)), algorithm, samples)


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


# --------------------------------------------------------------------------- the paper's table


@dataclass(frozen=True)
class TableRow:
    """One row of a times-per-epoch table: ranks, whole-epoch minutes, communication minutes."""

    ranks: int
    train_min: float  # wall-clock per epoch, communication included
    comm_min: float


@dataclass(frozen=True)
class Setup:
    """What the table's runs had in common."""

    frames_per_epoch: float
    minibatch: int
    K: int
    n_bytes: float


def dnn_num_params(input_dim: int, hidden: int, num_hidden: int, num_pdfs: int) -> int:
    """Weights and biases of a fully connected DNN input -> num_hidden x hidden -> num_pdfs."""
    return (input_dim * hidden + hidden + (num_hidden - 1) * (hidden * hidden + hidden)
            + hidden * num_pdfs + num_pdfs)


# Su & Chen 2015, time per epoch by GPU count: 300 h Switchboard, averaging every 10 minibatches of 1024 frames.
PAPER_TABLE: tuple[TableRow, ...] = (
    TableRow(1, 254.5, 0.0),
    TableRow(2, 183.4, 19.9),
    TableRow(4, 96.0, 12.9),
    TableRow(8, 51.0, 7.62),
    TableRow(16, 27.3, 4.31),
)
PAPER_SPEEDUPS = {(16, 10): 9.32, (16, 20): 10.07, (32, 10): 17.0}
# Assumed: 300 h at 100 frames/s; DNN 440-6x2048-9000 (the paper says ~9000 pdfs) in float32.
PAPER_SETUP = Setup(frames_per_epoch=300 * 3600 * 100, minibatch=1024, K=10,
                    n_bytes=4 * dnn_num_params(440, 2048, 6, 9000))


@dataclass(frozen=True)
class FitRow:
    """A table row next to the fitted model's value; residual = model - measured (minutes)."""

    ranks: int
    train_min: float
    comm_min: float
    model_train_min: float
    model_comm_min: float

    @property
    def train_residual_min(self) -> float:
        """Model minus measured whole-epoch minutes."""
        return self.model_train_min - self.train_min

    @property
    def comm_residual_min(self) -> float:
        """Model minus measured communication minutes."""
        return self.model_comm_min - self.comm_min


@dataclass(frozen=True)
class CostFit:
    """Fitted parameters of the cost model and how well they reproduce the table."""

    algorithm: Algorithm
    setup: Setup
    alpha: float  # s per message
    beta: float  # s per byte
    compute_per_minibatch_s: float  # from the 1-rank row
    parallel_slowdown: float
    fixed_overhead_s: float
    rows: tuple[FitRow, ...]

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """1 / beta: the effective allreduce bandwidth the fit implies."""
        return math.inf if self.beta == 0 else 1.0 / self.beta


def _nonneg_lstsq(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0, by trying every set of free variables (A has 2-3 columns)."""
    n = A.shape[1]
    best, best_err = np.zeros(n), float(np.sum(y**2))
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        x_sub = np.linalg.lstsq(A[:, cols], y, rcond=None)[0]
        if np.any(x_sub < 0):
            continue
        x = np.zeros(n)
        x[cols] = x_sub
        err = float(np.sum((A @ x - y) ** 2))
        if err < best_err - 1e-15 * max(best_err, 1.0):
            best, best_err = x, err
    return best


def fit_table(table: Sequence[TableRow], setup: Setup,
              algorithm: Algorithm = "rabenseifner") -> CostFit:
    """Fit alpha, beta, parallel_slowdown and fixed_overhead_s to `table` by least squares.

    The 1-rank row gives the compute per minibatch exactly. The parameters separate:
      comm(p)  = rounds(p) [a(p) alpha + b(p) beta]                       -> alpha, beta
      train(p) - comm(p) = (1 + eta) T1 / p + fixed   (p > 1)             -> eta, fixed
    Each is a 2-unknown linear least-squares problem with non-negative unknowns; rows are
    weighted by 1/measured so that the 2-rank row (largest times) does not dominate.
    Under recursive doubling every message carries all n bytes, so only alpha + n*beta is
    identifiable (lstsq then returns one of the equivalent splits).
    """
    rows = sorted(table, key=lambda r: r.ranks)
    ones = [r for r in rows if r.ranks == 1]
    many = [r for r in rows if r.ranks > 1]
    if len(ones) != 1 or len(many) < 2:
        raise UserError("the table needs exactly one 1-rank row and at least two others, got "
                        f"ranks "
                        f"{[r.ranks for r in rows]}")
    t1 = ones[0].train_min * 60.0
    steps1 = setup.frames_per_epoch / setup.minibatch
    t_mb = t1 / steps1
    ps = np.array([r.ranks for r in many], dtype=float)
    comm = np.array([r.comm_min for r in many]) * 60.0
    compute = np.array([r.train_min for r in many]) * 60.0 - comm
    rounds = setup.frames_per_epoch / (ps * setup.minibatch * setup.K)

    coef = np.array([allreduce_coefficients(int(p), setup.n_bytes, algorithm) for p in ps])
    A_comm = rounds[:, None] * coef / comm[:, None]
    alpha, beta = _nonneg_lstsq(A_comm, np.ones_like(comm))

    A_comp = np.stack([t1 / ps, np.ones_like(ps)], axis=1) / compute[:, None]
    scale, fixed = _nonneg_lstsq(A_comp, np.ones_like(compute))
    eta = scale - 1.0

    fit_rows = []
    for r in rows:
        a_s = allreduce_seconds(r.ranks, setup.n_bytes, alpha, beta, algorithm)
        e = epoch_time(r.ranks, setup.frames_per_epoch, setup.minibatch, setup.K, t_mb, a_s,
                       parallel_slowdown=eta, fixed_overhead_s=fixed)
        fit_rows.append(FitRow(r.ranks, r.train_min, r.comm_min, e.total_s / 60.0, e.comm_s / 60.0))
    return CostFit(algorithm, setup, float(alpha), float(beta), t_mb, float(eta), float(fixed),
                   tuple(fit_rows))


def fit_paper_table(algorithm: Algorithm = "rabenseifner") -> CostFit:
    """`fit_table` on Su & Chen's time-per-epoch table (PAPER_TABLE) under PAPER_SETUP."""
    return fit_table(PAPER_TABLE, PAPER_SETUP, algorithm)


def fitted_epoch_time(fit: CostFit, p: int, K: int | None = None) -> EpochTime:
    """Epoch time the fitted model predicts for `p` ranks averaging every `K` (default: table's)."""
    s = fit.setup
    a_s = allreduce_seconds(p, s.n_bytes, fit.alpha, fit.beta, fit.algorithm)
    return epoch_time(p, s.frames_per_epoch, s.minibatch, s.K if K is None else K,
                      fit.compute_per_minibatch_s, a_s,
                      parallel_slowdown=fit.parallel_slowdown, fixed_overhead_s=fit.fixed_overhead_s)


def fitted_speedup(fit: CostFit, p: int, K: int | None = None) -> float:
    """Speedup (Su & Chen's definition, see `speedup`) the fitted model predicts for `p` ranks."""
    return fitted_epoch_time(fit, 1).total_s / fitted_epoch_time(fit, p, K).total_s


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


def from_summary(summary: dict[str, Any]) -> MeasuredCosts:
    """MeasuredCosts of a labavg run from its summary.json dict (labavg/jobs/runs.py: make_summary).

    compute per minibatch = compute_seconds / steps; allreduce = comm_seconds / averaging_rounds;
    frames per epoch = frames_trained / epochs (all ranks; short if the run stopped early).
    """
    need = ("compute_seconds", "comm_seconds", "steps", "averaging_rounds", "num_params",
            "minibatch", "ranks")
    missing = [k for k in need if summary.get(k) is None]
    if missing:
        raise UserError(f"summary.json lacks {missing}: not a finished labavg run summary")
    steps, rounds = int(summary["steps"]), int(summary["averaging_rounds"])
    if steps < 1:
        raise UserError(f"summary.json: steps={steps}, need at least one minibatch to measure "
                        "compute")
    if int(summary["ranks"]) > 1 and rounds < 1:
        raise UserError(f"summary.json: averaging_rounds={rounds} with ranks={summary['ranks']}: "
                        "no allreduce was measured")
    ranks, minibatch = int(summary["ranks"]), int(summary["minibatch"])
    frames = summary.get("frames_trained") or steps * minibatch * ranks
    epochs = summary.get("epochs") or 1
    return MeasuredCosts(
        compute_per_minibatch_s=float(summary["compute_seconds"]) / steps,
        allreduce_s=float(summary["comm_seconds"]) / max(rounds, 1),
        num_params=int(summary["num_params"]),
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
