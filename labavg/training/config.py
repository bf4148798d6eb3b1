"""A training run's settings: the TrainConfig composite of every section, its validation,
presets and memory check.

Each section is declared next to the code it configures ([model], [rbm], [newbob] in
labavg.training.settings, [data] in labavg.data.settings, [ngsgd] in labavg.optim.settings,
[averaging] with its [averaging.hierarchy] in labavg.averaging.settings, each method's table
with its declaration in labavg.averaging.registry); the machinery that declares, checks and
lists them is labavg.base.schema, the one that reads and writes their values
labavg.base.settings. A TOML file holds the training keys at the top level and one table per
section. Importing this module, or validating with it, imports no torch.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from labavg.averaging.registry import methods
from labavg.averaging.settings import MOVED_TO_AVERAGING, AveragingConfig
from labavg.base.errors import UserError
from labavg.base.faults import parse_fault
from labavg.base.paths import check_directory
from labavg.base.schema import (FINITE_POSITIVE, NONEMPTY, POSITIVE, SEED, Flag, Rule, bad,
                                field_of, flags, integer, one_of, real, setting, type_of)
from labavg.base.settings import (check_value, first_named_problem, from_dict, load_toml, named,
                                  with_overrides)
from labavg.comm.settings import BACKENDS, ON_RANK_LOSS, ElasticConfig
from labavg.data.settings import DataConfig
from labavg.optim.settings import MAX_CHANGE_DEFAULTS, OPTIMIZERS, NGConfig
from labavg.training.memory import (BYTES_PER_PARAMETER, MEMORY_FRACTION, MIN_FEAT_DIM,
                                    MIN_NUM_PDFS, PAYLOAD_BYTES_PER_PARAMETER, parameter_count,
                                    physical_memory)
from labavg.training.settings import (LR_SCALING, PRETRAIN, SCHEDULES, ModelConfig,
                                      NewbobConfig, RBMConfig)

# torch's intra-op pool gains nothing past the cores (4x leaves room for SMT and for
# oversubscription experiments), and a pool of 10^5 threads makes OpenMP fail inside torch
# with a segfault rather than an error.
THREADS_PER_CORE_LIMIT = 4


def _threads_limit() -> int:
    return THREADS_PER_CORE_LIMIT * (os.cpu_count() or 1)


LIMIT = real(0, text="finite and >= 0 (0 turns the limit off)")
# A count of ranks past any machine or cluster this lab runs on: one process or thread each.
MAX_RANKS = 1 << 20
# 30 days: a wait longer than the platform's time_t (watchdog_seconds = 1e308) fails inside the
# collectives mid-run; a longer silence is no run's legitimate work.
WATCHDOG_LIMIT_S = 30 * 24 * 3600
# Past any run's length in minibatches: a check that never comes is a typo, not a setting.
CV_EVERY_LIMIT = 10**9
DEVICE = Rule(lambda v: v in ("cpu", "cuda", "auto") or re.fullmatch(r"cuda:\d+", v) is not None,
              "cpu, cuda, cuda:N or auto")
THREADS = Rule(lambda v: 1 <= v <= _threads_limit(),
               f"in 1..{THREADS_PER_CORE_LIMIT} x the {os.cpu_count() or 1} CPUs of this machine",
               low=1, high=_threads_limit())


@dataclass
class TrainConfig:
    """Everything one training run needs. Defaults follow the paper where CPU time allows."""

    out: str = setting("runs/run", "run directory to write", flag="--out")
    backend: str = setting("inproc", "how the ranks talk", one_of(BACKENDS), flag="--backend")
    ranks: int = setting(1, "number of workers (num_jobs)", POSITIVE, flag="--ranks")
    # the paper trains with natural-gradient SGD
    optimizer: str = setting("ngsgd", "optimizer", one_of(OPTIMIZERS), flag="--optimizer")
    lr: float = setting(0.008, "initial per-frame learning rate of one job (nnet1's default)",
                        FINITE_POSITIVE, flag="--lr")
    final_lr: float | None = setting(None, "final learning rate (default 0.01 x lr, as the paper)",
                                     FINITE_POSITIVE, flag="--final-lr")
    lr_scaling: str = setting("linear", "effective lr x num_jobs (linear, as the paper and "
                              "Kaldi), x sqrt(num_jobs), or none", one_of(LR_SCALING),
                              flag="--lr-scaling")
    schedule: str = setting("exponential", "learning-rate schedule", one_of(SCHEDULES),
                            flag="--schedule")
    pretrain: str = setting("none", "initialisation", one_of(PRETRAIN), flag="--pretrain")
    minibatch: int = setting(256, "frames per minibatch", POSITIVE, flag="--minibatch")
    epochs: int = setting(2, "passes over the training data", POSITIVE, flag="--epochs")
    seed: int = setting(0, "random seed", SEED, flag="--seed")
    device: str = setting("cpu", "device", DEVICE, flag="--device")
    threads: int = setting(1, "torch threads per process", THREADS, flag="--threads")
    # nnet1's SGD, the paper's baseline, has no max-change; NG-SGD comes from nnet2/3 with it.
    max_change_per_sample: float | None = setting(
        None, "Kaldi's per-layer max-change per sample (default: 0.075 for ngsgd, off for sgd; "
        "0: off)", LIMIT)
    max_param_change: float | None = setting(
        None, "Kaldi's whole-model max-change (default: 2.0 for ngsgd, off for sgd; 0: off)",
        LIMIT)
    checkpoint_every: int = setting(50, "averaging rounds between checkpoints (and each epoch end)",
                                    POSITIVE, flag="--checkpoint-every")
    log_every: int = setting(1, "minibatches between per-minibatch events", POSITIVE)
    cv_every: int = setting(
        0, "minibatches between held-out CV checks inside epochs, of the mean of the workers' "
        "models, off the training clock (a 'cv' event each; 0: off, CV at epoch ends only)",
        integer(0, CV_EVERY_LIMIT, text=f"in 0..{CV_EVERY_LIMIT} minibatches (0 turns the "
                "checks off)"), flag="--cv-every")
    speedup_pairs: int = setting(
        5, "paired speedup measurements in a run of several ranks: rank 0 trains a few "
        "minibatches alone between two rounds, then all ranks train (labavg.jobs.speedup; 0: none)",
        integer(0, 100), flag="--speedup-pairs")
    tensorboard: bool = setting(True, "write TensorBoard files")
    inject_fault: str | None = setting(None, 'a deliberate fault, e.g. "nan@rank1:step20" '
                                       "(labavg.base.faults)")
    watchdog_seconds: float = setting(
        120.0, "a rank silent this long ends the job (0: off; labavg.comm.watchdog)",
        real(0, WATCHDOG_LIMIT_S, text=f"in [0, {WATCHDOG_LIMIT_S}] seconds (0 turns the "
             "watchdog off)"))
    decode_data: str | None = setting(
        None, "decode this at the end (a data dir, or a corpus with dev/ and test/); "
        "summary.json gains wer and per", NONEMPTY, flag="--decode-data")
    model: ModelConfig = setting(help="the DNN", factory=ModelConfig)
    data: DataConfig = setting(help="the data", factory=DataConfig)
    ngsgd: NGConfig = setting(help="natural-gradient SGD", factory=NGConfig)
    rbm: RBMConfig = setting(help="RBM pretraining", factory=RBMConfig)
    newbob: NewbobConfig = setting(help="the Newbob schedule", factory=NewbobConfig)
    averaging: AveragingConfig = setting(help="how the workers average (the averager's plan)",
                                         factory=AveragingConfig)
    on_rank_loss: str = setting("stop", "when a worker is lost: stop the job (then --resume), "
                                "or continue averaging among those present (backend torch, "
                                "through torchft)", one_of(ON_RANK_LOSS))
    elastic: ElasticConfig = setting(help="the quorum of on_rank_loss = \"continue\"",
                                     factory=ElasticConfig)

    # Keys of an earlier labavg that are now in [averaging]; a file with one is refused with
    # where each went.
    MOVED: ClassVar[dict[str, str]] = MOVED_TO_AVERAGING

    def effective_average_every(self) -> int:
        """K, the minibatches between averaging rounds (averaging.average_every, or
        averaging.average_every_frames over the minibatch)."""
        return self.averaging.effective_average_every(self.minibatch)

    def max_change_limits(self) -> tuple[float, float]:
        """(max_change_per_sample, max_param_change) in force: Kaldi nnet2's for NG-SGD,
        none for plain SGD unless set (0 means off)."""
        per_sample, whole = MAX_CHANGE_DEFAULTS[self.optimizer]
        return (per_sample if self.max_change_per_sample is None else self.max_change_per_sample,
                whole if self.max_param_change is None else self.max_param_change)

    def final_learning_rate(self) -> float:
        """The unscaled final learning rate (0.01 x initial unless set)."""
        return self.final_lr if self.final_lr is not None else 0.01 * self.lr

    def problem(self, prefix: str = "") -> str | None:
        """What ties the run's settings and sections together; the message, or None."""
        if self.ranks > MAX_RANKS:  # before any check that multiplies by it (memory)
            return (f"ranks = {self.ranks} is more ranks than labavg starts (at most "
                    f"{MAX_RANKS})")
        if self.averaging.hierarchy.across_nodes_every > 0:
            problem = self.hierarchy_problem(
                self.ranks if self.backend == "inproc" or self.ranks > 1 else None)
            if problem is not None:
                return problem
        if self.on_rank_loss == "continue":
            problem = self.elastic_problem()
            if problem is not None:
                return problem
        tensors = 2 * (self.model.hidden_layers + 1)  # a weight and a bias per affine layer
        fragments = self.averaging.streaming_fragments
        if self.averaging.overlap == "streaming" and fragments > tensors:
            return (f"averaging.streaming_fragments = {fragments} exceeds the {tensors} "
                    f"parameter tensors of a model with {self.model.hidden_layers} hidden layers")
        if self.data.buffer_frames < self.minibatch:
            # FrameBatches needs a whole minibatch in its buffer.
            return (f"data.buffer_frames ({self.data.buffer_frames}) must be at least the "
                    f"minibatch ({self.minibatch})")
        return None

    def elastic_problem(self) -> str | None:
        """What on_rank_loss = "continue" does not combine with (labavg.comm.elastic)."""
        why = None
        if self.backend != "torch":
            why = f"backend = {self.backend!r}: elastic runs are torch processes under torchft"
        elif self.averaging.hierarchy.across_nodes_every > 0:
            why = "averaging.hierarchy: a node group has no elastic form"
        elif self.averaging.schedule != "constant":
            why = (f"averaging.schedule = {self.averaging.schedule!r}: a worker joining would "
                   f"need the schedule's state, which the heal does not carry yet")
        elif self.averaging.overlap != "none":
            why = (f"averaging.overlap = {self.averaging.overlap!r}: a worker joins as a round "
                   f"opens, and an overlapped round is still in flight then")
        elif self.averaging.reduce != "allreduce":
            why = (f"averaging.reduce = {self.averaging.reduce!r}: its point-to-point messages "
                   f"have no elastic form")
        elif self.elastic.min_workers > self.ranks:
            why = (f"elastic.min_workers = {self.elastic.min_workers} is more than the "
                   f"{self.ranks} ranks")
        return None if why is None else f"on_rank_loss = \"continue\" cannot run with {why}"

    def hierarchy_problem(self, size: int | None) -> str | None:
        """What is wrong with [averaging.hierarchy] on `size` ranks (None: not known yet)."""
        return self.averaging.hierarchy.problem_with(
            self.effective_average_every(), self.averaging.k_name(self.minibatch), self.backend, size)


def config_from_dict(values: Any, source: str = "config") -> TrainConfig:
    """Build a TrainConfig from nested plain values, naming `source` in every error."""
    return from_dict(TrainConfig, values, source)


def load_config(path: str | Path) -> TrainConfig:
    """Parse a TOML file into a TrainConfig. Errors name the file, and the line for syntax."""
    return load_toml(TrainConfig, path)


def cli_flags() -> list[Flag]:
    """The flags of `labavg train`: every setting that declares one, in declaration order."""
    return flags(TrainConfig)


def setting_field(dotted: str) -> Any:
    """The dataclass field of a dotted TrainConfig key (`model.hidden_dim`)."""
    return field_of(TrainConfig, dotted)


def setting_type(dotted: str) -> Any:
    """The type hint of a dotted TrainConfig key (`model.hidden_dim`: int)."""
    return type_of(TrainConfig, dotted)


def check_setting(key: str, value: Any) -> str | None:
    """What is wrong with `value` for the one TrainConfig setting `key` (dotted), or None;
    in `validate`'s words (labavg.base.settings.check_value)."""
    return check_value(TrainConfig, key, value)


def check_hierarchy(cfg: TrainConfig, size: int) -> None:
    """UserError unless the [averaging.hierarchy] settings fit `size` ranks (the launched ones)."""
    if cfg.averaging.hierarchy.across_nodes_every > 0:
        problem = cfg.hierarchy_problem(size)
        if problem is not None:
            raise UserError(problem)


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


def estimate_memory(cfg: TrainConfig, input_dim: int, num_pdfs: int) -> int:
    """Bytes one process of `cfg` needs for its model(s), minibatches and frame buffer.

    Per worker: 16 bytes per parameter (labavg.training.memory.BYTES_PER_PARAMETER; more for
    the outer state of a method that keeps one, its `outer_bytes_per_parameter`), the spliced
    frame buffer, and the activations of a minibatch with their gradients. An inproc run holds
    all its workers in one process; an MPI or torch rank holds one (ranks may be on other
    machines).
    """
    m = cfg.model
    params = parameter_count(m, input_dim, num_pdfs)
    widths = input_dim + 2 * m.hidden_layers * m.hidden_dim + num_pdfs
    buffer = max(cfg.data.buffer_frames, cfg.minibatch, cfg.rbm.minibatch_size) * input_dim * 4
    method = methods().get(cfg.averaging.method)
    per_parameter = BYTES_PER_PARAMETER + (method.outer_bytes_per_parameter if method else 0)
    if cfg.averaging.payload != "fp32":
        per_parameter += PAYLOAD_BYTES_PER_PARAMETER
    per_worker = params * per_parameter + buffer + 2 * 4 * cfg.minibatch * widths
    return per_worker * (cfg.ranks if cfg.backend == "inproc" else 1)


def check_model_size(cfg: TrainConfig, input_dim: int, num_pdfs: int,
                     memory: int | None = None, *, smallest: bool = False) -> int:
    """UserError unless `estimate_memory` fits in MEMORY_FRACTION of physical memory.

    Call it with the real input dim (feature dim x (2 context + 1)) and number of pdfs once
    the data is open, before the model is built; `smallest` says the dimensions are only the
    smallest plausible data's (validation's, before the data is open), which a message must
    not present as the data's. `memory` (bytes) replaces the machine's physical memory
    (tests); where neither is known the check passes. Returns the estimate.
    """
    need = estimate_memory(cfg, input_dim, num_pdfs)
    memory = physical_memory() if memory is None else memory
    if memory is None or need <= MEMORY_FRACTION * memory:
        return need
    limit = f"the limit is {MEMORY_FRACTION:g} of this machine's {memory / 2**30:.3g} GiB"
    data = ("even on the smallest data" if smallest
            else f"on {input_dim} inputs and {num_pdfs} pdfs")
    workers = cfg.ranks if cfg.backend == "inproc" else 1
    if workers > 1 and need / workers <= MEMORY_FRACTION * memory:
        # One worker fits: the number of workers in this one process is what does not.
        raise UserError(
            f"the model does not fit in memory with ranks = {cfg.ranks} in-process workers: "
            f"each needs about {need / workers / 2**30:.3g} GiB {data}, {need / 2**30:.3g} GiB "
            f"in all; {limit} (fewer ranks, or backend mpi for a process per rank)")
    m = cfg.model
    params = parameter_count(m, input_dim, num_pdfs)
    of_workers = f" for {cfg.ranks} inproc workers" if workers > 1 else ""
    raise UserError(
        f"the model does not fit in memory: model.hidden_layers={m.hidden_layers}, "
        f"model.hidden_dim={m.hidden_dim}, minibatch={cfg.minibatch}, "
        f"data.buffer_frames={cfg.data.buffer_frames} give {params:.3g} parameters {data}, "
        f"about {need / 2**30:.3g} GiB{of_workers}; {limit}")


def check_values(cfg: TrainConfig) -> TrainConfig:
    """UserError naming the first bad value (each setting's rule, then what ties settings
    together) and the file or flag it came from; what every source of settings goes through,
    a rank's launch file included. `validate` adds what needs this machine."""
    problem = first_named_problem(cfg)
    if problem is not None:
        raise UserError(problem)
    return cfg


def validate(cfg: TrainConfig) -> TrainConfig:
    """Raise UserError naming the first bad value; return cfg unchanged when all are good.

    Every field of every section is checked (its rule), then what ties them together (each
    section's `problem`), the run directory, and the model's size for the smallest plausible
    data. Each message names the file or flag of the values it is about.
    """
    check_values(cfg)
    if not NONEMPTY.ok(cfg.out):
        raise UserError(named(cfg, bad("out", "a non-empty path (the run directory)", cfg.out), "out"))
    problem = check_directory(cfg.out, "out", "the run directory")
    if problem is not None:
        raise UserError(named(cfg, problem, "out"))
    if cfg.pretrain == "rbm" and cfg.model.nonlinearity != "sigmoid":
        raise UserError(named(cfg, "pretrain = 'rbm' initialises sigmoid layers; set "
                                   "model.nonlinearity = 'sigmoid'"))
    if cfg.inject_fault is not None:
        try:
            fault = parse_fault(cfg.inject_fault)
        except UserError as exc:
            raise UserError(named(cfg, str(exc), "inject_fault")) from None
        if fault.kind == "kill" and cfg.backend == "inproc":
            raise UserError(named(cfg, "inject_fault 'kill' needs processes: use backend 'mpi' or 'torch'"))
        if fault.rank >= cfg.ranks:
            raise UserError(named(cfg, f"inject_fault names rank {fault.rank} but the run has "
                                       f"{cfg.ranks} ranks"))
    try:
        check_model_size(cfg, MIN_FEAT_DIM * (2 * cfg.data.context + 1), MIN_NUM_PDFS,
                         smallest=True)
    except UserError as exc:
        raise UserError(named(cfg, str(exc))) from None
    return cfg
