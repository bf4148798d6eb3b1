"""A run as a job of processes under mpiexec (backend mpi), torchrun (backend torch), srun
(`--launcher slurm`) or none (one plain process, for a working directory of its own).

This process owns the job: it holds the run directory's lock, checks what can be checked
once, and mpiexec/torchrun end when it dies, however it dies. The job's configuration travels
as a file (RUN_DIR/.launch.json, removed when the job ends), never as re-parsed flags: its
ranks run `python -m labavg.jobs.rank_main FILE` (RANK_MODULE), never the command line.
`allow_pipes` travels on the ranks' command line only, so no file can switch it on.

What the launcher and the ranks print is read by labavg.jobs.launcher_output; the events come
from the run's events.jsonl, as the ranks append them.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from labavg.base.errors import UserError
from labavg.base.events import Event, event_from_dict
from labavg.base.json_files import FLAG, NUMBER, OBJECT, TEXT, check_fields, load_json
from labavg.base.settings import to_dict
from labavg.base.waiting import Deadline, wait_until
from labavg.comm.launchers import end_with_parent
from labavg.jobs.job_outcome import JobFailed, last_steps, lost_ranks, srun_lost
from labavg.jobs.launcher_output import LauncherOutput
from labavg.jobs.run_json import RunSummary
from labavg.training.config import TrainConfig, check_values, config_from_dict

# True where the caller says an interruption itself, in one line for everything it ended
# (labavg.cli.signals): a job it started then ends without a line of its own.
interrupts_said_by_caller: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "labavg_interrupts_said_by_caller", default=False)

LAUNCH_FILE = ".launch.json"
# What JobRun writes; "since": the Unix time the command started (summary's process_seconds).
LAUNCH_FIELDS = {"config": OBJECT, "resume": FLAG, "stop_file": TEXT, "since": NUMBER}
RANK_MODULE = "labavg.jobs.rank_main"  # what a job's ranks run (`python -m`)
STOP_FILE = ".stop"
ELASTIC_STATE = ".elastic.json"  # an elastic job's lighthouse, workers and join socket, while it runs


def rank_config(path: str | Path) -> tuple[TrainConfig, bool, str | None, float | None]:
    """In a rank started by JobRun: (config, resume, stop file, since) from its launch file. The file
    is read back as any settings are: its shape and types checked, then every setting's rule
    (check_values), each refusal one line naming the file, before anything is trained."""
    path = Path(path)
    try:
        values = load_json(path)
    except FileNotFoundError:
        raise UserError(f"cannot read the launch file {path}: no such file") from None
    check_fields(values, LAUNCH_FIELDS, path, "launch file")
    unknown = [key for key in values if key not in LAUNCH_FIELDS]
    if unknown:
        raise UserError(f"{path}: unknown key {unknown[0]!r} in a launch file; known keys: "
                        f"{', '.join(LAUNCH_FIELDS)}"[:300])
    if values.get("config") is None:
        raise UserError(f"{path}: a launch file without its config")
    cfg = check_values(config_from_dict(values["config"], str(path)))
    return cfg, values.get("resume") is True, values.get("stop_file"), values.get("since")


def rank_argv(launch_file: Path, *, progress: bool, allow_pipes: bool) -> list[str]:
    """The arguments after `python` that run one rank of a job from its launch file."""
    return (["-m", RANK_MODULE, str(launch_file)] + ([] if progress else ["--no-progress"])
            + (["--allow-pipes"] if allow_pipes else []))


def job_command(cfg: TrainConfig, argv: list[str], *, hosts: str | None = None,
                slurm: bool = False) -> list[str]:
    """The command running `python *argv` as the job's ranks: mpiexec, torchrun, srun, or plain."""
    from labavg.comm.launchers import mpiexec_command, torchrun_command

    if slurm:
        from labavg.jobs.slurm import srun_command

        if hosts:
            raise UserError("--hosts is for mpiexec; under --launcher slurm the allocation "
                            "says which nodes run the ranks")
        return srun_command(cfg.ranks, argv, backend=cfg.backend)

    if cfg.backend == "mpi":
        return mpiexec_command(cfg.ranks, argv, hosts=hosts)
    if cfg.backend == "torch":
        if hosts:
            raise UserError("--hosts is for the mpi backend; start torchrun on every node instead")
        if cfg.on_rank_loss == "continue":
            from labavg.comm.launchers import elastic_command

            e = cfg.elastic
            return elastic_command(cfg.ranks, argv, min_workers=e.min_workers,
                                   heartbeat_ms=e.heartbeat_ms, join_timeout_ms=e.join_timeout_ms,
                                   state_file=str((Path(cfg.out) / ELASTIC_STATE).resolve()))
        return torchrun_command(cfg.ranks, argv)
    return [sys.executable, *argv]


class JobRun:
    """A job this process owns: the run directory's lock, the launch file, mpiexec/torchrun.

    What hydra prints about a failed job is replaced by one line naming the lost or failed
    rank; a message every rank printed is printed once (labavg.jobs.launcher_output).
    """

    def __init__(self, cfg: TrainConfig, *, resume: bool = False, allow_pipes: bool = False,
                 hosts: str | None = None, progress: bool = False, cwd: str | Path | None = None,
                 slurm: bool = False, since: float | None = None):
        from labavg.jobs.index import EVENTS, EventTail
        from labavg.jobs.run_dir import LOCK_HELD_ENV, run_dir_lock
        from labavg.jobs.runs import preflight

        self.cfg = cfg
        self.run_dir = Path(cfg.out) if cwd is None else Path(cwd) / cfg.out
        self.code: int | None = None
        self._tail = EventTail(self.run_dir / EVENTS)
        self._read: collections.deque[Event] = collections.deque()  # read, not yet yielded
        self._held = contextlib.ExitStack()
        self._held.enter_context(run_dir_lock(self.run_dir))
        try:
            if cwd is None:  # else the one rank checks, where its relative paths mean something
                preflight(cfg, resume=resume, allow_pipes=allow_pipes)
            launch_file = self.run_dir / LAUNCH_FILE
            self._stop_file = self.run_dir / STOP_FILE
            self._stop_file.unlink(missing_ok=True)
            from labavg.base.checkpoint import atomic_write_text

            atomic_write_text(launch_file, json.dumps(
                {"config": to_dict(cfg), "resume": resume,
                 "stop_file": str(self._stop_file.resolve()), "since": since}, indent=2) + "\n")
            self._held.callback(launch_file.unlink, missing_ok=True)
            self._held.callback(self._stop_file.unlink, missing_ok=True)
            argv = rank_argv(launch_file.resolve(), progress=progress, allow_pipes=allow_pipes)
            # The ranks import the labavg this process runs, whatever their working directory.
            here = str(Path(__file__).resolve().parents[1])
            path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
            env = {**os.environ, LOCK_HELD_ENV: str(self.run_dir.resolve()), "PYTHONPATH": path}
            self._proc = subprocess.Popen(
                job_command(cfg, argv, hosts=hosts, slurm=slurm), stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                preexec_fn=end_with_parent if sys.platform == "linux" else None)
        except BaseException:
            self._held.close()
            raise
        self._interrupted: int | None = None  # the signal this process was ended by
        # Set when the job has ended: a Thread.join that a signal interrupts can leave the
        # thread reported dead while it runs on (CPython gh-90882), so the ending is an Event.
        self._ended = threading.Event()
        self._output = LauncherOutput(torch=cfg.backend == "torch")
        # In a copy of this context, so that what the job prints goes where its starter's
        # output goes (a sweep's log under `labavg reproduce`).
        self._relay = threading.Thread(target=contextvars.copy_context().run,
                                       args=(self._relay_stderr,), daemon=True,
                                       name="labavg-job-stderr")
        self._relay.start()
        self._watch = threading.Thread(target=contextvars.copy_context().run, args=(self._follow,),
                                       daemon=True, name="labavg-job")
        self._watch.start()

    def _relay_stderr(self) -> None:
        for line in self._proc.stderr:
            shown = self._output.stderr_line(line)
            if shown is not None:
                sys.stderr.write(shown)
                sys.stderr.flush()

    def _follow(self) -> None:
        try:
            for line in self._proc.stdout:
                shown = self._output.stdout_line(line)
                if shown is not None:
                    sys.stdout.write(shown)
                    sys.stdout.flush()
            code = self._proc.wait()
            self._relay.join()
            output = self._output
            lost = (lost_ranks(self.run_dir, output.lost_pids)
                    or srun_lost(output.launcher_lines))
            signum = self._interrupted or output.interrupted_by(code, lost)
            if signum is not None:
                self._say_interrupted(signum)
                return
            self.code, text = output.closing(code, lost, _job_kind(self.cfg),
                                             lambda: last_steps(self.run_dir))
            sys.stderr.write(text)
        finally:
            try:
                self._held.close()
            finally:  # a lock that cannot be released (its directory removed) still ends the job
                self._ended.set()

    def _say_interrupted(self, signum: int) -> None:
        import signal

        self.code = 128 + signum
        if interrupts_said_by_caller.get():  # read in the context the job was started in
            return
        print(f"labavg: interrupted ({signal.Signals(signum).name}): every rank of the "
              f"{_job_kind(self.cfg)} job has ended; `labavg train --resume {self.cfg.out}` "
              f"continues it from its last checkpoint", file=sys.stderr, flush=True)

    def interrupt(self, signum: int, grace: float = 20.0, *, settle: float = 0.0) -> None:
        """End the job as Ctrl-C to its process group does, when this process alone got the
        signal: mpiexec/torchrun are told to end their ranks (SIGINT, then SIGKILL after
        `grace` seconds), and this returns once they have and the lock is released. With
        `settle`, the job is given that long to end by itself first (the signal may have
        reached its launcher too)."""
        import signal

        self._interrupted = signum
        if settle:
            self._ended.wait(settle)
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGINT)
        if not self._ended.wait(grace):
            self._proc.kill()
            self._ended.wait(grace)

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        deadline = Deadline(timeout)
        while True:
            ended = self._ended.is_set()
            self._read.extend(filter(None, map(event_from_dict, self._tail.read())))
            if self._read:
                while self._read:  # one at a time: a caller that stops early loses none
                    yield self._read.popleft()
                continue  # more may be there at once
            if ended:
                return
            if deadline.passed():
                raise TimeoutError(f"run {self.run_dir} still going after {timeout} s")
            # The ranks append to events.jsonl: a short wait between reads, cut short by the end.
            left = deadline.left()
            self._ended.wait(0.1 if left is None else min(0.1, left))

    def result(self, timeout: float | None = None) -> RunSummary | None:
        from labavg.jobs.index import SUMMARY
        from labavg.jobs.summary import load_summary

        # Short waits, so that Ctrl-C reaches the waiting (main) thread.
        if not wait_until(self._ended.is_set, timeout, 0.2, pause=self._ended.wait):
            raise TimeoutError(f"run {self.run_dir} still going after {timeout} s")
        if self.code != 0:
            raise JobFailed(self.run_dir, self.code if self.code is not None else -1,
                            self._output.reason())
        return load_summary(self.run_dir) if (self.run_dir / SUMMARY).is_file() else None

    def stop(self) -> None:
        # Every rank looks for the file at each averaging round and they agree to stop.
        if not self.done():
            self._stop_file.touch()

    def done(self) -> bool:
        return self._ended.is_set()


def _job_kind(cfg: TrainConfig) -> str:
    return {"mpi": "MPI", "torch": "torchrun"}.get(cfg.backend, "training")
