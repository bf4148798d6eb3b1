"""Reproducing Su & Chen (2015): the regime map and the paper's comparisons, in REPRODUCTION.md.

`labavg reproduce` runs the sweep files of `experiments/` (paper.toml: the paper's comparisons,
decoded; regime.toml: the regime map; explain.toml: the experiments behind each disagreement;
yesno.toml: the real Kaldi recipe, when given), measures 1 vs 2 MPI ranks on this machine, and
writes the report, its figure and a results file the notebooks read. Every step is
resumable: finished runs are kept, so running it again only adds what is missing.

Verdicts come from seeds, not from the sign of one difference: for each comparison the
per-seed paired difference (same seed, same data) gets a 95 % t-interval of its mean; the
comparison agrees (or disagrees) with the paper only when that interval excludes zero, and
is "within noise" otherwise.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labavg import costmodel
from labavg.checkpoint import atomic_write_text
from labavg.errors import UserError
from labavg.index import flatten_config, list_runs

# Su & Chen (2015), WER % on the Switchboard test set; 1-GPU baseline 14.7.
PAPER_WORKERS = {1: 14.7, 8: 15.1, 16: 15.1, 32: 15.2}
PAPER_SPEEDUP_K = {10: 9.32, 20: 10.07}  # 16 GPUs
# The paper's minibatch (1024 frames) and corpus (300 h at 100 frames/s) give its updates per
# worker per epoch, for placing its runs on the regime map.
PAPER_FRAMES_PER_EPOCH = 300 * 3600 * 100
PAPER_MINIBATCH = 1024
RESULTS_FILE = "reproduction-results.jsonl"  # beside the sweep files: what the notebooks read
# The repository's experiments/ (labavg is installed editable from its checkout).
EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"
DISCUSSION_MARKER = "<!-- discussion below: kept when the report is regenerated -->"
# The settings the comparisons vary; the rest is the sweep's base.
VARIED = ("ranks", "average_every", "optimizer", "pretrain", "schedule", "minibatch")
# Two-sided 95 % quantiles of Student's t by degrees of freedom (seeds - 1).
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228}


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


# --------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class Run:
    """One finished run: its settings (flattened, dotted keys) and summary.json."""

    name: str
    settings: dict[str, Any]
    summary: dict[str, Any]

    def get(self, key: str) -> Any:
        return self.settings.get(key)

    @property
    def seed(self) -> int:
        return int(self.settings["seed"])

    def metric(self, name: str) -> float | None:
        value = self.summary.get(name)
        if value is None or not math.isfinite(value):
            return None
        return 100.0 * value if name == "cv_frame_accuracy" else float(value)


def load_runs(sweep_dir: Path) -> list[Run]:
    """Every finished run of a sweep directory (unfinished ones are left out)."""
    runs = []
    if not (sweep_dir / "runs").is_dir():
        return runs
    for record in list_runs(sweep_dir / "runs"):
        if record.summary is None or record.summary.get("stopped"):
            continue
        settings = flatten_config(record.summary.get("config") or {})
        settings["corpus_hours"] = corpus_hours(settings.get("data.data") or "")
        summary = {**record.summary, "trace": run_trace(record.path)}
        runs.append(Run(record.name, settings, summary))
    return runs


def run_trace(run_dir: Path) -> dict[str, Any]:
    """What the report needs of a run's events (rank 0): the learning rate, CV accuracy and
    Newbob's decision at each epoch end, and how often max-change cut an update."""
    epochs, logged, limited, scales = [], 0, 0, []
    try:
        lines = (Path(run_dir) / "events.jsonl").read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        if '"rank": 0,' not in line:
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if event.get("type") == "epoch":
            epochs.append({k: event.get(k) for k in ("epoch", "lr", "cv_frame_accuracy", "accepted")})
        elif event.get("type") == "minibatch" and event.get("applied", True):
            logged += 1
            scale = event.get("max_change_scale", 1.0)
            if scale < 1.0:
                limited += 1
                scales.append(scale)
    return {"epochs": epochs, "max_change_limited": limited / logged if logged else None,
            "max_change_median_scale": statistics.median(scales) if scales else None}


SWEEPS = ("paper", "regime", "yesno", "mpi", "explain", "beyond")
# What a results file keeps of each run's settings: enough to select and to describe it.
_KEPT = VARIED + ("seed", "epochs", "lr", "lr_scaling", "backend", "data.data", "corpus_hours",
                  "model.hidden_layers", "model.hidden_dim", "model.nonlinearity", "decode_data",
                  "final_lr", "max_change_per_sample", "max_param_change", "rbm.epochs",
                  "averaging", "reduce", "payload", "payload_bits", "bmuf.momentum",
                  "bmuf.block_lr", "diloco.outer_lr", "diloco.momentum")


def collect(out: Path) -> dict[str, list[Run]]:
    """The finished runs of each sweep of a reproduction directory."""
    return {name: load_runs(out / name) for name in SWEEPS}


def write_results_file(runs: dict[str, list[Run]], path: Path) -> Path:
    """One JSON line per finished run (settings and summary, no paths to files), so that the
    notebooks and the report can be remade where the runs themselves are not."""
    lines = []
    for sweep, group in runs.items():
        for r in sorted(group, key=lambda r: r.name):
            summary = {k: v for k, v in r.summary.items() if k != "config"}
            settings = {k: r.settings.get(k) for k in _KEPT}
            lines.append(json.dumps({"sweep": sweep, "name": r.name, "settings": settings,
                                     "summary": summary}, sort_keys=True))
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


def read_results_file(path: Path) -> dict[str, list[Run]]:
    """The runs of a results file written by `write_results_file`, by sweep."""
    out: dict[str, list[Run]] = {name: [] for name in SWEEPS}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot read results file {path}: {exc.strerror}") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            out.setdefault(item["sweep"], []).append(
                Run(item["name"], item["settings"], item["summary"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{path}, line {number}: not a results line ({exc})") from None
    return out


def with_recorded(runs: dict[str, list[Run]], results: Path) -> dict[str, list[Run]]:
    """`runs` plus the runs of the results file whose run directories are not there: a report
    remade where only some sweeps' runs are (another machine, a cleaned runs directory) keeps
    the rest as they were recorded, and a run there is wins over its recorded copy."""
    if not Path(results).is_file():
        return runs
    out = {name: list(group) for name, group in runs.items()}
    for name, recorded in read_results_file(results).items():
        have = {r.name for r in out.get(name, [])}
        out.setdefault(name, []).extend(r for r in recorded if r.name not in have)
    return out


def select(runs: list[Run], **want: Any) -> dict[int, Run]:
    """The runs whose settings equal `want` (dotted keys with "__" for "."), by seed."""
    want = {k.replace("__", "."): v for k, v in want.items()}
    return {r.seed: r for r in runs if all(r.get(k) == v for k, v in want.items())}


# --------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Spread:
    """Mean over seeds, their standard deviation and the 95 % t-interval of the mean."""

    mean: float
    sd: float
    n: int
    low: float
    high: float


def spread(values: list[float]) -> Spread | None:
    """None without values; with one value the interval is unknown (infinite)."""
    if not values:
        return None
    mean = statistics.fmean(values)
    if len(values) == 1:
        return Spread(mean, math.nan, 1, -math.inf, math.inf)
    sd = statistics.stdev(values)
    half = T975.get(len(values) - 1, 1.96) * sd / math.sqrt(len(values))
    return Spread(mean, sd, len(values), mean - half, mean + half)


def paired(a: dict[int, Run], b: dict[int, Run], metric: str, relative: bool = False) -> list[float]:
    """b - a per seed both have (in %, of a, when `relative`)."""
    out = []
    for seed in sorted(set(a) & set(b)):
        va, vb = a[seed].metric(metric), b[seed].metric(metric)
        if va is None or vb is None:
            continue
        out.append(100.0 * (vb - va) / va if relative else vb - va)
    return out


def verdict(diff: Spread | None, paper_sign: int) -> str:
    """From the paired differences `worse - better` (positive: the paper's ordering)."""
    if diff is None:
        return "not run"
    if diff.n < 2:
        return "needs 2+ seeds"
    if diff.low > 0:
        return "agrees" if paper_sign > 0 else "disagrees"
    if diff.high < 0:
        return "disagrees" if paper_sign > 0 else "agrees"
    return "within noise"


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _mean_sd(s: Spread | None, digits: int = 2) -> str:
    if s is None:
        return "-"
    return _num(s.mean, digits) if s.n == 1 else f"{s.mean:.{digits}f} ± {s.sd:.{digits}f}"


def _interval(s: Spread | None, digits: int = 2, sign: bool = True) -> str:
    if s is None:
        return "-"
    fmt = f"{{:+.{digits}f}}" if sign else f"{{:.{digits}f}}"
    if s.n < 2:
        return fmt.format(s.mean) + " (1 seed)"
    return f"{fmt.format(s.mean)} [{fmt.format(s.low)}, {fmt.format(s.high)}]"


def _ci_of_runs(runs: dict[int, Run]) -> str:
    """The test-set 95 % interval of WER (bootstrap over utterances), averaged over seeds."""
    cis = [r.summary["wer_ci"] for r in runs.values() if r.summary.get("wer_ci")]
    if not cis:
        return "-"
    return f"{statistics.fmean(c[0] for c in cis):.2f}-{statistics.fmean(c[1] for c in cis):.2f}"


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f} %"


def _seeds(runs: dict[int, Run]) -> str:
    return str(len(runs)) if runs else "0"


def _stat(runs: dict[int, Run], metric: str) -> Spread | None:
    return spread([v for v in (r.metric(metric) for r in runs.values()) if v is not None])


# --------------------------------------------------------------------------- tables


def base_settings(runs: list[Run], sweep_file: Path | None) -> dict[str, Any]:
    """The sweep's base values of the varied settings (from its file, else the commonest)."""
    if sweep_file is not None and sweep_file.is_file():
        from labavg.config import to_dict
        from labavg.sweep import load_sweep

        base = flatten_config(to_dict(load_sweep(sweep_file).base))
        return {k: base[k] for k in VARIED}
    out = {}
    for key in VARIED:
        values = [r.get(key) for r in runs]
        out[key] = max(set(values), key=values.count) if values else None
    return out


def workers_table(runs: list[Run], base: dict[str, Any]) -> list[str]:
    """1 / 8 / 16 / 32 workers: WER, PER, frame accuracy, and the loss against 1 worker."""
    same = {k: v for k, v in base.items() if k != "ranks"}
    one = select(runs, ranks=1, **same)
    paper_rel = {n: 100 * (w - PAPER_WORKERS[1]) / PAPER_WORKERS[1] for n, w in PAPER_WORKERS.items()}
    out = ["| workers | seeds | updates per worker | WER % (mean ± sd) | test-set 95 % CI | PER % | "
           "CV frame acc % | updates cut by max-change | WER change vs 1 worker, % relative "
           "[95 % CI] | paper WER % (change) | verdict |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, paper in PAPER_WORKERS.items():
        here = select(runs, ranks=n, **same)
        updates = _stat(here, "steps")
        rel = spread(paired(one, here, "wer", relative=True)) if n > 1 else None
        if n == 1:
            word = "-"
        elif rel is None:
            word = "not run"
        elif rel.n < 2:
            word = "needs 2+ seeds"
        elif rel.low > paper_rel[n]:
            word = "disagrees: loses more"
        elif rel.high < paper_rel[n]:
            word = "agrees: loses less"
        else:
            word = "consistent (within noise)"
        paper_cell = f"{paper}" + ("" if n == 1 else f" ({paper_rel[n]:+.1f} %)")
        out.append(
            f"| {n} | {_seeds(here)} | {'-' if updates is None else f'{updates.mean:,.0f}'} | "
            f"{_mean_sd(_stat(here, 'wer'))} | {_ci_of_runs(here)} | {_mean_sd(_stat(here, 'per'))} | "
            f"{_mean_sd(_stat(here, 'cv_frame_accuracy'))} | {_percent(_trace_stat(here, 'max_change_limited'))} | "
            f"{'-' if n == 1 else _interval(rel, 1)} | {paper_cell} | {word} |")
    out += ["", "A row agrees when the whole interval lies below the paper's relative WER change "
            "(averaging costs less than in the paper), disagrees when it lies above it, and is "
            "consistent (within noise) when the paper's change is inside it."]
    return out


def pair_table(runs: list[Run], base: dict[str, Any], pair: Pair) -> list[str]:
    """One of the paper's two-way comparisons, with the paired WER difference and a verdict."""
    fixed = {**{k: v for k, v in base.items() if k != pair.vary}, **pair.fixed}
    sides = [(value, select(runs, **fixed, **{pair.vary: value})) for value in (pair.better, pair.worse)]
    out = [f"| {pair.vary} | seeds | WER % (mean ± sd) | test-set 95 % CI | PER % | CV frame acc % | "
           "paper WER % |", "|---|---|---|---|---|---|---|"]
    for i, (value, here) in enumerate(sides):
        paper = "-" if pair.paper is None else str(pair.paper[i])
        out.append(f"| {value} | {_seeds(here)} | {_mean_sd(_stat(here, 'wer'))} | {_ci_of_runs(here)} | "
                   f"{_mean_sd(_stat(here, 'per'))} | {_mean_sd(_stat(here, 'cv_frame_accuracy'))} | "
                   f"{paper} |")
    wer_diff = spread(paired(sides[0][1], sides[1][1], "wer"))
    acc_diff = spread(paired(sides[1][1], sides[0][1], "cv_frame_accuracy"))
    paper_sign = 0 if pair.paper is None else (1 if pair.paper[1] > pair.paper[0] else -1)
    if pair.paper is None:
        word = verdict(wer_diff, 1)
        word = {"agrees": f"{pair.better} better", "disagrees": f"{pair.worse} better"}.get(word, word)
    else:
        word = verdict(wer_diff, paper_sign)
    paper_diff = "" if pair.paper is None else f" (paper: {pair.paper[1] - pair.paper[0]:+.1f})"
    out += ["", f"WER of {pair.vary} = {pair.worse} minus {pair.vary} = {pair.better}, same seed: "
            f"{_interval(wer_diff)} points{paper_diff}; frame accuracy {pair.better} minus "
            f"{pair.worse}: {_interval(acc_diff)} points. Paper: {pair.finding}. "
            f"**Verdict: {word}.**"]
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


def _trace_stat(runs: dict[int, Run], key: str) -> float | None:
    values = [r.summary.get("trace", {}).get(key) for r in runs.values()]
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def probe_section(runs: dict[str, list[Run]], base: dict[str, Any], probe: Probe) -> list[str]:
    """One explaining experiment: each row's WER and accuracy, and its paired difference."""
    out = [f"### {probe.title}", "", probe.question, "",
           "| setting | seeds | WER % (mean ± sd) | WER difference, points [95 % CI] | "
           "CV frame acc % | updates cut by max-change | final effective lr |",
           "|---|---|---|---|---|---|---|"]
    found: dict[str, dict[int, Run]] = {}
    for label, sweep, want, against in probe.rows:
        fixed = {**{k: v for k, v in base.items() if k not in want}, **want}
        here = select(runs.get(sweep, []), **{k.replace(".", "__"): v for k, v in fixed.items()})
        found[label] = here
        diff = "-" if against is None else f"{_interval(spread(paired(found[against], here, 'wer')))} vs {against}"
        cut = _trace_stat(here, "max_change_limited")
        lrs = [r.summary.get("trace", {}).get("epochs", [{}])[-1].get("lr") for r in here.values()
               if r.summary.get("trace", {}).get("epochs")]
        out.append(f"| {label} | {_seeds(here)} | {_mean_sd(_stat(here, 'wer'))} | {diff} | "
                   f"{_mean_sd(_stat(here, 'cv_frame_accuracy'))} | {_percent(cut)} | "
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


def comparison_sections(runs: list[Run], base: dict[str, Any]) -> list[str]:
    out = ["### Number of workers", ""] + workers_table(runs, base)
    for pair in PAIRS:
        out += ["", f"### {pair.title}", ""] + pair_table(runs, base, pair)
    return out


def verdict_summary(runs: list[Run], base: dict[str, Any]) -> list[tuple[str, str]]:
    """(comparison, verdict) for every pair, as the report's summary table shows them."""
    out = []
    for pair in PAIRS:
        fixed = {**{k: v for k, v in base.items() if k != pair.vary}, **pair.fixed}
        a = select(runs, **fixed, **{pair.vary: pair.better})
        b = select(runs, **fixed, **{pair.vary: pair.worse})
        sign = 1 if pair.paper is None or pair.paper[1] > pair.paper[0] else -1
        out.append((pair.title, verdict(spread(paired(a, b, "wer")), sign)))
    return out


# --------------------------------------------------------------------------- the regime map


@dataclass(frozen=True)
class MapPoint:
    """N workers on one corpus: updates per worker, rounds and the accuracy lost against N = 1."""

    corpus: str
    hours: float
    ranks: int
    seeds: int
    updates: float
    rounds: float
    accuracy: Spread
    loss: Spread | None


def corpus_hours(path: str) -> float | None:
    """Hours of training speech of a built-in corpus (its corpus.json), None for other data."""
    try:
        return float(json.loads((Path(path) / "corpus.json").read_text())["hours"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def regime_points(runs: list[Run]) -> list[MapPoint]:
    """The map's points: for each corpus and N, the paired loss of CV frame accuracy vs N = 1."""
    points = []
    hours_of = {r.get("data.data"): r.get("corpus_hours") for r in runs}
    for data in sorted(hours_of, key=lambda d: hours_of[d] or 0.0):
        here = [r for r in runs if r.get("data.data") == data]
        hours = hours_of[data] or math.nan
        one = select(here, ranks=1)
        for n in sorted({r.get("ranks") for r in here}):
            these = select(here, ranks=n)
            acc = _stat(these, "cv_frame_accuracy")
            points.append(MapPoint(
                data, hours, n, len(these), _stat(these, "steps").mean,
                _stat(these, "averaging_rounds").mean, acc,
                spread(paired(one, these, "cv_frame_accuracy")) if n > 1 else Spread(0, 0, len(one), 0, 0)))
    return points


def regime_table(points: list[MapPoint]) -> list[str]:
    out = ["| corpus h | workers N | seeds | updates per worker | averaging rounds | CV frame acc % "
           "(mean ± sd) | loss vs N = 1, points [95 % CI] |", "|---|---|---|---|---|---|---|"]
    for p in points:
        loss = "0 (the reference)" if p.ranks == 1 else _interval(p.loss)
        out.append(f"| {round(p.hours, 2):g} | {p.ranks} | {p.seeds} | {p.updates:,.0f} | {p.rounds:,.0f} | "
                   f"{_mean_sd(p.accuracy)} | {loss} |")
    return out


def paper_updates_per_worker(ranks: int) -> float:
    """The paper's minibatches per worker in one epoch of 300 h at 1024 frames."""
    return PAPER_FRAMES_PER_EPOCH / (ranks * PAPER_MINIBATCH)


def _hours_label(hours: float) -> str:
    return f"{round(hours, 2):g} h"


def regime_figure(points: list[MapPoint], comparison: list[MapPoint], path: Path) -> Path:
    """Two panels: loss against N, and against updates per worker, one line per corpus size.

    Dashed lines in the right panel: the paper's updates per worker in one epoch at 32 (left)
    and 16 GPUs (right).
    """
    import holoviews as hv
    import holoviews.plotting.mpl  # noqa: F401  (loads the backend without making it current)

    mpl = {"backend": "matplotlib"}
    previous = hv.Store.current_backend  # a notebook's (bokeh) is given back at the end
    hv.Store.set_current_backend("matplotlib")
    try:
        return _draw_regime(hv, mpl, points, comparison, path)
    finally:
        hv.Store.set_current_backend(previous)


def _draw_regime(hv, mpl: dict[str, str], points: list[MapPoint], comparison: list[MapPoint],
                 path: Path) -> Path:
    by_n, by_updates = [], []
    for corpus in dict.fromkeys(p.corpus for p in points):  # in order of size
        pts = [p for p in points if p.corpus == corpus and p.loss is not None]
        hours = pts[0].hours if pts else math.nan
        label = f"{_hours_label(hours)} corpus" if math.isfinite(hours) else Path(corpus).name
        data = [(p.ranks, p.loss.mean) for p in pts]
        by_n.append(hv.Curve(data, "workers N", "loss", label=label)
                    * hv.Scatter(data, "workers N", "loss", label=label))
        ud = [(p.updates, p.loss.mean) for p in pts if p.ranks > 1]
        by_updates.append(hv.Curve(ud, "updates", "loss", label=label)
                          * hv.Scatter(ud, "updates", "loss", label=label))
    cd = [(p.updates, p.loss.mean) for p in comparison if p.ranks > 1 and p.loss is not None]
    if cd:
        by_updates.append(hv.Scatter(cd, "updates", "loss", label="comparisons")
                          .opts(marker="*", s=180, color="black", **mpl))
    paper = [hv.VLine(paper_updates_per_worker(n)).opts(color="grey", linestyle="--", **mpl)
             for n in (32, 16)]
    zero = hv.HLine(0).opts(color="black", linewidth=0.8, **mpl)
    ylabel = "CV frame accuracy lost vs 1 worker (points)"
    left = hv.Overlay(by_n + [zero]).opts(
        logx=True, xticks=[(n, str(n)) for n in (1, 2, 4, 8, 16, 32)],
        xlabel="workers N (log scale)", ylabel=ylabel, title="Accuracy lost against workers",
        legend_position="bottom_left", show_grid=True, aspect=1.2, **mpl)
    right = hv.Overlay(by_updates + paper + [zero]).opts(
        logx=True, xlabel="updates per worker, whole run (log scale)", ylabel=ylabel,
        title="... against updates per worker", show_legend=False, show_grid=True, aspect=1.2,
        **mpl)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    layout = (left + right).opts(sublabel_format="", fig_inches=(11, 4.6), **mpl)
    hv.save(layout, tmp, fmt="png", backend="matplotlib", dpi=100)
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------- yesno and speedup


def yesno_section(runs: list[Run]) -> list[str]:
    out = ["| workers | optimizer | seeds | WER % (mean ± sd) | test-set 95 % CI | PER % | CV frame acc % |",
           "|---|---|---|---|---|---|---|"]
    for n, opt in sorted({(r.get("ranks"), r.get("optimizer")) for r in runs}):
        here = select(runs, ranks=n, optimizer=opt)
        out.append(f"| {n} | {opt} | {_seeds(here)} | {_mean_sd(_stat(here, 'wer'))} | "
                   f"{_ci_of_runs(here)} | {_mean_sd(_stat(here, 'per'))} | "
                   f"{_mean_sd(_stat(here, 'cv_frame_accuracy'))} |")
    return out


MPI_POINTS = (("ranks1", 1, 10), ("ranks2", 2, 10), ("ranks2-K20", 2, 20))


def measure_mpi(paper_file: Path, out: Path, *, epochs: int = 1, cwd: Path | None = None) -> None:
    """1 and 2 MPI ranks (K = 10 and 20) with the comparisons' model and data; resumable."""
    import shutil

    from labavg.config import validate, with_overrides
    from labavg.launch import start_run
    from labavg.sweep import load_sweep

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


def speedup_section(mpi_runs: list[Run]) -> list[str]:
    """The cost model fitted to the paper's timing table, and this machine's measurement."""
    fit = costmodel.fit_paper_table()
    out = ["#### The paper's timing table and the cost model fitted to it", "",
           "| GPUs | paper train min/epoch | paper comm min | model train | model comm | "
           "paper speedup | model speedup |", "|---|---|---|---|---|---|---|"]
    for row in fit.rows:
        paper_speedup = costmodel.PAPER_TABLE[0].train_min / row.train_min
        out.append(f"| {row.ranks} | {row.train_min} | {row.comm_min} | {row.model_train_min:.1f} | "
                   f"{row.model_comm_min:.2f} | {paper_speedup:.2f} | "
                   f"{costmodel.fitted_speedup(fit, row.ranks):.2f} |")
    out.append(f"| 32 | - | - | - | - | 17 (reported) | {costmodel.fitted_speedup(fit, 32):.2f} |")
    out += ["", "Speedup = train(1) / train(N), communication inside the train column "
            "(docs/cost-model.md). At 16 GPUs: K = 10 model "
            f"{costmodel.fitted_speedup(fit, 16, K=10):.2f} (paper {PAPER_SPEEDUP_K[10]}), K = 20 "
            f"model {costmodel.fitted_speedup(fit, 16, K=20):.2f} (paper {PAPER_SPEEDUP_K[20]})."]
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
                   f"{s['comm_seconds']:.2f} | {100 * s['comm_fraction']:.1f} | {_num(speedup)} | "
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
        lines = [f"# Tiny version of {source / name}.toml (labavg.reproduction.tiny_experiments)"]
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


def comparison_map_points(paper_runs: list[Run], base: dict[str, Any]) -> list[MapPoint]:
    """The comparisons' workers runs as points of the regime map."""
    return regime_points([r for r in paper_runs if all(
        r.get(k) == v for k, v in base.items() if k != "ranks")])


def render_report(runs: dict[str, list[Run]], experiments: Experiments, *, command: str,
                  seconds: float, figure: Path | None, report: Path,
                  beyond_figure: Path | None = None) -> str:
    """REPRODUCTION.md (above the discussion marker) from the finished runs."""
    paper_runs, regime_runs, yesno_runs = (runs.get(k, []) for k in ("paper", "regime", "yesno"))
    base = base_settings(paper_runs, experiments.paper)
    points = regime_points(regime_runs)
    s0 = paper_runs[0].settings if paper_runs else {}
    updates32 = _stat(select(paper_runs, **base | {"ranks": 32}), "steps")
    hours = s0.get("corpus_hours")
    parts = [
        "# Reproducing Su & Chen (2015) with labavg", "",
        "Everything here is regenerated by `labavg reproduce --yesno ../shared/data/kaldi-yesno` "
        "(resumable: finished runs are reused; `--report-only` remakes this file from the runs "
        f"there are). This file was written by `{command}` in {seconds / 60:.1f} min; the "
        f"{sum(len(g) for g in runs.values())} runs it reports took "
        f"{_sum_wall(*runs.values()) / 3600:.1f} h of training wall time in all (two runs at a "
        "time on a 2-core machine; the decoding at the end of each run comes on top).", "",
        "## What was chosen, and why", "",
        "The paper's result (16-32 workers train nearly as well as one) holds where each worker "
        "makes many updates between the start and the end of training: its 300 h of Switchboard "
        "gave each of 32 GPUs about 3,300 minibatches per epoch. The regime map below measures "
        "how the accuracy lost to averaging shrinks as the updates per worker grow, and the "
        "comparisons are sized to sit inside that regime on a 2-core machine:",
        f"- corpus: the built-in synthetic speech, {_num(hours, 1)} h of training speech, with "
        "held-out dev (acoustic scale) and test (scored) sets of other speakers;",
        f"- model {s0.get('model.hidden_layers', '-')} x {s0.get('model.hidden_dim', '-')} "
        f"{s0.get('model.nonlinearity', '')}, {s0.get('epochs', '-')} epochs, minibatch "
        f"{base.get('minibatch')}, K = {base.get('average_every')} minibatches, NG-SGD, exponential "
        f"schedule, learning rate {s0.get('lr', '-')} x N workers;",
        f"- so that every worker at N = 32 makes {_num(updates32.mean if updates32 else None, 0)} "
        "updates (the issue asked for at least 1,000), while all comparisons x 3 seeds fit in a "
        "few hours; workers are simulated in one process (`inproc`: the same arithmetic as MPI "
        "ranks), so 32 fit on 2 cores;",
        "- every row is decoded (HLG from kaldifst, kaldi-decoder): WER and PER on the test set, "
        "with the test set's 95 % bootstrap interval, CV frame accuracy beside them;",
        "- plain SGD is plain (no max-change, as nnet1's SGD, the paper's baseline); NG-SGD keeps "
        "Kaldi nnet2's max-change.", "",
        "Verdicts use seeds: the per-seed paired difference (same seed, same data) gets a 95 % "
        "t-interval of its mean; a comparison agrees or disagrees with the paper only when the "
        "interval excludes zero, and is **within noise** otherwise.", "",
        "## Verdicts at a glance", "",
        "| comparison | verdict |", "|---|---|",
    ]
    parts += [f"| {title} | {word} |" for title, word in verdict_summary(paper_runs, base)]
    parts += ["", "## The regime map", "",
              f"Made by `labavg sweep {experiments.regime}` (also run by this command): "
              "CV frame accuracy lost by N workers against one worker on the same corpus and "
              "seed, for several corpus sizes. Updates per worker = minibatches each worker "
              "trained in the whole run.", ""]
    if figure is not None and figure.is_file():
        rel = os.path.relpath(figure.resolve(), report.resolve().parent)
        parts += [f"![regime map]({rel})", "",
                  "Left: the loss against N, one line per corpus size. Right: the same points "
                  "against updates per worker; black stars: the comparisons below (their "
                  "corpus, 4 epochs, minibatch 128); dashed lines: the paper's updates per worker "
                  "in one epoch at 32 (left) and 16 GPUs (right).", ""]
    parts += regime_table(points) if points else ["No regime runs yet."]
    parts += ["", "## The paper's comparisons", "",
              f"Made by `labavg sweep {experiments.paper}` (also run by this command). WER and "
              "PER in %, lower is better; frame accuracy in %, higher is better.", ""]
    parts += comparison_sections(paper_runs, base)
    if yesno_runs:
        parts += ["", "## Real data: Kaldi's yesno recipe", "",
                  f"Made by `labavg sweep {experiments.yesno}` in the recipe directory; decoded on "
                  "test_yesno (29 utterances, 232 words), where the recipe's monophone GMM scores "
                  "0.00 % WER. yesno has 31 training utterances, so at most 8 workers; with 11 "
                  "pdfs and two words it is easy, and differences are small.", ""]
        parts += yesno_section(yesno_runs)
    if runs.get("explain"):
        parts += ["", "## Why the disagreements: experiments", "",
                  f"Made by `labavg sweep {experiments.directory / 'explain.toml'}` (also run by this "
                  "command), against the runs above; same corpus and base settings, three seeds.", ""]
        for probe in PROBES:
            parts += probe_section(runs, base, probe) + [""]
        parts += ["#### The two schedules epoch by epoch (16 workers, seed 0)", ""]
        parts += schedule_trace(paper_runs, base)
    parts += ["", "## Speedup", ""] + speedup_section(runs.get("mpi", []))
    if runs.get("beyond"):
        from labavg.beyond import section

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

    from labavg.sweep import load_sweep

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
    from labavg.sweep import load_sweep

    for path in (exp.paper, exp.regime):
        load_sweep(path)
    jobs = [("paper", exp.paper, out / "paper", None), ("regime", exp.regime, out / "regime", None)]
    if yesno is not None:
        jobs.append(("yesno", exp.yesno, out / "yesno", yesno))
    for name in ("explain", "beyond"):
        path = getattr(exp, name)
        if path.is_file():
            jobs.append((name, path, out / name, None))
    if train:
        from labavg.sweep import make_corpora

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
    points = regime_points(runs["regime"])
    if points:
        base = base_settings(runs["paper"], exp.paper)
        regime_figure(points, comparison_map_points(runs["paper"], base), figure)
    if runs["beyond"]:
        from labavg.beyond import figure as draw_beyond

        draw_beyond(runs["beyond"], select([r for r in runs["beyond"] if r.get("ranks") == 1]),
                    beyond_figure)
    text = render_report(runs, exp, command=command, seconds=time.perf_counter() - start,
                         figure=figure, report=report, beyond_figure=beyond_figure)
    # A discussion written by people below the marker survives regeneration.
    kept = report.read_text().partition(DISCUSSION_MARKER)[2] if report.is_file() else ""
    atomic_write_text(report, f"{text}\n{DISCUSSION_MARKER}{kept or chr(10)}")
    return report
