"""A run's speedup: the one function behind every place that shows one.

The measurement is made inside the run (labavg.training.speedup_probe): at a few averaging
rounds rank 0 trains a few minibatches alone while the other ranks wait idle, then all ranks
train to the next round. Each such pair, taken back to back under the same load, gives

    ranks x (seconds per minibatch alone) / (seconds per minibatch of the N-rank segment)

over the same frames. The speedup is the median over the pairs, with their range; beside it the
cores the ranks had, the load as the run started, and what the cores allow: no speedup above
min(ranks, cores) is shown without a flag that says why. summary.json, `labavg info`, the quick
start, the dashboard, the notebooks and REPRODUCTION.md all read a run's speedup from here.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from labavg.base.events import Event, RunStarted, SpeedupPair
from labavg.jobs.run_json import RunSummary, as_summary

# Backends whose ranks are threads of one process (one interpreter, one lock between ops).
THREAD_BACKENDS = ("inproc",)
# Past this, a summary's ranks or cores read back are no count (and no float holds 10**400).
MAX_RANKS = 1 << 30


@dataclass(frozen=True)
class Speedup:
    """A run's measured speedup over one worker, with its spread and conditions."""

    value: float | None  # median over the pairs of ranks * solo / parallel seconds per minibatch
    low: float | None  # the pairs' lowest
    high: float | None  # the pairs' highest
    pairs: int  # pairs measured
    ranks: int
    cores: int  # CPU cores the ranks could use, summed over their hosts (0: not recorded)
    bound: float  # min(ranks, cores): the most the cores allow
    load: float | None  # the 1-minute load average as the run started
    threads: bool  # the ranks are threads of one process (backend inproc)
    flag: str | None  # oversubscribed, or why the value is above the bound

    @property
    def efficiency(self) -> float | None:
        """The speedup per rank (1.0 is perfect scaling)."""
        return None if self.value is None else self.value / self.ranks

    def text(self) -> str:
        """One line: value, range, pairs and conditions, then the flag."""
        if self.ranks == 1:
            return "1.00x (one worker: the reference)"
        if self.value is None:
            return "not measured (too few averaging rounds for a pair, or speedup_pairs = 0)"
        where = f"{self.ranks} {'threads' if self.threads else 'ranks'}"
        if self.cores:
            where += f" on {self.cores} core{'s' if self.cores != 1 else ''}"
        if self.load is not None:
            where += f", load {self.load:.1f}"
        spread = (f"{_figure(self.low)}-{_figure(self.high)} over {self.pairs} pairs"
                  if self.pairs > 1 else "1 pair")
        line = f"{_figure(self.value)}x ({spread}; {where})"
        return f"{line}; {self.flag}" if self.flag else line


def _figure(value: float) -> str:
    """A speedup as a table shows it: two decimals, or three digits for an absurd one read
    back (not 300 digits)."""
    return f"{value:.2f}" if abs(value) < 1e4 else f"{value:.3g}"


def measured_speedup(pairs: Iterable[tuple[float, float]], ranks: int, cores: int = 0,
                     load: float | None = None, threads: bool = False) -> Speedup:
    """The speedup of `ranks` ranks from (solo, parallel) seconds-per-minibatch pairs."""
    ratios = [r for r in (_ratio(ranks, solo, parallel) for solo, parallel in pairs)
              if r is not None]
    bound = float(min(ranks, cores)) if cores else float(ranks)
    if ranks == 1:
        return Speedup(1.0, 1.0, 1.0, 0, 1, cores, 1.0, load, threads, None)
    value = statistics.median(ratios) if ratios else None
    return Speedup(value, min(ratios, default=None), max(ratios, default=None), len(ratios),
                   ranks, cores, bound, load, threads,
                   _flag(value, max(ratios, default=None), ranks, cores, bound, load, threads))


def _ratio(ranks: int, solo: float, parallel: float) -> float | None:
    """One pair's speedup; None for a pair that measured nothing (a time not positive) or
    whose ratio is no number (extreme values read back: 1e308 / 1e-308 is inf)."""
    if not (solo > 0 and parallel > 0):  # NaN is neither
        return None
    try:
        ratio = ranks * solo / parallel
    except (OverflowError, ZeroDivisionError):
        return None
    return ratio if math.isfinite(ratio) and ratio > 0 else None


def shared_bound(ranks: int, cores: int, load: float | None) -> float | None:
    """The most `ranks` ranks can reach over one rank when `load` other busy processes share
    the `cores` fairly: alone, a rank gets min(1, C/(L+1)) of a core; N ranks get
    N min(1, C/(L+N)). min(ranks, cores) with no load; towards N as the load grows, since N
    processes take N shares of the cores from the other work."""
    if not cores or load is None:
        return None
    other = max(float(load), 0.0)
    return ranks * min(1.0, cores / (other + ranks)) / min(1.0, cores / (other + 1))


def _flag(value: float | None, high: float | None, ranks: int, cores: int, bound: float,
          load: float | None, threads: bool) -> str | None:
    notes = []
    if cores and ranks > cores:
        notes.append(f"{ranks} {'threads' if threads else 'ranks'} on {cores} "
                     f"core{'s' if cores != 1 else ''}: at most {cores}x here")
    if high is not None and high > bound:
        what = (f"{value:.2f}x is" if value is not None and value > bound
                else f"pairs up to {high:.2f}x are")
        shared = shared_bound(ranks, cores, load)
        if shared is not None and shared > 1.05 * bound and high <= 1.15 * shared:
            notes.append(f"{what} above the {bound:g}x {cores} idle cores allow: under load "
                         f"{load:.1f} the ranks took a larger share of the cores from the other "
                         f"work (fair sharing allows up to {shared:.2f}x)")
        else:
            # Pairs are short segments: a preempted solo segment reads slow and its pair high.
            notes.append(f"{what} above the {bound:g}x the cores allow: timing noise of the "
                         "pairs, not a real gain")
    return "; ".join(notes) or None


def speedup_from_events(events: Iterable[Event]) -> Speedup | None:
    """The speedup of a run so far, from its typed events (rank 0's RunStarted and
    SpeedupPairs); None before rank 0 has started."""
    started, pairs = None, []
    for event in events:
        if isinstance(event, RunStarted) and event.rank == 0:
            started = event
        elif isinstance(event, SpeedupPair) and event.rank == 0:
            pairs.append((event.solo_step_seconds, event.parallel_step_seconds))
    if started is None:
        return None
    return measured_speedup(pairs, started.size, started.cores, started.load,
                            _threads(started.backend))


def speedup_from_summary(summary: RunSummary | Mapping[str, Any]) -> Speedup | None:
    """The speedup summary.json records, measured again from its pairs (its stored figures are
    never passed on); None for a summary written before pairs existed, or whose ranks are no
    count of ranks."""
    s = as_summary(summary)
    if not isinstance(s.ranks, int) or not 1 <= s.ranks <= MAX_RANKS:
        return None
    if s.ranks > 1 and not isinstance(s.speedup_pairs, list):
        return None
    load, cores = s.load_at_start, s.cores
    return measured_speedup([tuple(p) for p in s.speedup_pairs or []], s.ranks,
                            cores if isinstance(cores, int) and 0 <= cores <= MAX_RANKS else 0,
                            load if isinstance(load, (int, float)) and math.isfinite(load)
                            and load >= 0 else None,
                            _threads(s.backend))


def _threads(backend: Any) -> bool:
    return backend in THREAD_BACKENDS
