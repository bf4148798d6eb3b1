"""Every listener labavg starts is on loopback when the run names no hosts (issue 44, family 9),
read from the real listening sockets of the real processes while they run.

Before: each MPI rank and each ipyparallel MPI engine held hydra's control port on 0.0.0.0
(inherited), and torchrun's agent listened on [::] for the rendezvous store whatever
--master-addr said. hydra's own copy is not movable (docs/cluster.md, Security): it is the
one listener beyond loopback these tests accept, and only in mpiexec and its proxy.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.support import PYTHON, child_env

HYDRA = {"mpiexec", "mpiexec.hydra", "hydra_pmi_proxy"}  # hydra's control port, unmovable


def _listeners(root: int) -> list[tuple[int, str, str, int]]:
    """(pid, name, address, port) of the LISTEN sockets of `root` and its descendants."""
    found = []
    try:
        tree = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return found
    for proc in tree:
        try:
            found += [(proc.pid, proc.name(), conn.laddr.ip, conn.laddr.port)
                      for conn in proc.net_connections(kind="inet")
                      if conn.status == psutil.CONN_LISTEN]
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return found


def _wide(found):
    return [entry for entry in found if not ipaddress.ip_address(entry[2]).is_loopback]


def _ranks_started(run_dir: Path, size: int) -> bool:
    """Whether every rank has written run_started (after its communicator is open)."""
    try:
        lines = (run_dir / "events.jsonl").read_text().splitlines()
    except OSError:
        return False
    started = set()
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("type") == "run_started":
            started.add(event.get("rank"))
    return started >= set(range(size))


def _train_sampling(corpus: Path, run_dir: Path, backend: str):
    """`labavg train --backend BACKEND --ranks 2` (no hosts); its listeners sampled every
    50 ms for the whole run: (every sample, the samples once every rank had started)."""
    command = [PYTHON, "-m", "labavg", "train", "--data", str(corpus), "--out", str(run_dir),
               "--backend", backend, "--ranks", "2", "--epochs", "2", "--minibatch", "64",
               "--hidden-layers", "1", "--hidden-dim", "32", "--context", "1",
               "--no-progress", "--set", "tensorboard=false"]
    job = subprocess.Popen(command, env=child_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    every, steady = [], []
    deadline = time.monotonic() + 240
    while job.poll() is None and time.monotonic() < deadline:
        found = _listeners(job.pid)
        every += found
        if _ranks_started(run_dir, 2) and job.poll() is None:
            steady.append(found)
        time.sleep(0.05)
    if job.poll() is None:
        job.kill()
    out = job.communicate(timeout=60)[0]
    assert job.returncode == 0, out
    return every, steady


@pytest.mark.slow  # a 2-rank MPI job: ~25 s
def test_a_local_mpi_job_listens_beyond_loopback_only_in_hydra(corpus, tmp_path):
    every, steady = _train_sampling(corpus, tmp_path / "run", "mpi")
    wide = [entry for found in steady for entry in _wide(found)]
    assert {name for _, name, *_ in wide} <= HYDRA, wide  # before: both ranks on 0.0.0.0
    assert len({port for *_, port in wide}) <= 1, wide
    # The ranks' own listeners (libfabric's) are there, on loopback.
    assert any(name == "python" for found in steady for _, name, *_ in found), steady


@pytest.mark.slow  # a 2-rank torchrun job: ~20 s
def test_a_local_torch_job_listens_on_loopback_only(corpus, tmp_path):
    every, steady = _train_sampling(corpus, tmp_path / "run", "torch")
    assert steady, "the ranks were never seen started"
    assert {name for _, name, *_ in every} >= {"pt_elastic", "python"}, every
    assert _wide(every) == [], _wide(every)  # before: pt_elastic on [::]:<store port>


@pytest.mark.slow  # a controller and 2 MPI engines: ~20 s
def test_an_ipyparallel_cluster_listens_beyond_loopback_only_in_hydra(tmp_path):
    from labavg.jobs.cluster import Cluster

    cluster = Cluster.start(2, profile_dir=str(tmp_path / "profile"), device="cpu")
    try:
        engines = {info["pid"] for info in cluster._infos}
        found = _listeners(os.getpid())
    finally:
        cluster.shutdown()
    names = {name for _, name, *_ in found}
    assert "hydra_pmi_proxy" in names and "python" in names, found
    wide = _wide(found)
    assert {name for _, name, *_ in wide} <= HYDRA, wide  # before: both engines on 0.0.0.0
    assert len({port for *_, port in wide}) <= 1, wide
    assert len(engines) == 2 and engines <= {pid for pid, *_ in found}, (engines, found)


# -- the mechanism, on real processes ----------------------------------------------------------

CHILD = """
import json, os, socket, sys
from labavg.comm.launchers import close_inherited_listeners
own = socket.socket(); own.bind(("0.0.0.0", 0)); own.listen()   # this process's own
own.set_inheritable(True)
closed = close_inherited_listeners()
print(json.dumps({"closed": closed, "own": own.fileno()}), flush=True)
sys.stdin.readline()
"""


def test_a_rank_closes_the_listeners_it_shares_with_its_parent_and_no_other(tmp_path):
    inherited = socket.socket()
    inherited.bind(("0.0.0.0", 0))
    inherited.listen()
    inherited.set_inheritable(True)
    connected_a, connected_b = socket.socketpair()  # inherited, not listening (like PMI_FD)
    connected_a.set_inheritable(True)
    loopback = socket.socket()  # inherited too but still listening: any address is closed
    loopback.bind(("127.0.0.1", 0))
    loopback.listen()
    loopback.set_inheritable(True)
    keep = (inherited.fileno(), connected_a.fileno(), loopback.fileno())
    child = subprocess.Popen([PYTHON, "-c", CHILD], pass_fds=keep, env=child_env(),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        report = json.loads(child.stdout.readline())
        fds = {int(fd) for fd in os.listdir(f"/proc/{child.pid}/fd")}
        child_listeners = {(c.laddr.ip, c.laddr.port) for c in
                           psutil.Process(child.pid).net_connections(kind="inet")
                           if c.status == psutil.CONN_LISTEN}
    finally:
        child.stdin.write("\n")
        child.stdin.close()
        child.wait(timeout=30)
    assert sorted(report["closed"]) == sorted([inherited.fileno(), loopback.fileno()])
    assert connected_a.fileno() in fds and report["own"] in fds
    assert ("0.0.0.0", inherited.getsockname()[1]) not in child_listeners
    assert len(child_listeners) == 1, child_listeners  # its own
    # The parent's copy is untouched: it still accepts.
    with socket.create_connection(("127.0.0.1", inherited.getsockname()[1]), timeout=5):
        inherited.settimeout(5)
        inherited.accept()[0].close()
    for sock in (inherited, connected_a, connected_b, loopback):
        sock.close()


def test_torch_launch_hosts_no_store_on_every_interface_and_the_command_uses_it():
    from labavg.comm.launchers import torchrun_command

    command = torchrun_command(2, ["-m", "labavg", "train"])
    assert command[:3] == [sys.executable, "-m", "labavg.comm.torch_launch"]
    assert "--master-addr" not in command  # a static rendezvous's store binds [::]
