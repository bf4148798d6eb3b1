"""A run another process writes, followed from its directory: what the dashboard shows of a
run started elsewhere (another server, a terminal, a job), for which this process has no
handle. Its config.json appears with rank 0's first event, its events.jsonl grows, and its
summary.json is written after the last event: the run has ended.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from pathlib import Path

from labavg.base.errors import UserError
from labavg.base.events import Event, event_from_dict
from labavg.jobs.index import CONFIG, EVENTS, SUMMARY, EventTail
from labavg.jobs.run_json import read_run_config
from labavg.training.config import TrainConfig

# How long a follower waits for the run directory to grow before it looks again: another
# process writes it, so there is nothing to block on.
LOOK_EVERY_S = 0.2
# Bytes of events.jsonl one look takes: a long run's log comes in pieces, so that its first
# events are handed on while the rest is read.
LOOK_BYTES = 1 << 20


class FollowedRun:
    """The run in `run_dir`, as its directory shows it, until `close()` (from any thread) or
    until `closed` is set (an Event of the caller's: the page follows something else)."""

    def __init__(self, run_dir: str | Path, closed: threading.Event | None = None) -> None:
        self.run_dir = Path(run_dir)
        self._tail = EventTail(self.run_dir / EVENTS)
        self._read: collections.deque[Event] = collections.deque()  # read, not yet yielded
        self._closed = threading.Event() if closed is None else closed

    def config(self) -> TrainConfig | None:
        """The run's configuration once config.json can be read; None if closed first."""
        while not self._closed.is_set():
            try:
                return read_run_config(self.run_dir / CONFIG)
            except (OSError, UserError):
                self._closed.wait(LOOK_EVERY_S)  # rank 0 writes it with its first event
        return None

    def events(self) -> Iterator[Event]:
        """The run's events (typed) as they are written, until its summary is written and
        every event read, or until closed."""
        while not self._closed.is_set():
            ended = self.done()  # before the read: no event is written after the summary
            chunk = self._tail.read(LOOK_BYTES)
            self._read.extend(filter(None, map(event_from_dict, chunk)))
            while self._read and not self._closed.is_set():  # a caller stopping loses none
                yield self._read.popleft()
            if chunk:
                continue
            if ended:
                return
            self._closed.wait(LOOK_EVERY_S)

    def done(self) -> bool:
        """Whether the run has ended (its summary.json is written)."""
        return (self.run_dir / SUMMARY).is_file()

    def close(self) -> None:
        """Stop following: `config` and `events` return (the run itself goes on)."""
        self._closed.set()
