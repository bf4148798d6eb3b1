"""What averaging costs in accuracy, as `labavg plan` predicts it from runs already recorded.

Three terms, each a least-squares line over paired (same seed) differences of CV frame accuracy
in experiments/reproduction-results.jsonl, each with the standard deviation of its residuals:

- the regime map (REPRODUCTION.md, "The regime"): accuracy lost by N workers against one,
  a + b x log2 N / sqrt(updates per worker), at the map's K;
- K: the change from the map's K at the same N and updates per worker (regime-variables' K
  runs and Beyond's plain-averaging grid), a line through zero on log2(K / map's K);
- the method: BMUF's or DiLoCo's accuracy minus plain averaging's at the same N and K
  (Beyond), a line on log2(K / map's K).

The terms add; their residual spreads add in quadrature. Where a prediction leaves the N,
updates or K that a term was fitted on, `AccuracyPrediction.extrapolated` names it; the K and
method terms are then held at the nearest K they saw (the regime line, fitted over octaves of
its predictor, is extended).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from labavg.base.errors import UserError
from labavg.studies.reproduction.regime import regime_points
from labavg.studies.reproduction.results import Run, paired, read_results_file, select

MAP_K = 10  # the map's averaging interval (experiments/regime.toml)
PLAIN = "model"  # plain model averaging's method name


@dataclass(frozen=True)
class Line:
    """y = intercept + slope x over `points` (x, y) pairs, and where x was seen."""

    intercept: float
    slope: float
    residual_sd: float
    points: int
    x_low: float
    x_high: float

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x

    def held(self, x: float) -> float:
        """The line at x, held at its value at the nearest end of what it saw beyond it: a
        difference measured at K = 10-200 is not a slope to extend to K = 1."""
        return self.at(min(max(x, self.x_low), self.x_high))

    def covers(self, x: float) -> bool:
        return self.x_low - 1e-9 <= x <= self.x_high + 1e-9


def fit_line(xs: list[float], ys: list[float], through_zero: bool = False) -> Line | None:
    """The least-squares line of ys on xs; None with too few points to fit it."""
    need = 2 if through_zero else 3
    if len(xs) < need or (not through_zero and len(set(xs)) < 2):
        return None
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    if through_zero:
        slope, intercept = float(x @ y / (x @ x)) if x @ x > 0 else 0.0, 0.0
    else:
        slope, intercept = (float(v) for v in np.polyfit(x, y, 1))
    residual = y - (intercept + slope * x)
    dof = max(len(xs) - (1 if through_zero else 2), 1)
    return Line(intercept, slope, math.sqrt(float(residual @ residual) / dof), len(xs),
                float(x.min()), float(x.max()))


def regime_x(ranks: int, updates: float) -> float:
    """The map's predictor: log2 N / sqrt(updates per worker)."""
    return math.log2(ranks) / math.sqrt(updates)


def _k(run: Run) -> int:
    return int(run.get("averaging.average_every") or MAP_K)


def _method(run: Run) -> str:
    return run.get("averaging.method") or PLAIN


def _fp32(runs: list[Run]) -> list[Run]:
    return [r for r in runs if (r.get("averaging.payload") or "fp32") == "fp32"]


def _k_pairs(variables: list[Run], regime: list[Run], beyond: list[Run]) -> list[tuple[float, float]]:
    """(log2(K / MAP_K), accuracy change against MAP_K) per seed, at the same N and data."""
    out = []
    plain_variables = [r for r in variables if (r.get("lr_scaling") or "linear") == "linear"
                       and r.get("max_change_per_sample") is None and _k(r) != MAP_K]
    for r in plain_variables:
        base = select([m for m in regime if m.get("data.data") == r.get("data.data")],
                      ranks=r.get("ranks"))
        out += [(math.log2(_k(r) / MAP_K), d) for d in paired(base, {r.seed: r}, "cv_acc_pct")]
    plain = [r for r in _fp32(beyond) if _method(r) == PLAIN and (r.get("ranks") or 1) > 1]
    for n in sorted({r.get("ranks") for r in plain}):
        at_map = {r.seed: r for r in plain if r.get("ranks") == n and _k(r) == MAP_K}
        for r in (r for r in plain if r.get("ranks") == n and _k(r) != MAP_K):
            out += [(math.log2(_k(r) / MAP_K), d) for d in paired(at_map, {r.seed: r}, "cv_acc_pct")]
    return out


def _method_pairs(beyond: list[Run], method: str) -> tuple[list[tuple[float, float]], set[int]]:
    """(log2(K / MAP_K), the method's accuracy minus plain averaging's) per seed, and the Ns."""
    runs = _fp32(beyond)
    out, ranks = [], set()
    for r in (r for r in runs if _method(r) == method):
        plain = {p.seed: p for p in runs if _method(p) == PLAIN and p.get("ranks") == r.get("ranks")
                 and _k(p) == _k(r)}
        found = paired(plain, {r.seed: r}, "cv_acc_pct")
        out += [(math.log2(_k(r) / MAP_K), d) for d in found]
        if found:
            ranks.add(int(r.get("ranks")))
    return out, ranks


@dataclass(frozen=True)
class AccuracyPrediction:
    """Predicted change of CV frame accuracy against one worker (points; negative = lost)."""

    change: float
    sd: float
    extrapolated: tuple[str, ...]


@dataclass(frozen=True)
class AccuracyModel:
    """The three fitted terms and what they were fitted on."""

    regime: Line
    ranks_seen: tuple[int, int]
    updates_seen: tuple[float, float]
    k_term: Line | None
    methods: dict[str, Line] = field(default_factory=dict)
    method_ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    source: str = ""

    def predict(self, ranks: int, updates: float, K: int, method: str = PLAIN) -> AccuracyPrediction:
        if ranks == 1:
            return AccuracyPrediction(0.0, 0.0, ())
        notes = []
        x = regime_x(ranks, updates)
        change, var = self.regime.at(x), self.regime.residual_sd ** 2
        if not self.ranks_seen[0] <= ranks <= self.ranks_seen[1]:
            notes.append(f"N = {ranks} outside the map's {self.ranks_seen[0]}-{self.ranks_seen[1]}")
        if not self.updates_seen[0] <= updates <= self.updates_seen[1]:
            notes.append(f"{updates:,.0f} updates per worker outside the map's "
                         f"{self.updates_seen[0]:,.0f}-{self.updates_seen[1]:,.0f}")
        lk = math.log2(K / MAP_K)
        if K != MAP_K:
            if self.k_term is None:
                notes.append(f"K = {K}: no runs measured K's effect")
            else:
                change, var = change + self.k_term.held(lk), var + self.k_term.residual_sd ** 2
                if not self.k_term.covers(lk):
                    notes.append(f"K = {K} outside the measured {_k_range(self.k_term)}")
        if method != PLAIN:
            line = self.methods.get(method)
            if line is None:
                notes.append(f"{method}: no runs measured it against plain averaging")
            else:
                change, var = change + line.held(lk), var + line.residual_sd ** 2
                if not line.covers(lk):
                    notes.append(f"{method} at K = {K} outside its measured {_k_range(line)}")
                seen = self.method_ranks.get(method, ())
                if seen and ranks not in seen:
                    notes.append(f"{method} measured at N = {', '.join(map(str, seen))} only")
        return AccuracyPrediction(change, math.sqrt(var), tuple(notes))


def _k_range(line: Line) -> str:
    return f"K = {MAP_K * 2 ** line.x_low:g}-{MAP_K * 2 ** line.x_high:g}"


def accuracy_model(results: Path) -> AccuracyModel:
    """The model fitted on a results file's regime, regime-variables and Beyond runs."""
    return accuracy_model_of(read_results_file(results), str(results))


def accuracy_model_of(runs: dict[str, list[Run]], source: str) -> AccuracyModel:
    """The model fitted on recorded runs, by sweep ('regime', 'regime-variables', 'beyond')."""
    points = [p for p in regime_points(runs.get("regime", [])) if p.ranks > 1 and p.loss is not None]
    regime = fit_line([regime_x(p.ranks, p.updates) for p in points], [p.loss.mean for p in points])
    if regime is None:
        raise UserError(f"{source}: fewer than 3 regime-map points (sweep 'regime'); "
                        "run `labavg reproduce` to record them")
    k_pairs = _k_pairs(runs.get("regime-variables", []), runs.get("regime", []),
                       runs.get("beyond", []))
    k_term = fit_line(*_unzip(k_pairs), through_zero=True) if k_pairs else None
    methods, method_ranks = {}, {}
    for method in sorted({_method(r) for r in runs.get("beyond", [])} - {PLAIN}):
        pairs, ranks = _method_pairs(runs.get("beyond", []), method)
        line = fit_line(*_unzip(pairs)) if pairs else None
        if line is not None:
            methods[method], method_ranks[method] = line, tuple(sorted(ranks))
    return AccuracyModel(regime, (min(p.ranks for p in points), max(p.ranks for p in points)),
                         (min(p.updates for p in points), max(p.updates for p in points)),
                         k_term, methods, method_ranks, source)


def _unzip(pairs: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    return [x for x, _ in pairs], [y for _, y in pairs]
