"""The run on screen: started here through labavg.jobs.launch, or followed from its run directory.

Every blocking thing (training, starting MPI engines) happens on a worker thread, and the UI
thread drains what the worker queued in a periodic callback (`LiveRun.drain`).

    LiveRun       one run on screen (in-process workers, MPI engines, or monitor mode)
    RunBuffers    what the live plots show about it, bounded in memory
    RankSeries    per-rank bounded buffers of one curve, assembled into one row per step/round
"""

from __future__ import annotations

import dataclasses
import json
import math
import queue
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import param

from dashboard.settings import RunSettings, new_run_dir
from labavg.training.config import TrainConfig
from labavg.base.settings import to_dict
from labavg.studies.costmodel import TEN_GBE, MeasuredCosts, from_summary, predict
from labavg.base.errors import UserError, one_line, user_error_of
from labavg.jobs.index import (
    CONFIG,
    EVENTS,
    SUMMARY,
    EventTail,
    effective_k,
    find_throughput_baseline,
    training_throughput,
)

POINTS_PER_CURVE = 5000
# Ranks the cost model predicts a speedup for, beside the run's own.
PREDICTED_RANKS = (1, 2, 4, 8, 16, 32, 64)
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


@dataclasses.dataclass(frozen=True)
class Speedup:
    """What the Live tab says about the run's speedup: measured, and the cost model's."""

    ranks: int
    K: int | None
    frames_per_second: float | None  # this run, all ranks
    baseline_frames_per_second: float | None
    baseline_name: str | None
    speedup: float | None
    efficiency: float | None
    predicted: list[tuple[int, float]]  # (ranks, speedup) on PREDICTION_NETWORK
    predicted_from: str  # which run's costs the prediction uses
    note: str  # why there is no measured speedup, or ""


PREDICTION_NETWORK = TEN_GBE


def live_speedup(buffers: RunBuffers, config: dict[str, Any],
                 baseline: dict[str, Any] | None) -> Speedup:
    """The run's throughput against its 1-rank baseline, and the cost model's speedups.

    Speedup = frames/s of this run (all ranks) / frames/s of the baseline, both over training
    time (compute + averaging); the baseline may differ in K, learning rate, schedule and
    epochs (`find_throughput_baseline`), which leave the cost of a frame alone. The
    prediction (`labavg.studies.costmodel.predict`, one rank per machine on PREDICTION_NETWORK) uses
    the baseline's measured costs when there is one, else this run's.
    """
    ranks = int(config.get("ranks", buffers.ranks) or 1)
    minibatch = int(config.get("minibatch") or 1)
    k = effective_k(config)
    fps = buffers.frames_per_second()
    base_fps = training_throughput(baseline) if baseline else None
    base_name = Path(str(baseline.get("config", {}).get("out", "?"))).name if baseline else None
    speedup = fps / base_fps if fps and base_fps else None
    note = ""
    if baseline is None:
        note = ("This 1-rank run is the baseline: runs of this model and data with more ranks "
                "(any K) will be measured against it." if ranks == 1 else
                "No speedup yet: no finished 1-rank run of this model, data, minibatch and "
                "optimizer in the runs directory. Run one with ranks = 1 (any K) to measure it.")
    elif fps is None:
        note = "Measuring: the first averaging round gives the run's frames/s."
    # The baseline's costs when there is one: one rank alone on the machine, so neither its
    # compute nor its per-round overhead includes waiting for ranks that share the cores.
    measured, source = buffers.measured_costs(minibatch), "this run"
    if baseline is not None:
        try:
            measured, source = from_summary(baseline), f"1-rank run {base_name}"
        except UserError:
            pass
    predicted: list[tuple[int, float]] = []
    if measured is not None and k:
        predicted = [(p.ranks, p.speedup) for p in predict(
            measured, PREDICTED_RANKS, Ks=(k,), network=PREDICTION_NETWORK)]
    return Speedup(ranks=ranks, K=k, frames_per_second=fps, baseline_frames_per_second=base_fps,
                   baseline_name=base_name, speedup=speedup,
                   efficiency=speedup / ranks if speedup is not None else None,
                   predicted=predicted, predicted_from=source if predicted else "", note=note)


@dataclasses.dataclass(frozen=True)
class Job:
    """A run started from a page of this server: what a reloaded or second page attaches to."""

    run_dir: str
    stop: threading.Event


# The server's runs in progress, by run directory. Sessions come and go (a reload is a new
# session); the run's thread does not, so every page must find it here, and Start anywhere
# must see it before a second run starts beside it.
_JOBS: dict[str, Job] = {}
_JOBS_LOCK = threading.Lock()


def active_job() -> Job | None:
    """A run in progress on this server, if any."""
    with _JOBS_LOCK:
        return next(iter(_JOBS.values()), None)


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
        # The summary of the finished 1-rank run the run on screen is measured against.
        self.baseline: dict[str, Any] | None = None

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
            problem = settings.check()
            if problem is not None:
                raise UserError(problem)
            runs_dir = Path(settings.runs_dir).expanduser()
            try:
                runs_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:  # what check_directory cannot foresee (a read-only disk)
                raise UserError(f"runs directory {settings.runs_dir!r} cannot be created: "
                                f"{exc.strerror}") from None
            # The name shows the K the run trains with (average_every_frames may set it).
            k = settings.to_config(runs_dir / "check").averaging_interval()
            out = new_run_dir(runs_dir, settings.ranks, k)
            cfg = settings.to_config(out)
        except UserError as exc:
            self.error = str(exc)
            self.status = f"Cannot start: {exc}"
            return False
        backend = settings.backend
        self._reset(cfg.ranks, to_dict(cfg), str(out), "live")
        self.baseline = find_throughput_baseline(out, self.config)
        launcher = "threads" if backend == "in-process workers" else "engines"
        job = Job(str(out), self._stop)
        with _JOBS_LOCK:
            _JOBS[job.run_dir] = job
        self._thread = threading.Thread(target=self._drive, args=(cfg, launcher, job), daemon=True,
                                        name="labavg-dashboard-run")
        self.running = True
        what = f"{cfg.ranks} rank{'s' if cfg.ranks > 1 else ''}, K={cfg.averaging_interval()}"
        if launcher == "engines":
            # Engines take seconds to start (more on a busy machine): say so, or the empty
            # plots look like a hung run.
            self.status = (f"Starting {cfg.ranks} MPI engines for {out.name} ({what}); the plots "
                           "fill once the engines train…")
        else:
            self.status = f"Starting {out.name} ({backend}, {what}): reading the data…"
        self._thread.start()
        return True

    def speedup(self) -> Speedup:
        """The run on screen's speedup against its 1-rank baseline, and the cost model's."""
        return live_speedup(self.buffers, self.config, self.baseline)

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
        self.baseline = None
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
                for event in handle.poll():
                    self._events.put(event)
                if self._stop.is_set() and not stopping:
                    handle.stop()
                    stopping = True
                time.sleep(0.05)
            summary = handle.wait()
            outcome = ("done", summary)
        except BaseException as exc:  # noqa: BLE001 - shown in the page, not lost on a thread
            outcome = ("failed", f"{type(exc).__name__}: {one_line(user_error_of(exc) or exc)}")
        for event in handle.poll() if handle is not None else []:
            self._events.put(event)
        self._outcome.put(outcome)

    # -- monitor mode ----------------------------------------------------------------------

    def attach(self) -> bool:
        """Follow the server's run in progress, with Stop (a reloaded or second page); False
        when there is none or this page shows a run of its own."""
        job = active_job()
        if job is None or (self.running and self.mode == "live") or (
                self._job is job and self.running) or (Path(job.run_dir) / SUMMARY).is_file():
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
        # A job's directory may not exist yet: its run creates it when it starts.
        self._reset(1, {}, str(run_dir), "monitor")
        self._job = job
        self._tail = EventTail(run_dir / EVENTS)
        self.running = True
        self.status = (f"Running {run_dir.name} (started from another page)…" if job
                       else f"Following {run_dir} (waiting for {CONFIG})…")
        self._poll_monitor()

    def _poll_monitor(self) -> None:
        run_dir = Path(self.run_dir)
        if not self.config:
            try:
                config = json.loads((run_dir / CONFIG).read_text())
            except (OSError, json.JSONDecodeError):
                return  # rank 0 writes config.json with its first event; keep waiting
            self.buffers = RunBuffers(int(config.get("ranks", 1)), self.maxlen)
            self.baseline = find_throughput_baseline(run_dir, config)
            self.config = config
            self.generation += 1
            self.status = (f"Running {run_dir.name} (started from another page)…" if self._job
                           else f"Following {run_dir}…")
        for event in self._tail.read():
            self._events.put(event)
        if (run_dir / SUMMARY).is_file() and self._events.empty() and self.buffers.finished:
            self.running = False
            self.mode = "idle"
            word = "Stopped" if self.buffers.finished.get("stopped") else "Finished"
            self.status = f"{word}: {run_dir.name} — {_finish_text(self.buffers.finished)}"

    # -- the UI thread's periodic work -----------------------------------------------------

    def drain(self, max_events: int = 200000) -> int:
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
            if self.running and self.buffers.last_step and not self._stop.is_set():
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
            finished = self.buffers.finished or {}
            word = "Stopped" if finished.get("stopped") or self._stop.is_set() else "Finished"
            self.status = f"{word}: {Path(self.run_dir).name} — {_finish_text(finished)}"

    @property
    def summary(self) -> dict[str, Any] | None:
        """rank 0's summary of the last run started here, once it has ended."""
        return self._summary


def _finish_text(finished: dict[str, Any]) -> str:
    if not finished:
        return "no summary"
    return (f"step {finished.get('step')}, CV frame accuracy {100 * finished.get('cv_frame_accuracy', 0):.1f}%, "
            f"{finished.get('wall_seconds', 0):.1f} s")
