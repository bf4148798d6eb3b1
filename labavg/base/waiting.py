"""Waiting with a deadline: the one loop that polls something until it holds or time runs out.

Engines registering, processes ending, a run's thread or events finishing: each is a predicate
asked every `poll` seconds until it holds or the deadline passes. The deadline is on the
monotonic clock, so a wall-clock step (NTP, a suspended laptop) neither cuts nor stretches it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Deadline:
    """`seconds` from now (None: never), for loops that do more than ask one predicate."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self._end = None if seconds is None else time.monotonic() + seconds

    def passed(self) -> bool:
        return self._end is not None and time.monotonic() >= self._end

    def left(self) -> float | None:
        """Seconds until the deadline (0 once passed), or None for no deadline."""
        return None if self._end is None else max(0.0, self._end - time.monotonic())


def wait_until(predicate: Callable[[], T], timeout: float | None, poll: float = 0.1, *,
               pause: Callable[[float], Any] = time.sleep) -> T:
    """`predicate()`'s first true value, asked every `poll` seconds; its last (false) value once
    `timeout` seconds (None: no limit) have passed. It is asked at least once, and once more at
    the deadline, never in a later pause.

    `pause(seconds)` waits between asks: `time.sleep`, or a call that returns early when the
    awaited thing happens (`thread.join`), which keeps the loop short enough for Ctrl-C to
    reach the main thread without making the caller wait out the poll.
    """
    deadline = Deadline(timeout)
    while True:
        value = predicate()
        left = deadline.left()
        if value or left == 0:
            return value
        pause(poll if left is None else min(poll, left))
