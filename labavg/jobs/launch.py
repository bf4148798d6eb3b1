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
import queue
import threading
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
    """`run_training` on a thread of this process; its events queued for `events`."""

    def __init__(self, cfg: TrainConfig, *, resume: bool = False, allow_pipes: bool = False,
                 progress: bool = False):
        self.cfg = cfg
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._summary: RunSummary | None = None
        self._error: BaseException | None = None
        self._drained = False  # events() has taken the run's last event
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
        return self._summary

    def stop(self) -> None:
        self._stop.set()

    def done(self) -> bool:
        return not self._thread.is_alive()


_ENDED = object()  # queued after a ThreadRun's last event


def _join(thread: threading.Thread, timeout: float | None, what: str) -> None:
    # Short joins, so that Ctrl-C reaches the waiting (main) thread.
    if not wait_until(lambda: not thread.is_alive(), timeout, 0.2, pause=thread.join):
        raise TimeoutError(f"run {what} still going after {timeout} s")


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
