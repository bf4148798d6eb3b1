"""The training layer's settings sections, next to the code they configure: [model]
(labavg.training.model), [rbm] (labavg.training.rbm), [newbob] and the learning-rate choices
(labavg.training.schedules). Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from labavg.base.schema import FINITE_POSITIVE, POSITIVE, SEED, integer, one_of, real, setting

NONLINEARITIES = ("sigmoid", "tanh", "relu", "pnorm")
SCHEDULES = ("exponential", "newbob")
PRETRAIN = ("none", "rbm")
LR_SCALING = ("none", "sqrt", "linear")
NEWBOB_CRITERIA = ("loss", "frame_accuracy")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the DNN. The paper used 6 x 2048 sigmoid layers on 440 inputs."""

    hidden_layers: int = setting(4, "number of hidden layers", integer(0), flag="--hidden-layers")
    hidden_dim: int = setting(512, "units per hidden layer", POSITIVE, flag="--hidden-dim")
    nonlinearity: str = setting("sigmoid", "activation of the hidden layers",
                                one_of(NONLINEARITIES), flag="--nonlinearity")
    pnorm_group: int = setting(5, "Kaldi's p-norm: hidden_dim inputs -> hidden_dim / group outputs",
                               POSITIVE)
    pnorm_p: float = setting(2.0, "the p of the p-norm", real(1, text="finite and >= 1 (a norm)"))

    def problem(self, prefix: str = "") -> str | None:
        """A p-norm group must divide the layer (labavg.training.model.PNorm)."""
        if self.nonlinearity == "pnorm" and self.hidden_dim % self.pnorm_group:
            return (f"{prefix}hidden_dim ({self.hidden_dim}) must be a multiple of "
                    f"{prefix}pnorm_group ({self.pnorm_group})")
        return None


@dataclass(frozen=True)
class RBMConfig:
    """Options of pretrain_dbn.sh and rbm-train-cd1-frmshuff (RbmTrainOptions in
    src/nnet/nnet-trnopts.h), Kaldi's defaults.

    The momentum ramps linearly from `momentum` to `momentum_max` in `momentum_steps` equal steps
    over the first `momentum_ramp_frames` frames of each layer (Kaldi: 40 steps of 500000
    frames). Frames are counted over all ranks, so the ramp ends at the same point of the data
    whatever the number of workers. The learning rate used in the update is
    learn_rate * (1 - momentum), as rbm-train-cd1-frmshuff sets it.
    """

    learn_rate: float = setting(0.4, "rbm_lrate, Bernoulli-Bernoulli RBMs", FINITE_POSITIVE)
    learn_rate_gaussian: float = setting(0.01, "rbm_lrate_low, the Gaussian-Bernoulli RBM",
                                         FINITE_POSITIVE)
    momentum: float = setting(0.5, "momentum at the start of a layer", real(0, 1, high_open=True))
    momentum_max: float = setting(0.9, "momentum at the end of the ramp", real(0, 1, high_open=True))
    momentum_steps: int = setting(40, "steps of the momentum ramp", POSITIVE)
    momentum_ramp_frames: int = setting(20_000_000, "frames (all ranks) the momentum ramp lasts",
                                        POSITIVE)
    l2_penalty: float = setting(2e-4, "L2 weight penalty", real(0))
    minibatch_size: int = setting(100, "rbm-train-cd1-frmshuff --bunchsize", POSITIVE)
    epochs: int = setting(1, "rbm_iter; the Gaussian-Bernoulli RBM trains for twice as many",
                          POSITIVE)
    gaussian_input: bool = setting(True, "input_vis_type=gauss")
    param_stddev_first: float = setting(0.1, "initial weight stddev, first RBM", FINITE_POSITIVE)
    param_stddev: float = setting(0.1, "initial weight stddev, later RBMs", FINITE_POSITIVE)
    # Kaldi initialises a Bernoulli RBM's visible biases to logit(mean activation) measured on
    # a 10k-utterance subset; we measure on the first frames of this epoch-0 shard, all ranks
    # pooled.
    vis_bias_init_frames: int = setting(1_000_000, "frames measured for the visible biases",
                                        POSITIVE)
    seed: int = setting(777, "random seed of the RBMs", SEED)

    def problem(self, prefix: str = "") -> str | None:
        """The momentum ramps up, in at least one frame per step."""
        if self.momentum_max < self.momentum:
            return (f"{prefix}momentum_max ({self.momentum_max!r}) must be >= {prefix}momentum "
                    f"({self.momentum!r})")
        if self.momentum_ramp_frames < self.momentum_steps:
            return (f"{prefix}momentum_ramp_frames ({self.momentum_ramp_frames}) must be >= "
                    f"{prefix}momentum_steps ({self.momentum_steps})")
        return None

    def __post_init__(self) -> None:
        if self.minibatch_size < 1 or self.epochs < 1 or self.momentum_steps < 1:
            raise ValueError(f"minibatch_size, epochs and momentum_steps must be >= 1: {self}")
        if self.momentum_ramp_frames < self.momentum_steps:
            raise ValueError(
                f"momentum_ramp_frames {self.momentum_ramp_frames} must be >= momentum_steps "
                f"{self.momentum_steps}"
            )
        if self.vis_bias_init_frames < 1:
            raise ValueError(f"vis_bias_init_frames must be >= 1, got {self.vis_bias_init_frames}")


@dataclass(frozen=True)
class NewbobConfig:
    """Options of Kaldi nnet1 `train_scheduler.sh` (same names, same defaults).

    With criterion "loss" the CV value is a loss (lower is better) and the improvements are
    relative: (prev - new) / prev. With criterion "frame_accuracy" the CV value is a frame
    accuracy in percent (higher is better, as Kaldi's FRAME_ACCURACY) and the improvements are
    absolute percentage points: use `NewbobConfig.for_frame_accuracy()` for the paper's
    thresholds (+0.5% to start halving, +0.1% to stop).
    """

    start_halving_impr: float = setting(0.01, "start halving below this CV improvement", real())
    end_halving_impr: float = setting(0.001, "stop below this CV improvement", real())
    halving_factor: float = setting(0.5, "learning-rate factor per halving",
                                    real(0, 1, low_open=True))
    min_iters: int = setting(0, "epochs before stopping is allowed", integer(0))
    max_iters: int = setting(20, "most epochs", POSITIVE)
    keep_lr_iters: int = setting(0, "epochs at the initial rate before halving may start", integer(0))
    criterion: str = setting("loss", "CV value compared: loss or frame_accuracy",
                             one_of(NEWBOB_CRITERIA))

    def __post_init__(self) -> None:
        if self.criterion not in NEWBOB_CRITERIA:
            raise ValueError(
                f"unknown Newbob criterion {self.criterion!r}; choose from {NEWBOB_CRITERIA}"
            )
        if not 0.0 < self.halving_factor <= 1.0:
            raise ValueError(f"halving_factor must be in (0, 1], got {self.halving_factor}")
        if self.max_iters < 1 or self.min_iters < 0 or self.keep_lr_iters < 0:
            raise ValueError(
                f"need max_iters >= 1, min_iters >= 0, keep_lr_iters >= 0; got {self.max_iters}, "
                f"{self.min_iters}, {self.keep_lr_iters}"
            )

    @classmethod
    def for_frame_accuracy(cls, **overrides: object) -> NewbobConfig:
        """The paper's accuracy-driven Newbob: halve below +0.5% absolute, stop below +0.1%."""
        fields = {"start_halving_impr": 0.5, "end_halving_impr": 0.1, "criterion": "frame_accuracy"}
        fields.update(overrides)
        return cls(**fields)  # type: ignore[arg-type]
