"""A run going on a labavg.jobs.cluster.Cluster's engines, as the client sees it.

`Cluster._submit` returns a `ClusterRun`, with the handle's `events()`, `result()`, `stop()`
and `done`; labavg.jobs.launch.EnginesRun wraps it in the handle every way of starting a run
gives back. What runs inside the engines is labavg.jobs.engine.

Data messages: the client keeps only the latest value per key of each request's data, so
each batch of events goes under its own key `<run>/<seq>` and the client reassembles the
sequence (a missing sequence number is a gap). `<run>/alive` is a heartbeat that the engine's
publisher thread refreshes every `heartbeat` seconds even while training is stuck in a
collective, so a silent heartbeat means a dead or frozen process, not a slow step.
"""

from __future__ import annotations

import collections
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

from labavg.base.events import Event, event_from_dict
from labavg.base.waiting import Deadline
from labavg.jobs.run_json import RunSummary, as_summary
from labavg.jobs.engine import ALIVE
from labavg.jobs.processes import pid_alive

_ECHO_GRACE_SECONDS = 5.0
_POLL_SECONDS = 0.05


class RunError(RuntimeError):
    """A run failed on an engine: `rank` names it, `step` is the step of its last event."""

    def __init__(self, message: str, rank: int, step: int | None, remote_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.step = step
        self.remote_traceback = remote_traceback


class ClusterRun:
    """A run going on the cluster's engines: live events, stop, kill and its final summary."""

    def __init__(self, cluster, run_id: str, results, infos: list[dict[str, Any]],
                 *, silence_timeout: float):
        self.run_id = run_id
        self._cluster = cluster  # its labavg.jobs.cluster.Cluster (which imports this module)
        self._results = results  # one AsyncResult per rank
        self._infos = infos
        self._silence = silence_timeout
        self._size = len(infos)
        self._next_seq = [0] * self._size
        self._final: list[dict[str, Any] | None] = [None] * self._size
        self._last_step: list[int | None] = [None] * self._size
        self._beat = [(-1, time.monotonic())] * self._size  # (last beat number, when it changed)
        self._missing: dict[tuple[int, int], float] = {}
        self._lock = threading.Lock()
        self.history: list[dict[str, Any]] = []
        self._unread: collections.deque[Event] = collections.deque()  # taken in, not yet yielded
        self.latencies: list[float] = []  # seconds from event creation on its engine to its arrival
        self.gaps: list[tuple[int, int]] = []  # (rank, seq) of batches that never arrived
        self.error: RunError | None = None
        self._error_is_echo, self._echo_since = False, 0.0
        self.killed = False
        # When one rank dies, MPICH takes the others down within about a collective; a fast
        # liveness sweep records who went first, so the error names the rank that died.
        self._died_at: dict[int, tuple[int, int]] = {}  # rank -> (sweep number, last step)
        local = [rank for rank, info in enumerate(infos) if info["host"] == socket.gethostname()]
        threading.Thread(target=self._sweep, args=(local,), name=f"labavg-watch-{run_id}",
                         daemon=True).start()

    @property
    def done(self) -> bool:
        """Whether every rank finished (or the run failed or was killed)."""
        if self.killed or all(f is not None for f in self._final):
            return True
        # An echo waits a little for the report of the rank that met the error.
        return self.error is not None and (
            not self._error_is_echo or time.monotonic() - self._echo_since > _ECHO_GRACE_SECONDS)

    def refresh(self) -> None:
        """Take in what has arrived (its events wait for `events`), so that `done` is known."""
        self._unread.extend(filter(None, map(event_from_dict, self._arrived())))

    def _arrived(self) -> list[dict[str, Any]]:
        """Events that arrived since the last look, in order per rank (ranks one after another)."""
        with self._lock:
            now_wall, new = time.time(), []
            for rank in range(self._size):
                new += self._take(rank, now_wall)
            self.history += new
            if all(final is not None for final in self._final):
                for ar in self._results:  # the finished run's data entries are no longer needed
                    self._cluster.client.metadata.pop(ar.msg_ids[0], None)
            elif self.error is None and not self.killed:
                self._watch()
            return new

    def _sources(self, rank: int) -> list[dict[str, Any]]:
        """The data dicts the client's IO thread fills for this rank's request.

        The AsyncResult owns the request's metadata and drops it from `client.metadata` once
        the (immediate) reply is in; data messages arriving later land in a new entry there.
        """
        ar = self._results[rank]
        sources = [ar.data]
        later = self._cluster.client.metadata.get(ar.msg_ids[0])
        if later is not None and later["data"] is not sources[0]:
            sources.append(later["data"])
        return sources

    def _take(self, rank: int, now_wall: float) -> list[dict[str, Any]]:
        sources, events = self._sources(rank), []
        prefix = f"{self.run_id}/"
        while True:
            key = f"{prefix}{self._next_seq[rank]:09d}"
            batch = next((data.pop(key) for data in sources if key in data), None)
            if batch is None:
                later = [k for data in sources for k in list(data) if k.startswith(prefix)
                         and k[len(prefix):].isdigit() and int(k[len(prefix):]) > self._next_seq[rank]]
                if not later:
                    break
                # PUB/SUB keeps order, so a later batch with this one missing is a lost message;
                # give it a moment (the data dict is filled by the client's IO thread) then skip.
                key = (rank, self._next_seq[rank])
                first_seen = self._missing.setdefault(key, time.monotonic())
                if time.monotonic() - first_seen < 1.0:
                    break
                self.gaps.append(key)
                self._next_seq[rank] += 1
                continue
            self._next_seq[rank] += 1
            for event in batch["events"]:
                event["t_arrived"] = now_wall
                self.latencies.append(now_wall - event["t_created"])
                if "step" in event:
                    self._last_step[rank] = event["step"]
            events += batch["events"]
            if batch["final"] is not None:
                self._final[rank] = batch["final"]
                # A rank that only echoes another's start-up error (PeerFailed) is not the one
                # to name: the rank that met the error replaces it when its report arrives.
                echo = batch["final"].get("error", "").startswith("PeerFailed")
                if batch["final"]["status"] == "failed" and (
                        self.error is None or (self._error_is_echo and not echo)):
                    self._error_is_echo, self._echo_since = echo, time.monotonic()
                    self.error = RunError(
                        f"rank {rank} raised {batch['final']['error']}{self._at_step(rank)}",
                        rank, self._last_step[rank], batch["final"]["traceback"])
        return events

    def _at_step(self, rank: int) -> str:
        step = self._last_step[rank]
        return " before its first step" if step is None else f" (its last event was at step {step})"

    def _sweep(self, local_ranks: list[int], period: float = 0.02) -> None:
        """Record in which sweep each local engine process is first seen gone (until the run ends)."""
        sweep = 0
        while not self.done and not self._cluster.closed:
            for rank in local_ranks:
                if rank not in self._died_at and not pid_alive(self._infos[rank]["pid"]):
                    self._died_at[rank] = (sweep, self._last_step[rank] or 0)
            sweep += 1
            time.sleep(period)

    def _first_dead(self) -> int | None:
        """The rank that died first (ties, within one sweep: the one with the earliest last step)."""
        if not self._died_at:
            return None
        return min(self._died_at, key=lambda rank: self._died_at[rank])

    def _watch(self) -> None:
        """Fail the run when an engine cannot report any more: start error, death, silence."""
        dead = self._first_dead()
        if dead is not None:
            info = self._infos[dead]
            self.error = RunError(f"rank {dead} died (engine {info['engine_id']}, pid {info['pid']} "
                                  f"is gone){self._at_step(dead)}", dead, self._last_step[dead])
            self._error_is_echo = False
            return
        registered = set(self._cluster.client.ids)
        now = time.monotonic()
        for rank, info in enumerate(self._infos):
            if self._final[rank] is not None:
                continue
            reason = None
            ar = self._results[rank]
            if ar.done() and ar.exception() is not None:
                reason = f"could not start the run: {ar.exception()}"
            elif info["engine_id"] not in registered:
                reason = f"died (engine {info['engine_id']} unregistered from the controller)"
            else:
                beats = [data.get(f"{self.run_id}/{ALIVE}") for data in self._sources(rank)]
                beat = max((b["beat"] for b in beats if b is not None), default=-1)
                if beat != self._beat[rank][0]:
                    self._beat[rank] = (beat, now)
                elif now - self._beat[rank][1] > self._silence:
                    reason = f"went silent (no heartbeat for {now - self._beat[rank][1]:.0f} s)"
            if reason is not None:
                self.error = RunError(f"rank {rank} {reason}{self._at_step(rank)}", rank,
                                      self._last_step[rank])
                self._error_is_echo = False
                return

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """The run's events typed (labavg.base.events) as they arrive, until the run has ended,
        its last ones included; a failed run ends them without raising (`result` raises).
        TimeoutError after `timeout` s. `history` keeps them as they came (with `t_arrived`)."""
        deadline = Deadline(timeout)
        while True:
            finished = self.done
            self.refresh()
            while self._unread:  # one at a time: a caller that stops early loses none
                yield self._unread.popleft()
            if finished:
                return
            if deadline.passed():
                raise TimeoutError(f"run {self.run_id} still going after {timeout} s")
            # The engines' data messages land in dicts the client's IO thread fills: nothing
            # to block on, so a short sleep between looks.
            time.sleep(_POLL_SECONDS)

    def result(self, timeout: float | None = None) -> RunSummary | None:
        """Block until the run ends; rank 0's summary. RunError names a failed rank."""
        for _ in self.events(timeout):
            pass
        if self.killed:
            raise RunError(f"run {self.run_id} was killed", -1, None)
        if self.error is not None:
            raise self.error
        summary = self._final[0]["summary"]
        return None if summary is None else as_summary(summary)

    def stop(self) -> None:
        """Ask every rank to stop at the next averaging point (after a checkpoint); returns at once."""
        self._cluster.request_stop(self.run_id)

    def kill(self) -> None:
        """Hard-stop the run's engines and restart them, leaving the cluster usable."""
        with self._lock:
            self.killed = True
        self._cluster.restart()

    def latency(self) -> dict[str, float]:
        """Median and 95th percentile (seconds) from event creation on an engine to its arrival here."""
        values = sorted(self.latencies)
        if not values:
            return {"count": 0, "median": float("nan"), "p95": float("nan")}
        p95 = values[min(len(values) - 1, int(round(0.95 * (len(values) - 1))))]
        return {"count": len(values), "median": statistics.median(values), "p95": p95}
