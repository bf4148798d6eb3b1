"""Run configuration: plain dataclasses, loaded from TOML and overridden by CLI flags.

A TOML file holds the training keys at the top level and one table per part:
`[model]`, `[data]`, `[ngsgd]`, `[rbm]`, `[newbob]`. Files are parsed, never executed.
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

from labavg.errors import UserError
from labavg.faults import parse_fault
from labavg.model import NONLINEARITIES, ModelConfig, parameter_count
from labavg.optim.ngsgd import NGConfig
from labavg.rbm import RBMConfig
from labavg.schedules import NEWBOB_CRITERIA, NewbobConfig

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
    decode_data: str | None = None  # decoded at the end: a data dir, or a corpus with dev/, test/
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


# ---------------------------------------------------------------------------------------------
# What each setting must be; `validate` checks them all. The sections in _SELF_CHECKING refuse
# bad values in __post_init__ with a bare ValueError, so their rules also run where they are
# built from plain values (TOML, --set, config.json), before the dataclass exists. The others
# stay buildable with bad values, so that a caller (a sweep naming its grid point) can build
# first and validate in its own try.

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


@dataclass(frozen=True)
class _Rule:
    ok: Callable[[Any], bool]
    text: str  # "must be <text>"


def _int(low: int, high: int | None = None, text: str | None = None) -> _Rule:
    if text is None:
        text = "positive" if (low, high) == (1, None) else (
            f">= {low}" if high is None else f"in {low}..{high}")
    return _Rule(lambda v: v >= low and (high is None or v <= high), text)


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
    return _Rule(ok, text)


def _choice(choices: tuple[str, ...]) -> _Rule:
    return _Rule(lambda v: v in choices, f"one of {', '.join(choices)}")


def _threads_limit() -> int:
    return THREADS_PER_CORE_LIMIT * (os.cpu_count() or 1)


_NONEMPTY = _Rule(lambda v: bool(v.strip()) and "\0" not in v, "a non-empty path")
_POSITIVE = _int(1)
_SEED = _int(0, SEED_LIMIT - 1)
_FINITE_POSITIVE = _real(0, low_open=True)
_LIMIT = _real(0, text="finite and >= 0 (0 turns the limit off)")
_DEVICE = _Rule(lambda v: v in ("cpu", "cuda", "auto") or re.fullmatch(r"cuda:\d+", v) is not None,
                "cpu, cuda, cuda:N or auto")

_RULES: dict[type, dict[str, _Rule]] = {
    TrainConfig: {
        "backend": _choice(BACKENDS),
        "ranks": _POSITIVE,
        "average_every": _POSITIVE,
        "average_every_frames": _POSITIVE,
        "optimizer": _choice(OPTIMIZERS),
        "lr": _FINITE_POSITIVE,
        "final_lr": _FINITE_POSITIVE,
        "lr_scaling": _choice(LR_SCALING),
        "schedule": _choice(SCHEDULES),
        "pretrain": _choice(PRETRAIN),
        "minibatch": _POSITIVE,
        "epochs": _POSITIVE,
        "seed": _SEED,
        "device": _DEVICE,
        "threads": _Rule(lambda v: 1 <= v <= _threads_limit(),
                         f"in 1..{THREADS_PER_CORE_LIMIT} x the {os.cpu_count() or 1} CPUs "
                         "of this machine"),
        "max_change_per_sample": _LIMIT,
        "max_param_change": _LIMIT,
        "checkpoint_every": _POSITIVE,
        "log_every": _POSITIVE,
        "watchdog_seconds": _real(0, text="finite and >= 0 (0 turns the watchdog off)"),
        "decode_data": _NONEMPTY,
    },
    ModelConfig: {
        "hidden_layers": _int(0),
        "hidden_dim": _POSITIVE,
        "nonlinearity": _choice(NONLINEARITIES),
        "pnorm_group": _POSITIVE,
        "pnorm_p": _real(1, text="finite and >= 1 (a norm)"),
    },
    DataConfig: {
        "data": _NONEMPTY,
        "ali": _NONEMPTY,
        "ali_dir": _NONEMPTY,
        "textgrid": _NONEMPTY,
        "context": _int(0),
        "cv_fraction": _real(0, 1, high_open=True),
        "buffer_frames": _POSITIVE,
    },
    # The bounds of OnlineNaturalGradient::InitDefault (NGConfig.__post_init__), plus finiteness.
    NGConfig: {
        "rank_in": _POSITIVE,
        "rank_out": _POSITIVE,
        "update_period": _POSITIVE,
        "num_samples_history": _real(0, 1e6, low_open=True),
        "alpha": _real(0),
        "epsilon": _real(0, 1e-5, low_open=True),
        "delta": _real(0, 1e-2, low_open=True),
        "max_eta": _real(0, 1, low_open=True, high_open=True),
        "num_initial_updates": _int(0),
        "condition_threshold": _FINITE_POSITIVE,
        "orthogonality_threshold": _FINITE_POSITIVE,
    },
    RBMConfig: {
        "learn_rate": _FINITE_POSITIVE,
        "learn_rate_gaussian": _FINITE_POSITIVE,
        "momentum": _real(0, 1, high_open=True),
        "momentum_max": _real(0, 1, high_open=True),
        "momentum_steps": _POSITIVE,
        "momentum_ramp_frames": _POSITIVE,
        "l2_penalty": _real(0),
        "minibatch_size": _POSITIVE,
        "epochs": _POSITIVE,
        "param_stddev_first": _FINITE_POSITIVE,
        "param_stddev": _FINITE_POSITIVE,
        "vis_bias_init_frames": _POSITIVE,
        "seed": _SEED,
    },
    NewbobConfig: {
        "start_halving_impr": _real(),
        "end_halving_impr": _real(),
        "halving_factor": _real(0, 1, low_open=True),
        "min_iters": _int(0),
        "max_iters": _POSITIVE,
        "keep_lr_iters": _int(0),
        "criterion": _choice(NEWBOB_CRITERIA),
    },
}
_SELF_CHECKING = (NGConfig, RBMConfig, NewbobConfig)
_SECTIONS = {"model": ModelConfig, "data": DataConfig, "ngsgd": NGConfig, "rbm": RBMConfig,
             "newbob": NewbobConfig}


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
    if cls is TrainConfig and v["data"].buffer_frames < v["minibatch"]:
        # FrameBatches needs a whole minibatch in its buffer.
        return (f"data.buffer_frames ({v['data'].buffer_frames}) must be at least the minibatch "
                f"({v['minibatch']})")
    return None


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


# ---------------------------------------------------------------------------------------------
# Memory.


def physical_memory() -> int | None:
    """Bytes of physical memory of this machine (os.sysconf), or None where it cannot tell."""
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return pages * page_size if pages > 0 and page_size > 0 else None


def estimate_memory(cfg: TrainConfig, input_dim: int, num_pdfs: int) -> int:
    """Bytes one process of `cfg` needs for its model(s), minibatches and frame buffer.

    Per worker: 16 bytes per parameter (see _BYTES_PER_PARAMETER), the spliced frame buffer,
    and the activations of a minibatch with their gradients. An inproc run holds all its
    workers in one process; an MPI or torch rank holds one (ranks may be on other machines).
    """
    m = cfg.model
    params = parameter_count(m, input_dim, num_pdfs)
    widths = input_dim + 2 * m.hidden_layers * m.hidden_dim + num_pdfs
    buffer = max(cfg.data.buffer_frames, cfg.minibatch, cfg.rbm.minibatch_size) * input_dim * 4
    per_worker = params * _BYTES_PER_PARAMETER + buffer + 2 * 4 * cfg.minibatch * widths
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
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"out {cfg.out!r} is an existing file; the run directory must be a "
                        "directory or a new path")
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
