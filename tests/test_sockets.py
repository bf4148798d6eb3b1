"""What a local multi-process run listens on, measured on real jobs (docs/cluster.md lists it).

Each job's ranks report when their communicator is up and then wait for a stop file, so the
sockets are read while every process is alive.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from labavg.comm.launchers import find_mpiexec, mpiexec_command

RANK_SCRIPT = """
import os, sys, time
from pathlib import Path
here = Path(sys.argv[2])
if sys.argv[1] == "mpi":
    from mpi4py import MPI
    import numpy as np
    comm = MPI.COMM_WORLD
    rank = comm.rank
    comm.Allreduce(np.ones(4), np.empty(4))  # connections are made at the first collective
else:
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.all_reduce(torch.ones(4))
(here / f"ready.{rank}").write_text(str(os.getpid()))
deadline = time.monotonic() + 60
while not (here / "stop").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def _listeners(root: int) -> list[tuple[int, str, str, int]]:
    """(pid, name, address, port) of every TCP/UDP listening socket of `root` and its descendants."""
    found = []
    proc = psutil.Process(root)
    for p in [proc, *proc.children(recursive=True)]:
        try:
            for conn in p.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN or (conn.type == socket.SOCK_DGRAM
                                                         and not conn.raddr):
                    found.append((p.pid, p.name(), conn.laddr.ip, conn.laddr.port))
        except psutil.NoSuchProcess:
            pass
    return found


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def _run_job(command: list[str], tmp_path: Path, env: dict | None = None):
    """Start `command`, wait until its 2 ranks are up; (listeners, rank pids, launcher pid)."""
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready.{r}").exists() for r in (0, 1)):
            if job.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"job did not start its ranks: {job.communicate()[0]}")
            time.sleep(0.05)
        time.sleep(0.3)  # the ready file is written just after the collective returns
        ranks = {int((tmp_path / f"ready.{r}").read_text()) for r in (0, 1)}
        found = _listeners(job.pid)
    finally:
        (tmp_path / "stop").write_text("")
    out = job.communicate(timeout=60)[0]
    assert job.returncode == 0, out
    return found, ranks, job.pid


@pytest.fixture
def rank_script(tmp_path) -> Path:
    path = tmp_path / "rank.py"
    path.write_text(RANK_SCRIPT)
    return path


def _non_loopback_ipv4() -> bool:
    return any(a.family == socket.AF_INET and not _is_loopback(a.address)
               for addrs in psutil.net_if_addrs().values() for a in addrs)


def test_local_mpi_job_listens_on_loopback_except_hydras_control_port(rank_script, tmp_path):
    command = mpiexec_command(2, [str(rank_script), "mpi", str(tmp_path)])
    found, ranks, launcher = _run_job(command, tmp_path)
    # hydra's control port: INADDR_ANY whatever the options, inherited by proxy and ranks.
    control = {port for pid, _, _, port in found if pid == launcher}
    assert len(control) == 1, found
    own = [entry for entry in found if entry[3] not in control]
    assert {pid for pid, *_ in own} >= ranks, f"no rank listener seen: {found}"  # libfabric's
    assert [entry for entry in own if not _is_loopback(entry[2])] == []


@pytest.mark.skipif(not _non_loopback_ipv4(), reason="this machine has only a loopback address")
def test_without_the_loopback_settings_mpich_ranks_listen_on_the_network(rank_script, tmp_path):
    """The control case: the check above does see a rank listening beyond loopback."""
    command = [str(find_mpiexec()), "-n", "2", "-launcher", "fork", sys.executable,
               str(rank_script), "mpi", str(tmp_path)]
    found, ranks, _ = _run_job(command, tmp_path)
    assert any(pid in ranks and not _is_loopback(ip) for pid, _, ip, _ in found), found


@pytest.mark.slow  # keeps README's fast command under 10 minutes; CI runs it
def test_torchrun_workers_listen_on_loopback_only_the_store_on_all(rank_script, tmp_path):
    """torchrun's TCPStore binds every interface (no flag moves it); gloo stays on 127.0.0.1."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(port), str(rank_script),
               "torch", str(tmp_path)]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    found, ranks, agent = _run_job(command, tmp_path, env)
    workers = [entry for entry in found if entry[0] in ranks]
    assert workers and all(_is_loopback(ip) for _, _, ip, _ in workers), found
    # What does listen beyond loopback: the agent's store, on the --master-port, nothing else.
    beyond = {(pid, p) for pid, _, ip, p in found if not _is_loopback(ip)}
    assert beyond <= {(agent, port)}, found
