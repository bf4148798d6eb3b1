"""Greedy layer-wise RBM pretraining of the DNN's sigmoid layers, as Kaldi nnet1 does it
(egs/wsj/s5/steps/nnet/pretrain_dbn.sh, src/nnetbin/rbm-train-cd1-frmshuff.cc,
src/nnet/nnet-rbm.h), made data-parallel by periodic model averaging (Su & Chen 2015).

One RBM per hidden layer: a Gaussian-Bernoulli RBM on the (CMVN'd, spliced) input, Bernoulli-
Bernoulli RBMs above it, each trained by CD-1 on the hidden probabilities of the layers already
trained. Every rank trains on its own shard and every `average_every` minibatches the RBM's
parameters are averaged over ranks with one allreduce; the momentum buffers stay local, like an
optimiser's state.

Pretraining always averages plainly (the averager of `averaging = "model"`), whatever the run's
`averaging`: block momentum and DiLoCo's outer step are defined for the supervised model, and
the pretrainer's rounds count RBM minibatches and end with the data, not every K of the run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from labavg.averaging.factory import make_pretraining_averager
from labavg.averaging.mean import broadcast_parameters, flatten_parameters
from labavg.comm.base import Communicator
from labavg.training.settings import RBMConfig
from labavg.training.model import DNN


@dataclass(frozen=True)
class RBMEvent:
    """Progress of one rank: after an averaging round (`divergence` set) or at an epoch's end
    (`divergence` None, `recon_error` the epoch's mean over all ranks).

    `step` counts this layer's minibatches so far; `recon_error` is Kaldi's Mse AvgLoss,
    0.5 * squared error summed over dimensions, averaged over frames.
    """

    rank: int
    layer: int
    epoch: int
    step: int
    recon_error: float
    divergence: float | None

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready record, tagged "type": "rbm" for the event log."""
        return {"type": "rbm", **asdict(self)}


class RBM(nn.Module):
    """An RBM's parameters in Kaldi's layout: weight [hidden, visible], vbias, hbias.

    Parameters take no gradients: CD-1 computes its own statistics.
    """

    def __init__(self, num_visible: int, num_hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_hidden, num_visible), requires_grad=False)
        self.vbias = nn.Parameter(torch.zeros(num_visible), requires_grad=False)
        self.hbias = nn.Parameter(torch.zeros(num_hidden), requires_grad=False)

    def hidden_probs(self, v: torch.Tensor) -> torch.Tensor:
        """P(h = 1 | v): what the DNN's affine + sigmoid layer computes once initialised."""
        return torch.sigmoid(v @ self.weight.T + self.hbias)


def momentum_at(frames: int, cfg: RBMConfig) -> float:
    """The momentum after `frames` frames: rbm-train-cd1-frmshuff's stepwise linear ramp."""
    period = cfg.momentum_ramp_frames // cfg.momentum_steps
    n = frames // period
    if n > cfg.momentum_steps:
        return cfg.momentum_max
    return cfg.momentum + n * (cfg.momentum_max - cfg.momentum) / cfg.momentum_steps


def rbm_cd1_gradients(
    W: torch.Tensor,
    vbias: torch.Tensor,
    hbias: torch.Tensor,
    v0: torch.Tensor,
    *,
    gaussian: bool,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """CD-1 statistics of one minibatch: (dW, dvbias, dhbias, recon_error).

    As rbm-train-cd1-frmshuff.cc and Rbm::RbmUpdate (nnet-rbm.h): h0 = P(h|v0); the hidden
    state is sampled as `torch.rand(h0.shape, generator) < h0` (the only random draw, Kaldi's
    BinarizeProbs); v1 is the reconstruction's mean (linear for Gaussian visible units, sigmoid
    for Bernoulli; never sampled); h1 = P(h|v1). Then dW = (h0' v0 - h1' v1) / N,
    dvbias = mean(v0 - v1), dhbias = mean(h0 - h1): the gradient ascent direction.
    recon_error = 0.5 * sum((v1 - v0)^2) / N (Kaldi's Mse AvgLoss).
    """
    dW, dvb, dhb, v1 = _cd1(W, vbias, hbias, v0, gaussian=gaussian, generator=generator)
    return dW, dvb, dhb, recon_error(v0, v1)


def recon_error(v0: torch.Tensor, v1: torch.Tensor) -> float:
    """Kaldi's Mse AvgLoss: half the squared error, summed over dimensions, per frame."""
    return 0.5 * (v1 - v0).square().sum().item() / v0.shape[0]


def reconstruction_runaway(v0: torch.Tensor, v1: torch.Tensor) -> float | None:
    """Kaldi's anti-weight-explosion check for Gaussian visible units (Rbm::RbmUpdate).

    Returns the factor std(v0) / std(v1) to scale the weights and biases by when the
    reconstruction's standard deviation (over all elements, ComputeStdDev in nnet-utils.h) is
    more than twice the data's, else None.
    """
    pos_std = _std_all(v0)
    neg_std = _std_all(v1)
    if pos_std * 2 < neg_std:
        return pos_std / neg_std
    return None


@dataclass
class CD1Trainer:
    """One rank's CD-1 training of one RBM: Rbm::RbmUpdate with rbm-train-cd1-frmshuff's
    momentum and learning-rate schedule. Mutable, local state (momentum buffers, frame count).

    `frames_per_frame` is how many frames the group processes per local frame (the number of
    ranks), for the momentum ramp.
    """

    rbm: RBM
    gaussian: bool
    cfg: RBMConfig
    frames_per_frame: int = 1
    frames: int = 0
    safeguard_hits: int = 0
    lr: float = field(init=False)
    mmt: float = field(init=False)
    _n_prev: int = field(init=False, default=-1)
    _corr: list[torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        self.mmt = self.cfg.momentum
        self.lr = self.base_lr * (1.0 - self.mmt)
        self._corr = [torch.zeros_like(p) for p in self._params()]

    @property
    def base_lr(self) -> float:
        """The configured learning rate for this RBM type (before the (1 - momentum) factor)."""
        return self.cfg.learn_rate_gaussian if self.gaussian else self.cfg.learn_rate

    def step(self, v0: torch.Tensor, generator: torch.Generator | None) -> float:
        """Train on one minibatch; returns its reconstruction error."""
        W, vb, hb = self._params()
        dW, dvb, dhb, v1 = _cd1(W, vb, hb, v0, gaussian=self.gaussian, generator=generator)
        error = recon_error(v0, v1)
        if not math.isfinite(error):
            raise FloatingPointError(f"RBM reconstruction is not finite (error {error})")
        scale = reconstruction_runaway(v0, v1) if self.gaussian else None
        if scale is not None:
            # Kaldi: shrink weights and biases, lr x 0.9, reset momentum, skip this update.
            for p in (W, vb, hb):
                p.mul_(scale)
            self.lr *= 0.9
            for c in self._corr:
                c.zero_()
            self.safeguard_hits += 1
        else:
            cW, cvb, chb = self._corr
            cW.mul_(self.mmt).add_(dW, alpha=self.lr).add_(W, alpha=-self.lr * self.cfg.l2_penalty)
            cvb.mul_(self.mmt).add_(dvb, alpha=self.lr)
            chb.mul_(self.mmt).add_(dhb, alpha=self.lr)
            W.add_(cW)
            vb.add_(cvb)
            hb.add_(chb)
        self._advance(v0.shape[0])
        return error

    def _advance(self, num_frames: int) -> None:
        # rbm-train-cd1-frmshuff: after each bunch, step the momentum when a new period starts,
        # which also restores the learning rate a safeguard hit had lowered.
        self.frames += num_frames * self.frames_per_frame
        n = self.frames // (self.cfg.momentum_ramp_frames // self.cfg.momentum_steps)
        if n > self._n_prev:
            self._n_prev = n
            self.mmt = momentum_at(self.frames, self.cfg)
            self.lr = self.base_lr * (1.0 - self.mmt)

    def _params(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.rbm.weight.data, self.rbm.vbias.data, self.rbm.hbias.data


def pretrain_dbn(
    model: DNN,
    batches_for_epoch: Callable[[int], Iterable[torch.Tensor]],
    comm: Communicator,
    cfg: RBMConfig,
    *,
    average_every: int,
    device: torch.device | str,
    reduce: str = "allreduce",
) -> Generator[RBMEvent, None, list[RBM]]:
    """Pretrain every hidden layer of `model` as an RBM and copy the weights into it.

    `batches_for_epoch(epoch)` gives this rank's input batches ([frames, input_dim], spliced
    and normalised to zero mean and unit variance like pretrain_dbn.sh's feature transform);
    they are re-cut into `cfg.minibatch_size`-frame minibatches (a last partial one is
    dropped). Layer i is trained on the hidden probabilities of layers 0..i-1. Every rank must
    yield the same number of minibatches; a mismatch raises ValueError on every rank (they
    all see it, so none hangs). Yields an event per averaging round and per epoch end, and
    returns (StopIteration.value) the trained RBMs, visible biases included. Each layer's
    weights and hidden biases are copied into the model as soon as that layer is trained, so
    run the generator to the end. `reduce` is the algorithm the rounds' means are computed
    with (labavg.comm.reduce), the run's.
    """
    if average_every < 1:
        raise ValueError(f"average_every must be >= 1, got {average_every}")
    if model.cfg.nonlinearity != "sigmoid":
        raise ValueError(
            f"RBM pretraining initialises sigmoid layers; the model uses {model.cfg.nonlinearity!r}"
        )
    device = torch.device(device)
    below: list[RBM] = []
    for layer, affine in enumerate(model.hidden):
        gaussian = layer == 0 and cfg.gaussian_input
        rbm, flat = _init_rbm(affine, layer, below, batches_for_epoch, comm, cfg, gaussian, device)
        yield from _train_rbm(rbm, flat, layer, below, batches_for_epoch, comm, cfg, gaussian,
                              average_every, device, reduce)
        with torch.no_grad():
            affine.weight.copy_(rbm.weight)
            affine.bias.copy_(rbm.hbias)
        below.append(rbm)
    return below


def _init_rbm(
    affine: nn.Linear,
    layer: int,
    below: list[RBM],
    batches_for_epoch: Callable[[int], Iterable[torch.Tensor]],
    comm: Communicator,
    cfg: RBMConfig,
    gaussian: bool,
    device: torch.device,
) -> tuple[RBM, torch.Tensor]:
    """Rbm::InitData as pretrain_dbn.sh configures it: N(0, param_stddev) weights, zero hidden
    biases, zero visible biases for Gaussian units and logit(mean activation) for Bernoulli
    ones (<VisibleBiasCmvnFilename>, clipped to [1e-4, 1 - 1e-4]). Rank 0's draw wins.
    Returns the RBM and the flat buffer its parameters now live in."""
    rbm = RBM(affine.in_features, affine.out_features).to(device)
    generator = torch.Generator(device=device)
    generator.manual_seed(cfg.seed + layer)
    stddev = cfg.param_stddev_first if layer == 0 else cfg.param_stddev
    with torch.no_grad():
        rbm.weight.normal_(0.0, stddev, generator=generator)
        if not gaussian:
            p = _mean_activation(below, batches_for_epoch(0), comm, cfg, affine.in_features, device)
            p = p.clamp(1e-4, 1.0 - 1e-4)
            rbm.vbias.copy_(torch.log(p) - torch.log1p(-p))
    flat = flatten_parameters([rbm])
    broadcast_parameters(flat, comm)
    return rbm, flat


def _mean_activation(
    below: list[RBM],
    batches: Iterable[torch.Tensor],
    comm: Communicator,
    cfg: RBMConfig,
    dim: int,
    device: torch.device,
) -> torch.Tensor:
    """Mean of the visible units over the first `vis_bias_init_frames` local frames, pooled
    over ranks: one allreduce of [sum, count] gives sum_all / count_all exactly."""
    stats = torch.zeros(dim + 1, dtype=torch.float64, device=device)
    for batch in batches:
        if stats[-1] >= cfg.vis_bias_init_frames:
            break
        v = _propagate(below, batch.to(device))
        stats[:-1] += v.sum(dim=0, dtype=torch.float64)
        stats[-1] += v.shape[0]
    comm.allreduce_mean(stats)
    if stats[-1] <= 0:
        raise ValueError("no frames to initialise the RBM's visible biases from")
    return (stats[:-1] / stats[-1]).to(torch.float32)


def _train_rbm(
    rbm: RBM,
    flat: torch.Tensor,
    layer: int,
    below: list[RBM],
    batches_for_epoch: Callable[[int], Iterable[torch.Tensor]],
    comm: Communicator,
    cfg: RBMConfig,
    gaussian: bool,
    average_every: int,
    device: torch.device,
    reduce: str = "allreduce",
) -> Iterator[RBMEvent]:
    trainer = CD1Trainer(rbm, gaussian, cfg, frames_per_frame=comm.size)
    # No global copy to restore: an RBM whose every rank diverged ends the run.
    averager = make_pretraining_averager(flat, comm, average_every, reduce)
    generator = torch.Generator(device=device)
    # Distinct CD-1 sampling per rank and layer; the initial parameters were broadcast.
    generator.manual_seed(cfg.seed + 1_000_003 * (comm.rank + 1) + layer)
    epochs = cfg.epochs * (2 if gaussian else 1)
    step = 0
    for epoch in range(epochs):
        minibatches = _rechunk(batches_for_epoch(epoch), cfg.minibatch_size)
        epoch_error, epoch_count = 0.0, 0
        while True:
            block = _take(minibatches, average_every)
            num = _agreed_count(len(block), average_every, comm, layer, epoch, device)
            if num == 0:
                break
            round_error = 0.0
            for batch in block:
                v0 = _propagate(below, batch.to(device))
                round_error += trainer.step(v0, generator)
            step += num
            epoch_error += round_error
            epoch_count += num
            stats = averager.round(flat)
            yield RBMEvent(comm.rank, layer, epoch, step, round_error / num, stats.divergence)
            if num < average_every:
                break
        mean_error = _global_mean(epoch_error, epoch_count, comm, device)
        yield RBMEvent(comm.rank, layer, epoch, step, mean_error, None)


def _agreed_count(
    count: int, average_every: int, comm: Communicator, layer: int, epoch: int, device: torch.device
) -> int:
    """The number of minibatches every rank runs this round: a histogram over 0..average_every
    of the ranks' counts, in one allreduce, so every rank sees the same minimum and the same
    mismatch."""
    if comm.size == 1:
        return count
    hist = torch.zeros(average_every + 1, dtype=torch.float64, device=device)
    hist[count] = 1.0
    comm.allreduce_mean(hist)
    present = torch.nonzero(hist > 0).flatten().tolist()
    if len(present) > 1:
        raise ValueError(
            f"RBM layer {layer} epoch {epoch}: ranks ran out of data at different points "
            f"(minibatches left this round: {present}); every rank must get the same number of "
            f"frames"
        )
    return min(present)


def _global_mean(total: float, count: int, comm: Communicator, device: torch.device) -> float:
    buf = torch.tensor([total, float(count)], dtype=torch.float64, device=device)
    comm.allreduce_mean(buf)
    return buf[0].item() / buf[1].item() if buf[1].item() > 0 else float("nan")


def _propagate(below: list[RBM], v: torch.Tensor) -> torch.Tensor:
    """The input through the layers already trained (rbm-convert-to-nnet: affine + sigmoid)."""
    with torch.no_grad():
        for rbm in below:
            v = rbm.hidden_probs(v)
    return v


def _rechunk(batches: Iterable[torch.Tensor], size: int) -> Iterator[torch.Tensor]:
    """Re-cut a stream of [frames, dim] batches into [size, dim] minibatches."""
    pending: list[torch.Tensor] = []
    have = 0
    for batch in batches:
        if batch.dim() != 2:
            raise ValueError(
                f"RBM input batches must be [frames, dim], got shape {tuple(batch.shape)}"
            )
        pending.append(batch)
        have += batch.shape[0]
        if have < size:
            continue
        joined = torch.cat(pending) if len(pending) > 1 else pending[0]
        full = (have // size) * size
        yield from joined[:full].split(size)
        pending = [joined[full:]] if have > full else []
        have -= full


def _take(it: Iterator[torch.Tensor], n: int) -> list[torch.Tensor]:
    out = []
    for item in it:
        out.append(item)
        if len(out) == n:
            break
    return out


def _cd1(
    W: torch.Tensor,
    vbias: torch.Tensor,
    hbias: torch.Tensor,
    v0: torch.Tensor,
    *,
    gaussian: bool,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """CD-1 statistics and the reconstruction v1 (see rbm_cd1_gradients)."""
    with torch.no_grad():
        h0 = torch.sigmoid(v0 @ W.T + hbias)
        uniform = torch.rand(h0.shape, generator=generator, device=h0.device, dtype=h0.dtype)
        h0_state = (uniform < h0).to(h0.dtype)
        v1 = h0_state @ W + vbias
        if not gaussian:
            v1 = torch.sigmoid(v1)
        h1 = torch.sigmoid(v1 @ W.T + hbias)
        n = v0.shape[0]
        dW = (h0.T @ v0 - h1.T @ v1) / n
        dvb = (v0 - v1).sum(dim=0) / n
        dhb = (h0 - h1).sum(dim=0) / n
    return dW, dvb, dhb, v1


def _std_all(x: torch.Tensor) -> float:
    # ComputeStdDev: population std over every element, variance clamped at zero.
    mean = x.mean()
    var = (x.square().mean() - mean.square()).clamp_min(0.0)
    return var.sqrt().item()
