"""The regime map: how much CV frame accuracy N averaging workers lose against one, and what
predicts it.

experiments/regime.toml trains N = 1..32 workers on corpora of 0.5-8 h; each point's loss is the
paired (same seed) frame-accuracy difference against N = 1 on the same corpus. Every candidate
predictor is a number per point; a least-squares line of the loss on it (on its log2 where it
spans octaves) says how much of the map it explains (R^2). experiments/regime-variables.toml
then moves one candidate at a time while N and the updates per worker stay fixed, which the map
alone cannot do (on the map the rounds follow the updates, and the frames per round, the
effective learning rate and the max-change share all follow N).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from labavg.studies.reproduction.tables import interval, markdown_table, mean_sd, words
from labavg.studies.reproduction.figures import save_png
from labavg.studies.reproduction.results import Run, paired, select, stat, trace_stat
from labavg.studies.reproduction.verdicts import ACCURACY_MARGIN, Spread, spread, verdict

# The paper's corpus (300 h at 100 frames/s) and minibatch (1024 frames) give its updates per
# worker per epoch, for placing its runs on the map.
PAPER_FRAMES_PER_EPOCH = 300 * 3600 * 100
PAPER_MINIBATCH = 1024
# A candidate that explains this share of the loss's variance collapses the curves.
COLLAPSES = 0.95


@dataclass(frozen=True)
class MapPoint:
    """N workers on one corpus and setting: what each candidate predictor is, and the accuracy
    lost against N = 1 (points, paired over seeds)."""

    corpus: str
    hours: float
    ranks: int
    seeds: int
    updates: float
    rounds: float
    frames_per_round: float
    effective_lr: float
    max_change_cut: float | None
    accuracy: Spread
    loss: Spread | None


def _lr_factor(run: Run) -> float:
    n, rule = run.get("ranks") or 1, run.get("lr_scaling") or "linear"
    return {"linear": n, "sqrt": math.sqrt(n)}.get(rule, 1.0)


def point(corpus: str, hours: float, these: dict[int, Run], one: dict[int, Run]) -> MapPoint:
    """The map point of `these` runs (same corpus and settings, by seed) against `one` worker."""
    any_run = next(iter(these.values()))
    n = any_run.get("ranks")
    k, mb = any_run.get("averaging.average_every") or 1, any_run.get("minibatch") or 1
    loss = (spread(paired(one, these, "cv_acc_pct")) if n > 1
            else Spread(0.0, 0.0, len(one), 0.0, 0.0))
    return MapPoint(corpus, hours, n, len(these), stat(these, "steps").mean,
                    stat(these, "averaging_rounds").mean, n * k * mb,
                    (any_run.get("lr") or math.nan) * _lr_factor(any_run),
                    trace_stat(these, "max_change_limited"), stat(these, "cv_acc_pct"), loss)


def regime_points(runs: list[Run]) -> list[MapPoint]:
    """The map's points: for each corpus (smallest first) and N, the loss against N = 1."""
    points = []
    hours_of = {r.get("data.data"): r.get("corpus_hours") for r in runs}
    for data in sorted(hours_of, key=lambda d: hours_of[d] or 0.0):
        here = [r for r in runs if r.get("data.data") == data]
        one = select(here, ranks=1)
        for n in sorted({r.get("ranks") for r in here}):
            points.append(point(data, hours_of[data] or math.nan, select(here, ranks=n), one))
    return points


# --------------------------------------------------------------------------- what predicts it


@dataclass(frozen=True)
class Candidate:
    """A predictor of the loss: its name, its value at a point, and whether it is fitted on
    its log2 (it spans octaves)."""

    name: str
    value: Callable[[MapPoint], float | None]
    log: bool = True

    def x(self, p: MapPoint) -> float | None:
        v = self.value(p)
        if v is None or not math.isfinite(v) or (self.log and v <= 0):
            return None
        return math.log2(v) if self.log else v


CANDIDATES = (
    Candidate("updates per worker", lambda p: p.updates),
    Candidate("averaging rounds", lambda p: p.rounds),
    Candidate("frames averaged per round (N x K x minibatch)", lambda p: p.frames_per_round),
    Candidate("effective learning rate (lr x N)", lambda p: p.effective_lr),
    Candidate("share of updates max-change cuts", lambda p: p.max_change_cut, log=False),
    Candidate("workers N", lambda p: p.ranks),
    Candidate("log2 N / sqrt(updates per worker)",
              lambda p: math.log2(p.ranks) / math.sqrt(p.updates), log=False),
)


@dataclass(frozen=True)
class Fit:
    """loss = intercept + slope x candidate (least squares over the map's multi-worker points)."""

    candidate: Candidate
    points: int
    intercept: float
    slope: float
    r2: float

    def predict(self, p: MapPoint) -> float | None:
        x = self.candidate.x(p)
        return None if x is None else self.intercept + self.slope * x


def fit(candidate: Candidate, points: list[MapPoint]) -> Fit | None:
    """The line of the points' mean loss on the candidate; None with fewer than 3 points."""
    pairs = [(candidate.x(p), p.loss.mean) for p in points if p.ranks > 1 and p.loss is not None]
    pairs = [(x, y) for x, y in pairs if x is not None]
    if len(pairs) < 3 or len({x for x, _ in pairs}) < 2:
        return None
    x, y = np.array(pairs).T
    slope, intercept = np.polyfit(x, y, 1)
    residual = y - (intercept + slope * x)
    r2 = 1.0 - float(residual.var() / y.var()) if y.var() > 0 else 0.0
    return Fit(candidate, len(pairs), float(intercept), float(slope), r2)


def fits(points: list[MapPoint]) -> list[Fit]:
    """Every candidate's fit, the best first."""
    found = [f for f in (fit(c, points) for c in CANDIDATES) if f is not None]
    return sorted(found, key=lambda f: -f.r2)


def fit_table(found: list[Fit]) -> list[str]:
    rows = [(f.candidate.name, "log2 of it" if f.candidate.log else "itself", f.points,
             f"{f.r2:.2f}", f"{f.slope:+.2f}") for f in found]
    return markdown_table(("candidate", "fitted on", "map points", "R^2", "slope, points per unit"),
                          rows)


def fit_sentence(found: list[Fit]) -> str:
    """What the fits say, in words written from them."""
    single = [f for f in found if f.candidate is not CANDIDATES[-1]]
    combined = next((f for f in found if f.candidate is CANDIDATES[-1]), None)
    if not single:
        return "Too few map points to fit a candidate yet."
    best = single[0]
    if best.r2 >= COLLAPSES:
        head = (f"{best.candidate.name.capitalize()} collapses the curves: it explains "
                f"R^2 = {best.r2:.2f} of the loss's variance across the {best.points} "
                "multi-worker points.")
    else:
        head = (f"No single candidate collapses the curves (R^2 >= {COLLAPSES:.2f}): the best, "
                f"{best.candidate.name}, explains R^2 = {best.r2:.2f} of the loss's variance "
                f"across the {best.points} multi-worker points.")
    if combined is None or combined.r2 <= best.r2:
        return head
    verb = "collapses them" if combined.r2 >= COLLAPSES else "comes closest"
    return (f"{head} N and the updates per worker together do better: the loss is about "
            f"{combined.slope:.1f} x log2 N / sqrt(updates per worker) "
            f"{combined.intercept:+.2f} points, which {verb} (R^2 = {combined.r2:.2f}): the loss "
            "grows with log N at a fixed number of updates and shrinks as one over their square "
            "root at a fixed N.")


# --------------------------------------------------------------------------- one variable at a time


def _change(run: Run) -> str | None:
    """What a regime-variables run changes from the map's setting, in words."""
    parts = []
    rule = run.get("lr_scaling") or "linear"
    if rule != "linear":
        parts.append({"sqrt": "learning rate x sqrt(N)", "none": "learning rate x 1"}.get(
            rule, f"lr_scaling {rule}"))
    if (run.get("averaging.average_every") or 10) != 10:
        parts.append(f"K = {run.get('averaging.average_every')}")
    if run.get("max_change_per_sample") == 0.0:
        parts.append("no per-frame max-change")
    return ", ".join(parts) or None


@dataclass(frozen=True)
class Variant:
    """A regime-variables setting at N workers against the map's run at the same N and seed."""

    change: str
    ranks: int
    corpus: str
    here: MapPoint
    map: MapPoint
    effect: Spread | None  # the variant's accuracy minus the map run's, points, paired

    @property
    def verdict(self) -> str:
        word = verdict(self.effect, None, ACCURACY_MARGIN)
        return {"positive": "higher accuracy", "negative": "lower accuracy",
                "~0": "same accuracy"}.get(word, word)


def variants(variable_runs: list[Run], map_runs: list[Run]) -> list[Variant]:
    """Each regime-variables setting, paired by seed with the map's run it varies."""
    groups: dict[tuple[str, int, str], list[Run]] = {}
    for r in variable_runs:
        change = _change(r)
        if change is not None:
            groups.setdefault((r.get("data.data"), r.get("ranks"), change), []).append(r)
    out = []
    for (data, n, change), group in sorted(groups.items(), key=lambda g: (g[0][1], g[0][2])):
        here_map = [r for r in map_runs if r.get("data.data") == data]
        base, one = select(here_map, ranks=n), select(here_map, ranks=1)
        if not base or not one:
            continue
        these = {r.seed: r for r in group}
        hours = group[0].get("corpus_hours") or math.nan
        out.append(Variant(change, n, data, point(data, hours, these, one),
                           point(data, hours, base, one),
                           spread(paired(base, these, "cv_acc_pct"))))
    return out


def variant_table(found: list[Variant]) -> list[str]:
    rows = []
    for v in found:
        cut = "-" if v.here.max_change_cut is None else f"{100 * v.here.max_change_cut:.0f} %"
        was = "-" if v.map.max_change_cut is None else f"{100 * v.map.max_change_cut:.0f} %"
        rows.append((v.ranks, v.change, v.here.seeds,
                     f"{v.here.rounds:,.0f} (map {v.map.rounds:,.0f})",
                     f"{v.here.frames_per_round:,.0f} (map {v.map.frames_per_round:,.0f})",
                     f"{v.here.effective_lr:.3g} (map {v.map.effective_lr:.3g})",
                     f"{cut} (map {was})", interval(v.effect), v.verdict))
    return markdown_table(
        ("workers N", "change from the map's run", "seeds", "averaging rounds", "frames per round",
         "effective lr", "updates cut by max-change",
         "CV frame acc change vs the map's run, points [95 % CI]", "verdict"), rows)


def _moved(v: Variant) -> list[str]:
    """The candidates a variant changes by more than a tenth against the map's run."""
    pairs = (("the averaging rounds", v.here.rounds, v.map.rounds),
             ("the frames per round", v.here.frames_per_round, v.map.frames_per_round),
             ("the effective learning rate", v.here.effective_lr, v.map.effective_lr),
             ("the max-change share", v.here.max_change_cut or 0.0, v.map.max_change_cut or 0.0))
    return [name for name, a, b in pairs if abs(a - b) > 0.1 * max(abs(a), abs(b), 1e-12)]


def variant_sentence(found: list[Variant]) -> str:
    """What the one-at-a-time runs say, in words written from them: a change that moves the
    accuracy by less than a tenth of the loss the map's run has there does not set the loss."""
    small, large = [], []
    for v in found:
        if v.effect is None or v.map.loss is None:
            continue
        (small if abs(v.effect.mean) < 0.1 * abs(v.map.loss.mean) else large).append(v)
    parts = []
    if small:
        changed = sorted({name for v in small for name in _moved(v)})
        parts.append(
            "At the same N and updates per worker, "
            + words([f"{v.change} at {v.ranks} workers ({interval(v.effect)} points)" for v in small])
            + " move the accuracy by less than a tenth of the loss the map's run has there "
            + f"({words(sorted({f'{v.map.loss.mean:+.2f}' for v in small}))} points), so "
            + (words(changed) if changed else "what they change") + " do not set the loss.")
    if large:
        lower = all(v.here.effective_lr < v.map.effective_lr and v.effect.high < 0 for v in large)
        parts.append(
            words([f"{v.change} at {v.ranks} workers moves it by {interval(v.effect)} points"
                   for v in large])
            + ("; a smaller effective learning rate loses more, not less, so the N-fold rate is "
               "not what costs accuracy" if lower else "") + ".")
    return " ".join(p[0].upper() + p[1:] for p in parts)


def holdout_sentence(best: Fit | None, comparison: list[MapPoint]) -> str:
    """The fit chosen on the map, tested on the comparisons' runs (another corpus, minibatch,
    epochs and learning rate): predicted against measured loss."""
    pts = [p for p in comparison if p.ranks > 1 and p.loss is not None]
    if best is None or not pts:
        return ""
    pred = [best.predict(p) for p in pts]
    if any(x is None for x in pred):
        return ""
    return ("The predictor was chosen on the map itself, so its R^2 flatters it; on the "
            "comparisons' runs, which it was not fitted to (another corpus, minibatch, number "
            "of epochs and learning rate), it predicts a loss of "
            + words([f"{x:+.2f}" for x in pred]) + " points at "
            + words([str(p.ranks) for p in pts]) + " workers, where they lost "
            + words([f"{p.loss.mean:+.2f}" for p in pts]) + ".")


# --------------------------------------------------------------------------- table and figure


def regime_table(points: list[MapPoint]) -> list[str]:
    rows = []
    for p in points:
        loss = "0 (the reference)" if p.ranks == 1 else interval(p.loss)
        cut = "-" if p.max_change_cut is None else f"{100 * p.max_change_cut:.0f} %"
        rows.append((f"{round(p.hours, 2):g}", p.ranks, p.seeds, f"{p.updates:,.0f}",
                     f"{p.rounds:,.0f}", cut, mean_sd(p.accuracy), loss))
    return markdown_table(
        ("corpus h", "workers N", "seeds", "updates per worker", "averaging rounds",
         "updates cut by max-change", "CV frame acc % (mean ± sd)",
         "loss vs N = 1, points [95 % CI]"), rows)


def paper_updates_per_worker(ranks: int) -> float:
    """The paper's minibatches per worker in one epoch of 300 h at 1024 frames."""
    return PAPER_FRAMES_PER_EPOCH / (ranks * PAPER_MINIBATCH)


def _label(p: MapPoint) -> str:
    return f"{round(p.hours, 2):g} h corpus" if math.isfinite(p.hours) else Path(p.corpus).name


def regime_figure(points: list[MapPoint], comparison: list[MapPoint], best: Fit | None,
                  path: Path) -> Path:
    """Three panels of the loss: against N and against updates per worker, a line per corpus
    size; and against the best-fitting candidate, with its fitted line."""
    import matplotlib

    matplotlib.use("Agg")  # files only, whatever backend a notebook chose
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3 if best else 2, figsize=(16 if best else 11, 4.8), sharey=True)
    for corpus in dict.fromkeys(p.corpus for p in points):
        pts = [p for p in points if p.corpus == corpus and p.loss is not None]
        many = [p for p in pts if p.ranks > 1]
        axes[0].plot([p.ranks for p in pts], [p.loss.mean for p in pts], "o-", label=_label(pts[0]))
        axes[1].plot([p.updates for p in many], [p.loss.mean for p in many], "o-")
        if best:
            xs = [best.candidate.x(p) for p in many]
            axes[2].plot(xs, [p.loss.mean for p in many], "o", label=_label(pts[0]))
    stars = [p for p in comparison if p.ranks > 1 and p.loss is not None]
    if stars:
        axes[1].plot([p.updates for p in stars], [p.loss.mean for p in stars], "*", ms=14,
                     color="black", label="the comparisons' runs")
    for n, style in ((32, ":"), (16, "--")):
        axes[1].axvline(paper_updates_per_worker(n), color="grey", linestyle=style,
                        label=f"the paper, 1 epoch at {n} GPUs")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xticks([1, 2, 4, 8, 16, 32], ["1", "2", "4", "8", "16", "32"])
    axes[0].set_xlabel("workers N (log scale)")
    axes[0].set_title("Accuracy lost against workers")
    axes[0].set_ylabel("CV frame accuracy lost vs 1 worker (points)")
    axes[1].set_xscale("log")
    axes[1].set_xlabel("updates per worker, whole run (log scale)")
    axes[1].set_title("... against updates per worker")
    axes[1].legend(fontsize=8, loc="lower right")
    axes[0].legend(fontsize=8, loc="lower left", title="each line: one corpus")
    if best:
        xs = [best.candidate.x(p) for p in points if p.ranks > 1 and best.candidate.x(p) is not None]
        line = np.linspace(0.0 if not best.candidate.log else min(xs), max(xs), 50)
        axes[2].plot(line, best.intercept + best.slope * line, color="black", linewidth=1,
                     label=f"fit to the map, R^2 = {best.r2:.2f}")
        held = [(best.candidate.x(p), p.loss.mean) for p in stars if best.candidate.x(p) is not None]
        if held:
            axes[2].plot(*zip(*held), "*", ms=14, color="black",
                         label="the comparisons' runs (not fitted)")
        unit = "log2 of " if best.candidate.log else ""
        axes[2].set_xlabel(f"{unit}{best.candidate.name}")
        axes[2].set_title("... against the best predictor")
        axes[2].legend(fontsize=8, loc="lower left")
    for ax in axes:
        ax.axhline(0, color="black", linewidth=0.8)
        ax.grid(True, alpha=0.3)
    return save_png(fig, path)


def comparison_points(paper_runs: list[Run], base: dict[str, Any]) -> list[MapPoint]:
    """The comparisons' workers runs (the paper sweep's base settings) as points of the map."""
    return regime_points([r for r in paper_runs if all(
        r.get(k) == v for k, v in base.items() if k != "ranks")])


def section(points: list[MapPoint], found_variants: list[Variant], comparison: list[MapPoint],
            figure: Path | None, report: Path, sweep_file: Path,
            variables_file: Path) -> list[str]:
    """The report's regime section (markdown lines)."""
    found = fits(points)
    out = ["## The regime: what predicts the loss to averaging", "",
           f"Made by `labavg sweep {sweep_file}` and `labavg sweep {variables_file}` (both run by "
           "this command): CV frame accuracy lost by N workers against one worker on the same "
           "corpus and seed, for several corpus sizes; updates per worker = minibatches each "
           "worker trained in the whole run.", ""]
    if points:
        out += [fit_sentence(found) + " " + holdout_sentence(found[0] if found else None,
                                                             comparison)]
        if found_variants:
            out += ["", variant_sentence(found_variants)]
        out += [""]
    if figure is not None and figure.is_file():
        rel = os.path.relpath(figure.resolve(), report.resolve().parent)
        out += [f"![regime map]({rel})", "",
                "Left: the loss against N, a line per corpus size. Middle: the same points against "
                "updates per worker; black stars: the comparisons' runs; grey lines: the paper's "
                "updates per worker in one epoch. Right: against the candidate that fits best, "
                "with its least-squares line.", ""]
    if found:
        out += ["### Each candidate against the map", ""] + fit_table(found) + [""]
    if found_variants:
        out += ["### One candidate at a time (same corpus, N and updates per worker)", ""]
        out += variant_table(found_variants) + [""]
    out += ["### The map", ""]
    out += regime_table(points) if points else ["No regime runs yet."]
    return out
