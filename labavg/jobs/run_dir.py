"""Run directories: what a finished or running training run leaves on disk, who may write one,
and what a resume may change.

RUN_DIR/config.json      the TrainConfig (written by rank 0 when the run starts)
RUN_DIR/events.jsonl     every rank's events, one JSON object a line (labavg.base.events)
RUN_DIR/final.pt         the trained model (labavg.decode.model), written by rank 0 at the end
RUN_DIR/summary.json     results, written by rank 0 after final.pt: the commit marker of a
                         finished run (labavg.jobs.runs.finish_run); a decode adds to it later
RUN_DIR/tensorboard/     TensorBoard event files, one folder per rank
RUN_DIR/checkpoints/     see labavg.base.checkpoint
RUN_DIR/.lock            held (flock) by the job writing the directory; names its holder once
                         the job has passed its checks (accept_run_dir)
RUN_DIR/heartbeat/       each rank's watchdog heartbeat while it runs (labavg.comm.watchdog)

labavg.jobs.runs writes them (run_training); labavg.jobs.index reads them back.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import stat
import sys
import time
from collections.abc import Iterator
from itertools import islice
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labavg.base.checkpoint import FINAL, checkpoint_dir, latest_step
from labavg.comm.launchers import launcher_rank
from labavg.training.config import TrainConfig, config_from_dict
from labavg.base.settings import to_dict
from labavg.base.errors import UserError, one_line
from labavg.comm.watchdog import HEARTBEAT_DIR
from labavg.jobs.index import CONFIG, EVENTS, SUMMARY
from labavg.jobs.run_json import RunSummary
from labavg.jobs.summary import load_summary

LOCK = ".lock"
# Set by a launcher that holds the run directory's lock for its ranks (to the resolved path).
LOCK_HELD_ENV = "LABAVG_RUN_DIR_LOCKED"

# Settings a resume may change: none of them changes what is computed (inproc and mpi are
# bitwise the same; a fault is injected once). `ranks` is not among them: it changes the
# sharding and, through lr_scaling, the learning rate; a resume may only lower it, as an
# elastic run loses workers (labavg.training.resume_layout; check_resume_config).
RESUME_FREE_KEYS = ("out", "backend", "device", "threads", "checkpoint_every", "log_every",
                    "tensorboard", "watchdog_seconds", "inject_fault", "speedup_pairs")


def _summary_or_none(run_dir: Path) -> RunSummary | None:
    """The run's summary.json, or None when it is missing or not (yet) readable."""
    try:
        return load_summary(run_dir)
    except (OSError, UserError):
        return None


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
        summary = _summary_or_none(run_dir)
        # Without its model a run has not finished (its end was cut short), nor while the
        # decode it asked for is missing: the resume completes it from the last checkpoint.
        if summary is not None and not summary.stopped and (run_dir / FINAL).is_file() \
                and not decode_missing(summary):
            raise UserError(
                f"--resume: {run_dir} has finished (step {summary.steps}, {SUMMARY}); "
                f"nothing to resume: start a new run with another --out to train more")
        _check_whole(run_dir, *found)
        if cfg is not None and launcher_rank() == 0:
            # Once per job: the other ranks learn of a refusal through the start-up agreement.
            check_resume_config(run_dir, cfg, found[1])
        return
    if (run_dir / EVENTS).exists() or (run_dir / SUMMARY).exists():
        raise UserError(
            f"run directory {run_dir} already holds a run; pass --resume to continue it or choose "
            f"another --out"
        )


def decode_missing(summary: RunSummary) -> bool:
    """A finished run asked to decode whose decode did not finish (stopped or failed)."""
    return summary.config is not None and summary.config.decode_data is not None \
        and summary.wer is None


def _check_whole(run_dir: Path, step: int, size: int) -> None:
    """UserError unless every rank's file of the checkpoint latest.json names is there."""
    folder = checkpoint_dir(run_dir) / f"{step:09d}"
    missing = list(islice((f"rank{r}.pt" for r in range(size)
                           if not (folder / f"rank{r}.pt").is_file()), 5))
    if missing:
        raise UserError(f"--resume: {run_dir / 'checkpoints' / 'latest.json'} names checkpoint "
                        f"{folder}, which lacks {', '.join(missing[:4])}"
                        f"{' and more' if len(missing) > 4 else ''}; the run cannot be resumed "
                        f"from it (nothing was changed)")


def check_resume_config(run_dir: Path, cfg: TrainConfig, checkpoint_ranks: int) -> None:
    """UserError naming every setting that differs from the run's own and would change results.

    The run's own settings are those its last checkpoint was trained with.
    """
    from labavg.base.checkpoint import load_rank_state

    step, _ = latest_step(run_dir)
    saved = load_rank_state(run_dir, step, 0).get("config")
    stored = _in_force(config_from_dict(saved, f"checkpoint {step}") if isinstance(saved, dict)
                       else load_config_of(run_dir))
    wanted = _in_force(cfg)
    fewer = cfg.ranks < checkpoint_ranks
    changed = [key for key in _leaves(wanted)
               if key.split(".")[0] not in RESUME_FREE_KEYS + (("ranks",) if fewer else ())
               and _get(stored, key) != _get(wanted, key)]
    if changed:
        shown = ", ".join(f"{k} = {_get(stored, k)!r} -> {_get(wanted, k)!r}" for k in changed[:4])
        more = f" (and {len(changed) - 4} more)" if len(changed) > 4 else ""
        raise UserError(
            f"--resume: {run_dir} was trained with other settings: {shown}{more}; a resume keeps "
            f"them (only {', '.join(k for k in RESUME_FREE_KEYS if k != 'out')} may change)")
    if checkpoint_ranks < cfg.ranks:
        raise UserError(f"--resume: the checkpoint of {run_dir} holds {checkpoint_ranks} ranks but "
                        f"the run has ranks = {cfg.ranks}; a resume goes on with as many ranks or "
                        f"fewer (1..{checkpoint_ranks}), never more")
    if fewer and cfg.on_rank_loss == "continue":
        raise UserError(f"--resume: ranks = {checkpoint_ranks} -> {cfg.ranks} on the elastic run "
                        f"{run_dir} (on_rank_loss = \"continue\"): resume it on its "
                        f"{checkpoint_ranks} ranks; a resume on fewer is for runs that stop")


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


# The run directories whose lock this context holds: a run started inside (on this thread, or
# on the threads a run starts, which carry their starter's context) finds its lock held here.
# Not os.environ: sweeps on threads of one process (the reproduction) each hold their own.
_HELD_HERE: ContextVar[frozenset[str]] = ContextVar("labavg_run_dirs_held", default=frozenset())


@contextmanager
def lock_held(run_dir: Path) -> Iterator[None]:
    """Tell runs started inside this context that the lock is held here (a job's processes
    are told by their environment, LOCK_HELD_ENV, which labavg.jobs.job_run sets)."""
    token = _HELD_HERE.set(_HELD_HERE.get() | {str(Path(run_dir).resolve())})
    try:
        yield
    finally:
        _HELD_HERE.reset(token)


@dataclass
class _Held:
    """A lock this process took: its open file, and whether its holder has been written."""

    fd: int
    named: bool = False


# The run directories whose lock this process took, by resolved path: accept_run_dir names the
# holder through it once the command has passed its checks.
_TAKEN: dict[str, _Held] = {}


@contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """Hold RUN_DIR/.lock for the life of the job, so that a second job cannot write there.

    Taken by the process that owns the job: the launcher that starts mpiexec (its ranks then
    find LOCK_HELD_ENV), the in-process trainer, or rank 0 of a job started by mpiexec, srun
    or torchrun. The lock is an flock, so it goes with its holder however that ends. Taking it
    writes nothing: the holder is written by accept_run_dir once every check has passed, so a
    refused command leaves the directory as it was (a lock file or a directory this call
    created is removed again).
    """
    run_dir = Path(run_dir)
    resolved = str(run_dir.resolve())
    if (resolved in _HELD_HERE.get() or os.environ.get(LOCK_HELD_ENV) == resolved
            or launcher_rank() != 0):
        yield
        return
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} is a file, not a directory")
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot write run directory {run_dir}: {exc.strerror}") from None
    held = None
    try:
        check_own_files(run_dir)
        fd, made = _open_lock(run_dir / LOCK)
        held = _Held(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            raise RunDirBusy(f"run directory {run_dir} is in use by another job ({_describe(holder)}); "
                            f"wait for it to end or stop it first") from None
        _TAKEN[resolved] = held
        try:
            yield
        except BaseException:
            if made and not held.named:  # refused: the lock file this call made goes again
                (run_dir / LOCK).unlink(missing_ok=True)
            raise
        finally:
            _TAKEN.pop(resolved, None)
    finally:
        if held is not None:
            os.close(held.fd)
        # A directory removed under the job (rm -rf by hand) has nothing left to clean.
        if created and run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {
                LOCK, HEARTBEAT_DIR}:
            shutil.rmtree(run_dir, ignore_errors=True)


def _open_lock(path: Path) -> tuple[int, bool]:
    """The lock file's descriptor, opened for writing without changing it, and whether this
    call created it. O_NOFOLLOW: a link planted between the check and the open is refused."""
    try:
        try:
            return os.open(path, os.O_RDWR | os.O_NOFOLLOW), False
        except FileNotFoundError:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), True
    except OSError as exc:
        raise UserError(f"cannot write the lock file {path}: "
                        f"{_OPEN_ERRORS.get(exc.errno, exc.strerror)}") from None


def accept_run_dir(run_dir: Path) -> None:
    """The command writing `run_dir` has passed every check: name it in the lock it holds
    (once; nothing where this process does not hold the lock, e.g. a rank of a job whose
    launcher holds it)."""
    held = _TAKEN.get(str(Path(run_dir).resolve()))
    if held is None or held.named:
        return
    holder = {"pid": os.getpid(), "host": socket.gethostname(),
              "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}
    os.ftruncate(held.fd, 0)
    os.pwrite(held.fd, (json.dumps(holder) + "\n").encode(), 0)
    held.named = True


# What labavg writes in a run directory (besides decode_<set>/, which is built beside and
# renamed into place): none of them may be a symbolic link, which would have the job write its
# lock, events, results or checkpoints wherever the link points.
OWN_NAMES = (LOCK, CONFIG, EVENTS, SUMMARY, FINAL, "checkpoints", HEARTBEAT_DIR,
             "tensorboard", ".launch.json", ".stop")
# Those of them that are files, which a directory in their place would make unwritable.
FILE_NAMES = (CONFIG, EVENTS, SUMMARY, FINAL, ".launch.json")
_OPEN_ERRORS = {errno.ELOOP: "it is a symbolic link, which labavg does not follow",
                errno.EISDIR: "it is a directory, not a file"}


def check_own_files(run_dir: Path) -> None:
    """UserError naming the first of the run directory's own files that is a symbolic link,
    or a directory where a file goes (or, for the lock, anything but a file)."""
    for name in OWN_NAMES:
        path = Path(run_dir) / name
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise UserError(f"cannot read {path}: {exc.strerror}") from None
        if stat.S_ISLNK(mode):
            raise UserError(f"{path} is a symbolic link (to {os.readlink(path)}); labavg does not "
                            f"write through links in a run directory: remove it")
        if name == LOCK and not stat.S_ISREG(mode):
            raise UserError(f"the lock file {path} is not a regular file (a "
                            f"{'directory' if stat.S_ISDIR(mode) else 'special file'}): remove it")
        if name in FILE_NAMES and stat.S_ISDIR(mode):
            raise UserError(f"{path} is a directory where labavg writes a file: remove it (or "
                            f"choose another --out)")
        if name in FILE_NAMES and stat.S_ISREG(mode) and _immutable(path):
            raise UserError(f"{path} cannot be replaced: it is immutable (chattr +i); "
                            f"`chattr -i {path}` (or choose another --out)")


def _immutable(path: Path) -> bool:
    """Whether `path` refuses to be written even by its owner (the immutable or append-only
    flag): a run would find it only at its last write. Opened without truncating: unchanged."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK))
    except OSError as exc:
        return exc.errno == errno.EPERM
    return False


def _describe(holder: str) -> str:
    try:
        info = json.loads(holder)
        return f"pid {info['pid']} on {info['host']} since {info['since']}: {info['command']}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"


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
