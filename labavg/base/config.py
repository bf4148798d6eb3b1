"""Run configuration: the one place a setting is declared.

Every setting is a dataclass field here, with its default, its help text, its rule (choices,
bounds) and, for the common ones, its command-line flag, in the field's metadata (`setting`).
`validate` checks the rules, `labavg train`'s flags (`cli_flags`) and the dashboard's
controls (`dashboard.settings`) are generated from them. This module imports no torch.

A TOML file holds the training keys at the top level and one table per part:
`[model]`, `[data]`, `[ngsgd]`, `[rbm]`, `[newbob]`, `[bmuf]`, `[diloco]`, `[hierarchy]`. Files are parsed,
never executed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labavg.base.errors import UserError
from labavg.base.faults import parse_fault

BACKENDS = ("inproc", "mpi", "torch")
OPTIMIZERS = ("sgd", "ngsgd")
# (max_change_per_sample, max_param_change) unless set: nnet2/3 for NG-SGD; nnet1 SGD has none.
MAX_CHANGE_DEFAULTS = {"sgd": (0.0, 0.0), "ngsgd": (0.075, 2.0)}
SCHEDULES = ("exponential", "newbob")
PRETRAIN = ("none", "rbm")
LR_SCALING = ("none", "sqrt", "linear")
NONLINEARITIES = ("sigmoid", "tanh", "relu", "pnorm")
NEWBOB_CRITERIA = ("loss", "frame_accuracy")
# How an averaging round combines the workers' models (labavg.averaging.methods, docs/averaging.md).
AVERAGING = ("model", "bmuf", "diloco")
# How the ranks compute the mean of their parameters (labavg.comm.reduce, docs/averaging.md).
REDUCE = ("allreduce", "butterfly", "ring")
# What a round sends (labavg.averaging.payload, docs/averaging.md): the fp32 parameters (the paper), or
# their change since the last round in 16 bits or as integer codes of PAYLOAD_BITS bits.
PAYLOADS = ("fp32", "bf16", "fp16", "int")
PAYLOAD_BITS = (4, 8, 16)
# Whether a round's mean runs while the next minibatches compute (labavg.averaging.overlap).
OVERLAP = ("none", "eager", "streaming")

SEED_LIMIT = 2**32  # numpy's SeedSequence refuses negatives; 32 bits as Kaldi's --srand
# torch's intra-op pool gains nothing past the cores (4x leaves room for SMT and for
# oversubscription experiments), and a pool of 10^5 threads makes OpenMP fail inside torch
# with a segfault rather than an error.
THREADS_PER_CORE_LIMIT = 4
# A model (with its gradients, averaging buffer and checkpoint copy, see `estimate_memory`)
# must fit in this fraction of physical memory; the rest is for the data, Python and the OS.
MEMORY_FRACTION = 0.5
# The smallest input `validate` assumes before the data is open: 13 MFCCs per frame and two
# pdfs. A model refused with these is refused for any data; `check_model_size` with the real
# dimensions follows once the data is read.
MIN_FEAT_DIM = 13
MIN_NUM_PDFS = 2
# Bytes per trainable scalar: float32 weights, their gradients, the flat parameter buffer that
# is averaged, and the averaged / checkpointed copy.
_BYTES_PER_PARAMETER = 4 * 4
# What an averaging method keeps besides: its outer optimizer's state (BMUF's filtered update,
# DiLoCo's momentum) and the block's update computed in each round.
_AVERAGER_BYTES_PER_PARAMETER = {"model": 0, "bmuf": 2 * 4, "diloco": 2 * 4}
# A lossy payload keeps the error-feedback residual and the delta (float32), its own encoding
# and the decoded sum: about 12 bytes more per parameter, not counting the gathered payloads.
_PAYLOAD_BYTES_PER_PARAMETER = 3 * 4


# ---------------------------------------------------------------------------------------------
# What a setting must be. A rule keeps its choices and bounds, so that a form (the dashboard)
# can offer exactly what `validate` accepts.


@dataclass(frozen=True)
class _Rule:
    ok: Callable[[Any], bool]
    text: str  # "must be <text>"
    choices: tuple[str, ...] | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False


def _int(low: int, high: int | None = None, text: str | None = None) -> _Rule:
    if text is None:
        text = "positive" if (low, high) == (1, None) else (
            f">= {low}" if high is None else f"in {low}..{high}")
    return _Rule(lambda v: v >= low and (high is None or v <= high), text, low=low, high=high)


def _real(low: float | None = None, high: float | None = None, *, low_open: bool = False,
          high_open: bool = False, text: str | None = None) -> _Rule:
    def ok(v: float) -> bool:
        if not math.isfinite(v):
            return False
        if low is not None and (v <= low if low_open else v < low):
            return False
        return high is None or (v < high if high_open else v <= high)

    if text is None:
        if low == 0 and low_open and high is None:
            text = "positive and finite"
        elif high is None:
            text = f"finite and >= {low}" if low is not None else "finite"
        else:
            text = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    return _Rule(ok, text, low=low, high=high, low_open=low_open, high_open=high_open)


def _choice(choices: tuple[str, ...]) -> _Rule:
    return _Rule(lambda v: v in choices, f"one of {', '.join(choices)}", choices=choices)


def _threads_limit() -> int:
    return THREADS_PER_CORE_LIMIT * (os.cpu_count() or 1)


_NONEMPTY = _Rule(lambda v: bool(v.strip()) and "\0" not in v, "a non-empty path")
_POSITIVE = _int(1)
_SEED = _int(0, SEED_LIMIT - 1)
_FINITE_POSITIVE = _real(0, low_open=True)
_LIMIT = _real(0, text="finite and >= 0 (0 turns the limit off)")
_DEVICE = _Rule(lambda v: v in ("cpu", "cuda", "auto") or re.fullmatch(r"cuda:\d+", v) is not None,
                "cpu, cuda, cuda:N or auto")
_THREADS = _Rule(lambda v: 1 <= v <= _threads_limit(),
                 f"in 1..{THREADS_PER_CORE_LIMIT} x the {os.cpu_count() or 1} CPUs of this machine",
                 low=1, high=_threads_limit())


def setting(default: Any = dataclasses.MISSING, help: str = "", rule: _Rule | None = None, *,
            flag: str | None = None, factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field with its help text, its rule and its command-line flag as metadata."""
    metadata = {"help": help, "rule": rule, "flag": flag}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


# ---------------------------------------------------------------------------------------------
# The settings.


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the DNN. The paper used 6 x 2048 sigmoid layers on 440 inputs."""

    hidden_layers: int = setting(4, "number of hidden layers", _int(0), flag="--hidden-layers")
    hidden_dim: int = setting(512, "units per hidden layer", _POSITIVE, flag="--hidden-dim")
    nonlinearity: str = setting("sigmoid", "activation of the hidden layers",
                                _choice(NONLINEARITIES), flag="--nonlinearity")
    pnorm_group: int = setting(5, "Kaldi's p-norm: hidden_dim inputs -> hidden_dim / group outputs",
                               _POSITIVE)
    pnorm_p: float = setting(2.0, "the p of the p-norm", _real(1, text="finite and >= 1 (a norm)"))


@dataclass
class DataConfig:
    """Where the frames come from and how they are cut into minibatches.

    `data` is a Kaldi data directory (feats.scp, cmvn.scp, utt2spk, ...) or a feature
    rspecifier. Labels come from `ali` (an rspecifier of pdf-id vectors), `ali_dir`
    (ali.*.gz + final.mdl, transition ids mapped to pdfs) or `textgrid` (TextGrid phone tiers);
    with none of them, a built-in corpus directory's own `pdf_ali.ark` is used.
    """

    data: str = setting("corpus", "Kaldi data directory or feature rspecifier", _NONEMPTY,
                        flag="--data")
    ali: str | None = setting(None, "rspecifier of pdf-id alignments (ark:..., scp:..., ark:...|)",
                              _NONEMPTY, flag="--ali")
    ali_dir: str | None = setting(None, "alignment directory with ali.*.gz and final.mdl",
                                  _NONEMPTY, flag="--ali-dir")
    textgrid: str | None = setting(None, "TextGrid file or directory of <utt>.TextGrid phone tiers",
                                   _NONEMPTY, flag="--textgrid")
    context: int = setting(5, "frames of context on each side (splice; Kaldi nnet1: 5)", _int(0),
                           flag="--context")
    cv_fraction: float = setting(0.1, "held-out utterances, as Kaldi nnet1",
                                 _real(0, 1, high_open=True))
    buffer_frames: int = setting(32768, "frames shuffled together (nnet1's --randomizer-size)",
                                 _POSITIVE)
    apply_cmvn: bool = setting(True, "apply cmvn.scp per speaker, as apply-cmvn")
    norm_vars: bool = setting(False, "CMVN normalises variances too (apply-cmvn --norm-vars)",
                              flag="--norm-vars")
    skip_mismatched: bool = setting(False, "drop utterances missing features or alignments",
                                    flag="--skip-mismatched")


@dataclass(frozen=True)
class NGConfig:
    """Settings of OnlineNaturalGradient (defaults: nnet2/nnet3 NaturalGradientAffineComponent)."""

    # The bounds of OnlineNaturalGradient::InitDefault (checked again in __post_init__).
    rank_in: int = setting(20, "rank of the input-side Fisher estimate", _POSITIVE)
    rank_out: int = setting(80, "rank of the output-side Fisher estimate", _POSITIVE)
    update_period: int = setting(4, "minibatches between Fisher updates", _POSITIVE)
    num_samples_history: float = setting(2000.0, "samples the Fisher estimate remembers",
                                         _real(0, 1e6, low_open=True))
    alpha: float = setting(4.0, "smoothing of the Fisher matrix towards the identity", _real(0))
    epsilon: float = setting(1.0e-10, "floor of the eigenvalues", _real(0, 1e-5, low_open=True))
    delta: float = setting(5.0e-4, "relative floor of the eigenvalues", _real(0, 1e-2, low_open=True))
    # Eta(): "don't let eta approach 1 too closely"
    max_eta: float = setting(0.9, "cap of the forgetting rate",
                             _real(0, 1, low_open=True, high_open=True))
    num_initial_updates: int = setting(10, "minibatches updated every time at first (Kaldi: 10)",
                                       _int(0))
    condition_threshold: float = setting(1.0e6, "PreconditionDirectionsInternal's condition limit",
                                         _FINITE_POSITIVE)
    orthogonality_threshold: float = setting(1.0e-3, "ReorthogonalizeRt1's threshold",
                                             _FINITE_POSITIVE)

    def __post_init__(self) -> None:
        # The same plausibility checks as OnlineNaturalGradient::InitDefault.
        checks = {
            "rank_in": self.rank_in > 0,
            "rank_out": self.rank_out > 0,
            "update_period": self.update_period > 0,
            "num_samples_history": 0.0 < self.num_samples_history <= 1.0e6,
            "alpha": self.alpha >= 0.0,
            "epsilon": 0.0 < self.epsilon <= 1.0e-5,
            "delta": 0.0 < self.delta <= 1.0e-2,
            "max_eta": 0.0 < self.max_eta < 1.0,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"bad NGConfig value(s) {', '.join(f'{k}={getattr(self, k)}' for k in bad)}")


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

    learn_rate: float = setting(0.4, "rbm_lrate, Bernoulli-Bernoulli RBMs", _FINITE_POSITIVE)
    learn_rate_gaussian: float = setting(0.01, "rbm_lrate_low, the Gaussian-Bernoulli RBM",
                                         _FINITE_POSITIVE)
    momentum: float = setting(0.5, "momentum at the start of a layer", _real(0, 1, high_open=True))
    momentum_max: float = setting(0.9, "momentum at the end of the ramp", _real(0, 1, high_open=True))
    momentum_steps: int = setting(40, "steps of the momentum ramp", _POSITIVE)
    momentum_ramp_frames: int = setting(20_000_000, "frames (all ranks) the momentum ramp lasts",
                                        _POSITIVE)
    l2_penalty: float = setting(2e-4, "L2 weight penalty", _real(0))
    minibatch_size: int = setting(100, "rbm-train-cd1-frmshuff --bunchsize", _POSITIVE)
    epochs: int = setting(1, "rbm_iter; the Gaussian-Bernoulli RBM trains for twice as many",
                          _POSITIVE)
    gaussian_input: bool = setting(True, "input_vis_type=gauss")
    param_stddev_first: float = setting(0.1, "initial weight stddev, first RBM", _FINITE_POSITIVE)
    param_stddev: float = setting(0.1, "initial weight stddev, later RBMs", _FINITE_POSITIVE)
    # Kaldi initialises a Bernoulli RBM's visible biases to logit(mean activation) measured on
    # a 10k-utterance subset; we measure on the first frames of this epoch-0 shard, all ranks
    # pooled.
    vis_bias_init_frames: int = setting(1_000_000, "frames measured for the visible biases",
                                        _POSITIVE)
    seed: int = setting(777, "random seed of the RBMs", _SEED)

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

    start_halving_impr: float = setting(0.01, "start halving below this CV improvement", _real())
    end_halving_impr: float = setting(0.001, "stop below this CV improvement", _real())
    halving_factor: float = setting(0.5, "learning-rate factor per halving",
                                    _real(0, 1, low_open=True))
    min_iters: int = setting(0, "epochs before stopping is allowed", _int(0))
    max_iters: int = setting(20, "most epochs", _POSITIVE)
    keep_lr_iters: int = setting(0, "epochs at the initial rate before halving may start", _int(0))
    criterion: str = setting("loss", "CV value compared: loss or frame_accuracy",
                             _choice(NEWBOB_CRITERIA))

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


@dataclass(frozen=True)
class BMUFConfig:
    """Blockwise model-update filtering (Chen & Huo 2016; labavg.averaging.methods, docs/averaging.md).

    Each round's change of the averaged model is filtered with block momentum before it is
    applied; a steady change is amplified by block_lr / (1 - momentum) in the long run, which
    is N, the factor plain averaging divides the workers' summed progress by, when momentum is
    1 - 1/N. The default 0.9 is that for N = 10, between the 2 and 32 workers a lab runs. The
    gain does what Su & Chen's N x learning rate does (lr_scaling = "linear"): with both, the
    factors multiply (docs/averaging.md).
    """

    momentum: float = setting(0.9, "block momentum (0: plain averaging; 1 - 1/ranks gives a "
                              "long-run gain of ranks)", _real(0, 1, high_open=True))
    block_lr: float = setting(1.0, "block learning rate: the share of each round's change "
                              "applied", _FINITE_POSITIVE)
    nesterov: bool = setting(True, "Nesterov block momentum: workers start each block from the "
                             "global model plus momentum x the filtered update")


@dataclass(frozen=True)
class DiLoCoConfig:
    """DiLoCo's outer optimizer (Douillard et al. 2023, the paper's values): SGD with Nesterov
    momentum on the outer gradient, the global model minus the average."""

    outer_lr: float = setting(0.7, "outer learning rate (1 with momentum 0: plain averaging)",
                              _FINITE_POSITIVE)
    momentum: float = setting(0.9, "outer momentum", _real(0, 1, high_open=True))
    nesterov: bool = setting(True, "Nesterov outer momentum (torch.optim.SGD's form)")


@dataclass(frozen=True)
class HierarchyConfig:
    """Hierarchical averaging (labavg.averaging.hierarchy.HierarchicalAverager, docs/averaging.md): the
    ranks of a node average every K minibatches (`average_every`), all ranks every `every`."""

    every: int = setting(0, "minibatches between averaging rounds across nodes, a multiple of "
                         "average_every (0: no hierarchy, every round across all ranks)", _int(0))
    node_size: int = setting(0, "ranks per node (0: the ranks sharing a host's memory; inproc "
                             "needs a number)", _int(0))


@dataclass
class TrainConfig:
    """Everything one training run needs. Defaults follow the paper where CPU time allows."""

    out: str = setting("runs/run", "run directory to write", flag="--out")
    backend: str = setting("inproc", "how the ranks talk", _choice(BACKENDS), flag="--backend")
    ranks: int = setting(1, "number of workers (num_jobs)", _POSITIVE, flag="--ranks")
    # the paper: 10 minibatches of 1024 frames
    average_every: int = setting(10, "minibatches between averaging rounds (K)", _POSITIVE,
                                 flag="--average-every")
    average_every_frames: int | None = setting(
        None, "frames between averaging rounds (K = round(frames / minibatch))", _POSITIVE,
        flag="--average-every-frames")
    averaging: str = setting("model", "how a round combines the models (model: plain average, "
                             "the paper; [bmuf], [diloco] tables)", _choice(AVERAGING),
                             flag="--averaging")
    reduce: str = setting("allreduce", "how the ranks compute the mean (allreduce: the backend's "
                          "collective; butterfly: recursive halving and doubling; ring)",
                          _choice(REDUCE), flag="--reduce")
    payload: str = setting("fp32", "what a round sends (fp32: the parameters; bf16, fp16, int: "
                           "their change since the last round, compressed)", _choice(PAYLOADS),
                           flag="--payload")
    payload_bits: int = setting(8, "bits per value of payload = int (4, 8 or 16)",
                                _Rule(lambda v: v in PAYLOAD_BITS, "4, 8 or 16 (the quantisation "
                                      "bits of payload = int)"),
                                flag="--payload-bits")
    error_feedback: bool = setting(True, "a lossy payload adds each rank's compression error to "
                                   "its next round's change (1-bit SGD, EF-SGD)")
    overlap: str = setting("none", "hide the round's mean behind the next K minibatches (eager: "
                           "one round late, the whole model; streaming: one fragment per round)",
                           _choice(OVERLAP), flag="--overlap")
    streaming_fragments: int = setting(4, "overlap = streaming: contiguous fragments of the "
                                       "model (whole parameter tensors), one synced per round",
                                       _POSITIVE)
    # the paper trains with natural-gradient SGD
    optimizer: str = setting("ngsgd", "optimizer", _choice(OPTIMIZERS), flag="--optimizer")
    lr: float = setting(0.008, "initial per-frame learning rate of one job (nnet1's default)",
                        _FINITE_POSITIVE, flag="--lr")
    final_lr: float | None = setting(None, "final learning rate (default 0.01 x lr, as the paper)",
                                     _FINITE_POSITIVE, flag="--final-lr")
    lr_scaling: str = setting("linear", "effective lr x num_jobs (linear, as the paper and "
                              "Kaldi), x sqrt(num_jobs), or none", _choice(LR_SCALING),
                              flag="--lr-scaling")
    schedule: str = setting("exponential", "learning-rate schedule", _choice(SCHEDULES),
                            flag="--schedule")
    pretrain: str = setting("none", "initialisation", _choice(PRETRAIN), flag="--pretrain")
    minibatch: int = setting(256, "frames per minibatch", _POSITIVE, flag="--minibatch")
    epochs: int = setting(2, "passes over the training data", _POSITIVE, flag="--epochs")
    seed: int = setting(0, "random seed", _SEED, flag="--seed")
    device: str = setting("cpu", "device", _DEVICE, flag="--device")
    threads: int = setting(1, "torch threads per process", _THREADS, flag="--threads")
    # nnet1's SGD, the paper's baseline, has no max-change; NG-SGD comes from nnet2/3 with it.
    max_change_per_sample: float | None = setting(
        None, "Kaldi's per-layer max-change per sample (default: 0.075 for ngsgd, off for sgd; "
        "0: off)", _LIMIT)
    max_param_change: float | None = setting(
        None, "Kaldi's whole-model max-change (default: 2.0 for ngsgd, off for sgd; 0: off)",
        _LIMIT)
    checkpoint_every: int = setting(50, "averaging rounds between checkpoints (and each epoch end)",
                                    _POSITIVE, flag="--checkpoint-every")
    log_every: int = setting(1, "minibatches between per-minibatch events", _POSITIVE)
    tensorboard: bool = setting(True, "write TensorBoard files")
    inject_fault: str | None = setting(None, 'a deliberate fault, e.g. "nan@rank1:step20" '
                                       "(labavg.base.faults)")
    watchdog_seconds: float = setting(
        120.0, "a rank silent this long ends the job (0: off; labavg.comm.watchdog)",
        _real(0, text="finite and >= 0 (0 turns the watchdog off)"))
    decode_data: str | None = setting(
        None, "decode this at the end (a data dir, or a corpus with dev/ and test/); "
        "summary.json gains wer and per", _NONEMPTY, flag="--decode-data")
    model: ModelConfig = setting(help="the DNN", factory=ModelConfig)
    data: DataConfig = setting(help="the data", factory=DataConfig)
    ngsgd: NGConfig = setting(help="natural-gradient SGD", factory=NGConfig)
    rbm: RBMConfig = setting(help="RBM pretraining", factory=RBMConfig)
    newbob: NewbobConfig = setting(help="the Newbob schedule", factory=NewbobConfig)
    bmuf: BMUFConfig = setting(help="block momentum (averaging = bmuf)", factory=BMUFConfig)
    diloco: DiLoCoConfig = setting(help="DiLoCo's outer optimizer (averaging = diloco)",
                                   factory=DiLoCoConfig)
    hierarchy: HierarchyConfig = setting(help="averaging within nodes, then across them",
                                         factory=HierarchyConfig)

    def averaging_interval(self) -> int:
        """K, the number of minibatches between averaging rounds."""
        if self.average_every_frames is not None:
            return max(1, round(self.average_every_frames / self.minibatch))
        return self.average_every

    def max_change_limits(self) -> tuple[float, float]:
        """(max_change_per_sample, max_param_change) in force: Kaldi nnet2's for NG-SGD,
        none for plain SGD unless set (0 means off)."""
        per_sample, whole = MAX_CHANGE_DEFAULTS[self.optimizer]
        return (per_sample if self.max_change_per_sample is None else self.max_change_per_sample,
                whole if self.max_param_change is None else self.max_param_change)

    def final_learning_rate(self) -> float:
        """The unscaled final learning rate (0.01 x initial unless set)."""
        return self.final_lr if self.final_lr is not None else 0.01 * self.lr


_SECTIONS = {"model": ModelConfig, "data": DataConfig, "ngsgd": NGConfig, "rbm": RBMConfig,
             "newbob": NewbobConfig, "bmuf": BMUFConfig, "diloco": DiLoCoConfig,
             "hierarchy": HierarchyConfig}
# The sections whose __post_init__ refuses bad values with a bare ValueError: their rules also
# run where they are built from plain values (TOML, --set, config.json), before the dataclass
# exists. The others stay buildable with bad values, so that a caller (a sweep naming its grid
# point) can build first and validate in its own try.
_SELF_CHECKING = (NGConfig, RBMConfig, NewbobConfig)
_RULES: dict[type, dict[str, _Rule]] = {
    cls: {f.name: f.metadata["rule"] for f in dataclasses.fields(cls) if f.metadata.get("rule")}
    for cls in (TrainConfig, *_SECTIONS.values())
}


@dataclass(frozen=True)
class Flag:
    """A command-line flag of `labavg train`, generated from a setting's metadata."""

    flag: str
    key: str  # dotted TrainConfig key
    kind: type  # int, float, str; bool for a switch (store_true)
    help: str


def cli_flags() -> list[Flag]:
    """The flags of every setting that declares one, in declaration order."""
    out: list[Flag] = []

    def walk(cls: type, prefix: str) -> None:
        hints = _field_types(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            if dataclasses.is_dataclass(hint):
                walk(hint, f"{prefix}{f.name}.")
            elif f.metadata.get("flag"):
                kind = next(a for a in typing.get_args(hint) or (hint,) if a is not type(None))
                rule = f.metadata["rule"]
                text = f.metadata["help"]
                if rule is not None and rule.choices:
                    text += ": " + " | ".join(rule.choices)
                out.append(Flag(f.metadata["flag"], prefix + f.name, kind, text))

    walk(TrainConfig, "")
    return out


def setting_field(dotted: str) -> dataclasses.Field:
    """The dataclass field of a dotted TrainConfig key (`model.hidden_dim`)."""
    cls: Any = TrainConfig
    *parents, leaf = dotted.split(".")
    for part in parents:
        cls = _field_types(cls)[part]
    return next(f for f in dataclasses.fields(cls) if f.name == leaf)


def _bad(key: str, text: str, value: Any) -> str:
    return f"{key} must be {text}; got {value!r}"


def _cross_checks(cls: type, v: Mapping[str, Any], prefix: str) -> str | None:
    """Checks that tie fields of one section together; the message, or None."""
    if cls is ModelConfig and v["nonlinearity"] == "pnorm" and v["hidden_dim"] % v["pnorm_group"]:
        return (f"{prefix}hidden_dim ({v['hidden_dim']}) must be a multiple of "
                f"{prefix}pnorm_group ({v['pnorm_group']})")
    if cls is RBMConfig:
        if v["momentum_max"] < v["momentum"]:
            return (f"{prefix}momentum_max ({v['momentum_max']!r}) must be >= {prefix}momentum "
                    f"({v['momentum']!r})")
        if v["momentum_ramp_frames"] < v["momentum_steps"]:
            return (f"{prefix}momentum_ramp_frames ({v['momentum_ramp_frames']}) must be >= "
                    f"{prefix}momentum_steps ({v['momentum_steps']})")
    if cls is TrainConfig and v["hierarchy"].every > 0:
        problem = _hierarchy_problem(v, v["ranks"] if v["backend"] == "inproc" or v["ranks"] > 1
                                     else None)
        if problem is not None:
            return problem
    if cls is TrainConfig and v["payload"] != "fp32" and v["reduce"] != "allreduce":
        # A compressed payload is gathered, not reduced: the reduce algorithms sum fp32.
        return (f"payload = {v['payload']!r} gathers the ranks' compressed changes and cannot "
                f"use reduce = {v['reduce']!r} (set reduce = \"allreduce\" or payload = \"fp32\")")
    if cls is TrainConfig and v["overlap"] != "none":
        problem = _overlap_problem(v)
        if problem is not None:
            return problem
    if cls is TrainConfig and v["data"].buffer_frames < v["minibatch"]:
        # FrameBatches needs a whole minibatch in its buffer.
        return (f"data.buffer_frames ({v['data'].buffer_frames}) must be at least the minibatch "
                f"({v['minibatch']})")
    return None


def _hierarchy_problem(v: Mapping[str, Any], size: int | None) -> str | None:
    """What is wrong with the [hierarchy] settings on `size` ranks (None: not known yet)."""
    h = v["hierarchy"]
    if v["average_every_frames"] is not None:
        k = max(1, round(v["average_every_frames"] / v["minibatch"]))
        k_name = f"K = {k} (average_every_frames = {v['average_every_frames']})"
    else:
        k, k_name = v["average_every"], f"average_every = {v['average_every']}"
    if h.every % k:
        return f"hierarchy.every = {h.every} is not a multiple of {k_name}"
    if h.node_size == 0 and v["backend"] == "inproc":
        return ("hierarchy.node_size = 0 (the hosts' shared-memory groups) cannot be told on "
                "backend 'inproc', whose ranks are threads of one process: set "
                "hierarchy.node_size")
    if size is not None and h.node_size > 0 and size % h.node_size:
        return f"hierarchy.node_size = {h.node_size} does not divide the {size} ranks"
    return None


def _overlap_problem(v: Mapping[str, Any]) -> str | None:
    """What `overlap` does not combine with (labavg.averaging.overlap, docs/averaging.md "Overlap")."""
    mode = v["overlap"]
    if v["hierarchy"].every > 0:
        return f"overlap = {mode} does not combine with hierarchy.every > 0 yet"
    if v["reduce"] != "allreduce":
        return (f"overlap = {mode} needs reduce = allreduce (the backend's non-blocking "
                f"collective); reduce = {v['reduce']} is a blocking exchange")
    if v["payload"] != "fp32":
        # The compressed payloads are gathered by a blocking allgather (labavg.averaging.payload).
        return (f"overlap = {mode} does not combine with payload = {v['payload']!r} yet "
                f"(set payload = \"fp32\" or overlap = \"none\")")
    tensors = 2 * (v["model"].hidden_layers + 1)  # a weight and a bias per affine layer
    if mode == "streaming" and v["streaming_fragments"] > tensors:
        return (f"streaming_fragments = {v['streaming_fragments']} exceeds the {tensors} "
                f"parameter tensors of a model with {v['model'].hidden_layers} hidden layers")
    return None


def check_hierarchy(cfg: TrainConfig, size: int) -> None:
    """UserError unless the [hierarchy] settings fit `size` ranks (the launched ones)."""
    if cfg.hierarchy.every > 0:
        problem = _hierarchy_problem(
            {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}, size)
        if problem is not None:
            raise UserError(problem)


def _check_fields(cls: type, values: Mapping[str, Any], prefix: str) -> str | None:
    """The first broken rule of one section's values (all fields present), or None."""
    for name, rule in _RULES.get(cls, {}).items():
        value = values[name]
        if value is not None and not rule.ok(value):
            return _bad(prefix + name, rule.text, value)
    return None


def _check_section(cls: type, values: Mapping[str, Any], prefix: str) -> str | None:
    return _check_fields(cls, values, prefix) or _cross_checks(cls, values, prefix)


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, hint: Any, source: str, key: str) -> Any:
    """Check a parsed value against a dataclass field's type hint (ints widen to floats)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, source, key)
            except UserError:
                continue
        names = " or ".join(getattr(a, "__name__", str(a)) for a in args)
        raise UserError(f"{source}: {key}: {value!r} is not a valid value (expected {names})")
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an integer literal beyond any float
                raise UserError(f"{source}: {key}: an integer of {value.bit_length()} bits is too "
                                "large for a number") from None
    elif hint is str:
        if isinstance(value, str):
            return value
    elif dataclasses.is_dataclass(hint):
        if isinstance(value, dict):
            return _from_dict(hint, value, source, key + ".")
        raise UserError(f"{source}: {key}: expected a table of settings, got {value!r}")
    else:
        return value
    name = getattr(hint, "__name__", str(hint))
    raise UserError(f"{source}: {key}: {value!r} is not a valid {name}")


def _from_dict(cls: type, values: Any, source: str, prefix: str = "") -> Any:
    if not isinstance(values, Mapping):
        where = f"{source}: {prefix[:-1]}" if prefix else source
        raise UserError(f"{where}: expected a table of settings, got {values!r}"[:300])
    hints = _field_types(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            raise UserError(f"{source}: unknown key {prefix}{key}; known keys: {', '.join(known)}")
        kwargs[key] = _coerce(value, hints[key], source, prefix + key)
    if cls in _SELF_CHECKING:
        merged = {f.name: getattr(cls(), f.name) for f in dataclasses.fields(cls)} | kwargs
        problem = _check_section(cls, merged, prefix)
        if problem is not None:
            raise UserError(f"{source}: {problem}")
    try:
        return cls(**kwargs)
    except ValueError as exc:  # a dataclass's own check that the rules above do not cover
        raise UserError(f"{source}: {prefix[:-1] or 'settings'}: {exc}") from None


def config_from_dict(values: Any, source: str = "config") -> TrainConfig:
    """Build a TrainConfig from nested plain values, naming `source` in every error."""
    return _from_dict(TrainConfig, values, source)


def load_config(path: str | Path) -> TrainConfig:
    """Parse a TOML file into a TrainConfig. Errors name the file, and the line for syntax."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise UserError(f"{path}: line {line}: not UTF-8 (byte {raw[exc.start]:#04x}); "
                        "TOML files are UTF-8") from None
    try:
        values = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: not valid TOML: {exc}") from None
    return config_from_dict(values, str(path))


def with_overrides(cfg: TrainConfig, overrides: dict[str, Any]) -> TrainConfig:
    """Return a copy of `cfg` with dotted keys (`model.hidden_dim`) replaced by values."""
    values = to_dict(cfg)
    for dotted, value in overrides.items():
        node = values
        *parents, leaf = dotted.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise UserError(f"unknown setting {dotted!r}")
            node = node[part]
        if leaf not in node:
            raise UserError(f"unknown setting {dotted!r}")
        node[leaf] = value
    return config_from_dict(values, "command line")


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config (JSON and TOML friendly, Nones kept)."""
    return dataclasses.asdict(cfg)


def check_setting(key: str, value: Any) -> str | None:
    """What is wrong with `value` for the one setting `key` (dotted), or None when it is good.

    The words are `validate`'s (and so the CLI's): "ranks must be positive; got 0". Only the
    setting's own rule is checked; what ties settings together needs the whole config
    (`validate`). For a form that checks each box as it is typed.
    """
    try:
        f = setting_field(key)
    except (KeyError, StopIteration):
        return f"unknown setting {key!r}"
    cls: Any = TrainConfig
    for part in key.split(".")[:-1]:
        cls = _field_types(cls)[part]
    hint = _field_types(cls)[f.name]
    rule = f.metadata["rule"]
    optional = type(None) in typing.get_args(hint)
    if value is None:
        if optional:
            return None
        return _bad(key, rule.text, value) if rule is not None else f"{key} needs a value"
    try:
        value = _coerce(value, hint, "setting", key)
    except UserError as exc:
        return str(exc).removeprefix("setting: ")
    if rule is not None and not rule.ok(value):
        return _bad(key, rule.text, value)
    return None


def check_directory(path: str | os.PathLike, key: str = "out",
                    what: str = "the run directory") -> str | None:
    """Why no directory can be written at `path`, or None: it must be a directory, or a new
    path under one, that this process may write into. Checked before anything is created,
    so that a run does not fail on its first write with a bare OSError."""
    text = str(path)
    target = Path(text).expanduser()
    try:
        if target.exists():
            if not target.is_dir():
                return f"{key} {text!r} is an existing file; {what} must be a directory or a new path"
            if not os.access(target, os.W_OK | os.X_OK):
                return f"{key} {text!r} is not writable"
            return None
        parent = target.absolute().parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
    except OSError as exc:  # a name too long, a loop of links
        return f"{key} {text!r} cannot be used: {exc.strerror}"
    if not parent.is_dir():
        return f"{key} {text!r} cannot be created: {parent} is a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{key} {text!r} cannot be created: {parent} is not writable"
    return None


# Named sets of overrides (dotted keys) of TrainConfig's defaults, for the dashboard's preset
# selector and `with_overrides`. Only what is trained changes, never ranks or K: runs of one
# preset then pair with its 1-rank runs for a speedup, whatever their ranks and K.
PRESETS: dict[str, dict[str, Any]] = {
    # A model small enough that a class sees it learn in minutes: on the 1 h built-in corpus,
    # 1 rank, 2 epochs took 106 s of training and reached 65.1 % CV frame accuracy (the
    # defaults' 4 x 512: 68.0 %, docs/corpus.md) on a shared 2-core machine. The paper's
    # optimizer and schedule, as the defaults.
    "teaching": {"model.hidden_layers": 2, "model.hidden_dim": 256, "epochs": 2},
}


def preset_config(name: str, cfg: TrainConfig | None = None) -> TrainConfig:
    """`cfg` (TrainConfig's defaults unless given) with preset `name`'s overrides."""
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return with_overrides(TrainConfig() if cfg is None else cfg, PRESETS[name])


# ---------------------------------------------------------------------------------------------
# Memory.


def parameter_count(cfg: ModelConfig, input_dim: int, num_pdfs: int) -> int:
    """Trainable scalars a DNN of `cfg` would have, computed without building it.

    Python integers, so an absurd shape gives an exact huge number rather than an overflow;
    `labavg.base.config.check_model_size` uses it to refuse a model before anything is allocated.
    """
    out_dim = cfg.hidden_dim // cfg.pnorm_group if cfg.nonlinearity == "pnorm" else cfg.hidden_dim
    total, dim = 0, input_dim
    for _ in range(min(cfg.hidden_layers, 1)):
        total += (dim + 1) * cfg.hidden_dim
        dim = out_dim
    # The layers after the first are all alike: no loop, so 10**12 layers cost nothing here.
    total += max(cfg.hidden_layers - 1, 0) * (out_dim + 1) * cfg.hidden_dim
    return total + (dim + 1) * num_pdfs


def physical_memory() -> int | None:
    """Bytes of physical memory of this machine (os.sysconf), or None where it cannot tell."""
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return pages * page_size if pages > 0 and page_size > 0 else None


def estimate_memory(cfg: TrainConfig, input_dim: int, num_pdfs: int) -> int:
    """Bytes one process of `cfg` needs for its model(s), minibatches and frame buffer.

    Per worker: 16 bytes per parameter (see _BYTES_PER_PARAMETER; 8 more for the outer state of
    averaging = bmuf or diloco), the spliced frame buffer,
    and the activations of a minibatch with their gradients. An inproc run holds all its
    workers in one process; an MPI or torch rank holds one (ranks may be on other machines).
    """
    m = cfg.model
    params = parameter_count(m, input_dim, num_pdfs)
    widths = input_dim + 2 * m.hidden_layers * m.hidden_dim + num_pdfs
    buffer = max(cfg.data.buffer_frames, cfg.minibatch, cfg.rbm.minibatch_size) * input_dim * 4
    per_parameter = _BYTES_PER_PARAMETER + _AVERAGER_BYTES_PER_PARAMETER.get(cfg.averaging, 0)
    if cfg.payload != "fp32":
        per_parameter += _PAYLOAD_BYTES_PER_PARAMETER
    per_worker = params * per_parameter + buffer + 2 * 4 * cfg.minibatch * widths
    return per_worker * (cfg.ranks if cfg.backend == "inproc" else 1)


def check_model_size(cfg: TrainConfig, input_dim: int, num_pdfs: int,
                     memory: int | None = None) -> int:
    """UserError unless `estimate_memory` fits in MEMORY_FRACTION of physical memory.

    Call it with the real input dim (feature dim x (2 context + 1)) and number of pdfs once
    the data is open, before the model is built. `memory` (bytes) replaces the machine's
    physical memory (tests); where neither is known the check passes. Returns the estimate.
    """
    need = estimate_memory(cfg, input_dim, num_pdfs)
    memory = physical_memory() if memory is None else memory
    if memory is not None and need > MEMORY_FRACTION * memory:
        m = cfg.model
        params = parameter_count(m, input_dim, num_pdfs)
        workers = f" for {cfg.ranks} inproc workers" if cfg.backend == "inproc" and cfg.ranks > 1 else ""
        raise UserError(
            f"the model does not fit in memory: model.hidden_layers={m.hidden_layers}, "
            f"model.hidden_dim={m.hidden_dim}, minibatch={cfg.minibatch}, "
            f"data.buffer_frames={cfg.data.buffer_frames} on {input_dim} inputs and {num_pdfs} "
            f"pdfs give {params:.3g} parameters, about {need / 2**30:.3g} GiB{workers}; the "
            f"limit is {MEMORY_FRACTION:g} of this machine's {memory / 2**30:.3g} GiB"
        )
    return need


# ---------------------------------------------------------------------------------------------


def validate(cfg: TrainConfig) -> TrainConfig:
    """Raise UserError naming the first bad value; return cfg unchanged when all are good.

    Every field of every section is checked (the rules above), then what ties them together,
    the run directory, and the model's size for the smallest plausible data.
    """
    sections = [(type(cfg), {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}, "")]
    sections += [(type(getattr(cfg, name)), dataclasses.asdict(getattr(cfg, name)), name + ".")
                 for name in _SECTIONS]
    # Single values first: a cross-field message about a value that is itself bad would
    # point at the wrong key.
    for check in (_check_fields, _cross_checks):
        for cls, values, prefix in sections:
            problem = check(cls, values, prefix)
            if problem is not None:
                raise UserError(problem)
    if not _NONEMPTY.ok(cfg.out):
        raise UserError(_bad("out", "a non-empty path (the run directory)", cfg.out))
    problem = check_directory(cfg.out, "out", "the run directory")
    if problem is not None:
        raise UserError(problem)
    if cfg.pretrain == "rbm" and cfg.model.nonlinearity != "sigmoid":
        raise UserError("pretrain = 'rbm' initialises sigmoid layers; set model.nonlinearity = 'sigmoid'")
    if cfg.inject_fault is not None:
        fault = parse_fault(cfg.inject_fault)
        if fault.kind == "kill" and cfg.backend == "inproc":
            raise UserError("inject_fault 'kill' needs processes: use backend 'mpi' or 'torch'")
        if fault.rank >= cfg.ranks:
            raise UserError(f"inject_fault names rank {fault.rank} but the run has {cfg.ranks} ranks")
    check_model_size(cfg, MIN_FEAT_DIM * (2 * cfg.data.context + 1), MIN_NUM_PDFS)
    return cfg
