"""Local processes of a cluster: liveness checks and ending them (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import signal
import time


def pid_alive(pid: int) -> bool:
    """Whether the process runs; a zombie (ended, not yet reaped by its parent) counts as gone."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_pids(pids: set[int], timeout: float) -> set[int]:
    """Wait up to `timeout` s for the processes to end; the pids still running then."""
    deadline = time.monotonic() + timeout
    alive = {pid for pid in pids if pid_alive(pid)}
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = {pid for pid in alive if pid_alive(pid)}
    return alive


def signal_pids(pids: list[int], grace: float = 3.0) -> None:
    """SIGTERM the processes, then SIGKILL whatever is left after `grace` seconds."""
    import psutil

    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            proc.send_signal(signal.SIGTERM)
            procs.append(proc)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)
