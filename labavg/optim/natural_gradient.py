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
from typing import NamedTuple

import torch
import torch.nn.functional as F

from labavg.optim.settings import NGConfig
from labavg.optim.max_change import row_sq_norms

_F64 = torch.float64
_CPU = torch.device("cpu")


class FisherState(NamedTuple):
    """One Fisher estimate: W_t = E_t^{1/2} R_t (device), D_t's diagonal d (CPU float64),
    rho_t, and t, the number of minibatches preconditioned (0: not yet initialised)."""

    W: torch.Tensor | None
    d: torch.Tensor | None
    rho: float
    t: int


class Preconditioned(NamedTuple):
    """Output of `precondition_directions`: X_hat (not yet times `scale`), gamma_t as a 0-d
    tensor, the squared row norms of X_hat, and the estimate to commit if the step is kept.
    `x_hat_one` is X_hat's column for the appended 1 (`precondition_with_one` only)."""

    x_hat: torch.Tensor
    scale: torch.Tensor
    row_sq: torch.Tensor
    state: FisherState
    x_hat_one: torch.Tensor | None = None


def eta(num_rows: int, cfg: NGConfig) -> float:
    """Forgetting rate eta = 1 - exp(-N / num_samples_history), capped (Kaldi's Eta())."""
    return min(1.0 - math.exp(-num_rows / cfg.num_samples_history), cfg.max_eta)


def is_updating(t: int, cfg: NGConfig) -> bool:
    """Kaldi's Updating(): every minibatch at first, then every update_period-th."""
    return t <= cfg.num_initial_updates or (t - cfg.num_initial_updates) % cfg.update_period == 0


def compute_et(d: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ComputeEt: e_ii = 1 / (beta / d_ii + 1) (eqn:tii); returns e, e^{1/2}, e^{-1/2}."""
    e = 1.0 / (beta / d + 1.0)
    sqrt_e = e.sqrt()
    return e, sqrt_e, 1.0 / sqrt_e


def compute_beta(rho: float, d: torch.Tensor, dim: int, alpha: float) -> float:
    """beta_t = rho_t (1 + alpha) + alpha/D tr(D_t)  (eqn:betat2)."""
    return rho * (1.0 + alpha) + alpha * float(d.sum()) / dim


def compute_zt(
    num_rows: int,
    rho: float,
    d: torch.Tensor,
    inv_sqrt_e: torch.Tensor,
    K: torch.Tensor,
    L: torch.Tensor,
    eta_t: float,
) -> torch.Tensor:
    """ComputeZt (eqn:Zt), in float64: Z_t = Y_t Y_t^T expressed through K_t and L_t."""
    d_rho = d + rho  # diag(D_t + rho_t I)
    eta_n = eta_t / num_rows
    eta1 = 1.0 - eta_t
    K = 0.5 * (K + K.T)
    L = 0.5 * (L + L.T)
    outer = inv_sqrt_e[:, None] * inv_sqrt_e[None, :]
    EKE = K * outer  # E^{-1/2} K E^{-1/2}
    ELE = L * outer  # E^{-1/2} L E^{-1/2}
    Z = eta_n**2 * EKE + eta_n * eta1 * (ELE * d_rho[None, :] + d_rho[:, None] * ELE)
    return Z + torch.diag(eta1**2 * d_rho**2)


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


def compute_wt1(
    num_rows: int,
    d: torch.Tensor,
    d1: torch.Tensor,
    rho: float,
    rho1: float,
    U: torch.Tensor,
    sqrt_c: torch.Tensor,
    inv_sqrt_e: torch.Tensor,
    W: torch.Tensor,
    J: torch.Tensor,
    eta_t: float,
    alpha: float,
) -> torch.Tensor:
    """ComputeWt1: W_{t+1} = A_t B_t with
    A_t = (eta/N) E_{t+1}^{1/2} C_t^{-1/2} U_t^T E_t^{-1/2}   (R x R, float64 on the CPU),
    B_t = J_t + (1-eta)/(eta/N) (D_t + rho_t I) W_t           (R x D, on the device)."""
    dim = W.shape[1]
    beta1 = compute_beta(rho1, d1, dim, alpha)
    _, sqrt_e1, _ = compute_et(d1, beta1)
    eta_n = eta_t / num_rows
    w_coeff = (1.0 - eta_t) / eta_n * (d + rho)
    B = torch.addcmul(J, w_coeff.to(W.device, W.dtype)[:, None], W)
    A = eta_n * (sqrt_e1 / sqrt_c)[:, None] * U.T * inv_sqrt_e[None, :]
    return A.to(W.device, W.dtype) @ B


def reorthogonalize_rt1(d1: torch.Tensor, rho1: float, W1: torch.Tensor, cfg: NGConfig) -> torch.Tensor:
    """ReorthogonalizeRt1: make R_{t+1} = E^{-1/2} W_{t+1} orthonormal again.

    O = R R^T = C C^T (Cholesky); W <- (E^{1/2} C^{-1} E^{-1/2}) W, which leaves the first
    (largest-eigenvalue) rows' directions alone. Falls back to Gram-Schmidt (QR here) when
    Cholesky fails or C^{-1} is out of range, as Kaldi does.
    """
    rank, dim = W1.shape
    beta1 = compute_beta(rho1, d1, dim, cfg.alpha)
    _, sqrt_e1, inv_sqrt_e1 = compute_et(d1, beta1)
    O = (W1 @ W1.T).to(_CPU, _F64) * (inv_sqrt_e1[:, None] * inv_sqrt_e1[None, :])
    eye = torch.eye(rank, dtype=_F64)
    if float((O - eye).abs().max()) <= cfg.orthogonality_threshold:  # O.IsUnit(threshold)
        return W1
    C, info = torch.linalg.cholesky_ex(O)
    ok = int(info) == 0
    if ok:
        C_inv = torch.linalg.solve_triangular(C, eye, upper=False)
        ok = bool(torch.isfinite(C_inv).all()) and float(C_inv.max()) < 100.0
    if not ok:
        Q, Rq = torch.linalg.qr(W1.to(_CPU, _F64).T)  # Gram-Schmidt of W's rows, in order
        signs = torch.where(torch.diagonal(Rq) < 0, -1.0, 1.0).to(_F64)
        R1 = (Q * signs[None, :]).T
        return (sqrt_e1[:, None] * R1).to(W1.device, W1.dtype)
    M = sqrt_e1[:, None] * C_inv * inv_sqrt_e1[None, :]
    return M.to(W1.device, W1.dtype) @ W1


def _update_fisher(
    J: torch.Tensor,
    H: torch.Tensor,
    tr_X: float,
    num_rows: int,
    state: FisherState,
    rank: int,
    cfg: NGConfig,
) -> FisherState:
    """The updating half of PreconditionDirectionsInternal: the power-method step
    Y = R T, Z = Y Y^T = U C U^T, R' = C^{-1/2} U^T Y, D' = C^{1/2} - rho' I.

    Takes J_t = H_t^T X_t (R x D) rather than X, so a caller that appends a column of ones
    to X analytically can supply J without materialising [X, 1]."""
    dim = J.shape[1]
    W, d, rho = state.W, state.d, state.rho
    eta_t = eta(num_rows, cfg)
    if num_rows > dim:
        # L_t = W_t J_t^T and K_t = J_t J_t^T in one product (Kaldi's compute_lk_together).
        LK = torch.cat([W, J]) @ J.T
    else:
        LK = torch.cat([H.T @ H, J @ J.T])  # L_t = H_t^T H_t, K_t = J_t J_t^T
    LK = LK.to(_CPU, _F64)
    if not (bool(torch.isfinite(LK).all()) and math.isfinite(tr_X)):
        return state  # a NaN would poison the estimate for good; that step is skipped anyway
    L, K = LK[:rank], LK[rank:]
    tr_d = float(d.sum())
    beta = rho * (1.0 + cfg.alpha) + cfg.alpha * tr_d / dim  # compute_beta, without a 2nd sum
    _, _, inv_sqrt_e = compute_et(d, beta)
    Z = compute_zt(num_rows, rho, d, inv_sqrt_e, K, L, eta_t)
    # Z_t is proportional to the fourth power of the data: scale before the eigensolver.
    z_scale = max(1.0, float(torch.trace(Z)))
    c, U = torch.linalg.eigh(Z / z_scale)
    c, U = c.flip(0) * z_scale, U.flip(1)  # SortSvd: largest first
    c_first, c_last = c[0].item(), c[-1].item()  # CPU tensors: no device sync
    must_reorthogonalize = c_first > cfg.condition_threshold * c_last
    c_floor = (rho * (1.0 - eta_t)) ** 2
    if c_last < c_floor:  # c is sorted, so its last entry is its smallest
        must_reorthogonalize = True
        c = c.clamp(min=c_floor)
    sqrt_c = c.sqrt()
    # (eqn:rhot1): rho_{t+1} = 1/(D-R) (eta/N tr(X X^T) + (1-eta)(D rho_t + tr D_t) - tr C^{1/2})
    rho1 = (
        eta_t / num_rows * tr_X + (1.0 - eta_t) * (dim * rho + tr_d) - float(sqrt_c.sum())
    ) / (dim - rank)
    d1 = sqrt_c - rho1  # (eqn:dt1): D_{t+1} = C_t^{1/2} - rho_{t+1} I
    floor_val = max(cfg.epsilon, cfg.delta * float(sqrt_c[0]))  # sqrt_c[0] is its largest
    rho1 = max(rho1, floor_val)
    d1 = d1.clamp(min=floor_val)
    W1 = compute_wt1(num_rows, d, d1, rho, rho1, U, sqrt_c, inv_sqrt_e, W, J, eta_t, cfg.alpha)
    if must_reorthogonalize:
        W1 = reorthogonalize_rt1(d1, rho1, W1, cfg)
    return FisherState(W=W1, d=d1, rho=rho1, t=state.t)


def append_one(X: torch.Tensor) -> torch.Tensor:
    """[X, 1]: the input with nnet2's column of ones for the bias."""
    return F.pad(X, (0, 1), value=1.0)


def _precondition(
    X: torch.Tensor,
    state: FisherState,
    rank: int,
    cfg: NGConfig,
    *,
    with_one: bool,
    need_output: bool = True,
) -> Preconditioned:
    """`precondition_directions` of X, or of [X, 1] when `with_one`, without building [X, 1].

    With W = [W_x, w_1] (the last column belongs to the 1): H = X W_x^T + 1 w_1^T,
    X_hat = [X - H W_x, 1 - H w_1], tr([X,1][X,1]^T) = tr(X X^T) + N and J = [H^T X, H^T 1].
    """
    num_rows, dim_x = X.shape
    dim = dim_x + 1 if with_one else dim_x
    one = torch.ones((), dtype=X.dtype, device=X.device)
    if dim == 1:
        # a 1-dim space: NG with rescaling is a no-op (Kaldi's special case)
        full = append_one(X) if with_one else X
        return Preconditioned(
            X, one, row_sq_norms(full), state._replace(t=state.t + 1), full[:, -1] if with_one else None
        )
    rank = effective_rank(rank, dim)
    if state.t == 0 or state.W is None:
        state = init_state(append_one(X) if with_one else X, rank, cfg)
    W = state.W
    tr_X_t = torch.linalg.vector_norm(X).square()
    if with_one:
        W_x, w_1 = W[:, :dim_x], W[:, dim_x]
        H = torch.addmm(w_1, X, W_x.T)  # H_t = [X, 1] W_t^T  (N x R)
        tr_X_t = tr_X_t + num_rows
    else:
        W_x, w_1 = W, None
        H = X @ W.T  # H_t = X_t W_t^T  (N x R)
    next_state = state
    if is_updating(state.t, cfg):
        J = H.T @ X  # J_t = H_t^T X_t  (R x D)
        if with_one:
            J = torch.cat([J, H.sum(0)[:, None]], dim=1)
        next_state = _update_fisher(J, H, float(tr_X_t), num_rows, state, rank, cfg)
    next_state = next_state._replace(t=state.t + 1)
    if not need_output:
        return Preconditioned(X, one, one, next_state)
    X_hat = torch.addmm(X, H, W_x, alpha=-1.0)  # X_hat_t = X_t - H_t W_t
    row_sq = row_sq_norms(X_hat)
    x_hat_one = None
    if with_one:
        x_hat_one = torch.addmv(one, H, w_1, alpha=-1.0)  # 1 - H_t w_1
        row_sq = torch.addcmul(row_sq, x_hat_one, x_hat_one)
    tr_hat = row_sq.sum()
    scale = torch.where((tr_X_t > 0) & (tr_hat > 0), torch.sqrt(tr_X_t / tr_hat), one)
    return Preconditioned(X_hat, scale, row_sq, next_state, x_hat_one)


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
