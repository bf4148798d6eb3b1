"""Starting a run: the one place that does it, whoever asks (CLI, sweeps, the reproduction,
the dashboard, notebooks).

`start_run(cfg)` returns a handle (RunHandle) at once: `events()` yields the run's typed events
(labavg.base.events) as they arrive until it has ended, `result()` blocks until then and
returns rank 0's RunSummary (labavg.jobs.run_json) or raises what ended a failed run, `stop()`
asks all ranks to stop together at the next averaging round (with a checkpoint), `done()` says
whether it has ended. A caller follows a run through these; none polls. Three implementations:

    ThreadRun    the run in a thread of this process (backend inproc, or a 1-rank mpi run)
    JobRun       a job of processes under mpiexec, torchrun or srun (labavg.jobs.job_run);
                 this process owns it
    EnginesRun   the ranks of an ipyparallel cluster of MPI engines (labavg.jobs.cluster)

Settings are validated here, once per start; a job's ranks read its launch file back as it is.
A caller naming problems before any start (the dashboard's form, a sweep's grid) validates
without starting and passes start_run what it built, not a validated copy.
"""

from __future__ import annotations

import contextvars
import ctypes
import queue
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from labavg.base.errors import UserError
from labavg.base.events import Event
from labavg.base.waiting import Deadline, wait_until
from labavg.jobs.job_run import JobRun
from labavg.jobs.run_json import RunSummary
from labavg.training.config import TrainConfig, validate

LAUNCHERS = ("threads", "job", "engines", "slurm")


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached a long command (labavg.cli.signals): a KeyboardInterrupt, so
    that every `finally` and every KeyboardInterrupt path (an MPI rank's abort) runs as for
    Ctrl-C, which names its signal."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def importing(frame) -> bool:
    """Whether `frame` runs inside an import. An exception raised there leaves the module half
    made in sys.modules (torch, half imported, crashes the next import of it with SIGSEGV), so
    an interruption waits until the import is over."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def signal_of(exc: BaseException) -> int:
    """The signal an interruption came from (Ctrl-C's SIGINT unless it says otherwise)."""
    return getattr(exc, "signum", signal.SIGINT)


class RunHandle(Protocol):
    """What every way of running a configuration gives back."""

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """The run's typed events as they arrive (each once over all calls), until the run has
        ended, its last ones included; blocks between them. TimeoutError after `timeout` s."""

    def result(self, timeout: float | None = None) -> RunSummary | None:
        """Block until the run ends; rank 0's summary. Raises what ended a failed run."""

    def stop(self) -> None:
        """Ask every rank to stop at the next averaging round; returns at once."""

    def done(self) -> bool:
        """Whether the run has ended (finished, stopped or failed)."""


def start_run(cfg: TrainConfig, *, resume: bool = False, launcher: str | None = None,
              allow_pipes: bool = False, hosts: str | None = None, progress: bool = False,
              cwd: str | Path | None = None, cluster=None, since: float | None = None) -> RunHandle:
    """Start `cfg` (validated here) and return its handle at once; UserError if it cannot start.

    `launcher` None picks by backend: threads for inproc and a local 1-rank mpi run, a job
    for mpi and torch. `hosts` (MPICH host list) runs an mpi job on other machines. `cwd` runs
    the ranks in that directory (Kaldi resolves scp paths against it), as a job of one process
    when the backend needs no launcher. `cluster` (a labavg.jobs.cluster.Cluster) runs on its
    engines; without one, "engines" starts a cluster of cfg.ranks engines for the run.
    `allow_pipes` lets data files run commands; only the command line's --allow-pipes sets it.
    `since` is the Unix time the run was asked for, which its summary's process_seconds
    counts from: the command line passes its process's start; default now.
    """
    since = time.time() if since is None else since
    cfg = validate(cfg)
    if _ending:  # an interrupted command ends its runs (end_runs): none starts after that
        raise Interrupted(_ending[0])
    if launcher is None:
        launcher = "engines" if cluster is not None else _default_launcher(cfg, hosts, cwd)
    if launcher == "threads":
        if cwd is not None:
            raise UserError("cwd needs processes: a thread cannot have a working directory of its own")
        return _live(ThreadRun(cfg, resume=resume, allow_pipes=allow_pipes, progress=progress,
                               since=since))
    if launcher in ("job", "slurm"):  # slurm: srun in this allocation instead of mpiexec
        return _live(JobRun(cfg, resume=resume, allow_pipes=allow_pipes, hosts=hosts,
                            progress=progress, cwd=cwd, slurm=launcher == "slurm", since=since))
    if launcher == "engines":
        return _live(EnginesRun(cfg, resume=resume, cluster=cluster))
    raise UserError(f"unknown launcher {launcher!r}; choose one of {', '.join(LAUNCHERS)}")


# Every run this process started and has not seen end: what an interrupted command ends before
# it exits (`end_runs`). Held strongly: a caller's frame that an interruption unwound has
# dropped its handle, and its run goes on all the same.
_LIVE: list[RunHandle] = []
_LIVE_LOCK = threading.Lock()
# The signal end_runs was called for, once it has been: the process is ending, and a thread
# about to start its next run (a sweep's next point) is refused instead.
_ending: list[int] = []


def _live(handle):
    with _LIVE_LOCK:
        ending = list(_ending)
        if not ending:
            _LIVE[:] = [h for h in _LIVE if not h.done()] + [handle]
    if ending:  # started while end_runs ended the others: ended too
        getattr(handle, "interrupt", lambda signum: handle.stop())(ending[0])
        raise Interrupted(ending[0])
    return handle


JOB_SETTLE_SECONDS = 3.0


def end_runs(signum: int, grace: float = 20.0) -> None:
    """End every run this process started that is still going, and wait until each has: its
    threads joined (ThreadRun) or its processes gone and its lock released (JobRun).

    The one way an interrupted command stops its work, wherever it waited for it (a sweep's
    point, a reproduction's sweep threads): a thread left running into interpreter shutdown
    ends the process with "terminate called without an active exception" (SIGABRT), and a job
    left behind would hold its run directory's lock."""
    with _LIVE_LOCK:
        _ending[:] = [signum]
        handles = [h for h in _LIVE if not h.done()]
    for handle in handles:
        if isinstance(handle, JobRun):
            # A Ctrl-C to the process group reached the job's launcher too: a second signal
            # while torchrun shuts its workers down breaks its logging ("--- Logging error
            # ---"). Only a job still going after a moment had the signal sent to us alone.
            handle.interrupt(signum, grace, settle=JOB_SETTLE_SECONDS)
            continue
        interrupt = getattr(handle, "interrupt", None)
        if interrupt is not None:
            interrupt(signum, grace)
        else:  # engines: a stop at the next round, with a checkpoint
            handle.stop()


def _default_launcher(cfg: TrainConfig, hosts: str | None, cwd: str | Path | None) -> str:
    if cfg.backend == "torch" or (cfg.backend == "mpi" and (cfg.ranks > 1 or hosts)):
        return "job"
    return "job" if cwd is not None else "threads"


# -- threads in this process ------------------------------------------------------------------


class ThreadRun:
    """`run_training` on a thread of this process; its events queued for `events`."""

    def __init__(self, cfg: TrainConfig, *, resume: bool = False, allow_pipes: bool = False,
                 progress: bool = False, since: float | None = None):
        self.cfg = cfg
        self._since = since
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._summary: RunSummary | None = None
        self._error: BaseException | None = None
        self._drained = False  # events() has taken the run's last event
        # Set when the run has ended: a Thread.join that a signal interrupts can leave the
        # thread reported dead while it runs on (CPython gh-90882), so the ending is an Event.
        self._ended = threading.Event()
        # In a copy of this context, so that what the run prints goes where its starter's
        # output goes (a sweep's log under `labavg reproduce`).
        self._thread = threading.Thread(
            target=contextvars.copy_context().run, args=(self._run, resume, allow_pipes, progress),
            daemon=True, name=f"labavg-run-{Path(cfg.out).name}")
        self._thread.start()

    def _run(self, resume: bool, allow_pipes: bool, progress: bool) -> None:
        from labavg.jobs.runs import run_training

        try:
            self._summary = run_training(self.cfg, resume=resume, progress=progress,
                                         on_event=self._events.put,
                                         should_stop=self._stop.is_set, allow_pipes=allow_pipes,
                                         since=self._since)
        except BaseException as exc:  # noqa: BLE001 - re-raised by result() on the caller's thread
            self._error = exc
        finally:
            self._events.put(_ENDED)
            self._ended.set()

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
        # Short waits, so that Ctrl-C reaches the waiting (main) thread.
        if not wait_until(self._ended.is_set, timeout, 0.2, pause=self._ended.wait):
            raise TimeoutError(f"run {self.cfg.out} still going after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._summary

    def stop(self) -> None:
        self._stop.set()

    def done(self) -> bool:
        return self._ended.is_set()

    def interrupt(self, signum: int = signal.SIGINT, grace: float = 20.0) -> None:
        """End the run now, as Ctrl-C ends a run in the main thread: KeyboardInterrupt is
        raised in its thread, once, where it next runs Python code (not inside an import), its
        ranks are aborted and its generators closed there (labavg.jobs.runs), and this returns
        once the thread has ended, or after `grace` seconds. The run resumes from its last
        checkpoint. `signum` is for the interface JobRun shares; a thread has no signal."""
        import sys

        ident = self._thread.ident
        deadline = Deadline(grace)
        # Not inside an import (see `importing`): the thread's first one is torch's.
        while not self._ended.is_set() and importing(sys._current_frames().get(ident)) \
                and not deadline.passed():
            self._ended.wait(0.05)
        if ident is not None and not self._ended.is_set():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident),
                                                       ctypes.py_object(KeyboardInterrupt))
        if self._ended.wait(deadline.left()):
            self._thread.join(grace)  # what is left of it: returning from its function


_ENDED = object()  # queued after a ThreadRun's last event


# -- ipyparallel engines ----------------------------------------------------------------------


class EnginesRun:
    """The run on the MPI engines of a `labavg.jobs.cluster.Cluster` (one started for it if
    none, shut down once `result()` has seen the run end)."""

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
            summary = self.handle.result(timeout)
        except TimeoutError:
            raise  # still going: its engines stay
        except BaseException:
            self._release()
            raise
        self._release()
        return summary

    def stop(self) -> None:
        self.handle.stop()

    def done(self) -> bool:
        return self.handle.done
