"""labavg.jobs.cluster on real ipyparallel MPI engines (2 engines under the venv's MPICH mpiexec).

The tests share one cluster and run in file order: start, runs, stop, a killed engine and
restart, then shutdown. A tiny synthetic corpus keeps each run to about a second.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labavg.averaging.settings import AveragingConfig
from labavg.jobs.cluster import Cluster
from labavg.base.events import Averaged, MinibatchDone, event_from_dict
from labavg.jobs.cluster_run import RunError
from labavg.jobs.launch import start_run
from labavg.jobs.processes import pid_alive
from labavg.data.settings import DataConfig
from labavg.training.config import TrainConfig
from labavg.base.errors import UserError
from labavg.training.model import ModelConfig
from labavg.jobs.index import read_events
from support import stop_at_first_round
from labavg.jobs.summary import load_summary


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from labavg.data.synth import synthesize

    out = tmp_path_factory.mktemp("cluster") / "corpus"
    synthesize(out, hours=0.02, seed=0)
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cl = Cluster.start(2, device="cpu", profile_dir=str(tmp_path_factory.mktemp("ipython") / "profile"),
                       timeout=90)
    yield cl
    cl.shutdown()


def make_cfg(out: Path, corpus: Path, average_every: int, epochs: int = 1) -> TrainConfig:
    return TrainConfig(out=str(out), ranks=2, backend="mpi", minibatch=64, epochs=epochs,
                       averaging=AveragingConfig(average_every=average_every),
                       model=ModelConfig(hidden_layers=1, hidden_dim=32),
                       data=DataConfig(data=str(corpus), context=2, buffer_frames=2048),
                       tensorboard=False)


@pytest.mark.slow  # end to end: out of the fast suite's 10 minutes
def test_engines_are_ordered_by_mpi_rank(cluster):
    info = cluster.info()
    assert cluster.ranks == [0, 1]
    assert [i["rank"] for i in info] == [0, 1] and all(i["size"] == 2 for i in info)
    assert [i["device"] for i in info] == ["cpu", "cpu"]
    assert len({i["pid"] for i in info}) == 2 and all(pid_alive(i["pid"]) for i in info)
    # %px-style code on the view sees the engine's rank and can import labavg
    cluster.view.execute("import labavg.jobs.cluster; seen = (rank, size, str(device))")
    assert cluster.view.pull("seen") == [(0, 2, "cpu"), (1, 2, "cpu")]


def test_a_cluster_refuses_a_non_mpi_config(cluster, corpus, tmp_path):
    cfg = make_cfg(tmp_path / "r", corpus, 2)
    cfg.backend = "inproc"
    with pytest.raises(UserError, match="backend 'inproc'"):
        start_run(cfg, cluster=cluster)
    cfg.backend, cfg.ranks = "mpi", 3
    with pytest.raises(UserError, match="ranks=3"):
        start_run(cfg, cluster=cluster)


def _check_complete(history, run_dir: Path, total: int, average_every: int) -> None:
    """Every step and averaging round of every rank, in order, as in the run's events.jsonl."""
    on_disk = list(read_events(run_dir))
    for rank in (0, 1):
        mine = [e for e in history if e["rank"] == rank]
        assert mine[0]["type"] == "run_started" and mine[-1]["type"] == "run_finished"
        assert [e["step"] for e in mine if e["type"] == "minibatch"] == list(range(1, total + 1))
        rounds = [e["step"] for e in mine if e["type"] == "average"]
        assert rounds == sorted(set(range(average_every, total + 1, average_every)) | {total})
        disk = [(e["type"], e.get("step")) for e in on_disk if e["rank"] == rank]
        assert [(e["type"], e.get("step")) for e in mine] == disk


def test_run_streams_events_while_running_and_history_is_complete(cluster, corpus, tmp_path):
    handle = cluster._submit(make_cfg(tmp_path / "k2", corpus, 2))
    seen = list(handle.events(timeout=120))
    summary = handle.result(timeout=10)
    assert handle.done and handle.gaps == []
    assert seen == [event_from_dict(e) for e in handle.history]  # typed, every one, in order
    total = handle.history[0]["steps_per_epoch"]
    assert summary.steps == total and summary.average_every == 2
    assert summary == load_summary(tmp_path / "k2")
    _check_complete(handle.history, tmp_path / "k2", total, 2)
    # streamed, not delivered at the end: the first events arrived before the last was created
    arrived = handle.history
    assert min(e["t_arrived"] for e in arrived) < max(e["t_created"] for e in arrived)
    assert {e["rank"] for e in arrived
            if e["t_arrived"] < max(x["t_created"] for x in arrived)} == {0, 1}
    latency = handle.latency()
    print(f"event latency over {latency['count']} events: median {latency['median'] * 1e3:.1f} ms, "
          f"p95 {latency['p95'] * 1e3:.1f} ms")
    assert latency["count"] == len(seen) and 0 < latency["median"] < 1.0


def test_second_run_reuses_the_warm_engines(cluster, corpus, tmp_path):
    pids = [i["pid"] for i in cluster.info()]
    handle = cluster._submit(make_cfg(tmp_path / "k8", corpus, 8))
    summary = handle.result(timeout=120)
    total = handle.history[0]["steps_per_epoch"]
    assert summary.average_every == 8 and summary.averaging_rounds == -(-total // 8)
    _check_complete(handle.history, tmp_path / "k8", total, 8)
    assert [i["pid"] for i in cluster.info()] == pids


def test_an_exception_on_the_engines_names_the_rank(cluster, corpus, tmp_path):
    cfg = make_cfg(tmp_path / "bad", corpus, 2)
    cfg.data.data = str(tmp_path / "no-such-corpus")
    handle = cluster._submit(cfg)
    assert list(handle.events(timeout=60)) == []  # they end; result() says why
    with pytest.raises(RunError) as failure:
        handle.result(timeout=60)
    assert failure.value.rank == 0 and str(failure.value).startswith("rank 0 raised ")
    assert "no-such-corpus" in str(failure.value) and "Traceback" in failure.value.remote_traceback
    assert handle.done and handle.history == []


def test_attach_finds_the_running_engines_and_detaches_without_stopping_them(cluster):
    attached = Cluster.attach(profile_dir=cluster.profile_dir, cluster_id=cluster.cluster_id,
                              device="cpu", timeout=30)
    try:
        assert attached.info() == cluster.info()
    finally:
        attached.shutdown()
    assert all(pid_alive(i["pid"]) for i in cluster.info())
    assert cluster.view.apply(os.getpid) == [i["pid"] for i in cluster.info()]


def test_stop_ends_the_run_at_an_averaging_point(cluster, corpus, tmp_path):
    handle = cluster._submit(make_cfg(tmp_path / "stop", corpus, 4, epochs=40))
    for event in handle.events(timeout=120):
        if isinstance(event, Averaged) and event.round >= 2:
            handle.stop()
            break
    summary = handle.result(timeout=60)
    planned = handle.history[0]["steps_per_epoch"] * 40
    assert summary.steps < planned and summary.steps % 4 == 0
    for rank in (0, 1):
        mine = [e for e in handle.history if e["rank"] == rank]
        assert [e["type"] for e in mine[-3:]] == ["message", "checkpoint", "run_finished"]
        assert mine[-3]["text"] == "stopped on request"
        assert {e["step"] for e in mine[-3:]} == {summary.steps}


def test_start_run_on_the_cluster_stops_resumes_and_keeps_the_engines(cluster, corpus, tmp_path):
    cfg = make_cfg(tmp_path / "seam", corpus, 4, epochs=3)
    handle = start_run(cfg, cluster=cluster)
    events = stop_at_first_round(handle)
    stopped = handle.result(60)
    per_epoch = events[0].steps_per_epoch
    assert stopped.stopped and stopped.steps < 3 * per_epoch
    finished = start_run(cfg, cluster=cluster, resume=True).result(120)
    assert not finished.stopped and finished.steps == 3 * per_epoch and finished.resumed
    assert not cluster.closed and len(cluster.info()) == 2  # a cluster it was given stays up


# Fast-suite margin: an end-to-end twin of a fast test; CI runs it with -m slow.
@pytest.mark.slow
def test_killed_engine_makes_result_name_the_rank_then_kill_restarts(cluster, corpus, tmp_path):
    victim = cluster.info()[1]["pid"]
    handle = cluster._submit(make_cfg(tmp_path / "dead", corpus, 20, epochs=40))
    for event in handle.events(timeout=120):
        if event.rank == 1 and isinstance(event, MinibatchDone) and event.step >= 3:
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            break
    with pytest.raises(RunError) as failure:
        handle.result(timeout=60)
    assert time.monotonic() - killed_at < 30
    assert failure.value.rank == 1 and failure.value.step is not None and failure.value.step >= 3
    assert str(failure.value).startswith("rank 1 died") and f"step {failure.value.step}" in str(failure.value)

    handle.kill()  # the survivor is stuck in (or aborted by) the collective: fresh engines
    assert cluster.ranks == [0, 1] and not pid_alive(victim)
    assert victim not in [i["pid"] for i in cluster.info()]
    summary = cluster._submit(make_cfg(tmp_path / "after", corpus, 8)).result(timeout=120)
    assert summary.average_every == 8 and summary.steps > 0


@pytest.mark.slow
def test_kill_recovers_engines_hung_in_a_collective(cluster, corpus, tmp_path):
    # rank 0 alone enters a barrier: its engine blocks in MPI and answers nothing any more
    hung = cluster.client[cluster.engine_ids[0]].execute(
        "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()", block=False)
    pids = [i["pid"] for i in cluster.info()]
    with pytest.raises(TimeoutError):
        hung.get(timeout=1)
    started = time.monotonic()
    cluster.restart()  # what ClusterRun.kill() does
    assert time.monotonic() - started < 60
    assert cluster.ranks == [0, 1] and not any(pid_alive(pid) for pid in pids)
    assert cluster.view.apply(os.getpid) == [i["pid"] for i in cluster.info()]


# Fast-suite margin: an end-to-end twin of a fast test; CI runs it with -m slow.
@pytest.mark.slow
def test_shutdown_of_engines_hung_in_mpi_says_so_and_leaves_no_processes(cluster, caplog):
    # rank 0 blocks in a barrier rank 1 never enters: it cannot act on the request to exit
    cluster.client[cluster.engine_ids[0]].execute("from mpi4py import MPI; MPI.COMM_WORLD.Barrier()",
                                                  block=False)
    time.sleep(0.5)
    hung = cluster.info()[0]["pid"]
    pids = cluster.process_ids()
    assert len(pids) >= 4  # controller, mpiexec, 2 engines (plus schedulers, proxies, nannies)
    with caplog.at_level(logging.WARNING):
        cluster.shutdown(grace=2)
    deadline = time.monotonic() + 10
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if pid_alive(pid)] == []
    said = [r.getMessage() for r in caplog.records if "did not exit" in r.getMessage()]
    assert len(said) == 1 and f"[{hung}]" in said[0]


@pytest.mark.slow
def test_a_normal_shutdown_in_a_notebook_prints_nothing(corpus, tmp_path):
    """As notebook 03 ends: after a run, shutdown() in an IPython kernel's running event loop."""
    script = Path(__file__).parent / "cluster_scripts" / "notebook_shutdown.py"
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script), str(corpus), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for stream in (proc.stdout, proc.stderr):
        assert "=== end" in stream, stream[-3000:]
        said = stream.split("=== shutdown\n", 1)[1].split("=== end", 1)[0]
        # ipyparallel used to print the engines' logs (~6 KB, with tracebacks) and its stop steps
        assert said == "", said[-3000:]
    pids = json.loads((tmp_path / "pids.json").read_text())
    assert len(pids) >= 4 and [pid for pid in pids if pid_alive(pid)] == []
