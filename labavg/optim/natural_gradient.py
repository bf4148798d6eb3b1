"""Kaldi's online natural-gradient preconditioner (OnlineNaturalGradient): the Fisher estimate
of one side of an affine layer, and the preconditioning of that side's rows with it.

Follows src/nnet3/natural-gradient-online.{h,cc} (class OnlineNaturalGradient, current Kaldi
master) and the paper: D. Povey, X. Zhang, S. Khudanpur, "Parallel training of DNNs with
Natural Gradient and Parameter Averaging", arXiv:1410.7455, Sec. 3.5 and Appendix C. Equation
tags like (eqn:Zt) are those of the long comment in natural-gradient-online.h.

For each affine layer two Fisher-matrix factors are estimated online, one for the inputs X
(with a 1 appended for the bias) and one for the output derivatives dY, each of the form

    F_t = R_t^T D_t R_t + rho_t I,     R_t: R x D with orthonormal rows,

and the optimizer (labavg.optim.ngsgd) updates with both. Big (N x D) products run on the
model's device in its dtype; the small R x R algebra (Z_t, its eigendecomposition, A_t, re-orthogonalisation) runs on the CPU
in float64, as Kaldi does it on the CPU (in double for Z_t).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from labavg.optim.settings import NGConfig
from labavg.optim.fisher_update import FisherJob, FisherState, compute_beta, compute_et, update_fishers
from labavg.optim.max_change import row_sq_norms

_F64 = torch.float64
_CPU = torch.device("cpu")


class Preconditioned(NamedTuple):
    """Output of `precondition_directions`: X_hat (not yet times `scale`), gamma_t as a 0-d
    tensor, the squared row norms of X_hat, and the estimate to commit if the step is kept.
    `x_hat_one` is X_hat's column for the appended 1 (`precondition_with_one` only).

    From `start_precondition`, `scale` is None (`gamma` gives it from `tr_x` and `tr_hat`,
    tr(X X^T) and tr(X_hat X_hat^T)) and, on an updating minibatch, `state` is the estimate
    not yet updated and `job` what `finish_updates` needs to update it."""

    x_hat: torch.Tensor
    scale: torch.Tensor | None
    row_sq: torch.Tensor
    state: FisherState
    x_hat_one: torch.Tensor | None = None
    tr_x: torch.Tensor | None = None
    tr_hat: torch.Tensor | None = None
    job: FisherJob | None = None


def is_updating(t: int, cfg: NGConfig) -> bool:
    """Kaldi's Updating(): every minibatch at first, then every update_period-th."""
    return t <= cfg.num_initial_updates or (t - cfg.num_initial_updates) % cfg.update_period == 0


def gamma(tr_x: torch.Tensor, tr_hat: torch.Tensor) -> torch.Tensor:
    """gamma_t = sqrt(tr(X X^T) / tr(X_hat X_hat^T)), 1 where either trace is 0 (elementwise,
    so a stack of traces gives every estimate's at once)."""
    return torch.where((tr_x > 0) & (tr_hat > 0), torch.sqrt(tr_x / tr_hat), 1.0)


def init_orthonormal_special(rank: int, dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """InitOrthonormalSpecial (current Kaldi): orthonormal rows with no zero row or column.

    Row r has entries at columns r, r + rank, r + 2 rank, ...: the first is 1.1, the others
    1.0, all times 1 / sqrt(1.1^2 + n_r - 1) for the row's n_r entries; the rows stay
    orthonormal because their supports are disjoint. E.g. rank 2, dim 5:
    [1.1, 0, 1, 0, 1] / sqrt(3.21) and [0, 1.1, 0, 1, 0] / sqrt(2.21).

    Why 1.1 and not 1: symmetry breaking. Kaldi's comment: no weighted sum of the rows
    should be all ones, because the derivative in that direction can be zero in some
    architectures (here: softmax output derivatives, rows summing to zero) and forces an
    inefficient renormalization. With 1.0 everywhere that direction also stays in the learned
    subspace for good (J_t = H_t^T X_t has no component along it, so the power method never
    moves it out), wasting one of the R directions on a zero eigenvalue, and the output side
    drifts between float32 and float64 (~7e-3 against ~3e-6 with 1.1; tests/test_ngsgd.py).
    """
    first_elem = 1.1
    cols = torch.arange(dim)
    rows = cols % rank
    counts = torch.bincount(rows, minlength=rank).to(_F64)
    normalizer = (first_elem**2 + counts - 1.0).rsqrt()
    values = normalizer[rows]
    values[:rank] *= first_elem  # column r < rank is the first entry of row r (rank <= dim)
    R = torch.zeros(rank, dim, dtype=_F64)
    R[rows, cols] = values
    return R.to(device=device, dtype=dtype)


def init_default(dim: int, rank: int, cfg: NGConfig, dtype: torch.dtype, device: torch.device) -> FisherState:
    """InitDefault: rho = d_ii = epsilon, W = E^{1/2} R with e_ii = 1/(2 + (D+R) alpha / D)."""
    e_tii = 1.0 / (2.0 + (dim + rank) * cfg.alpha / dim)
    W = init_orthonormal_special(rank, dim, dtype, device) * math.sqrt(e_tii)
    d = torch.full((rank,), cfg.epsilon, dtype=_F64)
    return FisherState(W=W, d=d, rho=cfg.epsilon, t=0)


def effective_rank(rank: int, dim: int) -> int:
    """InitDefault: a rank >= D is cut to D - 1."""
    return min(rank, dim - 1)


def init_state(X0: torch.Tensor, rank: int, cfg: NGConfig) -> FisherState:
    """Init(): a few power-method updates on the first minibatch from InitDefault's start
    (3, or 1 if the minibatch has no more rows than the rank)."""
    num_rows, dim = X0.shape
    state = init_default(dim, rank, cfg, X0.dtype, X0.device)._replace(t=1)  # t=1: no recursion
    num_init_iters = 1 if num_rows <= rank else 3
    for _ in range(num_init_iters):
        state = precondition_directions(X0, state, rank, cfg, need_output=False).state
    return state._replace(t=0)


def append_one(X: torch.Tensor) -> torch.Tensor:
    """[X, 1]: the input with nnet2's column of ones for the bias."""
    return F.pad(X, (0, 1), value=1.0)


def _fisher_job(J: torch.Tensor, H: torch.Tensor, tr_X: torch.Tensor, state: FisherState) -> FisherJob:
    """The device half of an update: L_t and K_t to the CPU in float64 (J_t is given so that
    a caller appending a column of ones to X analytically need not build [X, 1])."""
    num_rows, dim = H.shape[0], J.shape[1]
    if num_rows > dim:
        # L_t = W_t J_t^T and K_t = J_t J_t^T in one product (Kaldi's compute_lk_together).
        LK = torch.cat([state.W, J]) @ J.T
    else:
        LK = torch.cat([H.T @ H, J @ J.T])  # L_t = H_t^T H_t, K_t = J_t J_t^T
    return FisherJob(state, J, LK.to(_CPU, _F64), tr_X, num_rows, state.t + 1)


def start_precondition(
    X: torch.Tensor,
    state: FisherState,
    rank: int,
    cfg: NGConfig,
    *,
    with_one: bool,
    need_output: bool = True,
    overwrite: bool = False,
) -> Preconditioned:
    """`precondition_directions` of X, or of [X, 1] when `with_one`, without building [X, 1],
    and with its Fisher update left to `finish_updates` (`job`) and gamma to `gamma`.
    `overwrite`: X_hat is written into X (no copy of X; for a caller that owns X).

    With W = [W_x, w_1] (the last column belongs to the 1): H = X W_x^T + 1 w_1^T,
    X_hat = [X - H W_x, 1 - H w_1], tr([X,1][X,1]^T) = tr(X X^T) + N and J = [H^T X, H^T 1].
    """
    num_rows, dim_x = X.shape
    dim = dim_x + 1 if with_one else dim_x
    if dim == 1:
        # a 1-dim space: NG with rescaling is a no-op (Kaldi's special case); zero traces
        # give gamma 1
        full = append_one(X) if with_one else X
        zero = torch.zeros((), dtype=X.dtype, device=X.device)
        return Preconditioned(X, None, row_sq_norms(full), state._replace(t=state.t + 1),
                              full[:, -1] if with_one else None, zero, zero)
    rank = effective_rank(rank, dim)
    if state.t == 0 or state.W is None:
        state = init_state(append_one(X) if with_one else X, rank, cfg)
    W = state.W
    tr_X_t = torch.linalg.vector_norm(X).square()
    # H_t = [X, 1] W_t^T (N x R), computed as its transpose W_t [X, 1]^T: MKL runs the
    # skinny product 15-25 % faster so (R 20: 135 -> 104 us at N 256, D 512) with the same
    # bits; H is made contiguous again (N R floats) so that what follows rounds as before.
    if with_one:
        W_x, w_1 = W[:, :dim_x], W[:, dim_x]
        H = torch.addmm(w_1[:, None], W_x, X.T).T.contiguous()
        tr_X_t = tr_X_t + num_rows
    else:
        W_x, w_1 = W, None
        H = (W @ X.T).T.contiguous()
    job = None
    if is_updating(state.t, cfg):
        J = H.T @ X  # J_t = H_t^T X_t  (R x D)
        if with_one:
            J = torch.cat([J, H.sum(0)[:, None]], dim=1)
        job = _fisher_job(J, H, tr_X_t, state)
    next_state = state._replace(t=state.t + 1)
    if not need_output:
        return Preconditioned(X, None, tr_X_t, next_state, None, tr_X_t, tr_X_t, job)
    # X_hat_t = X_t - H_t W_t
    X_hat = X.addmm_(H, W_x, alpha=-1.0) if overwrite else torch.addmm(X, H, W_x, alpha=-1.0)
    row_sq = row_sq_norms(X_hat)
    x_hat_one = None
    if with_one:
        one = torch.ones((), dtype=X.dtype, device=X.device)
        x_hat_one = torch.addmv(one, H, w_1, alpha=-1.0)  # 1 - H_t w_1
        row_sq = torch.addcmul(row_sq, x_hat_one, x_hat_one)
    return Preconditioned(X_hat, None, row_sq, next_state, x_hat_one, tr_X_t, row_sq.sum(), job)


def finish_updates(results: Sequence[Preconditioned], cfg: NGConfig) -> list[FisherState]:
    """The estimates to commit for `start_precondition`'s results: those of updating
    minibatches updated together (labavg.optim.fisher_update), the others as they are."""
    jobs = [r.job for r in results if r.job is not None]
    updated = iter(update_fishers(jobs, cfg)) if jobs else iter(())
    return [next(updated) if r.job is not None else r.state for r in results]


def _precondition(X: torch.Tensor, state: FisherState, rank: int, cfg: NGConfig, *,
                  with_one: bool, need_output: bool = True) -> Preconditioned:
    """`start_precondition` finished: the estimate updated, gamma computed."""
    result = start_precondition(X, state, rank, cfg, with_one=with_one, need_output=need_output)
    (next_state,) = finish_updates([result], cfg)
    return result._replace(scale=gamma(result.tr_x, result.tr_hat), state=next_state, job=None)


def precondition_directions(
    X: torch.Tensor,
    state: FisherState,
    rank: int,
    cfg: NGConfig,
    *,
    need_output: bool = True,
) -> Preconditioned:
    """PreconditionDirections: X_hat = beta_t X G_t^{-1} = X - X W^T W  (eqn:pt2), with
    G_t = F_t + alpha/D tr(F_t) I, and gamma_t = sqrt(tr(X X^T) / tr(X_hat X_hat^T)) so that
    gamma_t X_hat has X's Frobenius norm. Pure: returns the next estimate (t + 1, updated
    when `is_updating`) without touching `state`. Initialises from X when state.t == 0."""
    return _precondition(X, state, rank, cfg, with_one=False, need_output=need_output)


def precondition_with_one(X: torch.Tensor, state: FisherState, rank: int, cfg: NGConfig) -> Preconditioned:
    """`precondition_directions` of [X, 1] (nnet2 appends a 1 so the bias is preconditioned
    too) without materialising it: `x_hat` is X_hat's first D columns, `x_hat_one` its last;
    `row_sq`, `scale` and the estimate are those of the full [X, 1]."""
    return _precondition(X, state, rank, cfg, with_one=True)


class OnlineNaturalGradient:
    """One online Fisher estimate (Kaldi's class of the same name), e.g. a layer's input side."""

    def __init__(self, rank: int, config: NGConfig) -> None:
        self.rank = rank
        self.config = config
        self.state = FisherState(W=None, d=None, rho=config.epsilon, t=0)

    def precondition(self, X: torch.Tensor) -> Preconditioned:
        """Precondition the rows of X (N x D); `commit` the result to keep its estimate."""
        return precondition_directions(X, self.state, self.rank, self.config)

    def commit(self, result: Preconditioned) -> None:
        """Adopt the estimate computed by `precondition`."""
        self.state = result.state

    def fisher(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(R_t, diag D_t, rho_t) in float64 on the CPU: F_t = R^T diag(d) R + rho I."""
        W, d, rho = self.state.W, self.state.d, self.state.rho
        if W is None:
            raise ValueError("the Fisher estimate is not initialised yet")
        beta = compute_beta(rho, d, W.shape[1], self.config.alpha)
        _, _, inv_sqrt_e = compute_et(d, beta)
        return inv_sqrt_e[:, None] * W.to(_CPU, _F64), d.clone(), rho

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only: t, rho and (once initialised) W and d."""
        s = self.state
        out = {"t": torch.tensor(s.t, dtype=torch.int64), "rho": torch.tensor(s.rho, dtype=_F64)}
        if s.W is not None:
            out["W"] = s.W.detach().clone()
            out["d"] = s.d.clone()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor], device: torch.device) -> None:
        """Restore from `state_dict`, putting W on `device`."""
        W = state.get("W")
        d = state.get("d")
        self.state = FisherState(
            W=None if W is None else W.to(device).clone(),
            d=None if d is None else d.to(_CPU, _F64).clone(),
            rho=float(state["rho"]),
            t=int(state["t"]),
        )
