"""What the live plots show about one run, bounded in memory.

    RunBuffers    everything about one run (its events routed by kind)
    RankSeries    per-rank bounded buffers of one curve, assembled into one row per step/round
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Any

import numpy as np

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

    def add(self, rank: int, x: float, y: float) -> None:
        """Record rank's value y at x."""
        if not 0 <= rank < self.ranks:
            return
        self.points[rank].append((x, y))
        row = self._pending.get(x)
        if row is None:
            row = self._pending[x] = np.full(self.ranks, np.nan)
        row[rank] = y
        if not np.isnan(row).any():
            self._emit(x, self._pending.pop(x))
        elif len(self._pending) > _MAX_PENDING:
            oldest = min(self._pending)
            self._emit(oldest, self._pending.pop(oldest))

    def _emit(self, x: float, row: np.ndarray) -> None:
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


@dataclasses.dataclass
class RunBuffers:
    """Everything the live plots show about one run, bounded in memory."""

    ranks: int
    maxlen: int = POINTS_PER_CURVE

    def __post_init__(self) -> None:
        self.loss = RankSeries(self.ranks, self.maxlen)  # x = step
        self.divergence = RankSeries(self.ranks, self.maxlen)  # x = averaging round
        self.compute = RankSeries(self.ranks, self.maxlen)  # x = averaging round
        self.comm = RankSeries(self.ranks, self.maxlen)
        self.fps = RankSeries(self.ranks, self.maxlen)
        self.cv: deque = deque(maxlen=self.maxlen)  # (epoch, cv acc, train acc), rank 0
        self.last_step = 0
        self.finished: dict[str, Any] | None = None
        self.started: dict[str, Any] | None = None  # rank 0's run_started
        self.pairs: list[dict[str, Any]] = []  # rank 0's speedup_pair events (labavg.jobs.speedup)
        self.messages: deque = deque(maxlen=20)
        # Throughput as Su & Chen's epoch time counts it: frames of all ranks over rank 0's
        # compute + averaging seconds (the ranks wait for each other at every round).
        self.frames = 0.0
        self.seconds = 0.0
        self.comm_seconds = 0.0
        self.rounds = 0
        self.round_steps = 0  # rank 0's minibatches up to its last averaging round

    def add(self, event: dict[str, Any]) -> None:
        """Route one event dict (labavg.base.events) into the buffers."""
        kind, rank = event.get("type"), event.get("rank", 0)
        if kind == "minibatch":
            self.loss.add(rank, event["step"], event["loss"])
            self.last_step = max(self.last_step, event["step"])
        elif kind == "average":
            rnd = event["round"]
            self.divergence.add(rank, rnd, event["divergence"])
            self.compute.add(rank, rnd, event["compute_seconds"])
            self.comm.add(rank, rnd, event["comm_seconds"])
            self.fps.add(rank, rnd, event["frames_per_second"])
            self.frames += event["frames_per_second"] * event["compute_seconds"]
            if rank == 0:
                self.seconds += event["compute_seconds"] + event["comm_seconds"]
                self.comm_seconds += event["comm_seconds"]
                self.rounds += 1
                start = self.started.get("start_step", 0) if self.started else 0
                self.round_steps = event["step"] - start
        elif kind == "run_started" and rank == 0:
            self.started = event
        elif kind == "speedup_pair" and rank == 0:
            self.pairs.append(event)
        elif kind == "epoch" and rank == 0:
            self.cv.append((event["epoch"], event["cv_frame_accuracy"], event["train_frame_accuracy"]))
        elif kind == "message":
            self.messages.append(f"rank {rank}, step {event['step']}: {event['text']}")
        elif kind == "run_finished" and rank == 0:
            self.finished = event
            for series in (self.loss, self.divergence, self.compute, self.comm, self.fps):
                series.flush()


    def frames_per_second(self) -> float | None:
        """Frames per second of all ranks so far (training time), None before a round."""
        return self.frames / self.seconds if self.seconds > 0 else None

    def speedup_events(self) -> list[dict[str, Any]]:
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
                             num_params=int(s["num_params"]), minibatch=minibatch, ranks=self.ranks,
                             frames_per_epoch=float(s["steps_per_epoch"] * minibatch * self.ranks))
