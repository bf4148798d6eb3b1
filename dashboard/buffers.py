"""What the live plots show about one run, bounded in memory.

    RunBuffers    everything about one run (its typed events routed by type)
    RankSeries    per-rank bounded buffers of one curve, assembled into one row per step/round
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from dashboard.live_plots import LIVE_PLOTS, RANK0, LivePlot
from dashboard.membership import Workers
from labavg.base.events import (Averaged, Event, MemberLost, Message, MinibatchDone,
                                RunFinished, RunStarted, SpeedupPair)
from labavg.studies.costmodel import MeasuredCosts

POINTS_PER_CURVE = 5000
# Pending rows wait this long (in rows) for a late rank before they are emitted with a gap.
_MAX_PENDING = 64


class RankSeries:
    """One quantity of every rank: bounded per-rank deques plus complete rows for streaming.

    A row is (x, rank 0 value, ..., rank N-1 value, mean) and is emitted once every rank has
    reported x (or, with a gap, when it is `_MAX_PENDING` rows behind), so the plots receive
    one append per step instead of one per event.
    """

    def __init__(self, ranks: int, maxlen: int = POINTS_PER_CURVE) -> None:
        self.ranks = ranks
        self.points = [deque(maxlen=maxlen) for _ in range(ranks)]
        self._pending: dict[float, np.ndarray] = {}
        self._fresh: deque = deque(maxlen=maxlen)
        # An elastic run's workers that left (a row waits for them no more), and where each
        # worker that came back reported first (a row before that never waits for it).
        self._gone: set[int] = set()
        self._since: dict[int, float] = {}
        self._emitted = -math.inf  # the highest x of a row sent

    def add(self, rank: int, x: float, y: float) -> None:
        """Record rank's value y at x."""
        if not 0 <= rank < self.ranks:
            return
        self.points[rank].append((x, y))
        if rank in self._gone:  # back (a worker that joined in its place)
            self._gone.discard(rank)
            self._since[rank] = x
        row = self._pending.get(x)
        if row is None:
            if x <= self._emitted and rank in self._since:
                # A joined worker's first values, for a step the others' row already went
                # with: drawn from its next row on, as the row sent cannot take it any more.
                return
            row = self._pending[x] = np.full(self.ranks, np.nan)
        row[rank] = y
        if self._complete(x, row):
            self._emit(x, self._pending.pop(x))
        elif len(self._pending) > _MAX_PENDING:
            oldest = min(self._pending)
            self._emit(oldest, self._pending.pop(oldest))

    def _complete(self, x: float, row: np.ndarray) -> bool:
        """Every worker a row at x waits for has reported."""
        if not self._gone and not self._since:  # every run but an elastic one's after a change
            return not np.isnan(row).any()
        return all(not math.isnan(row[r]) for r in range(self.ranks)
                   if r not in self._gone and x >= self._since.get(r, -math.inf))

    def leave(self, rank: int) -> None:
        """`rank` left an elastic run: its curve ends; the rows that waited for it go."""
        if not 0 <= rank < self.ranks:
            return
        self._gone.add(rank)
        for x in sorted(self._pending):
            if self._complete(x, self._pending[x]):
                self._emit(x, self._pending.pop(x))

    def _emit(self, x: float, row: np.ndarray) -> None:
        self._emitted = max(self._emitted, x)
        finite = row[~np.isnan(row)]
        mean = float(finite.mean()) if finite.size else math.nan
        self._fresh.append((x, *row.tolist(), mean))

    def flush(self) -> None:
        """Emit the rows still waiting for a rank (at the end of a run)."""
        for x in sorted(self._pending):
            self._emit(x, self._pending.pop(x))

    def take(self) -> list[tuple[float, ...]]:
        """The complete rows since the last call, oldest first."""
        rows = list(self._fresh)
        self._fresh.clear()
        return rows

    def columns(self) -> list[str]:
        """Column names of the rows: x, rank0..rankN-1, mean."""
        return ["x", *(f"rank{r}" for r in range(self.ranks)), "mean"]


class RunBuffers:
    """Everything the live plots show about one run, bounded in memory: a `RankSeries` per
    series of each plot of `dashboard.live_plots.LIVE_PLOTS`, and what the status line and
    the speedup are computed from. Fed typed events (labavg.base.events), dispatched by type."""

    def __init__(self, ranks: int, maxlen: int = POINTS_PER_CURVE,
                 plots: tuple[LivePlot, ...] = LIVE_PLOTS) -> None:
        self.ranks, self.maxlen = ranks, maxlen
        self.plots = tuple(plot for plot in plots if plot.feed is not None)
        self.series = {plot.name: {s.column: RankSeries(1 if plot.ranks == RANK0 else ranks, maxlen)
                                   for s in plot.series} for plot in self.plots}
        self.workers = Workers(ranks, maxlen)  # who is present (an elastic run's N over time)
        self.last_step = 0
        self.finished: RunFinished | None = None  # rank 0's
        self.started: RunStarted | None = None  # rank 0's
        self.pairs: list[SpeedupPair] = []  # rank 0's (labavg.jobs.speedup)
        self.messages: deque = deque(maxlen=20)
        # Throughput as Su & Chen's epoch time counts it: frames of all ranks over rank 0's
        # compute + averaging seconds (the ranks wait for each other at every round).
        self.frames = 0.0
        self.seconds = 0.0
        self.comm_seconds = 0.0
        self.rounds = 0
        self.round_steps = 0  # rank 0's minibatches up to its last averaging round

    def of(self, plot: str, column: str | None = None) -> RankSeries:
        """The rows of one series of plot `plot` (its first when `column` is None)."""
        series = self.series[plot]
        return series[column] if column is not None else next(iter(series.values()))

    def add(self, event: Event) -> None:
        """Route one typed event into the plots it feeds and the run's own counts."""
        for plot in self.plots:
            if plot.takes(event):
                x, rank = plot.x_value(event), 0 if plot.ranks == RANK0 else event.rank
                for s in plot.series:
                    self.series[plot.name][s.column].add(rank, x, s.value(event))
        self.workers.add(event)
        match event:
            case MinibatchDone():
                self.last_step = max(self.last_step, event.step)
            case MemberLost():
                for rows in self._per_rank():
                    for rank in event.lost:
                        rows.leave(rank)
            case Averaged():
                self._averaged(event)
            case RunStarted(rank=0):
                self.started = event
            case SpeedupPair(rank=0):
                self.pairs.append(event)
            case Message():
                self.messages.append(f"rank {event.rank}, step {event.step}: {event.text}")
            case RunFinished(rank=0):
                self.finished = event
                self.flush()

    def _per_rank(self) -> list[RankSeries]:
        # Rank 0's series (RANK0) are of one rank: not the launch ranks a change names.
        return [rows for series in self.series.values() for rows in series.values()
                if rows.ranks == self.ranks]

    def _averaged(self, event: Averaged) -> None:
        self.frames += event.frames_per_second * event.compute_seconds
        if event.rank == 0:
            self.seconds += event.compute_seconds + event.comm_seconds
            self.comm_seconds += event.comm_seconds
            self.rounds += 1
            start = self.started.start_step if self.started else 0
            self.round_steps = event.step - start

    def flush(self) -> None:
        """Emit the rows still waiting for a rank (at the end of a run)."""
        for series in self.series.values():
            for rows in series.values():
                rows.flush()

    def frames_per_second(self) -> float | None:
        """Frames per second of all ranks so far (training time), None before a round."""
        return self.frames / self.seconds if self.seconds > 0 else None

    def speedup_events(self) -> list[Event]:
        """What `labavg.jobs.speedup.speedup_from_events` reads: rank 0's run_started and pairs."""
        return [] if self.started is None else [self.started, *self.pairs]

    def measured_costs(self, minibatch: int) -> MeasuredCosts | None:
        """The cost model's inputs as this run measured them, once it has averaged."""
        s = self.started
        if s is None or self.rounds == 0 or self.round_steps < 1:
            return None
        compute = (self.seconds - self.comm_seconds) / self.round_steps
        return MeasuredCosts(compute_per_minibatch_s=compute,
                             allreduce_s=self.comm_seconds / self.rounds,
                             num_params=int(s.num_params), minibatch=minibatch, ranks=self.ranks,
                             frames_per_epoch=float(s.steps_per_epoch * minibatch * self.ranks))
