"""Local processes of a cluster: liveness checks and ending them (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import signal

from labavg.base.waiting import wait_until


def pid_alive(pid: int) -> bool:
    """Whether the process runs; a zombie (ended, not yet reaped by its parent) counts as gone."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_pids(pids: set[int], timeout: float) -> set[int]:
    """Wait up to `timeout` s for the processes to end; the pids still running then.

    Not psutil.wait_procs, which `signal_pids` uses on processes it has just signalled: it
    counts a zombie of another parent as running until that parent reaps it, and reaps a
    zombie child of ours; here, as in `pid_alive`, a zombie has ended and is left to its parent.
    """
    alive = set(pids)

    def all_gone() -> bool:
        alive.difference_update([pid for pid in alive if not pid_alive(pid)])
        return not alive

    wait_until(all_gone, timeout, poll=0.05)
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
