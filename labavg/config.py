"""Run configuration: plain dataclasses, loaded from TOML and overridden by CLI flags.

A TOML file holds the training keys at the top level and one table per part:
`[model]`, `[data]`, `[ngsgd]`, `[rbm]`, `[newbob]`. Files are parsed, never executed.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labavg.errors import UserError
from labavg.faults import parse_fault
from labavg.model import NONLINEARITIES, ModelConfig
from labavg.optim.ngsgd import NGConfig
from labavg.rbm import RBMConfig
from labavg.schedules import NewbobConfig

BACKENDS = ("inproc", "mpi", "torch")
OPTIMIZERS = ("sgd", "ngsgd")
SCHEDULES = ("exponential", "newbob")
PRETRAIN = ("none", "rbm")
LR_SCALING = ("none", "linear")


@dataclass
class DataConfig:
    """Where the frames come from and how they are cut into minibatches.

    `data` is a Kaldi data directory (feats.scp, cmvn.scp, utt2spk, ...) or a feature
    rspecifier. Labels come from `ali` (an rspecifier of pdf-id vectors), `ali_dir`
    (ali.*.gz + final.mdl, transition ids mapped to pdfs) or `textgrid` (TextGrid phone tiers);
    with none of them, a built-in corpus directory's own `pdf_ali.ark` is used.
    """

    data: str = "corpus"
    ali: str | None = None
    ali_dir: str | None = None
    textgrid: str | None = None
    context: int = 5  # splice +-5 frames, as Kaldi nnet1
    cv_fraction: float = 0.1  # held-out utterances, as Kaldi nnet1
    buffer_frames: int = 32768  # nnet1's --randomizer-size
    apply_cmvn: bool = True
    norm_vars: bool = False
    skip_mismatched: bool = False


@dataclass
class TrainConfig:
    """Everything one training run needs. Defaults follow the paper where CPU time allows."""

    out: str = "runs/run"
    backend: str = "inproc"
    ranks: int = 1
    average_every: int = 10  # minibatches between averaging rounds (paper: 10 x 1024 frames)
    average_every_frames: int | None = None  # if set, K = round(frames / minibatch)
    optimizer: str = "ngsgd"  # the paper trains with natural-gradient SGD
    lr: float = 0.008  # per-frame learning rate of one job (nnet1's default)
    final_lr: float | None = None  # default 0.01 x initial, as in the paper
    lr_scaling: str = "linear"  # effective lr x num_jobs, as the paper and Kaldi
    schedule: str = "exponential"
    pretrain: str = "none"
    minibatch: int = 256
    epochs: int = 2
    seed: int = 0
    device: str = "cpu"
    threads: int = 1  # torch threads per process
    max_change_per_sample: float = 0.075
    max_param_change: float = 2.0
    checkpoint_every: int = 50  # averaging rounds between checkpoints (and at each epoch end)
    log_every: int = 1  # minibatches between per-minibatch events
    tensorboard: bool = True
    inject_fault: str | None = None  # e.g. "nan@rank1:step20" (labavg.faults)
    watchdog_seconds: float = 120.0  # a rank silent this long ends the job (0: off); labavg.watchdog
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    ngsgd: NGConfig = field(default_factory=NGConfig)
    rbm: RBMConfig = field(default_factory=RBMConfig)
    newbob: NewbobConfig = field(default_factory=NewbobConfig)

    def averaging_interval(self) -> int:
        """K, the number of minibatches between averaging rounds."""
        if self.average_every_frames is not None:
            return max(1, round(self.average_every_frames / self.minibatch))
        return self.average_every

    def final_learning_rate(self) -> float:
        """The unscaled final learning rate (0.01 x initial unless set)."""
        return self.final_lr if self.final_lr is not None else 0.01 * self.lr


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, hint: Any, where: str) -> Any:
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
                return _coerce(value, arg, where)
            except UserError:
                continue
        raise UserError(f"{where}: {value!r} is not a valid value (expected {hint})")
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif dataclasses.is_dataclass(hint):
        if isinstance(value, dict):
            return _from_dict(hint, value, where)
    else:
        return value
    name = getattr(hint, "__name__", str(hint))
    raise UserError(f"{where}: {value!r} is not a valid {name}")


def _from_dict(cls: type, values: dict[str, Any], where: str) -> Any:
    hints = _field_types(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            raise UserError(f"{where}: unknown key {key!r}; known keys: {', '.join(known)}")
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}")
    return cls(**kwargs)


def config_from_dict(values: dict[str, Any], source: str = "config") -> TrainConfig:
    """Build a TrainConfig from nested plain values, naming `source` in every error."""
    return _from_dict(TrainConfig, values, source)


def load_config(path: str | Path) -> TrainConfig:
    """Parse a TOML file into a TrainConfig. Errors name the file, and the line for syntax."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"cannot read config file {path}: {exc.strerror}") from None
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


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UserError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise UserError(f"{name} must be positive; got {value!r}")


def validate(cfg: TrainConfig) -> TrainConfig:
    """Raise UserError naming the first bad value; return cfg unchanged when all are good."""
    _check_choice("backend", cfg.backend, BACKENDS)
    _check_choice("optimizer", cfg.optimizer, OPTIMIZERS)
    _check_choice("schedule", cfg.schedule, SCHEDULES)
    _check_choice("pretrain", cfg.pretrain, PRETRAIN)
    _check_choice("lr_scaling", cfg.lr_scaling, LR_SCALING)
    _check_choice("model.nonlinearity", cfg.model.nonlinearity, NONLINEARITIES)
    for name in ("ranks", "average_every", "minibatch", "epochs", "threads", "checkpoint_every",
                 "log_every"):
        _check_positive(name, getattr(cfg, name))
    for name in ("lr", "max_change_per_sample", "max_param_change"):
        _check_positive(name, getattr(cfg, name))
    if cfg.final_lr is not None:
        _check_positive("final_lr", cfg.final_lr)
    if cfg.average_every_frames is not None:
        _check_positive("average_every_frames", cfg.average_every_frames)
    _check_positive("model.hidden_dim", cfg.model.hidden_dim)
    if cfg.model.hidden_layers < 0:
        raise UserError(f"model.hidden_layers must be >= 0; got {cfg.model.hidden_layers}")
    if cfg.model.nonlinearity == "pnorm" and cfg.model.hidden_dim % cfg.model.pnorm_group:
        raise UserError(
            f"model.hidden_dim ({cfg.model.hidden_dim}) must be a multiple of "
            f"model.pnorm_group ({cfg.model.pnorm_group})"
        )
    if cfg.pretrain == "rbm" and cfg.model.nonlinearity != "sigmoid":
        raise UserError("pretrain = 'rbm' initialises sigmoid layers; set model.nonlinearity = 'sigmoid'")
    if cfg.inject_fault is not None:
        fault = parse_fault(cfg.inject_fault)
        if fault.kind == "kill" and cfg.backend == "inproc":
            raise UserError("inject_fault 'kill' needs processes: use backend 'mpi' or 'torch'")
        if fault.rank >= cfg.ranks:
            raise UserError(f"inject_fault names rank {fault.rank} but the run has {cfg.ranks} ranks")
    if cfg.data.context < 0:
        raise UserError(f"data.context must be >= 0; got {cfg.data.context}")
    if not 0 <= cfg.data.cv_fraction < 1:
        raise UserError(f"data.cv_fraction must be in [0, 1); got {cfg.data.cv_fraction}")
    if cfg.device not in ("cpu", "cuda", "auto") and not cfg.device.startswith("cuda:"):
        raise UserError(f"device must be cpu, cuda, cuda:N or auto; got {cfg.device!r}")
    return cfg
