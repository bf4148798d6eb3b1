"""The paper's comparisons (Su & Chen 2015) and their effects measured here, seed by seed.

A Pair is one comparison the paper made: the side it found better, the side it found worse, the
settings held fixed and its WER on both sides. An Effect is that comparison measured on this
reproduction's runs (labavg.studies.reproduction.results), read by the one rule of
labavg.studies.reproduction.verdicts. A Probe is an experiment run to explain a disagreement.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labavg.jobs.index import flatten_config
from labavg.studies.reproduction.results import Run, paired, select
from labavg.studies.reproduction.verdicts import (ACCURACY_MARGIN, NEGATIVE, POSITIVE, ZERO, Spread,
                                                in_direction, log_ratio, spread, verdict)

# Su & Chen (2015), WER % on the Switchboard test set; 1-GPU baseline 14.7.
PAPER_WORKERS = {1: 14.7, 8: 15.1, 16: 15.1, 32: 15.2}
PAPER_SPEEDUP_K = {10: 9.32, 20: 10.07}  # 16 GPUs
# The settings the comparisons vary; the rest is the sweep's base.
VARIED = ("ranks", "averaging.average_every", "optimizer", "pretrain", "schedule", "minibatch")


@dataclass(frozen=True)
class Pair:
    """A comparison of the paper: `better` beat `worse` there (WER `paper`), at `fixed`."""

    title: str
    vary: str
    better: Any
    worse: Any
    fixed: dict[str, Any]
    paper: tuple[float, float] | None
    finding: str

    @property
    def name(self) -> str:
        """The varied setting as the report's tables name it: its key within its section."""
        return self.vary.rsplit(".", 1)[-1]

    @property
    def paper_effect(self) -> float | None:
        """The paper's WER change of `worse` over `better`, 100 x ln(ratio)."""
        return None if self.paper is None else log_ratio(*self.paper)


WORKER_PAIRS = tuple(
    Pair(f"{n} workers vs 1", "ranks", 1, n, {}, (PAPER_WORKERS[1], PAPER_WORKERS[n]),
         f"{n} workers cost a little WER") for n in PAPER_WORKERS if n > 1)
PAIRS = (
    Pair("Averaging every 10 vs 20 minibatches (16 workers)", "averaging.average_every", 10, 20,
         {"ranks": 16}, (15.1, 15.8), "averaging every 10 minibatches is better"),
    Pair("NG-SGD vs plain SGD (1 worker)", "optimizer", "ngsgd", "sgd", {"ranks": 1},
         (14.7, 14.9), "NG-SGD is better"),
    Pair("NG-SGD vs plain SGD (16 workers)", "optimizer", "ngsgd", "sgd", {"ranks": 16},
         (15.1, 16.3), "NG-SGD is better, by more than at 1 worker"),
    Pair("RBM pretraining vs random initialisation (32 workers)", "pretrain", "rbm", "none",
         {"ranks": 32}, (15.2, 16.4), "RBM pretraining is better"),
    Pair("Exponential vs Newbob schedule (16 workers)", "schedule", "exponential", "newbob",
         {"ranks": 16}, (15.1, 15.4), "the exponential schedule is better"),
    Pair("Minibatch of 128 vs 256 frames (16 workers, K = 10 minibatches)", "minibatch", 128, 256,
         {"ranks": 16}, None, "no figure in the paper"),
)
# Every comparison of the report's first table, the paper's headline first.
HEADLINE = WORKER_PAIRS + PAIRS


@dataclass(frozen=True)
class Effect:
    """One comparison measured seed by seed: WER of `worse` over `better` (100 x ln ratio) and
    the frame accuracy `better` gains over `worse` (points)."""

    pair: Pair
    sides: tuple[dict[int, Run], dict[int, Run]]
    wer_values: tuple[float, ...]
    accuracy: Spread | None

    @property
    def wer(self) -> Spread | None:
        return spread(self.wer_values)

    @property
    def verdict(self) -> str:
        word = verdict(self.wer, self.pair.paper_effect)
        if self.pair.paper is None:  # no figure in the paper: which side is better, if any
            return {POSITIVE: f"{self.pair.better} better", NEGATIVE: f"{self.pair.worse} better",
                    ZERO: "no difference"}.get(word, word)
        return word

    @property
    def accuracy_verdict(self) -> str:
        word = verdict(self.accuracy, None, ACCURACY_MARGIN)
        return {POSITIVE: "the paper's direction", NEGATIVE: "against the paper",
                ZERO: "~0"}.get(word, word)

    @property
    def direction(self) -> str:
        k, n = in_direction(self.wer_values, self.pair.paper_effect)
        return f"{k} of {n}" if n else "-"


def effect(runs: list[Run], base: dict[str, Any], pair: Pair) -> Effect:
    fixed = {**{k: v for k, v in base.items() if k != pair.vary}, **pair.fixed}
    better = select(runs, **fixed, **{pair.vary: pair.better})
    worse = select(runs, **fixed, **{pair.vary: pair.worse})
    return Effect(pair, (better, worse), tuple(paired(better, worse, "wer", log=True)),
                  spread(paired(worse, better, "cv_acc_pct")))


def base_settings(runs: list[Run], sweep_file: Path | None) -> dict[str, Any]:
    """The sweep's base values of the varied settings (from its file, else the commonest)."""
    if sweep_file is not None and sweep_file.is_file():
        from labavg.base.settings import to_dict
        from labavg.studies.sweep import load_sweep

        base = flatten_config(to_dict(load_sweep(sweep_file).base))
        return {k: base[k] for k in VARIED}
    out = {}
    for key in VARIED:
        values = [r.get(key) for r in runs]
        out[key] = max(set(values), key=values.count) if values else None
    return out


@dataclass(frozen=True)
class Probe:
    """An experiment that explains a disagreement: rows (label, sweep, settings, the label of
    the row it is compared with seed by seed, or None)."""

    title: str
    question: str
    rows: tuple[tuple[str, str, dict[str, Any], str | None], ...]


PROBES = (
    Probe("Does RBM pretraining help at this scale at all, and are 32 workers' RBMs under-trained?",
          "RBM pretraining against random initialisation at 1 worker, and at 32 workers with 1 and "
          "4 epochs of CD-1 per layer (pretrain_dbn.sh: rbm_iter = 1, for 300 h).",
          (("1 worker, random init", "paper", {"ranks": 1, "pretrain": "none"}, None),
           ("1 worker, RBM (1 epoch)", "explain", {"ranks": 1, "pretrain": "rbm"},
            "1 worker, random init"),
           ("32 workers, random init", "paper", {"ranks": 32, "pretrain": "none"}, None),
           ("32 workers, RBM (1 epoch)", "paper", {"ranks": 32, "pretrain": "rbm", "rbm.epochs": 1},
            "32 workers, random init"),
           ("32 workers, RBM (4 epochs)", "explain", {"ranks": 32, "pretrain": "rbm", "rbm.epochs": 4},
            "32 workers, random init"))),
    Probe("Is it the exponential schedule's end point that Newbob beats?",
          "16 workers: the exponential schedule to 0.01 x lr (the paper's), the same to 0.1 x lr, "
          "and Newbob.",
          (("exponential to 0.01 x lr", "paper", {"ranks": 16, "schedule": "exponential", "final_lr": None}, None),
           ("exponential to 0.1 x lr", "explain", {"ranks": 16, "schedule": "exponential", "final_lr": 0.0008},
            "exponential to 0.01 x lr"),
           ("Newbob", "paper", {"ranks": 16, "schedule": "newbob"}, "exponential to 0.01 x lr"))),
    Probe("Is max-change what holds many workers back?",
          "16 workers with Kaldi's per-frame max-change (the default) and without it (the "
          "whole-model limit stays), against 1 worker.",
          (("1 worker", "paper", {"ranks": 1}, None),
           ("16 workers, max-change", "paper", {"ranks": 16, "max_change_per_sample": None}, "1 worker"),
           ("16 workers, no per-frame max-change", "explain",
            {"ranks": 16, "max_change_per_sample": 0.0}, "1 worker"))),
)
