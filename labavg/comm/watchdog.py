"""The watchdog: a rank that goes silent ends the job instead of hanging it.

A blocking collective waits for every rank, so one stopped, hung or lost process would keep
all the others spinning in their next allreduce for ever (MPI has no timeout; torch's is 300 s).
Each rank of a process backend runs a `Watchdog` thread beside its trainer:

- the trainer beats it at every event and every collective (`WatchedCommunicator` wraps the
  real communicator, so the trainer itself knows nothing of this);
- long local work says that it is moving, whatever backend watches it: `progress()` at each
  step of it (a minibatch, a CV batch), `busy()` around one long call that cannot (a checkpoint
  written); both reach the watcher of the calling thread (this Watchdog, or an in-process
  rank's group, labavg.comm.inproc), and do nothing where none watches;
- a rank whose own main thread makes no progress for `limit` seconds outside a collective (a
  hung step, the `hang` fault) ends the job naming itself;
- a rank that has waited `limit` seconds inside one collective looks at its peers' heartbeat
  files (RUN_DIR/heartbeat/rankR.json, rewritten every second by each rank's watchdog thread):
  peers whose file has not changed for `limit` seconds (a SIGSTOPped or frozen process, a lost
  node) are named and the job is ended; peers still beating and computing are waited for. With
  no run directory there are no heartbeat files and the wait itself ends the job.

Staleness is judged by each rank's own monotonic clock (a heartbeat counter that stopped
changing), never by comparing wall clocks of different hosts. The job is ended through the
communicator's `abort` (MPI_Abort, or process exit under torchrun), which is safe from this
thread: labavg's MPI runs at MPI_THREAD_MULTIPLE.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

T = TypeVar("T")

if TYPE_CHECKING:  # annotations only: a job's launcher reads HEARTBEAT_DIR without torch
    import torch

HEARTBEAT_DIR = "heartbeat"
TICK_SECONDS = 1.0
# A verdict must still hold this long before the job is ended: after the whole job was stopped
# and continued (SIGSTOP/SIGCONT, a debugger) every clock has jumped, and the ranks need a
# moment to show that they are moving again.
CONFIRM_SECONDS = 5.0
EXIT_WATCHDOG = 3  # exit status of a job ended by the watchdog (2 is a user error)


class ProgressWatcher(Protocol):
    """What watches one thread's rank: told of its progress and of long work it is busy with."""

    def progress(self) -> None: ...

    def busy(self, on: bool) -> None: ...


_watched = threading.local()  # .watcher: the ProgressWatcher of this thread's rank, if any


def watch_thread(watcher: ProgressWatcher | None) -> None:
    """Make `watcher` the one `progress()` and `busy()` reach from the calling thread (None:
    no longer watched). A rank's trainer runs on one thread: a process's main thread, or an
    in-process rank's own."""
    _watched.watcher = watcher


def progress() -> None:
    """The calling rank made progress in long local work (a step, a CV batch). Where its
    watcher is an in-process group that was aborted, this raises, so that an interrupted or
    failed run's ranks stop at their next batch instead of at the end of the pass."""
    watcher = getattr(_watched, "watcher", None)
    if watcher is not None:
        watcher.progress()


def beating(items: Iterable[T]) -> Iterator[T]:
    """`items`, with `progress()` before each: a pass over batches beats once a batch."""
    for item in items:
        progress()
        yield item


@contextlib.contextmanager
def busy() -> Iterator[None]:
    """The calling rank computes or writes for a while without a point to say `progress()`
    (one checkpoint written): its own watchdog does not take that time for a hung step, and
    its peers still judge it by its heartbeat, which goes on while its process lives. A
    frozen or lost process, and a rank waiting in a collective, are judged as before."""
    watcher = getattr(_watched, "watcher", None)
    if watcher is None:
        yield
        return
    watcher.busy(True)
    try:
        yield
    finally:
        watcher.busy(False)


class Watchdog:
    """Watches one rank's progress and its peers' heartbeats; ends the job when one goes silent."""

    def __init__(self, comm: Any, limit: float, run_dir: Path | None = None,
                 tick: float = TICK_SECONDS):
        self.comm = comm
        self.limit = float(limit)
        self.tick = tick
        self.dir = Path(run_dir) / HEARTBEAT_DIR if run_dir is not None else None
        self._lock = threading.Lock()
        self._step = 0
        self._beat = time.monotonic()
        self._armed = False  # no "hung step" verdicts before the first collective is over
        self._collective: str | None = None
        self._collective_since = 0.0
        self._suspended = False  # the main thread is in the consumer's code, not the trainer's
        self._busy = 0  # depth of busy() blocks the main thread is in
        self._count = 0
        self._peers: dict[int, tuple[Any, float]] = {}  # rank -> (last count seen, when it changed)
        self._silent: list[dict[str, Any]] = []  # heartbeats of the peers last found silent
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="labavg-watchdog", daemon=True)

    # -- called by the rank's main thread -----------------------------------------------------

    def start(self) -> "Watchdog":
        """Start watching the calling thread (the rank's trainer runs on it)."""
        if self.dir is not None and self.dir.parent.is_dir():
            # Never creates the run directory itself: that is its lock holder's, which
            # removes it again if the job fails to start.
            self.dir.mkdir(exist_ok=True)
        self._write_heartbeat()
        self._thread.start()
        watch_thread(self)
        return self

    def progress(self) -> None:
        self.beat()

    def busy(self, on: bool) -> None:
        with self._lock:
            self._busy += 1 if on else -1
            self._beat = time.monotonic()  # the work's time is counted from its end

    def beat(self, step: int | None = None) -> None:
        """The main thread made progress (an event, a finished collective)."""
        with self._lock:
            self._beat = time.monotonic()
            if step is not None:
                self._step = step

    def suspend(self) -> None:
        """The trainer handed an event to its consumer: that time is not the trainer's to account for."""
        with self._lock:
            self._suspended = True

    def resume(self) -> None:
        with self._lock:
            self._suspended = False
            self._beat = time.monotonic()

    def enter(self, name: str) -> None:
        with self._lock:
            self._collective = name
            self._collective_since = time.monotonic()

    def leave(self) -> None:
        with self._lock:
            self._collective = None
            self._beat = time.monotonic()
            self._armed = True

    def close(self, job_ends: bool = False) -> None:
        """Stop watching; `job_ends`: this rank is about to end the whole job (an abort), so
        no other rank will remove its own heartbeat: this one removes them all."""
        if getattr(_watched, "watcher", None) is self:
            watch_thread(None)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5 * self.tick)
        if job_ends:
            self._remove_heartbeats()
        elif self.dir is not None:
            (self.dir / f"rank{self.comm.rank}.json").unlink(missing_ok=True)
            try:
                self.dir.rmdir()  # the last rank out removes the folder
            except OSError:
                pass

    # -- the watchdog thread ------------------------------------------------------------------

    def _run(self) -> None:
        suspect = None  # when the current verdict was first reached
        while not self._stop.wait(self.tick):
            self._count += 1
            self._write_heartbeat()
            now = time.monotonic()
            verdict = self.check(now)
            if verdict is None:
                suspect = None
            elif suspect is None:
                suspect = now
            elif now - suspect >= CONFIRM_SECONDS:
                self._end(verdict)
                return

    def check(self, now: float) -> str | None:
        """The reason to end the job now, or None. Pure but for reading peers' heartbeats."""
        with self._lock:
            collective, since, beat, step, armed = (
                self._collective, self._collective_since, self._beat, self._step,
                self._armed and not self._suspended and not self._busy)
        if collective is None:
            if armed and now - beat > self.limit:
                return (f"rank {self.comm.rank} made no progress for {now - beat:.0f} s after "
                        f"step {step} (watchdog_seconds = {self.limit:g})")
            return None
        if now - since <= self.limit:
            return None
        peers = self._read_peers(now)
        if peers is None:
            return (f"rank {self.comm.rank} waited {now - since:.0f} s in {collective} at step "
                    f"{step}; the other ranks did not arrive (watchdog_seconds = {self.limit:g})")
        silent = [(r, info) for r, (info, stale) in sorted(peers.items()) if stale > self.limit]
        self._silent = [info for _, info in silent if isinstance(info, dict)]
        if silent:
            names = ", ".join(
                f"rank {r}" + (f" (pid {info['pid']} on {info['host']}, last step {info['step']})"
                               if isinstance(info, dict) else " (no heartbeat)")
                for r, info in silent)
            return (f"{names} silent for over {self.limit:g} s while rank {self.comm.rank} waited "
                    f"in {collective} at step {step} (watchdog_seconds = {self.limit:g})")
        waiting = all(isinstance(info, dict) and info.get("collective") for info, _ in peers.values())
        if waiting and now - since > 2 * self.limit:
            return (f"every rank has waited over {self.limit:g} s in a collective at step {step}: "
                    f"the ranks called different collectives")
        return None

    def _read_peers(self, now: float) -> dict[int, tuple[Any, float]] | None:
        """rank -> (its heartbeat, seconds since it last changed), for every other rank."""
        if self.dir is None:
            return None
        out = {}
        for rank in range(self.comm.size):
            if rank == self.comm.rank:
                continue
            info = _read_json(self.dir / f"rank{rank}.json")
            count = info.get("count") if isinstance(info, dict) else None
            last, changed = self._peers.get(rank, (None, now))
            if count != last or rank not in self._peers:
                changed = now
            self._peers[rank] = (count, changed)
            out[rank] = (info, now - changed)
        return out

    def _write_heartbeat(self) -> None:
        if self.dir is None:
            return
        with self._lock:
            info = {"rank": self.comm.rank, "pid": os.getpid(), "host": socket.gethostname(),
                    "step": self._step, "collective": self._collective, "count": self._count}
        path = self.dir / f"rank{self.comm.rank}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            # Only into the folder start() made: once a rank ending the job has removed it,
            # the others' last beats do not make it again.
            # Never through a link planted in the run directory (O_NOFOLLOW).
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(info))
            os.replace(tmp, path)
        except OSError:
            pass  # a full or vanished disk must not kill training; peers will see us as stale

    def _end(self, reason: str) -> None:
        print(f"labavg: error: watchdog: {reason}; ending the job", file=sys.stderr, flush=True)
        _kill_frozen(self._silent)
        self._remove_heartbeats()  # the job ends here: no rank's close() will
        self.comm.abort(reason, EXIT_WATCHDOG, quiet=True)


    def _remove_heartbeats(self) -> None:
        if self.dir is None:
            return
        for rank in range(self.comm.size):
            (self.dir / f"rank{rank}.json").unlink(missing_ok=True)
        try:
            self.dir.rmdir()
        except OSError:
            pass  # a peer wrote once more: its folder is judged fresh by the next job anyway


def _kill_frozen(silent: list[dict[str, Any]]) -> None:
    """SIGKILL the silent peers on this host: a stopped process ignores the SIGTERM that
    torchrun sends when a rank exits, and torchrun waits 30 s more before its SIGKILL."""
    import signal

    here = socket.gethostname()
    for info in silent:
        pid = info.get("pid")
        if info.get("host") == here and isinstance(pid, int) and pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass  # already gone, or not ours


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class WatchedCommunicator:
    """A communicator whose collectives tell the watchdog when this rank is waiting in one."""

    def __init__(self, comm: Any, watchdog: Watchdog):
        self._comm = comm
        self._watchdog = watchdog
        self.rank, self.size, self.local_rank = comm.rank, comm.size, comm.local_rank

    def _call(self, name: str, fn, *args, **kwargs):
        self._watchdog.enter(name)
        try:
            return fn(*args, **kwargs)
        finally:
            self._watchdog.leave()

    def allreduce_mean(self, buf: torch.Tensor) -> None:
        self._call("allreduce", self._comm.allreduce_mean, buf)

    def iallreduce_mean(self, buf: torch.Tensor) -> "_WatchedPending":
        # Starting can block too (inproc copies; MPI may progress), and the wait is where a
        # lost peer shows: both count as waiting in a collective.
        return _WatchedPending(self, self._call("iallreduce", self._comm.iallreduce_mean, buf))

    def broadcast(self, buf: torch.Tensor, root: int = 0) -> None:
        self._call("broadcast", self._comm.broadcast, buf, root)

    def allgather(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        self._call("allgather", self._comm.allgather, send, recv)

    def sendrecv(self, send: torch.Tensor | None, dst: int, recv: torch.Tensor | None,
                 src: int) -> None:
        # One reduce algorithm's step: a wait on a peer like a collective's.
        self._call("sendrecv", self._comm.sendrecv, send, dst, recv, src)

    def barrier(self) -> None:
        self._call("barrier", self._comm.barrier)

    def idle_barrier(self) -> None:
        self._call("barrier", self._comm.idle_barrier)

    def split(self, color: int, key: int = 0) -> "WatchedCommunicator":
        return WatchedCommunicator(self._call("split", self._comm.split, color, key),
                                   self._watchdog)

    def node_color(self) -> int | None:
        return self._call("node_color", self._comm.node_color)

    def abort(self, reason: str, code: int = 1, quiet: bool = False) -> None:
        self._comm.abort(reason, code, quiet=quiet)

    def close(self) -> None:
        self._comm.close()


class _WatchedPending:
    """A non-blocking mean whose wait tells the watchdog, as a blocking collective does."""

    def __init__(self, comm: WatchedCommunicator, pending: Any) -> None:
        self._comm, self._pending = comm, pending

    def wait(self) -> None:
        self._comm._call("iallreduce wait", self._pending.wait)
