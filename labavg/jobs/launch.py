"""Starting a run: the one place that does it, whoever asks (CLI, sweeps, the reproduction,
the dashboard, notebooks).

`start_run(cfg)` returns a handle with `poll()` (the events that arrived since the last call,
as dicts), `stop()` (all ranks stop together at the next averaging round, with a checkpoint),
`wait()` (rank 0's summary) and `done()`. Three implementations:

    ThreadRun    the run in a thread of this process (backend inproc, or a 1-rank mpi run)
    JobRun       a job of processes under mpiexec (backend mpi) or torchrun (backend torch);
                 this process owns it: it holds the run directory's lock, checks what can be
                 checked once, and mpiexec/torchrun end when it dies, however it dies
    EnginesRun   the ranks of an ipyparallel cluster of MPI engines (labavg.jobs.cluster)

A job's configuration travels as a file (RUN_DIR/.launch.json, removed when the job ends),
never as re-parsed flags: its ranks run `python -m labavg.jobs.rank_main FILE` (RANK_MODULE),
never the command line. `allow_pipes` travels on the ranks' command line only, so no file can
switch it on.

Settings are validated here, once per start; the ranks read the launch file back as it is. A
caller naming problems before any start (the dashboard's form, a sweep's grid) validates
without starting and passes start_run what it built, not a validated copy.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Protocol

from labavg.training.config import TrainConfig, config_from_dict, validate
from labavg.base.settings import to_dict
from labavg.base.errors import UserError
from labavg.base.events import Event
from labavg.base.waiting import Deadline, wait_until
from labavg.jobs.run_json import RunSummary, as_summary
from labavg.jobs.job_outcome import JobFailed, last_steps, lost_ranks, srun_lost, status_of
from labavg.jobs.slurm import SRUN_LINE as _SRUN_LINE

LAUNCH_FILE = ".launch.json"
RANK_MODULE = "labavg.jobs.rank_main"  # what a job's ranks run (`python -m`)
STOP_FILE = ".stop"
LAUNCHERS = ("threads", "job", "engines", "slurm")


class RunHandle(Protocol):
    """What every way of running a configuration gives back."""

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """The run's typed events as they arrive (each once over all calls), until the run has
        ended, its last ones included; blocks between them. TimeoutError after `timeout` s."""

    def result(self, timeout: float | None = None) -> RunSummary | None:
        """Block until the run ends; rank 0's summary. Raises what ended a failed run."""

    def poll(self) -> list[dict[str, Any]]:
        """The events (dicts, labavg.base.events) that arrived since the last call."""

    def stop(self) -> None:
        """Ask every rank to stop at the next averaging round; returns at once."""

    def wait(self, timeout: float | None = None) -> dict[str, Any] | None:
        """Block until the run ends; rank 0's summary. Raises what ended a failed run."""

    def done(self) -> bool:
        """Whether the run has ended (finished, stopped or failed)."""


def start_run(cfg: TrainConfig, *, resume: bool = False, launcher: str | None = None,
              allow_pipes: bool = False, hosts: str | None = None, progress: bool = False,
              cwd: str | Path | None = None, cluster=None) -> RunHandle:
    """Start `cfg` (validated here) and return its handle at once; UserError if it cannot start.

    `launcher` None picks by backend: threads for inproc and a local 1-rank mpi run, a job
    for mpi and torch. `hosts` (MPICH host list) runs an mpi job on other machines. `cwd` runs
    the ranks in that directory (Kaldi resolves scp paths against it), as a job of one process
    when the backend needs no launcher. `cluster` (a labavg.jobs.cluster.Cluster) runs on its
    engines; without one, "engines" starts a cluster of cfg.ranks engines for the run.
    `allow_pipes` lets data files run commands; only the command line's --allow-pipes sets it.
    """
    cfg = validate(cfg)
    if launcher is None:
        launcher = "engines" if cluster is not None else _default_launcher(cfg, hosts, cwd)
    if launcher == "threads":
        if cwd is not None:
            raise UserError("cwd needs processes: a thread cannot have a working directory of its own")
        return ThreadRun(cfg, resume=resume, allow_pipes=allow_pipes, progress=progress)
    if launcher in ("job", "slurm"):  # slurm: srun in this allocation instead of mpiexec
        return JobRun(cfg, resume=resume, allow_pipes=allow_pipes, hosts=hosts, progress=progress,
                      cwd=cwd, slurm=launcher == "slurm")
    if launcher == "engines":
        return EnginesRun(cfg, resume=resume, cluster=cluster)
    raise UserError(f"unknown launcher {launcher!r}; choose one of {', '.join(LAUNCHERS)}")


def _default_launcher(cfg: TrainConfig, hosts: str | None, cwd: str | Path | None) -> str:
    if cfg.backend == "torch" or (cfg.backend == "mpi" and (cfg.ranks > 1 or hosts)):
        return "job"
    return "job" if cwd is not None else "threads"


# -- threads in this process ------------------------------------------------------------------


class ThreadRun:
    """`run_training` on a thread of this process; its events queued for `poll`."""

    def __init__(self, cfg: TrainConfig, *, resume: bool = False, allow_pipes: bool = False,
                 progress: bool = False):
        self.cfg = cfg
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._summary: dict[str, Any] | None = None
        self._error: BaseException | None = None
        self._drained = False  # events() has taken the run's last event
        self._thread = threading.Thread(
            target=self._run, args=(resume, allow_pipes, progress), daemon=True,
            name=f"labavg-run-{Path(cfg.out).name}")
        self._thread.start()

    def _run(self, resume: bool, allow_pipes: bool, progress: bool) -> None:
        from labavg.jobs.runs import run_training

        try:
            self._summary = run_training(self.cfg, resume=resume, progress=progress,
                                         on_event=self._events.put,
                                         should_stop=self._stop.is_set, allow_pipes=allow_pipes)
        except BaseException as exc:  # noqa: BLE001 - re-raised by result() on the caller's thread
            self._error = exc
        finally:
            self._events.put(_ENDED)

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        deadline = Deadline(timeout)
        while not self._drained:
            try:
                # Short gets, so that Ctrl-C reaches the waiting (main) thread.
                left = deadline.left()
                event = self._events.get(timeout=0.2 if left is None else min(0.2, left))
            except queue.Empty:
                if deadline.passed():
                    raise TimeoutError(f"run {self.cfg.out} still going after {timeout} s") from None
                continue
            if event is _ENDED:
                self._drained = True
            else:
                yield event

    def result(self, timeout: float | None = None) -> RunSummary | None:
        _join(self._thread, timeout, self.cfg.out)
        if self._error is not None:
            raise self._error
        return None if self._summary is None else as_summary(self._summary)

    def poll(self) -> list[dict[str, Any]]:
        new = _drain(self._events)
        self._drained = self._drained or _ENDED in new
        return [e.to_dict() for e in new if e is not _ENDED]

    def stop(self) -> None:
        self._stop.set()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> dict[str, Any] | None:
        summary = self.result(timeout)
        return None if summary is None else summary.to_dict()


_ENDED = object()  # queued after a ThreadRun's last event


def _drain(events: queue.SimpleQueue) -> list[dict[str, Any]]:
    out = []
    while True:
        try:
            out.append(events.get_nowait())
        except queue.Empty:
            return out


def _join(thread: threading.Thread, timeout: float | None, what: str) -> None:
    # Short joins, so that Ctrl-C reaches the waiting (main) thread.
    if not wait_until(lambda: not thread.is_alive(), timeout, 0.2, pause=thread.join):
        raise TimeoutError(f"run {what} still going after {timeout} s")


# -- a job of processes under mpiexec or torchrun ---------------------------------------------


def rank_config(path: str | Path) -> tuple[TrainConfig, bool, str | None]:
    """In a rank started by JobRun: (config, resume, stop file) from its launch file, as
    start_run validated it (only its types are checked again, as it is read back)."""
    path = Path(path)
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read the launch file {path}: {exc}") from None
    cfg = config_from_dict(values.get("config"), str(path))
    return cfg, bool(values.get("resume")), values.get("stop_file")


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
        return torchrun_command(cfg.ranks, argv)
    return [sys.executable, *argv]


class JobRun:
    """A job this process owns: the run directory's lock, the launch file, mpiexec/torchrun.

    What hydra prints about a failed job is replaced by one line naming the lost or failed
    rank; a message every rank printed is printed once.
    """

    def __init__(self, cfg: TrainConfig, *, resume: bool = False, allow_pipes: bool = False,
                 hosts: str | None = None, progress: bool = False, cwd: str | Path | None = None,
                 slurm: bool = False):
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
                 "stop_file": str(self._stop_file.resolve())}, indent=2) + "\n")
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
                preexec_fn=_end_with_parent if sys.platform == "linux" else None)
        except BaseException:
            self._held.close()
            raise
        self._interrupted: int | None = None  # the signal this process was ended by
        # Set when the job has ended: a Thread.join that a signal interrupts can leave the
        # thread reported dead while it runs on (CPython gh-90882), so the ending is an Event.
        self._ended = threading.Event()
        self._lost_pids: set[int] = set()
        self._errors: list[str] = []
        self._launcher_lines: list[str] = []
        self._in_traceback = False
        self._rank_said: list[str] = []  # why a rank ended the job ("labavg: rank R failed: ...")
        self._raised: str | None = None  # the first exception line of a rank's traceback
        self._relay = threading.Thread(target=self._relay_stderr, daemon=True,
                                       name="labavg-job-stderr")
        self._relay.start()
        self._watch = threading.Thread(target=self._follow, daemon=True, name="labavg-job")
        self._watch.start()

    def _relay_stderr(self) -> None:
        for line in self._proc.stderr:
            if line.startswith("labavg: error:"):
                # Every rank that met the same error says so: print it once.
                message = re.sub(r"^labavg: error: rank \d+: ", "labavg: error: ", line)
                if message in self._errors:
                    continue
                self._errors.append(message)
            elif line.startswith("labavg: rank "):
                # Folded into the job's one closing line, with where each rank got to.
                self._rank_said.append(_ENDING_THE_JOB.sub("", line.strip()[len("labavg: "):]))
                continue
            elif any(mark in line for mark in _HYDRA_NOISE):
                continue
            elif line.strip() == "labavg: interrupted":  # a rank's; the launcher says it once
                continue
            elif (_HYDRA_TRACE.match(line) or _SRUN_LINE.match(line)
                  or (self.cfg.backend == "torch" and self._torchrun_line(line))):
                # torchrun's own log lines and its ChildFailedError traceback too; a worker
                # it saw killed by a signal ("exitcode: -9") is a lost rank.
                self._lost_pids.update(int(p) for p in _TORCHRUN_SIGNALLED.findall(line))
                # Across hosts, the proxies and mpiexec trace how they noticed a lost process;
                # held back, and shown only if labavg cannot say which rank was lost.
                self._launcher_lines.append(line)
                continue
            if _EXCEPTION_LINE.match(line) and self._raised is None:
                self._raised = line.strip()  # a rank's traceback ends with what it raised
            sys.stderr.write(line)
            sys.stderr.flush()

    def _torchrun_line(self, line: str) -> bool:
        """Whether `line` is torchrun's: its log lines, and from a traceback on (its
        ChildFailedError and failure report are the last it prints); a rank's own ends the
        job through labavg's one line instead."""
        self._in_traceback = self._in_traceback or line.startswith("Traceback ")
        return self._in_traceback or bool(_TORCH_LOG.match(line))

    def _follow(self) -> None:
        try:
            for line in self._proc.stdout:
                # Hydra reports a lost process ("PID n RUNNING AT host") in a banner on stdout.
                self._lost_pids.update(int(p) for p in re.findall(r"PID (\d+) RUNNING", line))
                if any(line.startswith(mark) for mark in _HYDRA_NOISE) or (
                        _HYDRA_TRACE.match(line) and "Ctrl-C" in line):  # told to interrupt
                    continue
                sys.stdout.write(line)
                sys.stdout.flush()
            code = self._proc.wait()
            self._relay.join()
            lost = lost_ranks(self.run_dir, self._lost_pids) or srun_lost(self._launcher_lines)
            # Ended by a signal (Ctrl-C, or the launcher alone told to stop): not a failure. srun
            # also ends with 143 when it has killed the rest of a step after a rank was lost:
            # then the lost rank is the news.
            if self._interrupted is not None or (
                    code in _SIGNALLED and not (lost or self._rank_said or self._errors)):
                self._say_interrupted(self._interrupted or _SIGNALLED[code])
                return
            if code == 0 or not (lost or self._rank_said or self._errors):
                sys.stderr.writelines(self._launcher_lines)
            if code != 0 and self._errors:
                # What the ranks said decides: torchrun exits 1, and srun reports the peers it
                # killed (137), whatever status the rank that ended the job chose.
                code = status_of(self._errors)
            if code == 0:
                sys.stderr.writelines(f"labavg: {said}\n" for said in self._rank_said)
            elif not self._errors:
                said = "".join(f"{s}; " for s in self._rank_said[:1])
                self._errors.append(f"labavg: error: {said}the {_job_kind(self.cfg)} job failed "
                                    f"(exit status {code}); {lost}{last_steps(self.run_dir)}\n")
                sys.stderr.write(self._errors[-1])
            self.code = code
        finally:
            self._held.close()
            self._ended.set()

    def _say_interrupted(self, signum: int) -> None:
        import signal

        self.code = 128 + signum
        print(f"labavg: interrupted ({signal.Signals(signum).name}): every rank of the "
              f"{_job_kind(self.cfg)} job has ended; `labavg train --resume {self.cfg.out}` "
              f"continues it from its last checkpoint", file=sys.stderr, flush=True)

    def interrupt(self, signum: int, grace: float = 20.0) -> None:
        """End the job as Ctrl-C to its process group does, when this process alone got the
        signal: mpiexec/torchrun are told to end their ranks (SIGINT, then SIGKILL after
        `grace` seconds), and this returns once they have and the lock is released."""
        import signal

        self._interrupted = signum
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGINT)
        if not self._ended.wait(grace):
            self._proc.kill()
            self._ended.wait(grace)

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        from labavg.base.events import event_from_dict

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

        self._wait_ended(timeout)
        return load_summary(self.run_dir) if (self.run_dir / SUMMARY).is_file() else None

    def _wait_ended(self, timeout: float | None) -> None:
        # Short waits, so that Ctrl-C reaches the waiting (main) thread.
        if not wait_until(self._ended.is_set, timeout, 0.2, pause=self._ended.wait):
            raise TimeoutError(f"run {self.run_dir} still going after {timeout} s")
        if self.code != 0:
            # The first error a rank printed is the cause; later ones are its peers' consequences.
            said = [self._raised] + [e.strip().removeprefix("labavg: error: ") for e in self._errors]
            raise JobFailed(self.run_dir, self.code if self.code is not None else -1,
                            "; ".join(filter(None, said[:2])) or None)

    def poll(self) -> list[dict[str, Any]]:
        return self._tail.read()

    def stop(self) -> None:
        # Every rank looks for the file at each averaging round and they agree to stop.
        if not self.done():
            self._stop_file.touch()

    def done(self) -> bool:
        return self._ended.is_set()

    def wait(self, timeout: float | None = None) -> dict[str, Any] | None:
        summary = self.result(timeout)
        return None if summary is None else summary.to_dict()


# Exit statuses of a launcher ended by SIGINT or SIGTERM (130/143 from mpiexec and torchrun,
# -2/-15 from Popen when it died of the signal itself): the signal each stands for.
_SIGNALLED = {130: 2, 143: 15, -2: 2, -15: 15}


def _job_kind(cfg: TrainConfig) -> str:
    return {"mpi": "MPI", "torch": "torchrun"}.get(cfg.backend, "training")


def _end_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


# What hydra and MPICH print about a failed job, which labavg's own message replaces.
_HYDRA_NOISE = ("=====", "=   ", "This typically refers to a problem", "Please see the FAQ",
                "application called MPI_Abort")
# How a failed rank's line ends under each launcher: the closing line says what happened next.
_ENDING_THE_JOB = re.compile(r"; (exiting so torchrun ends the job|aborting all \d+ MPI ranks)$")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b: ")
_TORCH_LOG = re.compile(r"^\[?[IWEF]\d{4} \d\d:\d\d:\d\d")  # torch's glog-style lines
_TORCHRUN_SIGNALLED = re.compile(r"failed \(exitcode: -\d+\) local_rank: \d+ \(pid: (\d+)\)")
# hydra's own trace lines: "[proxy:0@host] ...", "[mpiexec@host] ...".
_HYDRA_TRACE = re.compile(r"^\[(proxy:\d+|mpiexec)@[^\]]*\] ")


# -- ipyparallel engines ----------------------------------------------------------------------


class EnginesRun:
    """The run on the MPI engines of a `labavg.jobs.cluster.Cluster` (one started for it if none)."""

    def __init__(self, cfg: TrainConfig, *, resume: bool = False, cluster=None):
        # Imported here: ipyparallel engines are optional and may be missing or broken.
        from labavg.jobs.cluster import Cluster

        self._owned = cluster is None
        self.cluster = Cluster.start(cfg.ranks) if cluster is None else cluster
        try:
            self.handle = self.cluster._submit(cfg, resume=resume)
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        if self._owned:
            self.cluster.shutdown()

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        return self.handle.events(timeout)

    def result(self, timeout: float | None = None) -> RunSummary | None:
        try:
            return self.handle.result(timeout)
        finally:
            self._release()

    def poll(self) -> list[dict[str, Any]]:
        return self.handle.poll()

    def stop(self) -> None:
        self.handle.stop()

    def done(self) -> bool:
        return self.handle.done

    def wait(self, timeout: float | None = None) -> dict[str, Any] | None:
        summary = self.result(timeout)
        return None if summary is None else summary.to_dict()
