"""The one rule every verdict of the reproduction follows, and the statistics it rests on.

An effect is measured per seed (the same seed and data on both sides of a comparison) and its
mean gets a 95 % Student-t interval. The interval is then read against the reference's effect
(the paper's, where it has one) and against zero:

- "as the paper": the interval excludes zero and contains the paper's effect, or the interval
  and the paper's effect are both within the margin of zero;
- "larger than the paper's" / "smaller than the paper's": the interval lies wholly beyond /
  short of the paper's effect (short of it while containing zero counts as smaller: the paper's
  effect is excluded);
- "opposite": the interval lies wholly on the other side of zero;
- "unresolved: about n seeds would decide": the interval contains both zero and the paper's
  effect; n is the seeds at which an interval of the measured spread, centred on the measured
  mean, would exclude one of them (or, where the paper's effect is ~0, fit within the margin)
  with 80 % power.

Without a reference effect (a comparison the paper has no figure for, the Beyond section) the
same interval is read against zero only: "positive", "negative", "~0" (within the margin),
or unresolved.

WER effects are 100 x ln(WER_b / WER_a) per seed, about the relative change in %: on a log scale
a seed at 20 % WER and one at 40 % count as the same doubling, so a method whose error rate
varies by a factor between seeds (plain SGD at 16 workers) does not swamp the interval.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Iterable

# Student's t quantiles by degrees of freedom: two-sided 95 % (0.975) and the 80 % power term
# (one-sided 0.80) of a sample-size estimate.
_T = {
    0.975: (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
            2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
            2.060, 2.056, 2.052, 2.048, 2.045, 2.042),
    0.80: (1.376, 1.061, 0.978, 0.941, 0.920, 0.906, 0.896, 0.889, 0.883, 0.879, 0.876, 0.873,
           0.870, 0.868, 0.866, 0.865, 0.863, 0.862, 0.861, 0.860, 0.859, 0.858, 0.858, 0.857,
           0.856, 0.856, 0.855, 0.855, 0.854, 0.854),
}
# Beyond this many seeds "unresolved" says "more than" instead of a number.
MAX_SEEDS = 100
# What counts as no effect: 1 % relative WER, 0.1 points of frame accuracy.
WER_MARGIN = 1.0
ACCURACY_MARGIN = 0.1

AS_THE_PAPER = "as the paper"
LARGER = "larger than the paper's"
SMALLER = "smaller than the paper's"
OPPOSITE = "opposite"
POSITIVE, NEGATIVE, ZERO = "positive", "negative", "~0"
UNRESOLVED = "unresolved"
# A WER effect read against zero, in words that say which way WER moved.
WER_WORDS = {POSITIVE: "higher WER", NEGATIVE: "lower WER", ZERO: "same WER"}
NOT_RUN = "not run"
ONE_SEED = "needs 2+ seeds"

RULE = (
    "Each verdict reads the 95 % t-interval of an effect measured seed by seed (same seed, same "
    "data on both sides) against the paper's effect and against zero: **as the paper** when the "
    "interval excludes zero and contains the paper's effect (or both are within "
    f"{WER_MARGIN:g} % of zero), **larger** or **smaller than the paper's** when it lies wholly "
    "beyond or short of it, **opposite** when it lies on the other side of zero, and "
    "**unresolved** when it contains both zero and the paper's effect, with the seeds that would "
    "decide at the measured spread (80 % power). WER effects are 100 x ln(WER ratio) per seed, "
    "about the relative change in %, so that a seed at 40 % WER does not outweigh one at 20 %; "
    "frame accuracy, beside them, is a difference in points and has no paper figure, so it is "
    "read against zero only.")


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile; tabled to 30 degrees of freedom, Cornish-Fisher beyond."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if p in _T and df <= len(_T[p]):
        return _T[p][df - 1]
    z = statistics.NormalDist().inv_cdf(p)
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class Spread:
    """Mean over seeds, their standard deviation and the 95 % t-interval of the mean."""

    mean: float
    sd: float
    n: int
    low: float
    high: float


def spread(values: Iterable[float]) -> Spread | None:
    """None without values; with one value the interval is unknown (infinite)."""
    values = list(values)
    if not values:
        return None
    mean = statistics.fmean(values)
    if len(values) == 1:
        return Spread(mean, math.nan, 1, -math.inf, math.inf)
    sd = statistics.stdev(values)
    half = t_quantile(0.975, len(values) - 1) * sd / math.sqrt(len(values))
    return Spread(mean, sd, len(values), mean - half, mean + half)


def log_ratio(a: float, b: float) -> float | None:
    """100 x ln(b / a): b's change over a in (log) per cent; None where either is not > 0."""
    if a is None or b is None or a <= 0 or b <= 0:
        return None
    return 100.0 * math.log(b / a)


def seeds_to_decide(effect: Spread, distance: float) -> int | None:
    """The seeds at which the t-interval of an effect with this spread would exclude a value
    `distance` from its mean with 80 % power; None where more than MAX_SEEDS would be needed."""
    if distance <= 0 or not math.isfinite(effect.sd):
        return None
    if effect.sd == 0:
        return 2
    for n in range(2, MAX_SEEDS + 1):
        if (t_quantile(0.975, n - 1) + t_quantile(0.80, n - 1)) * effect.sd / math.sqrt(n) <= distance:
            return n
    return None


def _unresolved(effect: Spread, distance: float) -> str:
    n = seeds_to_decide(effect, distance)
    return f"{UNRESOLVED}: more than {MAX_SEEDS} seeds" if n is None else \
        f"{UNRESOLVED}: about {max(n, effect.n + 1)} seeds would decide"


def _to_zero_or_margin(effect: Spread, margin: float) -> float:
    """How far the interval's half-width must shrink to decide: to exclude zero (the mean's
    distance from it) or to fit within the margin of zero, whichever comes first."""
    return max(abs(effect.mean), margin - abs(effect.mean))


def verdict(effect: Spread | None, paper: float | None = None, margin: float = WER_MARGIN) -> str:
    """The rule (module docstring) on a per-seed effect's spread and the paper's effect."""
    if effect is None:
        return NOT_RUN
    if effect.n < 2:
        return ONE_SEED
    if paper is None:
        if -margin <= effect.low and effect.high <= margin:
            return ZERO
        if effect.low > 0:
            return POSITIVE
        if effect.high < 0:
            return NEGATIVE
        return _unresolved(effect, _to_zero_or_margin(effect, margin))
    if abs(paper) <= margin:
        if -margin <= effect.low and effect.high <= margin:
            return AS_THE_PAPER
        if effect.low > 0 or effect.high < 0:
            return LARGER
        return _unresolved(effect, _to_zero_or_margin(effect, margin))
    sign = 1.0 if paper > 0 else -1.0  # orient so that the paper's effect is positive
    lo, hi = sorted((sign * effect.low, sign * effect.high))
    p, m = abs(paper), sign * effect.mean
    if hi < 0:
        return OPPOSITE
    if lo > p:
        return LARGER
    if hi < p:
        return SMALLER
    if lo > 0:
        return AS_THE_PAPER
    return _unresolved(effect, max(abs(m), abs(m - p)))


def in_direction(values: Iterable[float], paper: float | None) -> tuple[int, int]:
    """(seeds whose effect has the paper's sign, or is positive without a paper figure; seeds)."""
    values = list(values)
    sign = 1.0 if paper is None or paper >= 0 else -1.0
    return sum(1 for v in values if sign * v > 0), len(values)
