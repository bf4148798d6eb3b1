"""Run directories: what a finished or running training run leaves on disk.

RUN_DIR/config.json      the TrainConfig (written by rank 0 when the run starts)
RUN_DIR/events.jsonl     every rank's events, one JSON object a line (labavg.events)
RUN_DIR/summary.json     results, written by rank 0 at the end
RUN_DIR/tensorboard/     TensorBoard event files, one folder per rank
RUN_DIR/checkpoints/     see labavg.checkpoint
RUN_DIR/.lock            held (flock) by the job writing the directory; names its holder
RUN_DIR/heartbeat/       each rank's watchdog heartbeat while it runs (labavg.watchdog)

`run_training` is the consumer the CLI and notebooks call: it iterates the trainer and writes
these files. Every rank appends to events.jsonl with one O_APPEND write per line, which
keeps lines whole on a local file system.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from labavg.checkpoint import atomic_write_text, latest_step, remove_orphans
from labavg.comm.launchers import launcher_rank
from labavg.config import TrainConfig, config_from_dict, to_dict
from labavg.errors import UserError, one_line
from labavg.watchdog import HEARTBEAT_DIR
from labavg.events import Averaged, EpochDone, Event, MinibatchDone, RunFinished, RunStarted
# Reading runs back lives in labavg.index; these names stay importable from here.
from labavg.index import (CONFIG, EVENTS, SUMMARY, EventTail, comparable_config,  # noqa: F401
                          find_baseline, read_events, read_json, summary_row)

LOCK = ".lock"
# Set by a launcher that holds the run directory's lock for its ranks (to the resolved path).
LOCK_HELD_ENV = "LABAVG_RUN_DIR_LOCKED"

# Settings a resume may change: none of them changes what is computed (inproc and mpi are
# bitwise the same; a fault is injected once). `ranks` is not among them: it changes the
# sharding and, through lr_scaling, the learning rate.
RESUME_FREE_KEYS = ("out", "backend", "device", "threads", "checkpoint_every", "log_every",
                    "tensorboard", "watchdog_seconds", "inject_fault")


def check_run_dir(run_dir: Path, resume: bool, cfg: TrainConfig | None = None) -> None:
    """Refuse to mix a new run into an existing run directory, and resumes that change results.

    A resume continues an unfinished run (killed, or stopped on request) with the settings it
    was started with; a finished run is left as it is (its summary feeds speedups).
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} is a file, not a directory")
    if resume:
        found = latest_step(run_dir)
        if found is None:
            raise UserError(f"--resume: {run_dir} holds no checkpoint to resume from")
        summary = read_json(run_dir / SUMMARY)
        if summary is not None and not summary.get("stopped"):
            raise UserError(
                f"--resume: {run_dir} has finished (step {summary.get('steps')}, {SUMMARY}); "
                f"nothing to resume: start a new run with another --out to train more")
        if cfg is not None and launcher_rank() == 0:
            # Once per job: the other ranks learn of a refusal through the start-up agreement.
            check_resume_config(run_dir, cfg, found[1])
        return
    if (run_dir / EVENTS).exists() or (run_dir / SUMMARY).exists():
        raise UserError(
            f"run directory {run_dir} already holds a run; pass --resume to continue it or choose "
            f"another --out"
        )


def check_resume_config(run_dir: Path, cfg: TrainConfig, checkpoint_ranks: int) -> None:
    """UserError naming every setting that differs from the run's own and would change results.

    The run's own settings are those its last checkpoint was trained with.
    """
    from labavg.checkpoint import load_rank_state

    step, _ = latest_step(run_dir)
    saved = load_rank_state(run_dir, step, 0).get("config")
    stored = _in_force(config_from_dict(saved, f"checkpoint {step}") if isinstance(saved, dict)
                       else load_config_of(run_dir))
    wanted = _in_force(cfg)
    changed = [key for key in _leaves(wanted)
               if key.split(".")[0] not in RESUME_FREE_KEYS and _get(stored, key) != _get(wanted, key)]
    if changed:
        shown = ", ".join(f"{k} = {_get(stored, k)!r} -> {_get(wanted, k)!r}" for k in changed[:4])
        more = f" (and {len(changed) - 4} more)" if len(changed) > 4 else ""
        raise UserError(
            f"--resume: {run_dir} was trained with other settings: {shown}{more}; a resume keeps "
            f"them (only {', '.join(k for k in RESUME_FREE_KEYS if k != 'out')} may change)")
    if checkpoint_ranks != cfg.ranks:
        raise UserError(f"--resume: the checkpoint of {run_dir} holds {checkpoint_ranks} ranks but "
                        f"the run has ranks = {cfg.ranks}")


def _in_force(cfg: TrainConfig) -> dict[str, Any]:
    """The settings as the trainer applies them: an unset max-change is its optimizer's default."""
    values = to_dict(cfg)
    values["max_change_per_sample"], values["max_param_change"] = cfg.max_change_limits()
    return values


def _leaves(values: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in values.items():
        out += _leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else [prefix + key]
    return out


def _get(values: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        values = values.get(part) if isinstance(values, dict) else None
    return values


class RunDirBusy(UserError):
    """The run directory is locked by another live job."""


@contextmanager
def lock_held(run_dir: Path) -> Iterator[None]:
    """Tell jobs started inside (in this process or its children) that the lock is held here."""
    before = os.environ.get(LOCK_HELD_ENV)
    os.environ[LOCK_HELD_ENV] = str(Path(run_dir).resolve())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(LOCK_HELD_ENV, None)
        else:
            os.environ[LOCK_HELD_ENV] = before


@contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """Hold RUN_DIR/.lock for the life of the job, so that a second job cannot write there.

    Taken by the process that owns the job: the launcher that starts mpiexec (its ranks then
    find LOCK_HELD_ENV), the in-process trainer, or rank 0 of a job started by mpiexec, srun
    or torchrun. The lock is an flock, so it goes with its holder however that ends. A
    directory this call created and left holding only the lock is removed again.
    """
    run_dir = Path(run_dir)
    resolved = str(run_dir.resolve())
    if os.environ.get(LOCK_HELD_ENV) == resolved or launcher_rank() != 0:
        yield
        return
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} is a file, not a directory")
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise UserError(f"cannot write run directory {run_dir}: {exc.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            raise RunDirBusy(f"run directory {run_dir} is in use by another job ({_describe(holder)}); "
                            f"wait for it to end or stop it first") from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        yield
    finally:
        os.close(fd)
        if created and {p.name for p in run_dir.iterdir()} <= {LOCK, HEARTBEAT_DIR}:
            shutil.rmtree(run_dir, ignore_errors=True)


def _describe(holder: str) -> str:
    try:
        info = json.loads(holder)
        return f"pid {info['pid']} on {info['host']} since {info['since']}: {info['command']}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"


class EventLog:
    """Appends events to events.jsonl and, if asked, to this rank's TensorBoard files."""

    def __init__(self, run_dir: Path, rank: int, tensorboard: bool = True) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(run_dir / EVENTS, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard" / f"rank{rank}"))

    def write(self, event: Event) -> None:
        """Log one event (one write call, so concurrent ranks never split a line)."""
        os.write(self._fd, (json.dumps(event.to_dict(), allow_nan=True) + "\n").encode())
        if self._tb is None:
            return
        if isinstance(event, MinibatchDone):
            self._tb.add_scalar("train/loss", event.loss, event.step)
            self._tb.add_scalar("train/frame_accuracy", event.frame_accuracy, event.step)
            self._tb.add_scalar("train/lr", event.lr, event.step)
        elif isinstance(event, Averaged):
            self._tb.add_scalar("averaging/divergence", event.divergence, event.step)
            self._tb.add_scalar("averaging/comm_seconds", event.comm_seconds, event.step)
            self._tb.add_scalar("averaging/frames_per_second", event.frames_per_second, event.step)
        elif isinstance(event, EpochDone):
            self._tb.add_scalar("cv/loss", event.cv_loss, event.step)
            self._tb.add_scalar("cv/frame_accuracy", event.cv_frame_accuracy, event.step)

    def close(self) -> None:
        """Flush and close the files."""
        os.close(self._fd)
        if self._tb is not None:
            self._tb.close()


def read_summary(run_dir: Path) -> dict[str, Any]:
    """summary.json of a finished run; UserError naming the path otherwise."""
    path = Path(run_dir) / SUMMARY
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{run_dir} is not a finished labavg run: {path} is missing") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None


def make_summary(cfg: TrainConfig, started: RunStarted, finished: RunFinished,
                 baseline: dict[str, Any] | None) -> dict[str, Any]:
    """The summary.json of a run, with speedup when a 1-rank baseline exists."""
    summary: dict[str, Any] = {
        "ranks": started.size,
        "backend": cfg.backend,
        "average_every": started.average_every,
        "averaging": started.averaging,
        "reduce": started.reduce,
        "payload": started.payload,
        "optimizer": cfg.optimizer,
        "pretrain": cfg.pretrain,
        "schedule": cfg.schedule,
        "minibatch": cfg.minibatch,
        "epochs": cfg.epochs,
        "lr": cfg.lr,
        "effective_lr": started.effective_lr,
        "num_params": started.num_params,
        "num_pdfs": started.num_pdfs,
        "frames_trained": finished.frames_trained,
        "steps": finished.step,
        "averaging_rounds": finished.averaging_rounds,
        "cv_frame_accuracy": finished.cv_frame_accuracy,
        "cv_loss": finished.cv_loss,
        "wall_seconds": finished.wall_seconds,
        "compute_seconds": finished.compute_seconds,
        "comm_seconds": finished.comm_seconds,
        "bytes_per_round": started.bytes_per_round,
        "bytes_sent": finished.bytes_sent,
        "hierarchy_every": started.hierarchy_every,
        "node_ranks": started.node_ranks,
        "node_rounds": finished.node_rounds,
        "node_bytes_sent": finished.node_bytes_sent,
        "all_rounds": finished.averaging_rounds - finished.node_rounds,
        "all_bytes_sent": finished.bytes_sent - finished.node_bytes_sent,
        "stopped": finished.stopped,
        "comm_fraction": finished.comm_seconds / max(finished.compute_seconds + finished.comm_seconds, 1e-12),
        "overlap": started.overlap,
        "fragment_bytes": list(started.fragment_bytes),
        "overlap_bytes_sent": finished.overlap_bytes_sent,
        "comm_wait_seconds": finished.wait_seconds,
        "comm_hidden_fraction": comm_hidden_fraction(finished),
        "speedup": None,
        "parallel_efficiency": None,
        "baseline_wall_seconds": None,
        "config": to_dict(cfg),
    }
    if baseline is not None and finished.wall_seconds > 0:
        speedup = baseline["wall_seconds"] / finished.wall_seconds
        summary.update(
            speedup=speedup,
            parallel_efficiency=speedup / started.size,
            baseline_wall_seconds=baseline["wall_seconds"],
        )
    return summary


def comm_hidden_fraction(finished: RunFinished) -> float | None:
    """The share of the averaging communication that overlap hid (docs/averaging.md, Overlap):
    1 - (seconds per byte the non-blocking means held the rank) / (seconds per byte of the
    same run's blocking rounds), None without both kinds of rounds. Per byte, because a
    streaming round sends one fragment and an epoch end's blocking round the whole model."""
    blocking_seconds = finished.comm_seconds - finished.overlap_seconds
    blocking_bytes = finished.bytes_sent - finished.overlap_bytes_sent
    if finished.overlap_bytes_sent <= 0 or blocking_bytes <= 0 or blocking_seconds <= 0:
        return None
    return 1.0 - ((finished.overlap_seconds / finished.overlap_bytes_sent)
                  / (blocking_seconds / blocking_bytes))


def open_source(cfg: TrainConfig, allow_pipes: bool = False):
    """The run's training data, opened and checked (DataError names what is wrong)."""
    from labavg.data.dataset import open_dataset

    return open_dataset(
        cfg.data.data, ali=cfg.data.ali, ali_dir=cfg.data.ali_dir, textgrid=cfg.data.textgrid,
        apply_cmvn=cfg.data.apply_cmvn, norm_vars=cfg.data.norm_vars,
        skip_mismatched=cfg.data.skip_mismatched, allow_pipes=allow_pipes,
    )


def preflight(cfg: TrainConfig, resume: bool = False, allow_pipes: bool = False):
    """Everything that can be checked before any rank starts; returns the opened data.

    The launcher of a multi-process job calls it once, so that a bad setting or data set is
    reported once, before N ranks meet it; run_training calls it on every rank anyway.
    """
    from labavg.train import check_fits

    run_dir = Path(cfg.out)
    check_run_dir(run_dir, resume, cfg)
    if cfg.decode_data is not None:
        from labavg.decode.run import check_decode_data

        check_decode_data(cfg.decode_data)
    source = open_source(cfg, allow_pipes)
    check_fits(cfg, source)  # with cfg.ranks; the ranks check again with the size they find
    return source


def run_training(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    on_event: Callable[[Event], None] | None = None,
    progress: bool = True,
    should_stop: Callable[[], bool] | None = None,
    allow_pipes: bool = False,
) -> dict[str, Any] | None:
    """Train with `cfg`, writing cfg.out as a run directory; return rank 0's summary.

    At the end rank 0 writes RUN_DIR/final.pt (labavg.decode.model); with `cfg.decode_data` it
    also decodes that data (a data dir, or a corpus with dev/ and test/) and the summary gains
    wer, wer_ci, per, per_ci, acwt and decode_set.

    Under mpiexec/torchrun every process calls this; only rank 0 returns the summary (others
    return None). `on_event` sees every event this process sees. `allow_pipes` lets data files
    and rspecifiers run commands (Kaldi's `cmd |`); only the command line's --allow-pipes sets it.
    """
    from labavg.train import train

    run_dir = Path(cfg.out)
    with run_dir_lock(run_dir):
        if resume and launcher_rank() == 0:
            remove_orphans(run_dir)
        opened: dict[str, Any] = {}

        def open_data():  # opened on every rank (labavg.train.train agrees on the outcome)
            opened["source"] = preflight(cfg, resume, allow_pipes)
            return opened["source"]

        return _consume(cfg, train(cfg, open_data, run_dir, resume, should_stop=should_stop),
                        run_dir, resume, on_event, progress, opened)


def _consume(cfg: TrainConfig, events: Iterator[Event], run_dir: Path, resume: bool,
             on_event: Callable[[Event], None] | None, progress: bool,
             opened: dict[str, Any]) -> dict[str, Any] | None:
    """Write the run directory from the trainer's events; rank 0's summary (and final.pt)."""
    logs: dict[int, EventLog] = {}
    started: dict[int, RunStarted] = {}
    summary = None
    bar = None
    # Load averages (1 minute) at the start and end: a speedup against a 1-rank run that ran
    # under another load is not the averaging's alone (the dashboard warns of it).
    load_start = os.getloadavg()[0]
    try:
        for event in events:
            if event.rank not in logs:
                if event.rank == 0 and not resume:
                    atomic_write_text(run_dir / CONFIG, json.dumps(to_dict(cfg), indent=2) + "\n")
                logs[event.rank] = EventLog(run_dir, event.rank, cfg.tensorboard)
            logs[event.rank].write(event)
            if on_event is not None:
                on_event(event)
            if isinstance(event, RunStarted):
                started[event.rank] = event
                if event.rank == 0 and progress:
                    bar = _progress_bar(event, cfg)
            elif bar is not None and event.rank == 0 and isinstance(event, MinibatchDone):
                bar.update(event.step - bar.n)
                bar.set_postfix(loss=f"{event.loss:.3f}", acc=f"{event.frame_accuracy:.3f}", refresh=False)
            elif isinstance(event, RunFinished) and event.rank == 0:
                summary = make_summary(cfg, started[0], event, find_baseline(run_dir, to_dict(cfg)))
                summary["resumed"] = resume
                summary["load_average"] = {"start": load_start, "end": os.getloadavg()[0]}
                atomic_write_text(run_dir / SUMMARY, json.dumps(summary, indent=2) + "\n")
    finally:
        if bar is not None:
            bar.close()
        for log in logs.values():
            log.close()
    if summary is not None:
        # After the trainer has ended (its ranks released, its watchdog gone): exporting and
        # decoding take minutes, and a failed decode must not lose the training result above.
        from labavg.decode.run import export_and_decode

        summary.update(export_and_decode(run_dir, cfg, opened["source"], cfg.decode_data))
        atomic_write_text(run_dir / SUMMARY, json.dumps(summary, indent=2) + "\n")
    return summary


def decode_pending(run_dir: Path) -> bool:
    """A finished run asked to decode whose decode did not finish (stopped while it ran)."""
    summary = read_summary(run_dir)
    wanted = (summary.get("config") or {}).get("decode_data")
    return wanted is not None and summary.get("wer") is None


def finish_decode(cfg: TrainConfig, allow_pipes: bool = False) -> dict[str, Any]:
    """Export and decode a finished run whose decode was cut short; return its new summary."""
    from labavg.decode.run import export_and_decode

    run_dir = Path(cfg.out)
    with run_dir_lock(run_dir):
        summary = read_summary(run_dir)
        summary.update(export_and_decode(run_dir, cfg, open_source(cfg, allow_pipes),
                                         cfg.decode_data))
        atomic_write_text(run_dir / SUMMARY, json.dumps(summary, indent=2) + "\n")
    return summary


def _progress_bar(event: RunStarted, cfg: TrainConfig):
    import sys

    from tqdm import tqdm

    # Off a terminal (a notebook, a log file) every refresh is kept as a line: refresh rarely.
    interval = 0.1 if sys.stderr.isatty() else 5.0
    return tqdm(total=event.steps_per_epoch * cfg.epochs, initial=event.start_step, unit="mb",
                desc=f"train x{event.size}", dynamic_ncols=True, mininterval=interval)


def format_table(summaries: Iterable[dict[str, Any]]) -> str:
    """A Markdown table of run summaries (one row per run); error rates when the run decoded."""
    cols = [("run", "run"), ("ranks", "ranks"), ("K", "average_every"), ("opt", "optimizer"),
            ("lr", "lr"), ("epochs", "epochs"), ("method", "averaging"),
            ("WER % (95% CI)", "wer"), ("PER %", "per"),
            ("cv acc %", "cv_frame_accuracy"), ("cv loss", "cv_loss"), ("wall s", "wall_seconds"),
            ("comm %", "comm_fraction"), ("speedup", "speedup"), ("efficiency %", "parallel_efficiency"),
            ("stopped", "status")]
    rows = [{**summary_row(s.get("run"), s), "run": s.get("run")} for s in summaries]
    if not any(r["wer"] is not None for r in rows):
        cols = [c for c in cols if c[1] not in ("wer", "per")]
    if any(r["reduce"] not in (None, "allreduce") for r in rows):
        # Only then: the column would repeat the default in every table of plain runs.
        cols.insert(cols.index(("method", "averaging")) + 1, ("reduce", "reduce"))
    if any(r["payload"] not in (None, "fp32") for r in rows):
        cols.insert(cols.index(("method", "averaging")) + 1, ("payload", "payload"))

    def cell(key: str, row: dict[str, Any]) -> str:
        value = row[key]
        if value is None:
            return "-"
        if key == "wer":
            low, high = (row["wer_ci_low"], row["wer_ci_high"]) if row["wer_ci_low"] is not None \
                else (math.nan, math.nan)
            return f"{value:.2f} ({low:.2f}-{high:.2f})"
        if key == "per":
            return f"{value:.2f}"
        if key in ("cv_frame_accuracy", "comm_fraction"):
            return f"{100 * value:.2f}"
        if key == "parallel_efficiency":  # a percentage, as the dashboard shows it
            return f"{100 * value:.0f}"
        if key == "status":
            return "yes" if value == "stopped" else "no"
        if key == "lr":
            return f"{value:g}"
        if isinstance(value, float):
            return "nan" if math.isnan(value) else f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
        return str(value)

    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join(cell(k, row) for _, k in cols) + " |")
    return "\n".join(lines)


def load_config_of(run_dir: Path) -> TrainConfig:
    """The TrainConfig a run directory was started with."""
    path = Path(run_dir) / CONFIG
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{run_dir} is not a labavg run directory: {path} is missing") from None
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise UserError(f"{path}: not a valid labavg configuration ({one_line(exc)}); "
                        f"the run cannot be resumed") from None
    if not isinstance(values, dict):
        raise UserError(f"{path}: not a valid labavg configuration (expected a JSON object)")
    return config_from_dict(values, str(path))
