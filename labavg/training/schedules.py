"""Learning-rate schedules as small pure functions, the way Kaldi's recipe scripts keep
schedule policy outside the trainer.

* `scale_lr`: the learning rate for N averaged workers (Su & Chen 2015 multiply it by N; Kaldi
  nnet2/nnet3 do the same with `effective_lr * num_jobs`).
* `exponential_lr`: geometric decay from an initial to a final rate (Kaldi nnet2/nnet3
  `get_learning_rate`; the paper used final = 0.01 x initial).
* Newbob (`newbob_start`, `newbob_step`): the epoch-level accept/reject and halving policy of
  Kaldi nnet1 `steps/nnet/train_scheduler.sh` (2015 version, with min_iters/keep_lr_iters), as a
  state machine whose state is a frozen, JSON-serialisable dataclass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from labavg.training.settings import LR_SCALING, NewbobConfig


def scale_lr(lr: float, num_jobs: int, rule: str) -> float:
    """The learning rate each of `num_jobs` averaged workers uses.

    "linear" multiplies by num_jobs: averaging N models divides each worker's step by N
    (Su & Chen 2015, Sec. 3; Kaldi nnet3 train_dnn.py uses effective_lr * num_jobs). "sqrt"
    multiplies by sqrt(num_jobs), the rule that keeps the variance of an averaged SGD step
    (Krizhevsky 2014), for testing whether the N-fold rate is what costs accuracy.
    """
    if num_jobs < 1:
        raise ValueError(f"num_jobs must be >= 1, got {num_jobs}")
    if rule == "none":
        return lr
    if rule == "linear":
        return lr * num_jobs
    if rule == "sqrt":
        return lr * math.sqrt(num_jobs)
    raise ValueError(f"unknown learning-rate scaling rule {rule!r}; choose from {LR_SCALING}")


def exponential_lr(initial: float, final: float, progress: float) -> float:
    """initial * (final / initial) ** progress, progress = fraction of the run's minibatches done.

    Kaldi nnet3 `steps/libs/nnet3/train/common.py: get_learning_rate` decays the same way per
    iteration; here progress may be as fine-grained as the caller likes.
    """
    if initial <= 0 or final <= 0:
        raise ValueError(f"learning rates must be positive, got initial={initial} final={final}")
    if not 0.0 <= progress <= 1.0:
        raise ValueError(f"progress must be in [0, 1], got {progress}")
    return initial * (final / initial) ** progress


@dataclass(frozen=True)
class NewbobState:
    """Where the schedule stands after `iters` epochs.

    `best` is the CV value of the last ACCEPTED model (the initial model's before any epoch),
    `lr_scale` the product of every halving so far (current lr = initial lr * lr_scale).
    """

    iters: int
    best: float
    halving: bool = False
    lr_scale: float = 1.0
    stopped: bool = False


@dataclass(frozen=True)
class NewbobDecision:
    """What to do after an epoch: keep or restore the model, rescale the lr, stop or go on.

    `lr_factor` multiplies the learning rate for the next epoch (already folded into
    `state.lr_scale`).
    """

    accept: bool
    lr_factor: float
    stop: bool
    state: NewbobState


def newbob_start(initial_cv: float, cfg: NewbobConfig) -> NewbobState:
    """The state before the first epoch, from the CV value of the initial model
    (train_scheduler.sh's "CROSSVAL PRERUN")."""
    _check_cv(initial_cv, cfg)
    if not math.isfinite(initial_cv):
        raise ValueError(f"the initial model's CV value must be finite, got {initial_cv}")
    if cfg.criterion == "loss" and initial_cv <= 0:
        # The relative improvement divides by it.
        raise ValueError(f"the initial CV loss must be positive, got {initial_cv}")
    return NewbobState(iters=0, best=initial_cv)


def newbob_step(state: NewbobState, cv_value: float, cfg: NewbobConfig) -> NewbobDecision:
    """One pass of train_scheduler.sh's epoch loop body, after the epoch's CV.

    Follows the script line by line: accept when better (or while iter <= keep_lr_iters or
    iter <= min_iters); no halving logic while iter <= keep_lr_iters; the improvement is
    measured against the last accepted value, so a rejected epoch counts as zero improvement;
    stop when already halving and the improvement is below end_halving_impr (unless
    iter <= min_iters, which then also skips this epoch's halving, as the script's `continue`
    does); start halving below start_halving_impr; halve every epoch once halving; stop after
    max_iters epochs. A non-finite CV value counts as worse (rejected).
    """
    if state.stopped:
        raise ValueError("the Newbob schedule has already stopped")
    _check_cv(cv_value, cfg)
    it = state.iters + 1
    prev = state.best
    if not math.isfinite(cv_value):
        better = False
    else:
        better = cv_value > prev if _higher_is_better(cfg) else cv_value < prev
    accept = better or it <= cfg.keep_lr_iters or it <= cfg.min_iters
    best = cv_value if accept else prev
    last_iter = it >= cfg.max_iters

    def decide(lr_factor: float, stop: bool, halving: bool) -> NewbobDecision:
        new_state = replace(
            state,
            iters=it,
            best=best,
            halving=halving,
            lr_scale=state.lr_scale * lr_factor,
            stopped=stop,
        )
        return NewbobDecision(accept=accept, lr_factor=lr_factor, stop=stop, state=new_state)

    if it <= cfg.keep_lr_iters:
        return decide(1.0, last_iter, state.halving)
    impr = _improvement(prev, best, cfg)
    if state.halving and impr < cfg.end_halving_impr:
        if it <= cfg.min_iters:
            return decide(1.0, last_iter, state.halving)
        return decide(1.0, True, state.halving)
    halving = state.halving or impr < cfg.start_halving_impr
    return decide(cfg.halving_factor if halving else 1.0, last_iter, halving)


def _higher_is_better(cfg: NewbobConfig) -> bool:
    return cfg.criterion == "frame_accuracy"


def _improvement(prev: float, new: float, cfg: NewbobConfig) -> float:
    if _higher_is_better(cfg):
        return new - prev  # absolute percentage points (Su & Chen 2015)
    return (prev - new) / prev  # train_scheduler.sh: rel_impr


def _check_cv(value: float, cfg: NewbobConfig) -> None:
    if cfg.criterion == "frame_accuracy" and math.isfinite(value) and not 0.0 <= value <= 100.0:
        raise ValueError(f"frame accuracy must be a percentage in [0, 100], got {value}")
