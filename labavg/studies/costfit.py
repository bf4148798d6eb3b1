"""Fitting the cost model (labavg.studies.costmodel) to measurements: alpha and beta of a link
to its allreduce times (benchmarks/bench_network.py), and every free parameter to Su & Chen's
time-per-epoch table (2015, arXiv:1507.01239), with the fitted model's epoch times and speedups.
See docs/cost-model.md for the fitted values.

Least squares with non-negative unknowns (numpy); pure functions and frozen dataclasses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from labavg.base.errors import UserError
from labavg.studies.costmodel import (Algorithm, EpochTime, Network, allreduce_coefficients,
                                      allreduce_seconds, dnn_num_params, epoch_time)


# --------------------------------------------------------------------------- a link's allreduce times


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

