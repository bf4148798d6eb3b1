"""The worker threads behind the Live tab: they follow a run and hand the page what they read.

A run started from the page is followed through its handle (`start_run(...).events()`, then
`.result()`); a run another process writes is followed from its directory
(labavg.jobs.followed.FollowedRun: its config, then its typed events). Either way the worker
puts typed events (labavg.base.events), then one `Ended`, on the page's inbox, a thread-safe
queue the page's flush (`LiveRun.drain`) empties on its own thread: a worker never touches
the page's widgets or plots, which belong to the page's document.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from labavg.base.errors import UserError, one_line, user_error_of
from labavg.jobs.followed import FollowedRun
from labavg.jobs.run_json import RunSummary
from labavg.jobs.summary import load_summary
from labavg.training.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class ConfigFound:
    """A followed run's config.json has been read (rank 0 writes it with its first event)."""

    config: TrainConfig


@dataclasses.dataclass(frozen=True)
class Ended:
    """The run has ended: its summary (None when it wrote none), or why it failed."""

    summary: RunSummary | None = None
    error: str | None = None


@dataclasses.dataclass
class Job:
    """A run started from a page of this server (dashboard.jobs.JobRegistry holds it): what a
    reloaded or second page attaches to, with its config (that page's settings show the run
    before its config.json exists) and its Stop."""

    run_dir: str
    config: dict[str, Any]
    stopping: threading.Event = dataclasses.field(default_factory=threading.Event)
    handle: Any = None  # the run's handle (labavg.jobs.launch) once it has started

    def stop(self) -> None:
        """Ask the run to stop at its next averaging round (from any page, any thread)."""
        self.stopping.set()
        handle = self.handle
        if handle is not None:
            handle.stop()


def train(cfg: TrainConfig, launcher: str, job: Job, put: Callable[[Any], None]) -> None:
    """On a worker thread: start the run, hand on its events as they arrive, then its end."""
    from labavg.jobs.launch import start_run

    try:
        handle = start_run(cfg, launcher=launcher)
        job.handle = handle
        if job.stopping.is_set():  # Stop pressed while the run was starting
            handle.stop()
        for event in handle.events():
            put(event)
        ended = Ended(summary=handle.result())
    except BaseException as exc:  # noqa: BLE001 - shown in the page, not lost on a thread
        ended = Ended(error=f"{type(exc).__name__}: {one_line(user_error_of(exc) or exc)}")
    put(ended)


def follow(run_dir: Path, need_config: bool, put: Callable[[Any], None],
           quit: threading.Event) -> None:
    """On a worker thread: hand on a run directory's config (when `need_config`), its events
    as they are written, and its end once its summary is written and every event read; until
    `quit` is set (the page follows something else)."""
    run = FollowedRun(run_dir, closed=quit)
    if need_config:
        config = run.config()  # rank 0 writes config.json with its first event
        if config is None:
            return
        put(ConfigFound(config))
    for event in run.events():
        put(event)
    if not quit.is_set():
        put(Ended(summary=_summary(run_dir)))


def _summary(run_dir: Path) -> RunSummary | None:
    try:
        return load_summary(run_dir)
    except (OSError, UserError):
        return None


def start_thread(target: Callable[..., None], *args: Any, name: str) -> threading.Thread:
    """A daemon thread running target(*args), started."""
    thread = threading.Thread(target=target, args=args, daemon=True, name=name)
    thread.start()
    return thread

