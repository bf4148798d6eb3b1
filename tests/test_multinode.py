"""Training across emulated nodes: network namespaces on one machine (scripts/emulated-nodes.sh).

Each node is a network namespace with its own interface, joined to the others by a bridge
through tbf-shaped veth links, so MPICH's and torch's multi-node paths (hydra's launcher,
libfabric's tcp provider, the c10d rendezvous, gloo) run over a real network stack and not over
loopback or shared memory. Root only; skipped with the reason elsewhere, failed instead where
LABAVG_REQUIRE_NETNS=1 (a CI that must run them).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from labavg.base import checkpoint
from labavg.comm.launchers import find_mpiexec
from labavg.jobs.index import read_events
from labavg.jobs.summary import load_summary

from test_train import SMALL, final_params

# Emulated nodes: network namespaces, links and a job per node (`pytest -m slow`).
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "emulated-nodes.sh"
PYTHON = sys.executable
RATE = "1gbit"
# One per node: labavg-n<i>, lab0 at 198.18.0.<i+1>; bridge labavg-br0 (the script's names).
NS_PATTERN = re.compile(r"^labavg-n\d+$")
LINK_PATTERN = re.compile(r"^(lbn\d+(-p)?|labavg-br0)$")


def _why_no_namespaces() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CI runs as root)"
    for tool in ("ip", "tc", "flock"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found (iproute2 / util-linux)"
    probe = f"labavg-probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@pytest.fixture(scope="module")
def netns():
    reason = _why_no_namespaces()
    if reason is not None:
        if os.environ.get("LABAVG_REQUIRE_NETNS") == "1":
            pytest.fail(f"LABAVG_REQUIRE_NETNS=1 but {reason}")
        pytest.skip(reason)


def _script(*args: str, state: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "LABAVG_NODES_DIR": str(state)}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def _ours_left() -> list[str]:
    """Namespaces and links of the emulation that exist now."""
    spaces = [line.split()[0] for line in
              subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
              if line.strip()]
    links = [line.split(": ")[1].split("@")[0] for line in
             subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout.splitlines()]
    return [n for n in spaces if NS_PATTERN.match(n)] + [n for n in links if LINK_PATTERN.match(n)]


@dataclass
class Nodes:
    """An emulation that is up: its host list, mpiexec's environment, its namespaces."""

    hosts: list[str]
    env: dict[str, str]
    namespaces: list[str]

    def sent_bytes(self, i: int) -> int:
        """Bytes node i's link has sent (its tbf qdisc's counter)."""
        out = subprocess.run(["ip", "netns", "exec", self.namespaces[i], "tc", "-s", "qdisc", "show",
                              "dev", "lab0"], capture_output=True, text=True, check=True).stdout
        return int(re.search(r"Sent (\d+) bytes", out)[1])

    def pids(self) -> dict[str, list[int]]:
        """Processes in each node's namespace (empty lists when none)."""
        return {ns: [int(p) for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                                    text=True).stdout.split()]
                for ns in self.namespaces}

    def wait_empty(self, timeout: float = 5.0) -> dict[str, list[int]]:
        """The processes still in a namespace after up to `timeout` s ({} when none).

        A launcher reaps its children as it exits, so give them a moment, not forever.
        """
        deadline = time.monotonic() + timeout
        while True:
            left = {ns: p for ns, p in self.pids().items() if p}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)


@pytest.fixture
def nodes(netns, tmp_path):
    """Two emulated nodes at RATE, torn down (and checked gone) whatever the test did."""
    state = tmp_path / "nodes"
    try:
        up = _script("up", "2", RATE, state=state)
        assert up.returncode == 0, up.stderr
        env = dict(line.split("=", 1) for line in (state / "env").read_text().splitlines() if line)
        hosts = (state / "hosts").read_text().strip().split(",")
        namespaces = [line.split()[1] for line in (state / "nodes").read_text().splitlines()]
        yield Nodes(hosts, env, namespaces)
    finally:
        down = _script("down", state=state)
        assert down.returncode == 0, down.stderr
        assert _ours_left() == [] and not state.exists()


def _env(nodes: Nodes | None = None) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **(nodes.env if nodes else {})}


def _labavg(*args: str, nodes: Nodes | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "labavg", *args], capture_output=True, text=True,
                          env=_env(nodes), timeout=timeout)


def _common(corpus: Path, backend: str = "mpi") -> list[str]:
    return ["--data", str(corpus), "--ranks", "2", "--backend", backend, *SMALL,
            "--checkpoint-every", "1"]


@pytest.fixture(scope="module")
def loopback(netns, corpus, tmp_path_factory) -> Path:
    """The reference: the same 2-rank MPI run on this machine's loopback and shared memory."""
    out = tmp_path_factory.mktemp("loopback") / "run"
    proc = _labavg("train", *_common(corpus), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


def _placement(nodes: Nodes, tmp_path: Path) -> list[int]:
    """The network namespace (inode) each of 2 MPI ranks runs in, in rank order."""
    # A file per rank: hydra forwards the ranks' stdout in chunks that can interleave mid-line.
    probe = subprocess.run(
        [str(find_mpiexec()), "-n", "2", "-hosts", ",".join(nodes.hosts), PYTHON, "-c",
         "import os, pathlib; pathlib.Path(f'{os.environ[\"PROBE_DIR\"]}/{os.environ[\"PMI_RANK\"]}')"
         ".write_text(str(os.stat('/proc/self/ns/net').st_ino))"],
        capture_output=True, text=True, env={**_env(nodes), "PROBE_DIR": str(tmp_path)}, timeout=60)
    assert probe.returncode == 0, probe.stderr
    return [int((tmp_path / str(rank)).read_text()) for rank in range(2)]


def _namespace_inodes(nodes: Nodes) -> list[int]:
    return [os.stat(f"/run/netns/{ns}").st_ino for ns in nodes.namespaces]


def test_mpi_hosts_across_nodes_matches_loopback_bitwise(nodes, loopback, corpus, tmp_path):
    assert _placement(nodes, tmp_path) == _namespace_inodes(nodes)  # rank i on node i
    before = [nodes.sent_bytes(i) for i in range(2)]
    out = tmp_path / "net"
    proc = _labavg("train", *_common(corpus), "--out", str(out), "--hosts", ",".join(nodes.hosts),
                   nodes=nodes)
    assert proc.returncode == 0, proc.stderr
    summary = load_summary(out)
    # The averaging crossed the emulated links: each rank sends at least half of the parameters
    # per round (n/2 in Rabenseifner's reduce-scatter, n/2 more in its allgather); shared memory
    # between the "nodes" would leave the links nearly idle.
    least = summary.averaging_rounds * 4 * summary.num_params // 2
    sent = [nodes.sent_bytes(i) - before[i] for i in range(2)]
    assert all(s >= least for s in sent), (sent, least)
    # Bitwise, not to rounding: with 2 ranks each averaged element is one addition (a + b, the
    # same either way round) and one division, whatever the transport.
    for rank in (0, 1):
        assert torch.equal(final_params(out, rank), final_params(loopback, rank))


def test_torchrun_nnodes_2_c10d_across_nodes(nodes, loopback, corpus, tmp_path):
    out = tmp_path / "torch"
    endpoint = f"{nodes.hosts[0]}:29400"  # a fresh namespace: nothing else listens there
    before = [nodes.sent_bytes(i) for i in range(2)]
    procs = []
    try:
        for i, ns in enumerate(nodes.namespaces):
            command = [
                "ip", "netns", "exec", ns, PYTHON, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                "--rdzv-id", "labavg-multinode",
                # torchrun guesses whether to host the rendezvous store, and what address to
                # advertise to the workers, from the host name, which every namespace shares
                # and which resolves outside them all (the workers then hang): say both.
                "--rdzv-conf", f"is_host={int(i == 0)}", "--local-addr", nodes.hosts[i],
                "-m", "labavg", "train", *_common(corpus, "torch"), "--out", str(out)]
            with open(tmp_path / f"node{i}.log", "w") as log:
                procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                              env=_env(nodes), start_new_session=True))
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    logs = "\n".join((tmp_path / f"node{i}.log").read_text()[-2000:] for i in range(2))
    assert codes == [0, 0], logs
    summary = load_summary(out)
    assert summary.ranks == 2 and summary.backend == "torch"
    least = summary.averaging_rounds * 4 * summary.num_params // 2  # gloo's ring: n/2 out
    sent = [nodes.sent_bytes(i) - before[i] for i in range(2)]
    assert all(s >= least for s in sent), (sent, least)
    assert {e["rank"] for e in read_events(out) if e["type"] == "run_finished"} == {0, 1}
    assert nodes.wait_empty() == {}
    # gloo's 2-rank sum is also one addition per element: the same model as MPI on loopback.
    assert torch.equal(final_params(out), final_params(loopback))


def test_rank_killed_on_the_second_node_ends_the_job_cleanly(nodes, loopback, corpus, tmp_path):
    assert _placement(nodes, tmp_path)[1] == _namespace_inodes(nodes)[1]  # rank 1 runs on node 1
    out = tmp_path / "cut"
    hosts = ",".join(nodes.hosts)
    start = time.monotonic()
    proc = _labavg("train", *_common(corpus), "--out", str(out), "--hosts", hosts, "--set",
                   'inject_fault="kill@rank1:step5"', nodes=nodes)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0 and elapsed < 90, (proc.returncode, elapsed)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr  # labavg's one line, not hydra's traces
    assert lines[0].startswith("labavg: error: the MPI job failed")
    assert "rank 1 (pid " in lines[0] and ") was lost" in lines[0]
    assert nodes.wait_empty() == {}
    assert not (out / "summary.json").exists()
    step, _ = checkpoint.latest_step(out)
    assert step == 3  # the last averaging round (K = 3) before the kill
    resumed = _labavg("train", "--resume", str(out), "--no-progress", "--hosts", hosts, nodes=nodes)
    assert resumed.returncode == 0, resumed.stderr
    assert torch.equal(final_params(out), final_params(loopback))
    assert nodes.wait_empty() == {}


# -- the script itself --------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["up", "0", RATE], "N must be a whole number from 1 to 16"),
    (["up", "2", "fast"], "use a tc rate such as"),
    (["up", "2", "200gbit"], "choose from 1mbit to 100gbit"),
    (["up", "2"], "usage:"),
    (["sideways"], "usage:"),
])
def test_bad_input_is_one_message_and_exit_2(netns, tmp_path, args, message):
    proc = _script(*args, state=tmp_path / "nodes")
    assert proc.returncode == 2 and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert _ours_left() == [] and not (tmp_path / "nodes").exists()


def test_down_removes_a_half_made_emulation(netns, tmp_path):
    state = tmp_path / "nodes"
    holder = None
    try:
        # What an `up` killed with SIGKILL can leave: a namespace with a process in it, a veth
        # pair never moved, a bridge, the state directory.
        subprocess.run(["ip", "netns", "add", "labavg-n7"], check=True)
        subprocess.run(["ip", "link", "add", "lbn3", "type", "veth", "peer", "name", "lbn3-p"],
                       check=True)
        subprocess.run(["ip", "link", "add", "labavg-br0", "type", "bridge"], check=True)
        state.mkdir()
        (state / "nodes").write_text("198.18.0.8 labavg-n7\n")
        holder = subprocess.Popen(["ip", "netns", "exec", "labavg-n7", "sleep", "600"])
        deadline = time.monotonic() + 10
        while not subprocess.run(["ip", "netns", "pids", "labavg-n7"], capture_output=True,
                                 text=True).stdout.strip():
            assert time.monotonic() < deadline, "sleep never entered labavg-n7"
            time.sleep(0.05)
        down = _script("down", state=state)
        assert down.returncode == 0, down.stderr
        assert f"ending processes left in labavg-n7: {holder.pid}" in down.stderr
        assert _ours_left() == [] and not state.exists()
        assert holder.wait(timeout=10) != 0
        again = _script("down", state=state)  # idempotent
        assert again.returncode == 0 and again.stderr == ""
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
        _script("down", state=state)


def test_an_interrupted_up_leaves_nothing_behind(netns, tmp_path):
    state = tmp_path / "nodes"
    env = {**os.environ, "LABAVG_NODES_DIR": str(state)}
    proc = subprocess.Popen(["bash", str(SCRIPT), "up", "16", RATE], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not any(NS_PATTERN.match(n) for n in _ours_left()):  # interrupt it mid-way
            assert time.monotonic() < deadline and proc.poll() is None, "up made no namespace"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode != 0 and "up failed; removing what it made" in err
        assert _ours_left() == [] and not state.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        _script("down", state=state)


def test_status_and_the_launcher_name_what_is_up(nodes, tmp_path):
    state = tmp_path / "nodes"
    status = _script("status", state=state)
    assert status.returncode == 0 and "hosts: 198.18.0.1,198.18.0.2" in status.stdout
    assert "rate 1Gbit" in status.stdout
    # The launcher refuses an address that is no emulated node, as ssh fails on an unknown host.
    lost = subprocess.run([nodes.env["HYDRA_LAUNCHER_EXEC"], "-x", "198.18.0.99", "true"],
                          capture_output=True, text=True)
    assert lost.returncode == 255 and "no emulated node has address 198.18.0.99" in lost.stderr
    inside = subprocess.run([nodes.env["HYDRA_LAUNCHER_EXEC"], "-x", nodes.hosts[1],
                             "ip", "-br", "addr", "show", "lab0"], capture_output=True, text=True)
    assert inside.returncode == 0 and nodes.hosts[1] in inside.stdout, inside.stderr


def test_mpi_hierarchy_node_size_0_groups_ranks_by_host(nodes, corpus, tmp_path):
    # 2 ranks on each emulated node: MPI_COMM_TYPE_SHARED must see two nodes of 2 (the
    # namespaces are one machine, so a grouping by machine would be one node of 4), and the
    # grouping must be hydra's placement (ranks 0, 1 on the first host): the model then equals
    # the inproc run whose node_size = 2 groups ranks 0, 1 and 2, 3.
    hosts = ",".join(f"{host}:2" for host in nodes.hosts)
    flags = ["--data", str(corpus), "--ranks", "4", *SMALL, "--set",
             "averaging.hierarchy.across_nodes_every=6"]
    out = tmp_path / "net"
    proc = _labavg("train", *flags, "--backend", "mpi", "--out", str(out), "--hosts", hosts,
                   nodes=nodes, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert load_summary(out).node_ranks == 2
    ref = tmp_path / "inproc"
    proc = _labavg("train", *flags, "--set", "averaging.hierarchy.node_size=2", "--out", str(ref))
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch.testing.assert_close(final_params(out), final_params(ref), rtol=1e-5, atol=1e-6)
