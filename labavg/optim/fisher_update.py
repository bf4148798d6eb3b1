"""The power-method update of Kaldi's online Fisher estimates (the updating half of
OnlineNaturalGradient::PreconditionDirectionsInternal, src/nnet3/natural-gradient-online.cc),
done for many estimates at once.

On an updating minibatch every affine layer's two estimates are updated. Their R x R algebra
(Z_t, its eigendecomposition, rho_{t+1}, D_{t+1}, A_t) is ~100 small torch ops per estimate,
which cost more than their arithmetic; here the estimates of one rank (all input sides, all
output sides) go through it as one batch, so a step of a 5-layer model runs each op twice
instead of ten times. Every op is elementwise or a reduction along the last dimension, and a
batched eigh is one LAPACK call per matrix, so a batch gives each estimate the bits it gets
alone (tests/test_ngsgd.py checks that). Equation tags (eqn:Zt) are those of the long comment
in natural-gradient-online.h; the R x R algebra runs in float64 on the CPU, as Kaldi does it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from labavg.optim.settings import NGConfig

_F64 = torch.float64
_CPU = torch.device("cpu")


class FisherState(NamedTuple):
    """One Fisher estimate: W_t = E_t^{1/2} R_t (device), D_t's diagonal d (CPU float64),
    rho_t, and t, the number of minibatches preconditioned (0: not yet initialised)."""

    W: torch.Tensor | None
    d: torch.Tensor | None
    rho: float
    t: int


class FisherJob(NamedTuple):
    """What an update of `state` needs from the device: J_t = H_t^T X_t (R x D), L_t and
    K_t stacked (2R x R, CPU float64), tr(X_t X_t^T) (0-d) and N. `next_t` is the t the
    updated estimate gets."""

    state: FisherState
    J: torch.Tensor
    LK: torch.Tensor
    tr_X: torch.Tensor
    num_rows: int
    next_t: int


def eta(num_rows: int, cfg: NGConfig) -> float:
    """Forgetting rate eta = 1 - exp(-N / num_samples_history), capped (Kaldi's Eta())."""
    return min(1.0 - math.exp(-num_rows / cfg.num_samples_history), cfg.max_eta)


def compute_et(d: torch.Tensor, beta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ComputeEt: e_ii = 1 / (beta / d_ii + 1) (eqn:tii); returns e, e^{1/2}, e^{-1/2}.
    `beta` is a number, or one per row of a batch of d's (shape [..., 1]). beta times 1/d,
    not beta / d: torch divides a number by a tensor so, and a batch must round alike."""
    e = 1.0 / (d.reciprocal() * beta + 1.0)
    sqrt_e = e.sqrt()
    return e, sqrt_e, 1.0 / sqrt_e


def compute_beta(rho, d: torch.Tensor, dim, alpha: float):
    """beta_t = rho_t (1 + alpha) + alpha/D tr(D_t)  (eqn:betat2); a float for one estimate,
    a [B] tensor for a batch (rho, dim: [B] tensors, d: [B, R])."""
    if d.dim() == 1:
        return rho * (1.0 + alpha) + alpha * float(d.sum()) / dim
    return rho * (1.0 + alpha) + alpha * d.sum(-1) / dim


def compute_zt(num_rows: int, rho, d: torch.Tensor, inv_sqrt_e: torch.Tensor, K: torch.Tensor,
               L: torch.Tensor, eta_t: float) -> torch.Tensor:
    """ComputeZt (eqn:Zt), in float64: Z_t = Y_t Y_t^T expressed through K_t and L_t.
    One estimate (d: [R], K, L: [R, R], rho a float) or a batch (d: [B, R], rho: [B, 1])."""
    d_rho = d + rho  # diag(D_t + rho_t I)
    eta_n = eta_t / num_rows
    eta1 = 1.0 - eta_t
    K = 0.5 * (K + K.mT)
    L = 0.5 * (L + L.mT)
    outer = inv_sqrt_e[..., :, None] * inv_sqrt_e[..., None, :]
    EKE = K * outer  # E^{-1/2} K E^{-1/2}
    ELE = L * outer  # E^{-1/2} L E^{-1/2}
    Z = eta_n**2 * EKE + eta_n * eta1 * (ELE * d_rho[..., None, :] + d_rho[..., :, None] * ELE)
    return Z + torch.diag_embed(eta1**2 * d_rho**2)


def wt1_factor(num_rows: int, d1: torch.Tensor, rho1, U: torch.Tensor, sqrt_c: torch.Tensor,
               inv_sqrt_e: torch.Tensor, dim, eta_t: float, alpha: float) -> torch.Tensor:
    """A_t = (eta/N) E_{t+1}^{1/2} C_t^{-1/2} U_t^T E_t^{-1/2}  (R x R, or a batch of them)."""
    beta1 = compute_beta(rho1, d1, dim, alpha)
    _, sqrt_e1, _ = compute_et(d1, beta1 if d1.dim() == 1 else beta1[:, None])
    eta_n = eta_t / num_rows
    return eta_n * (sqrt_e1 / sqrt_c)[..., :, None] * U.mT * inv_sqrt_e[..., None, :]


def wt1_product(A: torch.Tensor, d: torch.Tensor, rho, W: torch.Tensor, J: torch.Tensor,
                num_rows: int, eta_t: float) -> torch.Tensor:
    """W_{t+1} = A_t B_t, B_t = J_t + (1-eta)/(eta/N) (D_t + rho_t I) W_t  (on W's device)."""
    eta_n = eta_t / num_rows
    w_coeff = (1.0 - eta_t) / eta_n * (d + rho)
    B = torch.addcmul(J, w_coeff.to(W.device, W.dtype)[:, None], W)
    return A.to(W.device, W.dtype) @ B


def compute_wt1(num_rows: int, d: torch.Tensor, d1: torch.Tensor, rho: float, rho1: float,
                U: torch.Tensor, sqrt_c: torch.Tensor, inv_sqrt_e: torch.Tensor, W: torch.Tensor,
                J: torch.Tensor, eta_t: float, alpha: float) -> torch.Tensor:
    """ComputeWt1 for one estimate: W_{t+1} = A_t B_t (`wt1_factor`, `wt1_product`)."""
    A = wt1_factor(num_rows, d1, rho1, U, sqrt_c, inv_sqrt_e, W.shape[1], eta_t, alpha)
    return wt1_product(A, d, rho, W, J, num_rows, eta_t)


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


def update_fishers(jobs: Sequence[FisherJob], cfg: NGConfig) -> list[FisherState]:
    """The power-method step of every job, Y = R T, Z = Y Y^T = U C U^T,
    R' = C^{-1/2} U^T Y, D' = C^{1/2} - rho' I; the estimates of one rank and minibatch size
    as one batch. A job whose L_t, K_t or trace is not finite keeps its estimate (a NaN would
    poison it for good; that step is skipped anyway)."""
    out: list[FisherState | None] = [None] * len(jobs)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, job in enumerate(jobs):
        # An estimate whose rank was cut to D - 1 (a layer narrower than the rank) goes alone:
        # batched, its odd-length reductions rounded unlike the same estimate alone (seen on
        # 2 x 64 and 2 x 48 models; 2 x 128 and wider, whose ranks are 20 and 80, keep their
        # bits either way).
        rank, dim = job.J.shape
        groups.setdefault((rank, job.num_rows, i if rank == dim - 1 else -1), []).append(i)
    for index in groups.values():
        LK = torch.stack([jobs[i].LK for i in index])
        tr_X = torch.stack([jobs[i].tr_X for i in index]).to(_CPU, _F64)
        finite = (torch.isfinite(LK).flatten(1).all(1) & torch.isfinite(tr_X)).tolist()
        for i, ok in zip(index, finite):
            if not ok:
                out[i] = jobs[i].state._replace(t=jobs[i].next_t)
        kept = [k for k, ok in enumerate(finite) if ok]
        if len(kept) < len(index):
            if not kept:
                continue
            LK, tr_X = LK[kept], tr_X[kept]
            index = [index[k] for k in kept]
        for i, state in zip(index, _update_batch([jobs[i] for i in index], LK, tr_X, cfg)):
            out[i] = state
    return out  # type: ignore[return-value]


def _update_batch(jobs: list[FisherJob], LK: torch.Tensor, tr_X: torch.Tensor,
                  cfg: NGConfig) -> list[FisherState]:
    """`update_fishers` of B estimates of rank R and minibatch size N (LK: [B, 2R, R])."""
    rank, num_rows = LK.shape[2], jobs[0].num_rows
    d = torch.stack([job.state.d for job in jobs])
    rho = torch.tensor([job.state.rho for job in jobs], dtype=_F64)
    dim = torch.tensor([float(job.J.shape[1]) for job in jobs], dtype=_F64)
    eta_t = eta(num_rows, cfg)
    L, K = LK[:, :rank], LK[:, rank:]
    tr_d = d.sum(-1)
    beta = rho * (1.0 + cfg.alpha) + cfg.alpha * tr_d / dim  # compute_beta, without a 2nd sum
    _, _, inv_sqrt_e = compute_et(d, beta[:, None])
    Z = compute_zt(num_rows, rho[:, None], d, inv_sqrt_e, K, L, eta_t)
    # Z_t is proportional to the fourth power of the data: scale before the eigensolver.
    # The diagonal's cumsum adds in order, as torch.trace does.
    z_scale = torch.diagonal(Z, dim1=-2, dim2=-1).cumsum(-1)[:, -1].clamp(min=1.0)
    c, U = torch.linalg.eigh(Z / z_scale[:, None, None])
    c, U = c.flip(-1) * z_scale[:, None], U.flip(-1)  # SortSvd: largest first
    must_reorthogonalize = c[:, 0] > cfg.condition_threshold * c[:, -1]
    c_floor = (rho * (1.0 - eta_t)) ** 2
    must_reorthogonalize |= c[:, -1] < c_floor  # c is sorted: its last entry is its smallest
    c = c.clamp(min=c_floor[:, None])
    sqrt_c = c.sqrt()
    # (eqn:rhot1): rho_{t+1} = 1/(D-R) (eta/N tr(X X^T) + (1-eta)(D rho_t + tr D_t) - tr C^{1/2})
    rho1 = (eta_t / num_rows * tr_X + (1.0 - eta_t) * (dim * rho + tr_d) - sqrt_c.sum(-1)) / (dim - rank)
    d1 = sqrt_c - rho1[:, None]  # (eqn:dt1): D_{t+1} = C_t^{1/2} - rho_{t+1} I
    floor_val = (cfg.delta * sqrt_c[:, 0]).clamp(min=cfg.epsilon)  # sqrt_c[:, 0] is the largest
    rho1 = torch.maximum(rho1, floor_val)
    d1 = d1.clamp(min=floor_val[:, None])
    A = wt1_factor(num_rows, d1, rho1, U, sqrt_c, inv_sqrt_e, dim, eta_t, cfg.alpha)
    out = []
    for b, (job, rho1_b, reorth) in enumerate(zip(jobs, rho1.tolist(), must_reorthogonalize.tolist())):
        W1 = wt1_product(A[b], job.state.d, job.state.rho, job.state.W, job.J, num_rows, eta_t)
        if reorth:
            W1 = reorthogonalize_rt1(d1[b], rho1_b, W1, cfg)
        out.append(FisherState(W=W1, d=d1[b], rho=rho1_b, t=job.next_t))
    return out
