"""One way to wait: wait_until and Deadline (labavg.base.waiting), and wait_pids built on it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from labavg.base.waiting import Deadline, wait_until
from labavg.jobs.processes import wait_pids


def test_wait_until_returns_the_first_true_value():
    asked = []

    def third_time() -> str:
        asked.append(time.monotonic())
        return "ready" if len(asked) == 3 else ""

    assert wait_until(third_time, 10, poll=0.01) == "ready"
    assert len(asked) == 3


def test_wait_until_gives_the_last_false_value_at_the_deadline_and_no_later():
    asked = []
    start = time.monotonic()
    assert wait_until(lambda: asked.append(1) or len(asked) * 0, 0.3, poll=0.05) == 0
    waited = time.monotonic() - start
    # Asked again at the deadline, not a poll later; bounds loose for a loaded machine.
    assert 0.3 <= waited < 2.0 and len(asked) >= 2


def test_wait_until_asks_once_when_there_is_no_time():
    asked = []
    assert wait_until(lambda: asked.append(1), 0, poll=5) is None
    assert asked == [1]


def test_no_timeout_waits_as_long_as_it_takes():
    values = iter([None, None, None, 0, 42])
    assert wait_until(lambda: next(values), None, poll=0.001) == 42


def test_a_pause_that_returns_early_ends_the_wait_when_the_thing_happens():
    # thread.join as the pause: the wait ends when the thread does, not a whole poll later.
    thread = threading.Thread(target=time.sleep, args=(0.2,))
    thread.start()
    start = time.monotonic()
    assert wait_until(lambda: not thread.is_alive(), 30, poll=20, pause=thread.join)
    assert time.monotonic() - start < 10


def test_deadline():
    never = Deadline(None)
    assert not never.passed() and never.left() is None
    soon = Deadline(0.05)
    assert not soon.passed() and 0 < soon.left() <= 0.05
    time.sleep(0.06)
    assert soon.passed() and soon.left() == 0


def test_wait_pids_counts_an_unreaped_process_as_gone_and_leaves_it_to_its_parent():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    start = time.monotonic()
    assert wait_pids({proc.pid}, 30) == set()  # gone once it exits, a zombie until reaped
    assert time.monotonic() - start < 20
    # Not reaped by wait_pids (psutil.wait_procs would have): its parent still gets its status.
    assert proc.wait(timeout=10) == 3
