"""Reproducing Su & Chen (2015): the paper's comparisons, the regime map, in REPRODUCTION.md.

`labavg reproduce` runs the sweep files of `experiments/` (paper.toml: the paper's comparisons,
decoded; regime.toml and regime-variables.toml: the regime map and what predicts it;
explain.toml: the experiments behind each disagreement; yesno.toml: the real Kaldi recipe, when
given), measures 1 vs 2 MPI ranks on this machine, and writes the report, its figures and a
results file the notebooks read. Every step is resumable: finished runs are kept, so running it
again only adds what is missing. Every verdict follows labavg.studies.reproduction.verdicts' one rule.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labavg.studies import costmodel

from labavg.studies.reproduction import regime
from labavg.base.checkpoint import atomic_write_text
from labavg.base.errors import UserError
from labavg.jobs.index import flatten_config
from labavg.studies.reproduction.tables import interval, mean_sd, num, percent, words
from labavg.studies.reproduction.results import (RESULTS_FILE, Run, collect, paired, select, stat, trace_stat,
                            with_recorded, write_results_file)
from labavg.studies.reproduction.verdicts import (ACCURACY_MARGIN, AS_THE_PAPER, LARGER, NEGATIVE, OPPOSITE, POSITIVE,
                             RULE, SMALLER, ZERO, Spread, in_direction, log_ratio, spread, verdict)

# Su & Chen (2015), WER % on the Switchboard test set; 1-GPU baseline 14.7.
PAPER_WORKERS = {1: 14.7, 8: 15.1, 16: 15.1, 32: 15.2}
PAPER_SPEEDUP_K = {10: 9.32, 20: 10.07}  # 16 GPUs
# The repository's experiments/ (labavg is installed editable from its checkout).
EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"
DISCUSSION_MARKER = "<!-- discussion below: kept when the report is regenerated -->"
# The settings the comparisons vary; the rest is the sweep's base.
VARIED = ("ranks", "average_every", "optimizer", "pretrain", "schedule", "minibatch")


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
    def paper_effect(self) -> float | None:
        """The paper's WER change of `worse` over `better`, 100 x ln(ratio)."""
        return None if self.paper is None else log_ratio(*self.paper)


WORKER_PAIRS = tuple(
    Pair(f"{n} workers vs 1", "ranks", 1, n, {}, (PAPER_WORKERS[1], PAPER_WORKERS[n]),
         f"{n} workers cost a little WER") for n in PAPER_WORKERS if n > 1)
PAIRS = (
    Pair("Averaging every 10 vs 20 minibatches (16 workers)", "average_every", 10, 20,
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


# --------------------------------------------------------------------------- effects


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
                  spread(paired(worse, better, "cv_frame_accuracy")))


def _paper_cell(pair: Pair) -> str:
    return "-" if pair.paper is None else f"{pair.paper_effect:+.1f} ({pair.paper[0]} -> {pair.paper[1]})"


def headline_table(runs: list[Run], base: dict[str, Any]) -> list[str]:
    """Every comparison: its measured effect, the paper's, and the verdict of the one rule."""
    out = ["| comparison | seeds | WER change, % (100 ln ratio) [95 % CI] | seeds in the paper's "
           "direction | CV frame acc gain, points [95 % CI] | paper's WER change, % (WER %) | "
           "verdict |", "|---|---|---|---|---|---|---|"]
    for pair in HEADLINE:
        e = effect(runs, base, pair)
        acc = f"{interval(e.accuracy)} ({e.accuracy_verdict})" if e.accuracy else "-"
        out.append(f"| {pair.title} | {len(e.wer_values)} | {interval(e.wer, 1)} | "
                   f"{e.direction} | {acc} | {_paper_cell(pair)} | **{e.verdict}** |")
    return out


def headline_sentence(runs: list[Run], base: dict[str, Any]) -> str:
    """Where the paper holds here and where it does not, from the verdicts."""
    groups: dict[str, list[str]] = {}
    for pair in HEADLINE:
        if pair.paper is None:
            continue
        word = effect(runs, base, pair).verdict.split(":")[0]
        groups.setdefault(word, []).append(pair.title)
    said = {AS_THE_PAPER: "the paper holds for {}", LARGER: "{} {} larger than in the paper",
            SMALLER: "{} {} smaller", OPPOSITE: "{} {} the other way round",
            "unresolved": "{} {} unresolved", "needs 2+ seeds": "{} {} only one seed",
            "not run": "{} {} not run yet"}
    parts = []
    for word, template in said.items():
        titles = groups.get(word)
        if titles:
            verb = "has" if word == "needs 2+ seeds" else ("is" if len(titles) == 1 else "are")
            titles = [_lower(t) for t in titles]
            parts.append(template.format(words(titles)) if word == AS_THE_PAPER
                         else template.format(words(titles), verb))
    if not parts:
        return "No comparison has run yet."
    return "Here " + "; ".join(parts) + "."


def _lower(title: str) -> str:
    """A title inside a sentence: "Averaging every ..." -> "averaging every ...", "NG-SGD" kept."""
    return title[0].lower() + title[1:] if title[1:2].islower() else title


def verdict_summary(runs: list[Run], base: dict[str, Any]) -> list[tuple[str, str]]:
    """(comparison, verdict) for every comparison of the report's first table."""
    return [(pair.title, effect(runs, base, pair).verdict) for pair in HEADLINE]


# --------------------------------------------------------------------------- tables


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


def _ci_of_runs(runs: dict[int, Run]) -> str:
    """The test-set 95 % interval of WER (bootstrap over utterances), averaged over seeds."""
    cis = [r.summary["wer_ci"] for r in runs.values() if r.summary.get("wer_ci")]
    if not cis:
        return "-"
    return f"{statistics.fmean(c[0] for c in cis):.2f}-{statistics.fmean(c[1] for c in cis):.2f}"


def workers_table(runs: list[Run], base: dict[str, Any]) -> list[str]:
    """1 / 8 / 16 / 32 workers: WER, PER, frame accuracy, and the change against 1 worker."""
    same = {k: v for k, v in base.items() if k != "ranks"}
    out = ["| workers | seeds | updates per worker | WER % (mean ± sd) | test-set 95 % CI | PER % | "
           "CV frame acc % | updates cut by max-change | WER change vs 1 worker, % (100 ln ratio) "
           "[95 % CI] | paper WER % (change) | verdict |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    effects = {p.worse: effect(runs, base, p) for p in WORKER_PAIRS}
    for n, paper in PAPER_WORKERS.items():
        here = select(runs, ranks=n, **same)
        updates = stat(here, "steps")
        e = effects.get(n)
        paper_cell = f"{paper}" if e is None else f"{paper} ({e.pair.paper_effect:+.1f} %)"
        out.append(
            f"| {n} | {len(here)} | {'-' if updates is None else f'{updates.mean:,.0f}'} | "
            f"{mean_sd(stat(here, 'wer'))} | {_ci_of_runs(here)} | {mean_sd(stat(here, 'per'))} | "
            f"{mean_sd(stat(here, 'cv_frame_accuracy'))} | "
            f"{percent(trace_stat(here, 'max_change_limited'))} | "
            f"{'-' if e is None else interval(e.wer, 1)} | {paper_cell} | "
            f"{'-' if e is None else e.verdict} |")
    return out


def pair_table(runs: list[Run], base: dict[str, Any], pair: Pair) -> list[str]:
    """One of the paper's two-way comparisons: both sides, the effect and its verdict."""
    e = effect(runs, base, pair)
    out = [f"| {pair.vary} | seeds | WER % (mean ± sd) | test-set 95 % CI | PER % | CV frame acc % | "
           "paper WER % |", "|---|---|---|---|---|---|---|"]
    for i, (value, here) in enumerate(zip((pair.better, pair.worse), e.sides)):
        paper = "-" if pair.paper is None else str(pair.paper[i])
        out.append(f"| {value} | {len(here)} | {mean_sd(stat(here, 'wer'))} | {_ci_of_runs(here)} | "
                   f"{mean_sd(stat(here, 'per'))} | {mean_sd(stat(here, 'cv_frame_accuracy'))} | "
                   f"{paper} |")
    paper = "" if pair.paper is None else f" (paper: {pair.paper_effect:+.1f} %)"
    out += ["", f"WER of {pair.vary} = {pair.worse} over {pair.vary} = {pair.better}, same seed: "
            f"{interval(e.wer, 1)} % (100 ln ratio){paper}, {e.direction} seeds in the paper's "
            f"direction; frame accuracy {pair.better} minus {pair.worse}: {interval(e.accuracy)} "
            f"points ({e.accuracy_verdict}). Paper: {pair.finding}. **Verdict: {e.verdict}.**"]
    return out


def comparison_sections(runs: list[Run], base: dict[str, Any]) -> list[str]:
    out = ["### Number of workers", ""] + workers_table(runs, base)
    for pair in PAIRS:
        out += ["", f"### {pair.title}", ""] + pair_table(runs, base, pair)
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


def probe_section(runs: dict[str, list[Run]], base: dict[str, Any], probe: Probe) -> list[str]:
    """One explaining experiment: each row's WER and accuracy, and its effect on WER."""
    out = [f"### {probe.title}", "", probe.question, "",
           "| setting | seeds | WER % (mean ± sd) | WER change, % (100 ln ratio) [95 % CI] | "
           "verdict | CV frame acc % | updates cut by max-change | final effective lr |",
           "|---|---|---|---|---|---|---|---|"]
    found: dict[str, dict[int, Run]] = {}
    for label, sweep, want, against in probe.rows:
        fixed = {**{k: v for k, v in base.items() if k not in want}, **want}
        here = select(runs.get(sweep, []), **{k.replace(".", "__"): v for k, v in fixed.items()})
        found[label] = here
        diff, word = "-", "-"
        if against is not None:
            change = spread(paired(found[against], here, "wer", log=True))
            diff, word = f"{interval(change, 1)} vs {against}", verdict(change)
            word = {POSITIVE: "higher WER", NEGATIVE: "lower WER", ZERO: "same WER"}.get(word, word)
        lrs = [r.summary.get("trace", {}).get("epochs", [{}])[-1].get("lr") for r in here.values()
               if r.summary.get("trace", {}).get("epochs")]
        out.append(f"| {label} | {len(here)} | {mean_sd(stat(here, 'wer'))} | {diff} | {word} | "
                   f"{mean_sd(stat(here, 'cv_frame_accuracy'))} | "
                   f"{percent(trace_stat(here, 'max_change_limited'))} | "
                   f"{'-' if not lrs else f'{statistics.fmean(lrs):.2g}'} |")
    return out


def schedule_trace(runs: list[Run], base: dict[str, Any]) -> list[str]:
    """The learning rate and CV accuracy at each epoch end, exponential vs Newbob (seed 0)."""
    out = ["| epoch | exponential: lr | CV acc % | Newbob: lr | CV acc % | accepted |",
           "|---|---|---|---|---|---|"]
    fixed = {k: v for k, v in base.items() if k not in ("ranks", "schedule")}
    exp = select(runs, **fixed, ranks=16, schedule="exponential", final_lr=None).get(0)
    nb = select(runs, **fixed, ranks=16, schedule="newbob").get(0)
    if exp is None or nb is None:
        return ["(seed 0 of both schedules not finished yet)"]
    e_ep, n_ep = exp.summary.get("trace", {}).get("epochs", []), nb.summary.get("trace", {}).get("epochs", [])
    for i in range(max(len(e_ep), len(n_ep))):
        e = e_ep[i] if i < len(e_ep) else {}
        n = n_ep[i] if i < len(n_ep) else {}
        def cell(d, key, scale=1.0, fmt="{:.3g}"):
            v = d.get(key)
            return "-" if v is None else fmt.format(scale * v)
        out.append(f"| {i + 1} | {cell(e, 'lr')} | {cell(e, 'cv_frame_accuracy', 100, '{:.2f}')} | "
                   f"{cell(n, 'lr')} | {cell(n, 'cv_frame_accuracy', 100, '{:.2f}')} | "
                   f"{n.get('accepted', '-')} |")
    return out


def yesno_facts(recipe: Path | None) -> dict[str, Any]:
    """The recipe's test set and its GMM's best WER (exp/mono0a's wer_* files), where given."""
    import re

    if recipe is None:
        return {}
    facts: dict[str, Any] = {}
    try:
        facts["train_utterances"] = len((recipe / "data/train_yesno/text").read_text().splitlines())
    except OSError:
        pass
    best = None
    for path in sorted((recipe / "exp").glob("mono*/decode_test_yesno/wer_*")):
        text = path.read_text(errors="replace")
        wer = re.search(r"%WER ([\d.]+) \[ \d+ / (\d+)", text)
        ser = re.search(r"%SER [\d.]+ \[ \d+ / (\d+)", text)
        if wer and (best is None or float(wer.group(1)) < best[0]):
            best = (float(wer.group(1)), int(wer.group(2)), int(ser.group(1)) if ser else None)
    if best is not None:
        facts.update(gmm_wer=best[0], test_words=best[1], test_utterances=best[2])
    return facts


def yesno_section(runs: list[Run], facts: dict[str, Any], sweep_file: Path) -> list[str]:
    most = max((r.get("ranks") or 1 for r in runs), default=1)
    about = []
    if facts.get("test_utterances"):
        about.append(f"decoded on test_yesno ({facts['test_utterances']} utterances, "
                     f"{facts['test_words']} words), where the recipe's monophone GMM scores "
                     f"{facts['gmm_wer']:.2f} % WER")
    if facts.get("train_utterances"):
        about.append(f"yesno has {facts['train_utterances']} training utterances, so at most "
                     f"{most} workers here")
    out = ["## Real data: Kaldi's yesno recipe", "",
           f"Made by `labavg sweep {sweep_file}` in the recipe directory"
           + ("; " + "; ".join(about) if about else "") + ". With two words it is easy, and "
           "differences are small.", "",
           "| workers | optimizer | seeds | WER % (mean ± sd) | test-set 95 % CI | PER % | "
           "CV frame acc % |", "|---|---|---|---|---|---|---|"]
    for n, opt in sorted({(r.get("ranks"), r.get("optimizer")) for r in runs}):
        here = select(runs, ranks=n, optimizer=opt)
        out.append(f"| {n} | {opt} | {len(here)} | {mean_sd(stat(here, 'wer'))} | "
                   f"{_ci_of_runs(here)} | {mean_sd(stat(here, 'per'))} | "
                   f"{mean_sd(stat(here, 'cv_frame_accuracy'))} |")
    return out


MPI_POINTS = (("ranks1", 1, 10), ("ranks2", 2, 10), ("ranks2-K20", 2, 20))


def measure_mpi(paper_file: Path, out: Path, *, epochs: int = 1, cwd: Path | None = None) -> None:
    """1 and 2 MPI ranks (K = 10 and 20) with the comparisons' model and data; resumable."""
    import shutil

    from labavg.training.config import validate
    from labavg.base.settings import with_overrides
    from labavg.jobs.launch import start_run
    from labavg.studies.sweep import load_sweep

    base = load_sweep(paper_file).base
    for name, ranks, k in MPI_POINTS:
        run = out / "runs" / name
        if (run / "summary.json").is_file():
            continue
        if run.exists():
            shutil.rmtree(run)
        cfg = validate(with_overrides(base, {"out": str(run.resolve()), "ranks": ranks,
                                             "backend": "mpi", "average_every": k,
                                             "epochs": epochs, "decode_data": None}))
        start_run(cfg, cwd=cwd).wait()


def held_out_speedups() -> dict[int, float]:
    """Each multi-GPU row of the paper's table predicted by the cost model fitted to the others."""
    table = costmodel.PAPER_TABLE
    out = {}
    for row in table:
        if row.ranks > 1:
            fit = costmodel.fit_table([r for r in table if r is not row], costmodel.PAPER_SETUP)
            out[row.ranks] = costmodel.fitted_speedup(fit, row.ranks)
    return out


def cost_model_table() -> list[str]:
    """The paper's timing table, the model fitted to all of it, and leave-one-out predictions."""
    fit = costmodel.fit_paper_table()
    held = held_out_speedups()
    t1 = costmodel.PAPER_TABLE[0].train_min
    out = ["| GPUs | K | paper train min/epoch | paper comm min | paper speedup | fitted to every row "
           "(a fit) | predicted with this row held out | prediction error |",
           "|---|---|---|---|---|---|---|---|"]
    errors = []
    for row in fit.rows:
        paper = t1 / row.train_min
        pred = held.get(row.ranks)
        err = None if pred is None else 100 * (pred - paper) / paper
        if err is not None:
            errors.append((abs(err), row.ranks, err))
        out.append(f"| {row.ranks} | {costmodel.PAPER_SETUP.K} | {row.train_min} | {row.comm_min} | "
                   f"{paper:.2f} | {costmodel.fitted_speedup(fit, row.ranks):.2f} | "
                   f"{'-' if pred is None else f'{pred:.2f}'} | "
                   f"{'-' if err is None else f'{err:+.1f} %'} |")
    predicted = [(16, 20, PAPER_SPEEDUP_K[20]), (32, 10, costmodel.PAPER_SPEEDUPS[(32, 10)])]
    for ranks, k, paper in predicted:
        pred = costmodel.fitted_speedup(fit, ranks, K=k)
        out.append(f"| {ranks} | {k} | - | - | {paper:g} (reported) | not in the table | {pred:.2f} "
                   f"(from every row) | {100 * (pred - paper) / paper:+.1f} % |")
    worst = max(errors) if errors else None
    fit_err = max(abs(costmodel.fitted_speedup(fit, r.ranks) / (t1 / r.train_min) - 1)
                  for r in fit.rows)
    out += ["", "Speedup = train(1) / train(N), communication inside the train column "
            f"(docs/cost-model.md). Fitted to every row, the model is within {100 * fit_err:.1f} % "
            "of the table's speedups: a fit, not a test. Predicting each row from the others, "
            + ("" if worst is None else f"its largest error is {worst[2]:+.1f} % (at {worst[1]} "
               "GPUs)") + "; the last two rows are not in the table and are predictions: "
            + words([f"{costmodel.fitted_speedup(fit, n, K=k):.2f} against the paper's {p:g} at "
                     f"{n} GPUs and K = {k}" for n, k, p in predicted]) + "."]
    return out


def speedup_section(mpi_runs: list[Run]) -> list[str]:
    """The cost model on the paper's timing table, and this machine's measurement."""
    out = ["#### The paper's timing table and the cost model", ""] + cost_model_table()

    summaries = {r.name: r.summary for r in mpi_runs}
    if "ranks1" not in summaries or len(summaries) < 2:
        return out + ["", "No MPI measurement in this report."]
    one = summaries["ranks1"]
    out += ["", "#### Measured on this machine (MPI ranks, one thread each, 1 epoch)", "",
            "| ranks | K | wall s | compute s | comm s | comm % | speedup vs 1 rank | "
            "cost model at 16 ranks, 10 GbE |", "|---|---|---|---|---|---|---|---|"]
    for name, ranks, k in MPI_POINTS:
        s = summaries.get(name)
        if s is None:
            continue
        speedup = one["wall_seconds"] / s["wall_seconds"] if ranks > 1 else None
        predicted = "-"
        if ranks > 1:
            pred = costmodel.predict(costmodel.from_summary(s), [16], Ks=[k])[0]
            predicted = f"{pred.speedup:.2f} (efficiency {pred.efficiency:.2f})"
        out.append(f"| {ranks} | {k} | {s['wall_seconds']:.1f} | {s['compute_seconds']:.1f} | "
                   f"{s['comm_seconds']:.2f} | {100 * s['comm_fraction']:.1f} | {num(speedup)} | "
                   f"{predicted} |")
    out += ["", "The prediction takes this run's compute per minibatch and its measured seconds per "
            "averaging round as the local overhead, plus the allreduce of its parameters over "
            "10 GbE (costmodel.predict)."]
    return out


# --------------------------------------------------------------------------- the report


@dataclass(frozen=True)
class Experiments:
    """The sweep files of one reproduction (experiments/ by default, tiny ones in the tests)."""

    directory: Path

    @property
    def paper(self) -> Path:
        return self.directory / "paper.toml"

    @property
    def regime(self) -> Path:
        return self.directory / "regime.toml"

    @property
    def yesno(self) -> Path:
        return self.directory / "yesno.toml"

    @property
    def explain(self) -> Path:
        return self.directory / "explain.toml"

    @property
    def regime_variables(self) -> Path:
        return self.directory / "regime-variables.toml"

    @property
    def beyond(self) -> Path:
        return self.directory / "beyond.toml"


# The tiny version of the same pipeline (tests, notebooks at their CI size): same grids, two
# seeds, a tiny model for one epoch on tiny corpora.
# The model must learn something even so: an untrained one's flat posteriors make the decoder's
# beam search slow (every path stays within the beam), and the test sets are a few utterances.
TINY_BASE = {"epochs": 2, "log_every": 50, "checkpoint_every": 1000, "tensorboard": False,
             "model": {"hidden_layers": 1, "hidden_dim": 64},
             "data": {"context": 2, "buffer_frames": 4096}, "rbm": {"epochs": 1}}
TINY_HOURS = {"paper": [(0.1, 0.002, 0.003)], "regime": [(0.03, 0, 0), (0.06, 0, 0)]}
TINY_RANKS = {"regime": [1, 2, 4]}


def _toml_value(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, bool) else str(value).lower()


def _toml_table(name: str, values: dict[str, Any], array: bool = False) -> list[str]:
    head = f"[[{name}]]" if array else f"[{name}]"
    lines = [head] + [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in values.items()
                      if not isinstance(v, dict)]
    for key, sub in values.items():
        if isinstance(sub, dict):
            lines += [""] + _toml_table(f"{name}.{key}", sub)
    return lines


def tiny_experiments(source: Path, dest: Path) -> Path:
    """Write DEST/{paper,regime,explain}.toml: SOURCE's grids with seeds 0 and 1, on tiny corpora
    under DEST, with TINY_BASE over SOURCE's base; return DEST."""
    import tomllib

    dest.mkdir(parents=True, exist_ok=True)
    names = ("paper", "regime") + (("explain",) if (source / "explain.toml").is_file() else ())
    for name in names:
        spec = tomllib.loads((source / f"{name}.toml").read_text(encoding="utf-8"))
        data = "paper" if name == "explain" else name  # explain.toml trains on paper.toml's corpus
        corpora = [{"out": str((dest / f"{data}-{i}").resolve()), "hours": h, "dev_hours": d,
                    "test_hours": t} for i, (h, d, t) in enumerate(TINY_HOURS[data])]
        base = dict(spec.get("base", {}))
        for key, value in TINY_BASE.items():
            base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
        base["data"] = {**base.get("data", {}), "data": corpora[0]["out"]}
        if base.get("decode_data"):
            base["decode_data"] = corpora[0]["out"]
        lines = [f"# Tiny version of {source / name}.toml (labavg.studies.reproduction.report.tiny_experiments)"]
        for corpus in corpora:
            lines += [""] + _toml_table("corpus", corpus, array=True)
        lines += [""] + _toml_table("base", base)
        grids = spec.get("grid", [])
        for grid in grids if isinstance(grids, list) else [grids]:
            grid = dict(grid)
            if "seed" in grid:
                grid["seed"] = [0, 1]
            if "data.data" in grid:
                grid["data.data"] = [c["out"] for c in corpora]
            if name in TINY_RANKS and "ranks" in grid:
                grid["ranks"] = TINY_RANKS[name]
            lines += [""] + _toml_table("grid", grid, array=True)
        atomic_write_text(dest / f"{name}.toml", "\n".join(lines) + "\n")
    return dest


def _sum_wall(*groups: list[Run]) -> float:
    return sum(r.summary.get("wall_seconds") or 0.0 for g in groups for r in g)


def _seeds_per_point(runs: list[Run]) -> str:
    """"3", or "2-3" where the points have different numbers of seeds."""
    counts: dict[str, int] = {}
    for r in runs:
        key = r.name.split("-", 1)[-1] if r.name.startswith("seed_") else r.name
        counts[key] = counts.get(key, 0) + 1
    low, high = min(counts.values(), default=0), max(counts.values(), default=0)
    return f"{low}" if low == high else f"{low}-{high}"


def _provenance(runs: dict[str, list[Run]], command: str, seconds: float) -> list[str]:
    return [
        "Everything here is regenerated by `labavg reproduce --yesno ../shared/data/kaldi-yesno` "
        "(resumable: finished runs are reused; `--report-only` remakes this file from "
        "experiments/reproduction-results.jsonl and the runs there are). This file was written by "
        f"`{command}` in {seconds / 60:.1f} min; the {sum(len(g) for g in runs.values())} runs it "
        f"reports took {_sum_wall(*runs.values()) / 3600:.1f} h of training wall time in all (two "
        "runs at a time on a 2-core machine; the decoding at the end of each run comes on top).", ""]


def _answer(runs: dict[str, list[Run]], base: dict[str, Any]) -> list[str]:
    """The first screen: does the paper hold here? Every comparison under the one rule."""
    from labavg.studies.reproduction.beyond import fix_sentence

    paper_runs = runs.get("paper", [])
    fix = fix_sentence(runs.get("beyond", []))
    return ["# Reproducing Su & Chen (2015) with labavg", "", "## Does the paper hold here?", ""
            ] + headline_table(paper_runs, base) + [
        "", headline_sentence(paper_runs, base) + (" " + fix if fix else ""), "", RULE + " The WER "
        "change is that of the side the paper found worse (more workers, plain SGD, random "
        "initialisation, Newbob, K = 20, 256 frames) over the other, per seed; the frame accuracy "
        "gain is the other way round, so both are positive in the paper's direction.", ""]


def _chosen(paper_runs: list[Run], base: dict[str, Any]) -> list[str]:
    s0 = paper_runs[0].settings if paper_runs else {}
    updates32 = stat(select(paper_runs, **base | {"ranks": 32}), "steps")
    return [
        "## What was chosen, and why", "",
        "The comparisons are sized to run with seeds on a 2-core machine:",
        f"- corpus: the built-in synthetic speech, {num(s0.get('corpus_hours'), 1)} h of training "
        "speech, with held-out dev (acoustic scale) and test (scored) sets of other speakers;",
        f"- model {s0.get('model.hidden_layers', '-')} x {s0.get('model.hidden_dim', '-')} "
        f"{s0.get('model.nonlinearity', '')}, {s0.get('epochs', '-')} epochs, minibatch "
        f"{base.get('minibatch')}, K = {base.get('average_every')} minibatches, NG-SGD, exponential "
        f"schedule, learning rate {s0.get('lr', '-')} x N workers, "
        f"{_seeds_per_point(paper_runs)} seeds per point;",
        f"- so every worker at N = 32 makes {updates32.mean if updates32 else 0:,.0f} "
        "updates in the whole run, where the paper's made "
        f"{regime.paper_updates_per_worker(32):,.0f} in each epoch (300 h, 1024-frame minibatches); "
        "workers are simulated in one process (`inproc`: the same arithmetic as MPI ranks), so "
        "32 fit on 2 cores;",
        "- every row is decoded (HLG from kaldifst, kaldi-decoder): WER and PER on the test set, "
        "with the test set's 95 % bootstrap interval, CV frame accuracy beside them;",
        "- plain SGD is plain (no max-change, as nnet1's SGD, the paper's baseline); NG-SGD keeps "
        "Kaldi nnet2's max-change.", ""]


def _figure_link(figure: Path | None, report: Path, alt: str) -> list[str]:
    if figure is None or not figure.is_file():
        return []
    return [f"![{alt}]({os.path.relpath(figure.resolve(), report.resolve().parent)})", ""]


def render_report(runs: dict[str, list[Run]], experiments: Experiments, *, command: str,
                  seconds: float, figure: Path | None, report: Path,
                  beyond_figure: Path | None = None, yesno: dict[str, Any] | None = None) -> str:
    """REPRODUCTION.md (above the discussion marker) from the finished runs."""
    paper_runs = runs.get("paper", [])
    base = base_settings(paper_runs, experiments.paper)
    points = regime.regime_points(runs.get("regime", []))
    found = regime.variants(runs.get("regime-variables", []), runs.get("regime", []))
    parts = _answer(runs, base) + _provenance(runs, command, seconds) + _chosen(paper_runs, base)
    parts += ["## The paper's comparisons", "",
              f"Made by `labavg sweep {experiments.paper}` (also run by this command). WER and "
              "PER in %, lower is better; frame accuracy in %, higher is better.", ""]
    parts += comparison_sections(paper_runs, base) + [""]
    parts += regime.section(points, found, regime.comparison_points(paper_runs, base), figure,
                            report, experiments.regime, experiments.regime_variables)
    if runs.get("yesno"):
        parts += [""] + yesno_section(runs["yesno"], yesno or {}, experiments.yesno)
    if runs.get("explain"):
        parts += ["", "## Why the disagreements: experiments", "",
                  f"Made by `labavg sweep {experiments.explain}` (also run by this command), "
                  f"against the runs above; same corpus and base settings, "
                  f"{_seeds_per_point(runs['explain'])} seeds per setting.", ""]
        for probe in PROBES:
            parts += probe_section(runs, base, probe) + [""]
        parts += ["#### The two schedules epoch by epoch (16 workers, seed 0)", ""]
        parts += schedule_trace(paper_runs, base)
    parts += ["", "## Speedup", ""] + speedup_section(runs.get("mpi", []))
    if runs.get("beyond"):
        from labavg.studies.reproduction.beyond import section

        parts += [""] + section(runs["beyond"], experiments.beyond, beyond_figure, report)
    return "\n".join(parts) + "\n"


def _run_sweeps(jobs: list[tuple[str, Path, Path, Path | None]], parallel: int,
                results: Path | None = None) -> None:
    """`labavg sweep` for each (name, file, out, cwd), `parallel` at a time, logs in OUT.log;
    the runs `results` records are not trained again (`labavg sweep --recorded`)."""
    pending, running, failed = list(jobs), [], []
    while pending or running:
        while pending and len(running) < parallel:
            name, file, out, cwd = pending.pop(0)
            out.mkdir(parents=True, exist_ok=True)
            log = open(out.parent / f"{name}.log", "ab")
            print(f"labavg reproduce: sweep {name} ({file}) -> {out} (log {log.name})", flush=True)
            recorded = ["--recorded", str(results.resolve())] if results and results.is_file() else []
            proc = subprocess.Popen([sys.executable, "-m", "labavg.cli", "sweep", str(file.resolve()),
                                     "--out", str(out.resolve()), *recorded], cwd=cwd, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            running.append((name, proc, log))
        time.sleep(1.0)
        for item in list(running):
            name, proc, log = item
            if proc.poll() is not None:
                running.remove(item)
                log.close()
                if proc.returncode != 0:
                    failed.append(f"{name} (exit status {proc.returncode}; see {log.name})")
    if failed:
        raise UserError(f"sweeps failed: {', '.join(failed)}")


def _load_in(file: Path, cwd: Path):
    """A sweep file whose paths are relative to `cwd` (the yesno recipe)."""
    import contextlib

    from labavg.studies.sweep import load_sweep

    file = file.resolve()
    with contextlib.chdir(cwd):
        return load_sweep(file)


def reproduce(out: Path, *, experiments: Path = Path("experiments"), yesno: Path | None = None,
              report: Path = Path("REPRODUCTION.md"), figure: Path | None = None,
              parallel: int = 2, mpi: bool = True, results: Path | None = None,
              train: bool = True, command: str = "labavg reproduce") -> Path:
    """Run (or resume) every experiment, then write the report and the figure; return its path.

    With `train` False nothing is trained: the report is remade from the runs there are."""
    start = time.perf_counter()
    exp = Experiments(experiments)
    for path in (exp.paper, exp.regime) + ((exp.yesno,) if yesno is not None else ()):
        if not path.is_file():
            raise UserError(f"{path}: no such sweep file (labavg reproduce --experiments DIR)")
    if yesno is not None and not (yesno / "data").is_dir():
        raise UserError(f"--yesno {yesno}: not a Kaldi yesno recipe directory (no data/)")
    # Validate every file before hours of training start.
    from labavg.studies.sweep import load_sweep

    for path in (exp.paper, exp.regime):
        load_sweep(path)
    jobs = [("paper", exp.paper, out / "paper", None), ("regime", exp.regime, out / "regime", None)]
    if yesno is not None:
        jobs.append(("yesno", exp.yesno, out / "yesno", yesno))
    for name in ("regime-variables", "explain", "beyond"):
        path = getattr(exp, name.replace("-", "_"))
        if path.is_file():
            jobs.append((name, path, out / name, None))
    if train:
        from labavg.studies.sweep import make_corpora

        for _, file, _, cwd in jobs:  # first, one by one: sweeps running at once may share one
            make_corpora(load_sweep(file) if cwd is None else _load_in(file, cwd), cwd)
        _run_sweeps(jobs, parallel, results if results is not None else exp.directory / RESULTS_FILE)
        if mpi:
            measure_mpi(exp.paper, out / "mpi")
    figure = figure if figure is not None else report.parent / "docs" / "figures" / "regime-map.png"
    beyond_figure = figure.with_name("beyond-the-paper.png")
    results = results if results is not None else exp.directory / RESULTS_FILE
    runs = with_recorded(collect(out), results)
    write_results_file(runs, results)
    points = regime.regime_points(runs["regime"])
    if points:
        base = base_settings(runs["paper"], exp.paper)
        found = regime.fits(points)
        regime.regime_figure(points, regime.comparison_points(runs["paper"], base),
                             found[0] if found else None, figure)
    if runs["beyond"]:
        from labavg.studies.reproduction.beyond import figure as draw_beyond

        draw_beyond(runs["beyond"], select([r for r in runs["beyond"] if r.get("ranks") == 1]),
                    beyond_figure)
    text = render_report(runs, exp, command=command, seconds=time.perf_counter() - start,
                         figure=figure, report=report, beyond_figure=beyond_figure,
                         yesno=yesno_facts(yesno))
    # A discussion written by people below the marker survives regeneration.
    kept = report.read_text().partition(DISCUSSION_MARKER)[2] if report.is_file() else ""
    atomic_write_text(report, f"{text}\n{DISCUSSION_MARKER}{kept or chr(10)}")
    return report
