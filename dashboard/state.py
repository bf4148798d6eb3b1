"""Dashboard state: settings, the live run, the past runs. Plain `param` classes, no browser needed.

The UI (dashboard.components) only reads these objects and calls their methods; every
blocking thing (training, starting MPI engines) happens on a worker thread, and the UI thread
drains what the worker queued in a periodic callback.

    RunSettings   the controls, turned into a validated TrainConfig for the *next* run
    LiveRun       one run on screen: started here (in-process workers or MPI engines) or
                  followed from its run directory (monitor mode)
    RankSeries    per-rank bounded buffers of one curve, assembled into one row per step/round
    EventTail     incremental reader of a growing events.jsonl
    RunTable      the runs found in a runs directory, overlay selection and CSV export
"""

from __future__ import annotations

import csv
import dataclasses
import io
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

from labavg.config import DataConfig, TrainConfig, to_dict, validate, with_overrides
from labavg.errors import UserError, one_line, user_error_of
from labavg.model import ModelConfig
from labavg.index import (CONFIG, EVENTS, SUMMARY, EventTail, effective_k, fill_speedups,  # noqa: F401
                          list_runs, read_events, run_row)

BACKEND_LABELS = {"in-process workers": "inproc", "MPI engines": "mpi"}
POINTS_PER_CURVE = 5000
# Pending rows wait this long (in rows) for a late rank before they are emitted with a gap.
_MAX_PENDING = 64


class RunSettings(param.Parameterized):
    """The controls of the next run. Changing them never touches the run on screen."""

    backend = param.Selector(default="in-process workers", objects=list(BACKEND_LABELS), label="backend",
                             doc="in-process workers: threads of the dashboard; MPI engines: ipyparallel")
    ranks = param.Integer(default=2, bounds=(1, 64), label="ranks", doc="number of workers (num_jobs)")
    average_every = param.Integer(default=10, bounds=(1, 100000), label="K (average every)",
                                  doc="minibatches between averaging rounds")
    lr = param.Number(default=0.008, bounds=(0.0, 10.0), inclusive_bounds=(False, True),
                      label="learning rate", doc="initial per-frame learning rate of one job")
    final_lr = param.Number(default=None, allow_None=True, bounds=(0.0, 10.0),
                            inclusive_bounds=(False, True), label="final lr",
                            doc="final learning rate; empty: 0.01 x initial")
    schedule = param.Selector(default="exponential", objects=["exponential", "newbob"], label="schedule")
    optimizer = param.Selector(default="sgd", objects=["sgd", "ngsgd"], label="optimizer")
    pretrain = param.Selector(default="none", objects=["none", "rbm"], label="pretrain")
    minibatch = param.Integer(default=256, bounds=(1, 65536), label="minibatch",
                              doc="frames per minibatch")
    epochs = param.Integer(default=2, bounds=(1, 1000), label="epochs")
    hidden_layers = param.Integer(default=2, bounds=(0, 16), label="hidden layers")
    hidden_dim = param.Integer(default=256, bounds=(1, 8192), label="hidden units")
    context = param.Integer(default=5, bounds=(0, 50), label="context", doc="frames of context each side (splice)")
    data = param.String(default="corpus", label="data directory", doc="built-in corpus directory or a Kaldi data directory")
    runs_dir = param.String(default="runs", label="runs directory")
    overrides = param.Dict(default={}, doc="more TrainConfig settings as dotted keys (not shown)")

    def to_config(self, out: str | Path) -> TrainConfig:
        """The validated TrainConfig of a run written to `out`; UserError names a bad value."""
        data_dir = Path(self.data).expanduser()
        if not data_dir.exists():
            raise UserError(f"data: {data_dir} does not exist (make one with `labavg corpus synth`)")
        cfg = TrainConfig(
            out=str(out), backend=BACKEND_LABELS[self.backend], ranks=self.ranks,
            average_every=self.average_every, lr=self.lr, final_lr=self.final_lr,
            schedule=self.schedule, optimizer=self.optimizer, pretrain=self.pretrain,
            minibatch=self.minibatch, epochs=self.epochs, tensorboard=False,
            model=ModelConfig(hidden_layers=self.hidden_layers, hidden_dim=self.hidden_dim),
            data=DataConfig(data=str(data_dir), context=self.context),
        )
        if self.overrides:
            cfg = with_overrides(cfg, self.overrides)
        return validate(cfg)

    def check(self) -> str | None:
        """What is wrong with the settings as a message, or None when a run could start."""
        try:
            self.to_config(Path(self.runs_dir) / "check")
        except UserError as exc:
            return str(exc)
        return None


def describe_config(cfg: dict[str, Any]) -> str:
    """One line saying what a run (given its config dict) trains, for the page header."""
    model = cfg.get("model", {})
    data = cfg.get("data", {})
    final = cfg.get("final_lr")
    lr = f"lr {cfg.get('lr'):g}" + (f"→{final:g}" if final is not None else "")
    backend = {"inproc": "in-process", "mpi": "MPI"}.get(cfg.get("backend"), cfg.get("backend"))
    return (f"{backend} × {cfg.get('ranks')} ranks · K={effective_k(cfg)} · "
            f"{cfg.get('optimizer')} {lr} ({cfg.get('schedule')}) · pretrain {cfg.get('pretrain')} · "
            f"minibatch {cfg.get('minibatch')} · {cfg.get('epochs')} epochs · "
            f"{model.get('hidden_layers')}×{model.get('hidden_dim')} · data {Path(str(data.get('data'))).name}")


def new_run_dir(runs_dir: Path, ranks: int, average_every: int) -> Path:
    """A fresh, not yet existing run directory name under `runs_dir` (time, ranks and K)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = f"{stamp}-n{ranks}-k{average_every}"
    for i in range(1000):
        candidate = runs_dir / (base if i == 0 else f"{base}-{i}")
        if not candidate.exists():
            return candidate
    raise UserError(f"cannot find a free run directory name under {runs_dir}")


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
        self.messages: deque = deque(maxlen=20)

    def add(self, event: dict[str, Any]) -> None:
        """Route one event dict (labavg.events) into the buffers."""
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
        elif kind == "epoch" and rank == 0:
            self.cv.append((event["epoch"], event["cv_frame_accuracy"], event["train_frame_accuracy"]))
        elif kind == "message":
            self.messages.append(f"rank {rank}, step {event['step']}: {event['text']}")
        elif kind == "run_finished" and rank == 0:
            self.finished = event
            for series in (self.loss, self.divergence, self.compute, self.comm, self.fps):
                series.flush()


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

    # -- starting and stopping -------------------------------------------------------------

    def start(self, settings: RunSettings) -> bool:
        """Start a run with `settings` on a worker thread; False (and a status) when it cannot."""
        if self.running:
            self.status = "A run is already in progress; stop it first."
            return False
        try:
            # The name shows the K the run trains with (average_every_frames may set it).
            k = settings.to_config(Path(settings.runs_dir) / "check").averaging_interval()
            out = new_run_dir(Path(settings.runs_dir).expanduser(), settings.ranks, k)
            cfg = settings.to_config(out)
        except UserError as exc:
            self.error = str(exc)
            self.status = f"Cannot start: {exc}"
            return False
        backend = settings.backend
        self._reset(cfg.ranks, to_dict(cfg), str(out), "live")
        launcher = "threads" if backend == "in-process workers" else "engines"
        self._thread = threading.Thread(target=self._drive, args=(cfg, launcher), daemon=True,
                                        name="labavg-dashboard-run")
        self.running = True
        self.status = f"Running {out.name} ({backend}, {cfg.ranks} ranks, K={cfg.averaging_interval()})…"
        self._thread.start()
        return True

    def stop(self) -> None:
        """Ask the run to stop at its next averaging round (all ranks stop together)."""
        if self.running and self.mode == "live":
            self._stop.set()
            self.status = "Stopping at the next averaging round…"
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
        self.error = ""
        self.param.update(config=config, run_dir=run_dir, mode=mode)
        self.generation += 1

    def _drive(self, cfg: TrainConfig, launcher: str) -> None:
        """On the worker: start the run, relay its events, pass on a stop; report the outcome."""
        from labavg.launch import start_run

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

    def follow(self, run_dir: str | Path) -> bool:
        """Follow a run directory another process (CLI, cluster) is writing; False if it is none."""
        run_dir = Path(run_dir).expanduser()
        if self.running and self.mode == "live":
            self.status = "A run is in progress here; stop it before following another."
            return False
        if not run_dir.is_dir():
            self.status = f"Cannot follow {run_dir}: not a directory"
            return False
        self._reset(1, {}, str(run_dir), "monitor")
        self._tail = EventTail(run_dir / EVENTS)
        self.running = True
        self.status = f"Following {run_dir} (waiting for {CONFIG})…"
        self._poll_monitor()
        return True

    def _poll_monitor(self) -> None:
        run_dir = Path(self.run_dir)
        if not self.config:
            try:
                config = json.loads((run_dir / CONFIG).read_text())
            except (OSError, json.JSONDecodeError):
                return  # rank 0 writes config.json with its first event; keep waiting
            self.buffers = RunBuffers(int(config.get("ranks", 1)), self.maxlen)
            self.config = config
            self.generation += 1
            self.status = f"Following {run_dir}…"
        for event in self._tail.read():
            self._events.put(event)
        if (run_dir / SUMMARY).is_file() and self._events.empty() and self.buffers.finished:
            self.running = False
            self.mode = "idle"
            self.status = f"Finished: {run_dir.name} — {_finish_text(self.buffers.finished)}"

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


# -- the past runs -------------------------------------------------------------------------

TABLE_COLUMNS = ("run", "status", "backend", "ranks", "K", "optimizer", "lr", "schedule", "pretrain",
                 "minibatch", "epochs", "model", "wer_pct", "per_pct", "cv_acc_pct", "cv_loss",
                 "wall_s", "comm_pct", "speedup", "efficiency")


def _table_row(row: dict[str, Any]) -> dict[str, Any]:
    """The dashboard's columns of a `labavg.index.run_row`: percentages, short names."""

    def pct(value):
        return None if value is None else round(100 * value, 2)

    return {
        "run": row["run"], "status": row["status"], "backend": row["backend"],
        "ranks": row["ranks"], "K": row["average_every"], "optimizer": row["optimizer"],
        "lr": row["lr"], "schedule": row["schedule"], "pretrain": row["pretrain"],
        "minibatch": row["minibatch"], "epochs": row["epochs"], "model": row["model"],
        "wer_pct": row["wer"], "per_pct": row["per"],
        "cv_acc_pct": pct(row["cv_frame_accuracy"]), "cv_loss": row["cv_loss"],
        "wall_s": row["wall_seconds"], "comm_pct": pct(row["comm_fraction"]),
        "speedup": row["speedup"], "efficiency": row["parallel_efficiency"],
    }


class RunTable(param.Parameterized):
    """The runs under `runs_dir`: one row each (config + summary), overlay selection, CSV."""

    runs_dir = param.String(default="runs")
    rows = param.List(default=[], doc="one dict per run, TABLE_COLUMNS keys, oldest first")
    selected = param.List(default=[], doc="names of the runs to overlay")

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self._configs: dict[str, dict[str, Any]] = {}

    def refresh(self) -> list[dict[str, Any]]:
        """Rescan runs_dir; returns the rows (runs without config.json are not runs yet)."""
        records = list_runs(Path(self.runs_dir))
        rows = [run_row(r.name, r.config, r.summary) for r in records]
        fill_speedups(rows, records)
        rows = [_table_row(row) for row in rows]
        configs = {r.name: r.config for r in records}
        self._configs = configs
        self.selected = [name for name in self.selected if name in configs]
        self.rows = rows
        return rows

    def config_of(self, name: str) -> dict[str, Any]:
        """The config dict of run `name`."""
        return self._configs[name]

    def to_csv(self) -> str:
        """The table as CSV text (header + one line per run)."""
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=list(TABLE_COLUMNS), lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.rows)
        return out.getvalue()

    def overlay(self) -> dict[str, dict[str, list[float]]]:
        """For each selected run: its mean training loss by frames trained and its CV accuracy.

        x is frames over all ranks (step x minibatch x ranks) so runs with different numbers
        of ranks line up.
        """
        root = Path(self.runs_dir).expanduser()
        curves = {}
        for name in self.selected:
            config = self._configs.get(name)
            if config is None:
                continue
            scale = config.get("minibatch", 1) * config.get("ranks", 1)
            sums: dict[int, list[float]] = {}
            cv_x, cv_y = [], []
            for event in read_events(root / name) if (root / name / EVENTS).is_file() else []:
                if event.get("type") == "minibatch":
                    sums.setdefault(event["step"], []).append(event["loss"])
                elif event.get("type") == "epoch" and event.get("rank") == 0:
                    cv_x.append(event["step"] * scale)
                    cv_y.append(100 * event["cv_frame_accuracy"])
            steps = sorted(sums)
            curves[name] = {
                "frames": [s * scale for s in steps],
                "loss": [float(np.mean(sums[s])) for s in steps],
                "cv_frames": cv_x, "cv_acc_pct": cv_y,
            }
        return curves

    def scaling(self) -> list[dict[str, Any]]:
        """(ranks, speedup, efficiency, K, run) of the finished runs with a known speedup."""
        return [{"ranks": r["ranks"], "speedup": r["speedup"], "efficiency": r["efficiency"],
                 "K": r["K"], "run": r["run"]}
                for r in self.rows if r["status"] == "finished" and r["speedup"] is not None]
