"""The run on screen: started here through labavg.jobs.launch, or followed from its run directory.

The dashboard never trains in its own process: a run started from the page is a job of its
own (`start_run(cfg, launcher="job")`, in-process workers included; MPI engines are other
processes already), so training never holds the server's interpreter and the page stays
quick. A worker thread starts the job, relays its events and passes Stop on (RUN_DIR/.stop);
the UI thread drains what the worker queued in a periodic callback (`LiveRun.drain`) into
`dashboard.buffers.RunBuffers`.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
from pathlib import Path
from typing import Any

import param

from dashboard.buffers import POINTS_PER_CURVE, RunBuffers
from dashboard.settings import RunSettings, new_run_dir
from dashboard.speedup import RunSpeedup, live_speedup
from labavg.training.config import TrainConfig, config_from_dict
from labavg.base.settings import to_dict
from labavg.base.errors import UserError, one_line, user_error_of
from labavg.jobs.index import CONFIG, EVENTS, SUMMARY, EventTail
from labavg.jobs.run_json import read_run_config, read_run_summary


@dataclasses.dataclass(frozen=True)
class Job:
    """A run started from a page of this server: what a reloaded or second page attaches to
    (its config too, so that page's settings show the run before its config.json exists)."""

    run_dir: str
    stop: threading.Event
    config: dict[str, Any]


# The server's runs in progress, by run directory. Sessions come and go (a reload is a new
# session); the run's thread does not, so every page must find it here, and Start anywhere
# must see it before a second run starts beside it.
_JOBS: dict[str, Job] = {}
_JOBS_LOCK = threading.Lock()
# The last run started on this server: what a page opened after it ended shows.
_LAST: list[Job] = []
# Bytes of events.jsonl one periodic update reads of a followed run: a reload of a long run
# catches up over a few updates instead of parsing the whole log before the page answers.
_TAIL_BYTES = 1 << 20
_DRAIN_EVENTS = 20000  # events one periodic update moves into the buffers


def active_job() -> Job | None:
    """A run in progress on this server, if any."""
    with _JOBS_LOCK:
        return next(iter(_JOBS.values()), None)


def last_job() -> Job | None:
    """The run started last on this server (in progress or ended), if any."""
    with _JOBS_LOCK:
        return _LAST[-1] if _LAST else None


class LiveRun(param.Parameterized):
    """The run on screen. `start` trains on a worker thread; `follow` tails a run directory.

    The worker only puts event dicts on a thread-safe queue; `drain` (called by the UI's
    periodic callback, or by tests) moves them into bounded `RunBuffers`.
    """

    status = param.String(default="Idle. Set up a run and press Start, or follow a run directory.")
    mode = param.Selector(default="idle", objects=["idle", "live", "monitor"])
    running = param.Boolean(default=False)
    run_dir = param.String(default="")
    config = param.Dict(default={}, doc="config of the run on screen (not of the settings)")
    generation = param.Integer(default=0, doc="bumped when a new run replaces the buffers")
    error = param.String(default="")
    own = param.Boolean(default=False, doc="the run on screen was started from this page")

    def __init__(self, maxlen: int = POINTS_PER_CURVE, **params: Any) -> None:
        super().__init__(**params)
        self.maxlen = maxlen
        self.buffers = RunBuffers(1, maxlen)
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._outcome: queue.SimpleQueue = queue.SimpleQueue()
        self._tail: EventTail | None = None
        self._summary: dict[str, Any] | None = None
        self._job: Job | None = None  # the server's run this page follows (started elsewhere)
        self._closed = threading.Event()

    # -- starting and stopping -------------------------------------------------------------

    def start(self, settings: RunSettings) -> bool:
        """Start a run with `settings` on a worker thread; False (and a status) when it cannot."""
        if self.running:
            self.status = "A run is already in progress; stop it first."
            return False
        job = active_job()
        if job is not None:
            self.status = (f"{Path(job.run_dir).name} is training (started from another page); "
                           "it is on screen, stop it first.")
            self.attach()
            return False
        try:
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
            out = new_run_dir(runs_dir, settings.ranks, cfg.average_interval())
            cfg = dataclasses.replace(cfg, out=str(out))
        except UserError as exc:
            self.error = str(exc)
            self.status = f"Cannot start: {exc}"
            return False
        backend = settings.backend
        self.own, self._job = True, None
        self._reset(cfg.ranks, to_dict(cfg), str(out), "live")
        # In-process workers are threads of one job process, never of this server's.
        launcher = "job" if backend == "in-process workers" else "engines"
        job = Job(str(out), self._stop, self.config)
        with _JOBS_LOCK:
            _JOBS[job.run_dir] = job
            _LAST[:] = [job]
        self._thread = threading.Thread(target=self._drive, args=(cfg, launcher, job), daemon=True,
                                        name="labavg-dashboard-run")
        self.running = True
        what = f"{cfg.ranks} rank{'s' if cfg.ranks > 1 else ''}, K={cfg.average_interval()}"
        if launcher == "engines":
            # Engines take seconds to start (more on a busy machine): say so, or the empty
            # plots look like a hung run.
            self.status = (f"Starting {cfg.ranks} MPI engines for {out.name} ({what}); the plots "
                           "fill once the engines train…")
        else:
            self.status = (f"Starting {out.name} ({backend} in a job process, {what}): "
                           "reading the data…")
        self._thread.start()
        return True

    def speedup(self) -> RunSpeedup:
        """The run on screen's measured speedup (labavg.jobs.speedup) and the cost model's."""
        config = config_from_dict(self.config, f"{self.run_dir}: config") if self.config else None
        return live_speedup(self.buffers, config, self._summary)

    def stop(self) -> None:
        """Ask the run to stop at its next averaging round (all ranks stop together)."""
        if self.running and self.mode == "live":
            self._stop.set()
            self.status = "Stopping at the next averaging round…"
        elif self.mode == "monitor" and self._job is not None and self.running:
            self._job.stop.set()  # the run goes on being followed until its summary is written
            self.status = f"Stopping {Path(self._job.run_dir).name} at the next averaging round…"
        elif self.mode == "monitor":
            self.mode = "idle"
            self.running = False
            self.status = f"Stopped following {self.run_dir}."

    def close(self) -> None:
        """The page is gone (its session ended). Its run goes on (a reload or another page
        follows it from events.jsonl), but nothing drains this page's queue any more: the
        worker stops queueing for it, or a long run's events would pile up in the server."""
        self._closed.set()
        self._events = queue.SimpleQueue()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the worker thread; True when it has ended."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _reset(self, ranks: int, config: dict[str, Any], run_dir: str, mode: str) -> None:
        self.buffers = RunBuffers(ranks, self.maxlen)
        self._events = queue.SimpleQueue()
        self._outcome = queue.SimpleQueue()
        self._stop = threading.Event()
        self._summary = None
        self.error = ""
        self.param.update(config=config, run_dir=run_dir, mode=mode)
        self.generation += 1

    def _drive(self, cfg: TrainConfig, launcher: str, job: Job) -> None:
        """On the worker: start the run, relay its events, pass on a stop; report the outcome."""
        try:
            self._train(cfg, launcher)
        finally:
            with _JOBS_LOCK:
                _JOBS.pop(job.run_dir, None)

    def _train(self, cfg: TrainConfig, launcher: str) -> None:
        from labavg.jobs.launch import start_run

        handle = None
        try:
            handle = start_run(cfg, launcher=launcher)
            stopping = False
            while not handle.done():
                self._relay(handle.poll())
                if self._stop.is_set() and not stopping:
                    handle.stop()
                    stopping = True
                time.sleep(0.05)
            summary = handle.wait()
            outcome = ("done", summary)
        except BaseException as exc:  # noqa: BLE001 - shown in the page, not lost on a thread
            outcome = ("failed", f"{type(exc).__name__}: {one_line(user_error_of(exc) or exc)}")
        if handle is not None:
            self._relay(handle.poll())
        self._outcome.put(outcome)

    def _relay(self, events: list[dict[str, Any]]) -> None:
        if not self._closed.is_set():  # a closed page's queue is drained by nobody
            for event in events:
                self._events.put(event)

    # -- monitor mode ----------------------------------------------------------------------

    def attach(self, last: bool = False) -> bool:
        """Follow the server's run in progress, with Stop (a reloaded or second page); with
        `last`, else the run started last on this server (a page opened after it ended).
        False when there is none or this page shows a run of its own."""
        job = active_job()
        if job is not None and (Path(job.run_dir) / SUMMARY).is_file():
            job = None  # ended; its worker is about to take it off the list
        if job is None and last:
            job = last_job()
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
        self.own = False
        self._job = job
        ranks = config_from_dict(config, f"{run_dir}: config").ranks if config else 1
        self._reset(ranks, config, str(run_dir), "monitor")
        self._tail = EventTail(run_dir / EVENTS)
        ended = job is not None and (run_dir / SUMMARY).is_file()
        # An ended run is read in, not followed: Start stays on and Stop off meanwhile.
        self.running = not ended
        if job is None:
            self.status = f"Following {run_dir} (waiting for {CONFIG})…"
        elif ended:
            self.status = f"Reading {run_dir.name} (started from a page of this server)…"
        else:
            self.status = f"Running {run_dir.name} (started from another page)…"
        self._poll_monitor()

    def _poll_monitor(self) -> None:
        run_dir = Path(self.run_dir)
        if not self.config:
            try:
                cfg = read_run_config(run_dir / CONFIG)
            except (OSError, UserError):
                return  # rank 0 writes config.json with its first event; keep waiting
            self.buffers = RunBuffers(cfg.ranks, self.maxlen)
            self.config = to_dict(cfg)
            self.generation += 1
            self.status = f"Following {run_dir}…"
        for event in self._tail.read(_TAIL_BYTES):
            self._events.put(event)
        if (run_dir / SUMMARY).is_file() and self._events.empty() and self.buffers.finished:
            self.running = False
            self.mode = "idle"
            try:
                self._summary = read_run_summary(run_dir / SUMMARY).to_dict()
            except (OSError, UserError):
                pass
            self.status = _ended_text(run_dir, self.buffers.finished, False)

    # -- the UI thread's periodic work -----------------------------------------------------

    def drain(self, max_events: int = _DRAIN_EVENTS) -> int:
        """Move queued events into the buffers and update the status; returns how many moved."""
        if self.mode == "monitor" and self._tail is not None:
            self._poll_monitor()
        moved = 0
        add = self.buffers.add
        while moved < max_events:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            add(event)
            moved += 1
        if self.mode == "monitor" and self.buffers.finished is not None and self.running:
            self._poll_monitor()
        if self.mode == "live":
            self._check_outcome()
        return moved

    def _check_outcome(self) -> None:
        try:
            kind, value = self._outcome.get_nowait()
        except queue.Empty:
            if self.running and self.buffers.finished:
                # Rank 0 has ended the run; its process is still saving the model. Said now,
                # not when the process is gone (seconds later).
                self.status = _ended_text(Path(self.run_dir), self.buffers.finished,
                                          self._stop.is_set())
            elif self.running and self.buffers.last_step and not self._stop.is_set():
                self.status = f"Running {Path(self.run_dir).name}: step {self.buffers.last_step}"
            return
        # The worker has ended: take the events it queued last, then report.
        while True:
            try:
                self.buffers.add(self._events.get_nowait())
            except queue.Empty:
                break
        for series in (self.buffers.loss, self.buffers.divergence, self.buffers.compute,
                       self.buffers.comm, self.buffers.fps):
            series.flush()
        self.running = False
        self.mode = "idle"
        if kind == "failed":
            self.error = value
            self.status = f"Run failed: {value}"
        else:
            self._summary = value
            self.status = _ended_text(Path(self.run_dir), self.buffers.finished or {},
                                      self._stop.is_set())

    @property
    def from_server(self) -> bool:
        """Whether the run on screen was started from a page of this server."""
        return self.own or self._job is not None

    @property
    def summary(self) -> dict[str, Any] | None:
        """rank 0's summary of the last run started here, once it has ended."""
        return self._summary


def _ended_text(run_dir: Path, finished: dict[str, Any], asked: bool) -> str:
    """The status line of a run that has ended: Stopped (asked to, or its summary says so)
    or Finished, its name, and what it reached."""
    word = "Stopped" if finished.get("stopped") or asked else "Finished"
    return f"{word}: {run_dir.name} — {_finish_text(finished)}"


def _finish_text(finished: dict[str, Any]) -> str:
    if not finished:
        return "no summary"
    accuracy = finished.get("cv_frame_accuracy")
    cv = ("no CV (stopped before the first epoch's end)"
          if accuracy is None or math.isnan(accuracy) else f"CV frame accuracy {100 * accuracy:.1f}%")
    return f"step {finished.get('step')}, {cv}, {finished.get('wall_seconds', 0):.1f} s"
