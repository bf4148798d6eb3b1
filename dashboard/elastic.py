""""Lose a worker" and "Add a worker" on the elastic run on screen: what may be pressed, and why not.

An elastic run (backend torch, on_rank_loss = "continue") is a job of its own under
labavg.comm.elastic_launch; its launcher keeps RUN_DIR/.elastic.json while it runs (the pid of
every worker, the socket joins are asked on). The page only signals it, through
labavg.jobs.elastic_join: `lose` SIGKILLs one worker's processes, as a lost machine would be
lost, and `join` asks the launcher for a worker in the place of a lost one and waits until it
has taken part in a round. That wait (seconds) runs on a thread of its own; its outcome is
picked up by the page's flush (`WorkerControls.refresh`), which also says when the others
dropped the worker that was killed (its member_lost event). The dashboard never trains.
"""

from __future__ import annotations

import time
from typing import Any

import param
import psutil

from dashboard.live import LiveRun
from dashboard.membership import elastic_run
from dashboard.workers import start_thread
from labavg.base.errors import UserError, one_line
from labavg.training.config import TrainConfig
from labavg.jobs.elastic_join import elastic_state, join, lose

NOT_ELASTIC = ('workers leave and join only in an elastic run (backend torch, '
               'on_rank_loss = "continue")')
ENDED = "the run has ended: there is no worker to lose or add"
STARTING = "waiting for the job's launcher to start its workers"


def reasons(*, elastic: bool, running: bool, workers: tuple[int, ...] | None, launch: int,
            min_workers: int = 1, joining: bool = False) -> tuple[str, str]:
    """Why "Lose a worker" and "Add a worker" cannot be pressed now ("" where they can).

    `workers` are the launch ranks running (None while the job's state file is not there),
    `launch` how many the job started with, `joining` whether an Add still waits."""
    if not elastic:
        return NOT_ELASTIC, NOT_ELASTIC
    if not running:
        return ENDED, ENDED
    if workers is None:
        return STARTING, STARTING
    left = len(workers)
    lose_why = ""
    if left <= min_workers:
        lose_why = (f"{left} worker{'s' if left != 1 else ''} left and min_workers = "
                    f"{min_workers}: losing one would end the run")
    add_why = ""
    if joining:
        add_why = "a worker is joining…"
    elif left >= launch:
        add_why = f"all {launch} workers are running: a worker joins in the place of a lost one"
    return lose_why, add_why


def rank_to_lose(workers: tuple[int, ...]) -> int | None:
    """The worker "Lose a worker" kills unless another is chosen: the highest running rank
    other than the lowest (the lowest writes the run's record as long as it is there)."""
    ranks = sorted(workers)
    return ranks[-1] if len(ranks) > 1 else None


class WorkerControls(param.Parameterized):
    """The state behind the two buttons (dashboard.elastic_view draws them)."""

    elastic = param.Boolean(default=False, doc="the run on screen is elastic: the row is shown")
    workers = param.List(default=[], doc="launch ranks running now (the job's state file)")
    rank = param.Integer(default=None, allow_None=True, doc="the rank Lose kills")
    lose_reason = param.String(default="", doc="why Lose is off ('' when it is on)")
    add_reason = param.String(default="", doc="why Add is off ('' when it is on)")
    lose_message = param.String(default="", doc="what the last Lose did")
    add_message = param.String(default="", doc="what the last Add did, or is doing")
    joining = param.Boolean(default=False)

    def __init__(self, live: LiveRun, **params: Any) -> None:
        super().__init__(**params)
        self.live = live
        self._generation = live.generation
        self._killed: tuple[int, float, int] | None = None  # rank, time, changes seen then
        self._asked = 0.0  # when Add was pressed
        self._outcome: tuple[int, Any] | None = None  # (generation, Joined or error), from the thread
        self._config: dict[str, Any] | None = None  # the run's config.json object, and
        self._elastic: TrainConfig | None = None  # its settings when it is elastic

    # -- the page's flush ------------------------------------------------------------------

    def refresh(self) -> None:
        """Follow the run on screen: who runs, what may be pressed, what the last press did."""
        if self.live.generation != self._generation:  # another run on screen
            self._generation = self.live.generation
            self._killed = None
            self.param.update(lose_message="", add_message="", joining=False)
        if not self.live.running and not self.joining and (self.lose_message or self.add_message):
            self.param.update(lose_message="", add_message="")  # it has ended: say so instead
        cfg = self._elastic_run()
        elastic = cfg is not None
        workers = self._running() if elastic and self.live.running else None
        self._take_outcome()
        lose_why, add_why = reasons(elastic=elastic, running=self.live.running, workers=workers,
                                    launch=cfg.ranks if elastic else 1,
                                    min_workers=cfg.elastic.min_workers if elastic else 1,
                                    joining=self.joining)
        running = sorted(workers or ())
        rank = self.rank if self.rank in running[1:] else rank_to_lose(tuple(running))
        changes = dict(elastic=elastic, workers=running, rank=rank, lose_reason=lose_why,
                       add_reason=add_why)
        self.param.update(**{k: v for k, v in changes.items() if getattr(self, k) != v})
        self._say_lost()

    def _elastic_run(self) -> TrainConfig | None:
        """The run on screen's settings when it is elastic (else None), read once per run."""
        if self.live.config is not self._config:
            self._config = self.live.config
            self._elastic = elastic_run(self._config)
        return self._elastic

    def _running(self) -> tuple[int, ...] | None:
        try:
            state = elastic_state(self.live.run_dir)
        except UserError:
            return None
        launcher = state.get("launcher")
        if not isinstance(launcher, int) or not psutil.pid_exists(launcher):
            return None  # its launcher is gone, or on another machine: nothing to signal here
        return tuple(int(r) for r in state["workers"])

    def _say_lost(self) -> None:
        if self._killed is None:
            return
        rank, when, seen = self._killed
        for change in self.live.buffers.workers.changes[seen:]:
            if rank in change.lost:
                self._killed = None
                self.lose_message = (f"Rank {rank} lost at step {change.step}: {change.after} "
                                     f"go on, {change.time - when:.1f} s after the kill.")
                return

    def _take_outcome(self) -> None:
        outcome, self._outcome = self._outcome, None
        if outcome is None:
            return
        generation, result = outcome
        if generation != self._generation:
            return  # an Add for a run no longer on screen
        self.joining = False
        if isinstance(result, BaseException):
            self.add_message = f"⚠ {one_line(result)}"
            return
        seconds = time.time() - self._asked
        self.add_message = (f"Rank {result.rank} joined (pid {result.pid}), healed from a "
                            f"survivor {seconds:.1f} s after Add.")

    # -- the buttons -----------------------------------------------------------------------

    def lose(self) -> None:
        """Kill the chosen worker (SIGKILL to its processes): the others go on without it."""
        if self.lose_reason or self.rank is None:
            return
        try:
            rank = lose(self.live.run_dir, self.rank)
        except UserError as exc:
            self.lose_message = f"⚠ {one_line(exc)}"
            return
        self._killed = (rank, time.time(), len(self.live.buffers.workers.changes))
        cfg = self._elastic_run()
        heartbeat = f" (heartbeat {cfg.elastic.heartbeat_ms} ms)" if cfg is not None else ""
        self.lose_message = f"Killed rank {rank}; the others drop it at their next round{heartbeat}…"

    def add(self) -> None:
        """Ask the job's launcher for a worker in the place of a lost one; it joins at the
        next round (waited for on a thread: the page goes on meanwhile)."""
        if self.add_reason or self.joining:
            return
        self._asked = time.time()
        self.param.update(joining=True, add_reason="a worker is joining…",
                          add_message="Starting a worker: it joins at the job's next round…")
        start_thread(self._join, self.live.run_dir, self._generation,
                     name="labavg-dashboard-join")

    def _join(self, run_dir: str, generation: int) -> None:
        try:
            result: Any = join(run_dir)
        except Exception as exc:  # noqa: BLE001 - said beside the button, not lost on a thread
            result = exc
        self._outcome = (generation, result)
