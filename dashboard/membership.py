"""Who trains in the run on screen, from its events: the workers present over time.

An elastic run (backend torch, on_rank_loss = "continue"; labavg.comm.elastic) starts with
every launch rank, and each averaging round opens with an admission round that may drop a
worker or let one in (labavg.training.membership). Every worker present reports what changed,
so one change arrives as one `member_lost` or `member_joined` per worker: `Workers` takes each
change once (by its round and ranks) and keeps the step plot of N, the workers present, with a
point at every averaging round so the line reaches the run's latest round. `run_kind` says
from a run's config whether it is such a run (and whether its K changes: the live plots each
kind shows, dashboard.live_plots).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from dashboard.live_plots import RunKind
from labavg.base.errors import UserError
from labavg.base.events import Averaged, Event, MemberJoined, MemberLost, RunStarted
from labavg.training.config import TrainConfig, config_from_dict


def _run_config(config: Mapping[str, Any]) -> TrainConfig | None:
    if not config:
        return None
    try:
        return config_from_dict(dict(config), "the run on screen's config")
    except UserError:  # said where the run is read (its speedup, its settings)
        return None


def elastic_run(config: Mapping[str, Any]) -> TrainConfig | None:
    """The settings of a run whose config (config.json's object, as the page holds it) makes
    it elastic, where workers may leave and join; None for a run of fixed N."""
    cfg = _run_config(config)
    return cfg if cfg is not None and _elastic(cfg) else None


def _elastic(cfg: TrainConfig) -> bool:
    return cfg.backend == "torch" and cfg.on_rank_loss == "continue"


def run_kind(config: Mapping[str, Any]) -> RunKind:
    """The kind of the run of `config` (which live plots it shows): elastic or of fixed N,
    with K changing (averaging.schedule not constant) or constant; read once per config."""
    cfg = _run_config(config)
    if cfg is None:
        return RunKind()
    return RunKind(elastic=_elastic(cfg), scheduled=cfg.averaging.schedule != "constant")


@dataclasses.dataclass(frozen=True)
class Change:
    """One change of the workers present, as the run's events say it."""

    step: int
    round: int
    before: int  # workers present before it
    after: int
    lost: tuple[int, ...] = ()
    joined: tuple[int, ...] = ()
    time: float = 0.0  # Unix time of the first round committed with the new workers

    def text(self) -> str:
        """"4 -> 3 workers at step 35 (rank 3 lost)"."""
        what = ", ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} {word}"
                         for ranks, word in ((self.lost, "lost"), (self.joined, "joined")) if ranks)
        return f"{self.before} -> {self.after} workers at step {self.step} ({what})"


class Workers:
    """The workers present in one run, from its typed events (labavg.base.events).

    `members` are the launch ranks present as the events say; `changes` every change once;
    `take()` the new points (step, N) of the step plot of N since the last call.
    """

    def __init__(self, ranks: int, maxlen: int = 5000) -> None:
        self.launch = ranks
        self.members: set[int] = set()
        self.size: int | None = None  # workers present (None before the first run_started)
        self.changes: list[Change] = []
        self.points: deque = deque(maxlen=maxlen)
        self._fresh: deque = deque(maxlen=maxlen)
        self._seen: set[tuple[str, int, tuple[int, ...]]] = set()
        self._round = -1  # the last averaging round with a point

    def add(self, event: Event) -> Change | None:
        """Take one event; the change it says, when it is the first word of one."""
        match event:
            case RunStarted() if self.size is None:
                self.size = event.size
                self.members = set(range(event.size))
                self._point(event.start_step, event.size)
            case Averaged() if self.size is not None and event.round > self._round:
                self._round = event.round
                self._point(event.step, self.size)
            case MemberLost() | MemberJoined():
                return self._change(event)
        return None

    def _change(self, event: MemberLost | MemberJoined) -> Change | None:
        lost = event.lost if isinstance(event, MemberLost) else ()
        joined = event.joined if isinstance(event, MemberJoined) else ()
        key = (event.type, event.round, lost or joined)
        if key in self._seen:
            return None  # another worker's word for the same change
        self._seen.add(key)
        before = self.size if self.size is not None else self.launch
        change = Change(event.step, event.round, before, event.size, lost, joined, event.time)
        self.changes.append(change)
        self.members = (self.members - set(lost)) | set(joined)
        self.size = event.size
        # A step: N before the change up to its step, N after it from there on.
        self._point(event.step, before)
        self._point(event.step, event.size)
        self._round = max(self._round, event.round)
        return change

    def _point(self, step: int, n: int) -> None:
        self.points.append((float(step), float(n)))
        self._fresh.append((float(step), float(n)))

    def take(self) -> list[tuple[float, float]]:
        """The points (step, N) since the last call, oldest first."""
        rows = list(self._fresh)
        self._fresh.clear()
        return rows

    def text(self) -> str:
        """What changed, the last three changes: "4 -> 3 workers at step 35 (rank 3 lost); ..."."""
        more = len(self.changes) - 3
        return "; ".join([*([f"{more} earlier change{'s' if more > 1 else ''}"] if more > 0 else []),
                          *(c.text() for c in self.changes[-3:])])


def workers_over_time(events: Iterable[Event], ranks: int = 1) -> list[tuple[float, float]]:
    """The step plot of the workers present, (step, N), from a run's events."""
    workers = Workers(ranks)
    for event in events:
        workers.add(event)
    return list(workers.points)
