"""A cluster that dies with the process that started it.

A notebook's kernel starts the ipyparallel controller and `mpiexec` (with its proxies, engines
and their nannies) in sessions of their own, so that a Ctrl-C in a cell does not reach them. A
kernel that is killed (kill -9, a crash, Jupyter's restart of a busy kernel) runs no exit hook,
and the whole cluster stayed behind: 19 processes and about 1.5 GB per Run All. The guard is a
small process of its own session started beside the cluster: it watches its owner and, once
the owner has gone, ends every process of the cluster (TERM, then KILL after a grace period).
It leaves by itself once the cluster has stopped.

    python -m labavg.jobs.cluster_guard OWNER_PID ROOT_PID [ROOT_PID ...]
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil

POLL_SECONDS = 0.5
GRACE_SECONDS = 3.0


def start_guard(owner: int, roots: list[int]) -> subprocess.Popen:
    """Start a guard that ends `roots` and all their descendants once `owner` has gone."""
    return subprocess.Popen([sys.executable, "-m", "labavg.jobs.cluster_guard", str(owner),
                             *map(str, roots)], start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _processes(pids: list[int]) -> list[psutil.Process]:
    found = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return found


def _tree(roots: list[psutil.Process]) -> list[psutil.Process]:
    """The roots still running and their descendants (engines under proxies under mpiexec)."""
    tree = []
    for root in roots:
        try:
            if root.is_running():  # also false when the pid was reused
                tree += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return tree


def end_tree(roots: list[psutil.Process], grace: float = GRACE_SECONDS) -> None:
    """TERM every process of the trees, then KILL what is left after `grace` seconds."""
    tree = _tree(roots)
    for proc in tree:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(tree, timeout=grace)
    for proc in [*alive, *_tree(roots)]:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def guard(owner_pid: int, root_pids: list[int], poll: float = POLL_SECONDS) -> int:
    """Watch `owner_pid`; when it has gone, end the cluster. Returns when either has gone."""
    roots = _processes(root_pids)
    try:
        owner = psutil.Process(owner_pid)
    except psutil.NoSuchProcess:
        end_tree(roots)
        return 0
    while _tree(roots):
        try:
            if not owner.is_running() or owner.status() == psutil.STATUS_ZOMBIE:
                end_tree(roots)
                return 0
        except psutil.NoSuchProcess:
            end_tree(roots)
            return 0
        time.sleep(poll)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the notebook's cell
    try:
        owner, *roots = (int(arg) for arg in args)
    except ValueError:
        print("usage: python -m labavg.jobs.cluster_guard OWNER_PID ROOT_PID [ROOT_PID ...]",
              file=sys.stderr)
        return 2
    return guard(owner, roots)


if __name__ == "__main__":
    sys.exit(main())
