"""The run on screen: started here through labavg.jobs.launch, or followed from its run directory.

The dashboard never trains in its own process: a run started from the page is a job of its
own (`start_run(cfg, launcher="job")` for in-process workers, threads of that job process; MPI
engines are other processes already), so training never holds the server's interpreter and
the page stays quick. A worker thread (dashboard.workers) follows the run, through its
handle's typed events or from its directory, and queues what it reads on this page's inbox;
`LiveRun.drain`, the state half of the page's one periodic flush (dashboard.app), moves it
into `dashboard.buffers.RunBuffers` on the page's own thread. The server's runs are in a
`dashboard.jobs.JobRegistry` every page of the server shares.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
from pathlib import Path
from typing import Any

import param

from dashboard.buffers import POINTS_PER_CURVE, RunBuffers
from dashboard.jobs import JobRegistry
from dashboard.settings import RunSettings, new_run_dir
from dashboard.speedup import RunSpeedup, live_speedup
from dashboard.workers import ConfigFound, Ended, Job, follow, start_thread, train
from labavg.base.errors import UserError
from labavg.base.events import Event, RunFinished
from labavg.base.settings import to_dict
from labavg.jobs.index import CONFIG, SUMMARY
from labavg.jobs.run_json import RunSummary
from labavg.training.config import config_from_dict

_DRAIN_EVENTS = 20000  # events one flush moves into the buffers


class LiveRun(param.Parameterized):
    """The run on screen. `start` starts a job and follows it; `follow` tails a run directory.

    The worker only puts typed events on a thread-safe queue; `drain` (the page's flush, or
    a test) moves them into bounded `RunBuffers`.
    """

    status = param.String(default="Idle. Set up a run and press Start, or follow a run directory.")
    mode = param.Selector(default="idle", objects=["idle", "live", "monitor"])
    running = param.Boolean(default=False)
    run_dir = param.String(default="")
    config = param.Dict(default={}, doc="config of the run on screen (not of the settings)")
    generation = param.Integer(default=0, doc="bumped when a new run replaces the buffers")
    error = param.String(default="")
    own = param.Boolean(default=False, doc="the run on screen was started from this page")
    started = param.Boolean(default=False, doc="rank 0 of the run on screen has started")

    def __init__(self, maxlen: int = POINTS_PER_CURVE, jobs: JobRegistry | None = None,
                 **params: Any) -> None:
        super().__init__(**params)
        self.jobs = jobs if jobs is not None else JobRegistry()  # the server's (dashboard.jobs)
        self._starts_seen = self.jobs.started
        self.maxlen = maxlen
        self.buffers = RunBuffers(1, maxlen)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._quit = threading.Event()  # ends the follower of the run on screen
        self._summary: RunSummary | None = None
        self._job: Job | None = None  # the server's run on screen (this page's or another's)
        self._closed = threading.Event()

    # -- starting and stopping -------------------------------------------------------------

    def start(self, settings: RunSettings) -> bool:
        """Start a run with `settings` as a job followed by a worker thread; False (and a
        status) when it cannot."""
        if self.running:
            self.status = "A run is already in progress; stop it first."
            return False
        if self._refused_beside(self.jobs.active()):
            return False
        try:
            cfg, out = _planned(settings)
        except UserError as exc:
            self.error = str(exc)
            self.status = f"Cannot start: {exc}"
            return False
        backend = settings.backend
        job = Job(str(out), to_dict(cfg))
        if not self.jobs.add(job):  # another page's Start came first
            if not self._refused_beside(self.jobs.active()):
                self.status = "A run is already in progress; stop it first."
            return False
        self.own, self._job = True, job
        self._reset(cfg.ranks, job.config, str(out), "live")
        # In-process workers are threads of one job process, never of this server's.
        launcher = "job" if backend == "in-process workers" else "engines"
        self.running = True
        what = f"{cfg.ranks} rank{'s' if cfg.ranks > 1 else ''}, K={cfg.effective_average_every()}"
        if launcher == "engines":
            # Engines take seconds to start (more on a busy machine): say so, or the empty
            # plots look like a hung run.
            self.status = (f"Starting {cfg.ranks} MPI engines for {out.name} ({what}); the plots "
                           "fill once the engines train…")
        else:
            self.status = (f"Starting {out.name} ({backend} in a job process, {what}): "
                           "reading the data…")
        self._thread = start_thread(self._train, cfg, launcher, job, self._inbox,
                                    name="labavg-dashboard-run")
        return True

    def _refused_beside(self, job: Job | None) -> bool:
        """Whether `job`, the server's run in progress, keeps a second run from starting
        (it is then put on screen instead)."""
        if job is None:
            return False
        self.status = (f"{Path(job.run_dir).name} is training (started from another page); "
                       "it is on screen, stop it first.")
        self.attach()
        return True

    def _train(self, cfg: Any, launcher: str, job: Job, inbox: queue.SimpleQueue) -> None:
        try:
            train(cfg, launcher, job, lambda item: self._relay(inbox, item))
        finally:
            self.jobs.remove(job)

    def _relay(self, inbox: queue.SimpleQueue, item: Any) -> None:
        if not self._closed.is_set() or isinstance(item, Ended):  # a closed page reads nothing
            inbox.put(item)

    def speedup(self) -> RunSpeedup:
        """The run on screen's measured speedup (labavg.jobs.speedup) and the cost model's."""
        config = config_from_dict(self.config, f"{self.run_dir}: config") if self.config else None
        return live_speedup(self.buffers, config, self._summary)

    @property
    def stopping(self) -> bool:
        """Whether Stop was pressed for the server's run on screen."""
        return self._job is not None and self._job.stopping.is_set()

    def stop(self) -> None:
        """Ask the run to stop at its next averaging round (all ranks stop together)."""
        if self.running and self._job is not None:
            self._job.stop()  # a run of another page goes on being followed until it ends
            self.status = (f"Stopping {Path(self._job.run_dir).name} at the next averaging round…"
                           if self.mode == "monitor" else "Stopping at the next averaging round…")
        elif self.mode == "monitor":
            self._quit.set()
            self.mode = "idle"
            self.running = False
            self.status = f"Stopped following {self.run_dir}."

    def close(self) -> None:
        """The page is gone (its session ended). Its run goes on (a reload or another page
        follows it from events.jsonl), but nothing drains this page's inbox any more: the
        worker stops queueing for it, or a long run's events would pile up in the server."""
        self._closed.set()
        self._quit.set()
        self._inbox = queue.SimpleQueue()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the worker thread; True when it has ended."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _reset(self, ranks: int, config: dict[str, Any], run_dir: str, mode: str) -> None:
        self._quit.set()  # the follower of the run this one replaces
        self._quit = threading.Event()
        self.buffers = RunBuffers(ranks, self.maxlen)
        self._inbox = queue.SimpleQueue()
        self._summary = None
        self.error = ""
        self.param.update(config=config, run_dir=run_dir, mode=mode, started=False)
        self.generation += 1

    # -- monitor mode ----------------------------------------------------------------------

    def attach(self, last: bool = False) -> bool:
        """Follow the server's run in progress, with Stop (a reloaded or second page); with
        `last`, else the run started last on this server (a page opened after it ended).
        False when there is none or this page shows a run of its own."""
        job = self.jobs.active()
        if job is not None and (Path(job.run_dir) / SUMMARY).is_file():
            job = None  # ended; its worker is about to take it off the list
        if job is None and last:
            job = self.jobs.last()
        if job is None or (self.running and self.mode == "live") or (
                self._job is job and self.running):
            return False
        self._follow(Path(job.run_dir), job)
        return True

    def follow(self, run_dir: str | Path) -> bool:
        """Follow a run directory another process (CLI, cluster) is writing; False if it is none."""
        run_dir = Path(run_dir).expanduser()
        if self.running and self.mode == "live":
            self.status = "A run is in progress here; stop it before following another."
            return False
        if not run_dir.is_dir():
            self.status = f"Cannot follow {run_dir}: not a directory"
            return False
        self._follow(run_dir, None)
        return True

    def _follow(self, run_dir: Path, job: Job | None) -> None:
        # A job's directory may not exist yet: its run creates it when it starts. Its config
        # is known at once (the page's settings show it); a foreign run's comes with its log.
        config = dict(job.config) if job is not None else {}
        ranks = config_from_dict(config, f"{run_dir}: config").ranks if config else 1
        self.own, self._job = False, job  # before the new config is announced: it is the server's
        self._reset(ranks, config, str(run_dir), "monitor")
        ended = job is not None and (run_dir / SUMMARY).is_file()
        # An ended run is read in, not followed: Start stays on and Stop off meanwhile.
        self.running = not ended
        if job is None:
            self.status = f"Following {run_dir} (waiting for {CONFIG})…"
        elif ended:
            self.status = f"Reading {run_dir.name} (started from a page of this server)…"
        else:
            self.status = f"Running {run_dir.name} (started from another page)…"
        inbox = self._inbox
        self._thread = start_thread(follow, run_dir, not config, lambda item: self._relay(inbox, item),
                                    self._quit, name="labavg-dashboard-follow")

    # -- the page's flush ------------------------------------------------------------------

    def drain(self, max_events: int = _DRAIN_EVENTS) -> int:
        """Move what the worker queued into the buffers and the status (a run another page
        started comes on screen here too); returns how many events moved."""
        if self.jobs.started != self._starts_seen:  # a run started on this server
            self._starts_seen = self.jobs.started
            if not self.running:
                self.attach()
        moved = 0
        while moved < max_events:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            match item:
                case Event():
                    self.buffers.add(item)
                    moved += 1
                    if not self.started and item.rank == 0:
                        self.started = True
                case ConfigFound(config=cfg):
                    self._found(cfg)
                case Ended():
                    self._ended(item)
        if self.running and self.mode == "live":
            self._say_progress()
        return moved

    def _found(self, cfg: Any) -> None:
        self.buffers = RunBuffers(cfg.ranks, self.maxlen)
        self.config = to_dict(cfg)
        self.generation += 1
        self.status = f"Following {self.run_dir}…"

    def _say_progress(self) -> None:
        if self.buffers.finished is not None:
            # Rank 0 has ended the run; its process is still saving the model. Said now,
            # not when the process is gone (seconds later).
            self.status = _ended_text(Path(self.run_dir), self.buffers.finished, self.stopping)
        elif self.buffers.last_step and not self.stopping:
            self.status = f"Running {Path(self.run_dir).name}: step {self.buffers.last_step}"

    def _ended(self, ended: Ended) -> None:
        self.buffers.flush()
        live = self.mode == "live"
        self.running = False
        self.mode = "idle"
        if ended.error is not None:
            self.error = ended.error
            self.status = f"Run failed: {ended.error}"
            return
        self._summary = ended.summary
        self.status = _ended_text(Path(self.run_dir), self.buffers.finished,
                                  live and self.stopping)

    @property
    def from_server(self) -> bool:
        """Whether the run on screen was started from a page of this server."""
        return self._job is not None

    @property
    def summary(self) -> RunSummary | None:
        """rank 0's summary of the run on screen, once it has ended."""
        return self._summary


def _planned(settings: RunSettings) -> tuple[Any, Path]:
    """The run `settings` describe and its new run directory; UserError when they cannot run."""
    problem = settings.first_error()
    if problem is not None:
        raise UserError(problem)
    runs_dir = Path(settings.runs_dir).expanduser()
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # what check_directory cannot foresee (a read-only disk)
        raise UserError(f"runs directory {settings.runs_dir!r} cannot be created: "
                        f"{exc.strerror}") from None
    # The name shows the K the run trains with (averaging.average_every_frames may set it).
    cfg = settings.build(runs_dir / "check")
    out = new_run_dir(runs_dir, settings.ranks, cfg.effective_average_every())
    return dataclasses.replace(cfg, out=str(out)), out


def _ended_text(run_dir: Path, finished: RunFinished | None, asked: bool) -> str:
    """The status line of a run that has ended: Stopped (asked to, or its summary says so)
    or Finished, its name, and what it reached."""
    word = "Stopped" if (finished is not None and finished.stopped) or asked else "Finished"
    return f"{word}: {run_dir.name} — {_finish_text(finished)}"


def _finish_text(finished: RunFinished | None) -> str:
    if finished is None:
        return "no summary"
    accuracy = finished.cv_frame_accuracy
    cv = ("no CV (stopped before the first epoch's end)"
          if accuracy is None or math.isnan(accuracy) else f"CV frame accuracy {100 * accuracy:.1f}%")
    return f"step {finished.step}, {cv}, {finished.wall_seconds:.1f} s"
