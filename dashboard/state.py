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
from labavg.runs import CONFIG, EVENTS, SUMMARY, comparable_config

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
    return (f"{backend} × {cfg.get('ranks')} ranks · K={cfg.get('average_every')} · "
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


class EventTail:
    """Reads the lines appended to an events.jsonl since the last call.

    A last line without its newline is still being written: it is kept and completed by the
    next read, so a reader never parses half a JSON object.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = b""

    def read(self, max_bytes: int = 16 << 20) -> list[dict[str, Any]]:
        """New complete events (at most `max_bytes` read per call, so one call stays short)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read(max_bytes)
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        *lines, self._partial = data.split(b"\n")
        events = []
        for line in lines:
            if line.strip():
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a torn line from a crashed writer: skip, keep following
        return events


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
            out = new_run_dir(Path(settings.runs_dir).expanduser(), settings.ranks, settings.average_every)
            cfg = settings.to_config(out)
        except UserError as exc:
            self.error = str(exc)
            self.status = f"Cannot start: {exc}"
            return False
        backend = settings.backend
        self._reset(cfg.ranks, to_dict(cfg), str(out), "live")
        target = self._train_in_process if backend == "in-process workers" else self._train_on_engines
        self._thread = threading.Thread(target=self._guard, args=(target, cfg), daemon=True,
                                        name="labavg-dashboard-run")
        self.running = True
        self.status = f"Running {out.name} ({backend}, {cfg.ranks} ranks, K={cfg.average_every})…"
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

    def _guard(self, target, cfg: TrainConfig) -> None:
        """Run `target` and report its outcome to the UI thread (never raise on a worker)."""
        try:
            self._outcome.put(("done", target(cfg)))
        except BaseException as exc:  # noqa: BLE001 - shown in the page, not lost on a thread
            self._outcome.put(("failed", f"{type(exc).__name__}: {_root_message(exc)}"))

    def _train_in_process(self, cfg: TrainConfig) -> dict[str, Any] | None:
        from labavg.runs import run_training

        return run_training(cfg, on_event=lambda ev: self._events.put(ev.to_dict()),
                            progress=False, should_stop=self._stop.is_set)

    def _train_on_engines(self, cfg: TrainConfig) -> dict[str, Any] | None:
        # Imported here: ipyparallel engines are optional and may be missing or broken.
        from labavg.cluster import Cluster

        cluster = Cluster.start(cfg.ranks)
        try:
            handle = cluster.submit(cfg)
            stopping = False
            while not handle.done:
                for event in handle.poll():
                    self._events.put(event)
                if self._stop.is_set() and not stopping:
                    handle.stop()
                    stopping = True
                time.sleep(0.2)
            handle.wait()
            for event in handle.poll():
                self._events.put(event)
        finally:
            cluster.shutdown()
        summary_path = Path(cfg.out) / SUMMARY
        return json.loads(summary_path.read_text()) if summary_path.is_file() else None

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


def _root_message(exc: BaseException) -> str:
    """The message of the error behind `exc` (a simulated worker's UserError, say)."""
    return one_line(user_error_of(exc) or exc)


# -- the past runs -------------------------------------------------------------------------

TABLE_COLUMNS = ("run", "status", "backend", "ranks", "K", "optimizer", "lr", "schedule", "pretrain",
                 "minibatch", "epochs", "model", "wer_pct", "per_pct", "cv_acc_pct", "cv_loss",
                 "wall_s", "comm_pct", "speedup", "efficiency")


def _comparable(config: dict[str, Any]) -> str:
    return json.dumps(comparable_config(config), sort_keys=True)


def _table_row(name: str, config: dict[str, Any], summary: dict[str, Any] | None) -> dict[str, Any]:
    model = config.get("model", {})
    s = summary or {}

    def pct(value):
        return None if value is None else round(100 * value, 2)

    status = "running/incomplete" if summary is None else ("stopped" if s.get("stopped") else "finished")
    return {
        "run": name, "status": status, "backend": config.get("backend"), "ranks": config.get("ranks"),
        "K": config.get("average_every"), "optimizer": config.get("optimizer"), "lr": config.get("lr"),
        "schedule": config.get("schedule"), "pretrain": config.get("pretrain"),
        "minibatch": config.get("minibatch"), "epochs": config.get("epochs"),
        "model": f"{model.get('hidden_layers')}x{model.get('hidden_dim')}",
        "wer_pct": s.get("wer"), "per_pct": s.get("per"),
        "cv_acc_pct": pct(s.get("cv_frame_accuracy")), "cv_loss": s.get("cv_loss"),
        "wall_s": s.get("wall_seconds"), "comm_pct": pct(s.get("comm_fraction")),
        "speedup": s.get("speedup"), "efficiency": s.get("parallel_efficiency"),
    }


def fill_speedups(rows: list[dict[str, Any]], configs: dict[str, dict[str, Any]]) -> None:
    """Give finished runs without a speedup one from a 1-rank run of the same configuration.

    (summary.json only has a speedup when the baseline finished *before* the run.)
    """
    baselines: dict[str, float] = {}
    for row in rows:
        if row["status"] == "finished" and row["ranks"] == 1 and row["wall_s"]:
            baselines[_comparable(configs[row["run"]])] = row["wall_s"]
    for row in rows:
        if row["status"] != "finished" or row["speedup"] is not None or not row["wall_s"]:
            continue
        base = baselines.get(_comparable(configs[row["run"]]))
        if base is not None:
            row["speedup"] = base / row["wall_s"]
            row["efficiency"] = row["speedup"] / row["ranks"]


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
        root = Path(self.runs_dir).expanduser()
        rows, configs = [], {}
        for run_dir in sorted(root.iterdir()) if root.is_dir() else []:
            try:
                config = json.loads((run_dir / CONFIG).read_text())
            except (OSError, json.JSONDecodeError):
                continue
            try:
                summary = json.loads((run_dir / SUMMARY).read_text())
            except (OSError, json.JSONDecodeError):
                summary = None
            configs[run_dir.name] = config
            rows.append(_table_row(run_dir.name, config, summary))
        fill_speedups(rows, configs)
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
            for event in EventTail(root / name / EVENTS).read(max_bytes=1 << 30):
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
