"""labavg.jobs.processes: what the cluster and the tests use to see and end local processes."""

from __future__ import annotations

import subprocess
import sys
import time

from labavg.jobs.processes import pid_alive, signal_pids, wait_pids

_IGNORES_TERM = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                 "print(1, flush=True); time.sleep(60)")


def _sleeper(code: str = "import time; print(1, flush=True); time.sleep(60)") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()  # running its code (a TERM handler, if any, is in place)
    return proc


def test_a_running_process_is_alive_and_an_unreaped_one_is_not():
    proc = _sleeper("print(1, flush=True)")
    deadline = time.monotonic() + 10
    while pid_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is not None or not pid_alive(proc.pid)  # exited: a zombie until reaped
    proc.wait()
    sleeper = _sleeper()
    try:
        assert pid_alive(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not pid_alive(sleeper.pid)


def test_wait_pids_names_what_still_runs_and_signal_pids_ends_even_a_term_ignorer():
    polite, stubborn = _sleeper(), _sleeper(_IGNORES_TERM)
    try:
        assert wait_pids({polite.pid, stubborn.pid}, 0.2) == {polite.pid, stubborn.pid}
        started = time.monotonic()
        signal_pids([polite.pid, stubborn.pid], grace=0.5)
        assert time.monotonic() - started >= 0.5  # the ignorer sat out the grace, then SIGKILL
        # psutil reaps its children while it waits, so their exit statuses are not left to read
        assert not pid_alive(polite.pid) and not pid_alive(stubborn.pid)
        assert wait_pids({polite.pid, stubborn.pid}, 1.0) == set()
    finally:
        for proc in (polite, stubborn):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
