"""Elastic runs' bad cases on real processes, a real lighthouse and real signals: each ends in
one line, or the others go on; nothing of the job is left running."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from labavg.base.waiting import wait_until
from labavg.comm.elastic_launch import request_join
from support import processes_naming, running

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "elastic_worker.py")


class Job:
    """An elastic launcher running tests/elastic_worker.py, its stdout read as it comes."""

    started: list["Job"] = []

    def __init__(self, tmp_path: Path, nproc: int, *worker: str, launcher: tuple = ()):
        Job.started.append(self)
        self.state_file = tmp_path / "state.json"
        cmd = [sys.executable, "-m", "labavg.comm.elastic_launch", "--nproc", str(nproc),
               "--state-file", str(self.state_file), "--join-socket", str(tmp_path / "join"),
               *launcher, "--", WORKER, *worker]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=ROOT, start_new_session=True)
        self.lines: list[dict] = []
        self.pids: set[int] = {self.proc.pid}
        self._err: list[str] = []
        self._readers = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=lambda: self._err.extend(self.proc.stderr),
                                          daemon=True)]
        for reader in self._readers:
            reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.append(json.loads(line))

    def workers(self) -> dict[int, int]:
        """Launch rank -> pid of the running workers, from the launcher's state file."""
        state = wait_until(lambda: _read_json(self.state_file), 60, 0.05)
        assert state, "the launcher wrote no state file"
        workers = {int(r): int(p) for r, p in state["workers"].items()}
        self.pids |= set(workers.values())
        return workers

    def rounds(self, rank: int) -> list[dict]:
        return [d for d in list(self.lines) if d["rank"] == rank]

    def wait_for(self, what, timeout: float = 90) -> None:
        seen = wait_until(lambda: what() or self.proc.poll() is not None, timeout, 0.05)
        assert seen and what(), (self.proc.poll(), self.lines[-4:], "".join(self._err)[-1500:])

    def end(self, timeout: float = 120) -> tuple[int, str]:
        self.proc.wait(timeout=timeout)
        for reader in self._readers:
            reader.join(10)
        return self.proc.returncode, "".join(self._err)


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test():
    """A failed test's job is killed, a stopped worker too (its launcher's SIGTERM would wait)."""
    yield
    for job in Job.started:
        for pid in job.pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
    Job.started.clear()


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _members(rounds: list[dict]) -> list[list[int]]:
    """The successive memberships in `rounds`, each once."""
    seen: list[list[int]] = []
    for d in rounds:
        if not seen or seen[-1] != d["members"]:
            seen.append(d["members"])
    return seen


def test_two_lost_at_once_then_the_last_survivor_goes_on_alone(tmp_path):
    """min_workers = 1 (the default): 4 -> 2 in one step when two die together, then 2 -> 1,
    and the last one trains to the end and the job exits 0."""
    job = Job(tmp_path, 4, "40", "--pause", "0.05")
    workers = job.workers()
    job.wait_for(lambda: len(job.rounds(0)) >= 5)
    for rank in (2, 3):  # both before either is noticed
        os.killpg(workers[rank], signal.SIGKILL)
    job.wait_for(lambda: any(d["members"] == [0, 1] for d in job.rounds(0)))
    os.killpg(workers[1], signal.SIGKILL)
    code, err = job.end()
    assert code == 0, err[-1500:]
    last = job.rounds(0)
    assert last[-1]["round"] == 40 and last[-1]["members"] == [0]
    assert _members(last) == [[0, 1, 2, 3], [0, 1], [0]]
    assert "rank 1 left the job (signal SIGKILL); 1 worker goes on" in err
    assert err.count("left the job") == 3
    assert not running(job.pids)


def test_a_loss_during_a_heal_the_joiner_heals_from_another(tmp_path):
    """The survivor the lighthouse names as the joiner's source dies as it is asked for its
    state: the joiner heals from the other survivor, and the three go on bitwise alike."""
    marker = tmp_path / "died-serving"
    job = Job(tmp_path, 3, "80", "--admit", "--die-rank", "2", "--die-at", "5", "--pause",
              "0.1", "--timeout", "3", "--die-on-heal", str(marker))
    job.workers()
    job.wait_for(lambda: any(d["members"] == [0, 1] for d in job.rounds(0)))
    answer = request_join(tmp_path / "join")
    assert answer["rank"] == 2, answer
    job.pids.add(answer["pid"])
    code, err = job.end(180)
    assert marker.exists()  # a source did die serving the heal
    assert code == 0, err[-1500:]
    lost = [r for r in (0, 1) if job.rounds(r)[-1]["round"] < 80]
    assert len(lost) == 1, err[-1500:]
    survivor = 1 - lost[0]
    joiner, kept = job.rounds(2), {d["round"]: d for d in job.rounds(survivor)}
    healed = [d for d in joiner if d["healed"]]
    assert len(healed) == 1 and joiner[-1]["round"] == 80
    for d in joiner:
        assert d["x"] == kept[d["round"]]["x"] and d["m"] == kept[d["round"]]["m"], d["round"]
    assert joiner[-1]["members"] == sorted([survivor, 2])
    assert f"rank {lost[0]} left the job (exit status 1)" in err
    assert "got exception" not in err and "torchft/manager.py" not in err, err
    assert not running(job.pids)


def test_a_hung_worker_is_dropped_after_the_round_timeout(tmp_path):
    """Rank 2 stops (SIGSTOP) inside a round's collective: the others, blocked in it, drop it
    after round_timeout_s (2 s here) and go on. Continued (SIGCONT), it is inside a round the
    others left: no round takes it back, and after quorum_timeout_s (3 s) it leaves in one
    line."""
    job = Job(tmp_path, 3, "50", "--admit", "--pause", "0.1", "--timeout", "2",
              "--quorum-timeout", "3", "--die-rank", "2", "--stop-in-round", "5")
    workers = job.workers()
    job.wait_for(lambda: psutil.Process(workers[2]).status() == psutil.STATUS_STOPPED)
    stopped = time.time()  # within a poll (0.05 s) of the stop; the others come 0.3 s after it
    job.wait_for(lambda: any(d["members"] == [0, 1] for d in job.rounds(0)), 30)
    dropped = next(d for d in job.rounds(0) if d["members"] == [0, 1])
    assert 2 <= dropped["t"] - stopped < 2 + 1 + 3, dropped["t"] - stopped  # + a heartbeat
    assert dropped["round"] == 5  # the round it stopped in, among the two
    before = len(job.rounds(0))
    job.wait_for(lambda: len(job.rounds(0)) >= before + 3)  # the two go on
    os.kill(workers[2], signal.SIGCONT)
    code, err = job.end(180)
    assert code == 0, err[-1500:]
    assert [job.rounds(r)[-1]["round"] for r in (0, 1)] == [50, 50]
    assert job.rounds(2)[-1]["round"] == 4
    said = [line for line in err.splitlines() if line.startswith("labavg.comm.elastic.")]
    assert said == ["labavg.comm.elastic.TooFewWorkers: rank 2 was dropped by the others "
                    "(silent for longer than elastic.heartbeat_ms or elastic.round_timeout_s: "
                    "stopped?) and no round took it back within elastic.quorum_timeout_s = 3 s; "
                    "`labavg train --join` starts a worker in its place"]
    assert "labavg: rank 2 left the job (exit status 1); 2 workers go on" in err
    assert "got exception" not in err and "torchft/manager.py" not in err, err  # its logs: off
    assert not running(job.pids)


def test_a_worker_stopped_until_the_others_finished_does_not_go_on_alone(tmp_path):
    """Continued after the job finished, it would find itself alone and, with min_workers = 1,
    train on and write the run's results over the others'."""
    job = Job(tmp_path, 3, "30", "--admit", "--pause", "0.1")
    workers = job.workers()
    job.wait_for(lambda: len(job.rounds(2)) >= 5)
    os.kill(workers[2], signal.SIGSTOP)
    job.wait_for(lambda: [job.rounds(r)[-1]["round"] for r in (0, 1)] == [30, 30])
    job.wait_for(lambda: not running([workers[0], workers[1]]))
    os.kill(workers[2], signal.SIGCONT)
    code, err = job.end(60)
    assert code == 0, err[-1500:]
    assert not [d for d in job.rounds(2) if d["members"] == [2]]  # no round of its own
    assert "JobFinished: the job finished while rank 2 was away (stopped?): it ends without " \
           "writing" in err, err[-1500:]
    assert not running(job.pids)


def test_sigterm_to_the_launcher_ends_a_stopped_worker_at_once(tmp_path):
    job = Job(tmp_path, 2, "100000", "--pause", "0.05")
    workers = job.workers()
    job.wait_for(lambda: len(job.rounds(1)) >= 3)
    os.kill(workers[1], signal.SIGSTOP)
    sent = time.monotonic()
    job.proc.send_signal(signal.SIGTERM)
    code, err = job.end(60)
    assert code == 143, err[-1500:]
    assert time.monotonic() - sent < 5  # not the launcher's 10 s grace before SIGKILL
    assert not running(job.pids)


def test_a_lighthouse_port_taken_is_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        job = Job(tmp_path, 2, "5", launcher=("--lighthouse-port", str(port)))
        code, err = job.end(60)
    assert code == 2
    assert err == (f"labavg: error: --lighthouse-port {port}: the lighthouse cannot listen on "
                   f"127.0.0.1:{port}: Address already in use (os error 98)\n"), err
    assert not job.state_file.exists() and not (tmp_path / "join").exists()
    assert not [c for c in psutil.Process().children(recursive=True) if c.is_running()
                and c.status() != psutil.STATUS_ZOMBIE]


# Through `labavg train`, as a user runs it --------------------------------------------------

TRAIN = ["--hidden-layers", "2", "--hidden-dim", "64", "--minibatch", "32", "--no-progress",
         "--speedup-pairs", "0", "--backend", "torch", "--average-every", "5",
         "--set", 'on_rank_loss="continue"']


def _train(corpus: Path, out: Path, *args: str) -> subprocess.Popen:
    from tests.support import child_env

    return subprocess.Popen([sys.executable, "-m", "labavg", "train", "--data", str(corpus),
                             "--out", str(out), *TRAIN, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env())


def _events(out: Path) -> list[dict]:
    try:
        lines = (out / "events.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [json.loads(line) for line in lines if line.endswith("}")]



def _rounds_seen(out: Path, job: subprocess.Popen, n: int) -> None:
    def seen() -> bool:
        assert job.poll() is None, job.communicate()[1][-2000:]
        return sum(e["type"] == "average" for e in _events(out)) >= n

    assert wait_until(seen, 180, 0.1)


def test_two_lost_at_once_then_below_min_workers_the_job_ends_in_one_line(corpus, tmp_path):
    """4 -> 2 in one member_lost event; then with elastic.min_workers = 2 the last one ends
    after quorum_timeout_s in one line naming both settings, status 2."""
    from labavg.jobs.elastic_join import lose

    out = tmp_path / "run"
    job = _train(corpus, out, "--ranks", "4", "--epochs", "40", "--set",
                 "elastic.min_workers=2", "--set", "elastic.quorum_timeout_s=3")
    _rounds_seen(out, job, 4 * 2)
    lose(out, 3), lose(out, 2)
    assert wait_until(lambda: [e for e in _events(out) if e["type"] == "member_lost"], 60, 0.1)
    lose(out, 1)
    _, err = job.communicate(timeout=180)
    assert job.returncode == 2, err[-2000:]
    assert err.count("\n") == 1 and err.startswith("labavg: error: "), err[-2000:]
    assert ("fewer than elastic.min_workers = 2 workers were present for "
            "elastic.quorum_timeout_s = 3 s") in err
    lost = [e for e in _events(out) if e["type"] == "member_lost"]
    by_rank = {e["rank"]: e for e in lost}
    assert len(lost) == 2 and sorted(by_rank) == [0, 1], lost  # one event per survivor
    assert all(e["lost"] == [2, 3] and e["size"] == 2 for e in lost)
    assert not processes_naming(out) and not (out / ".elastic.json").exists()


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130)])
def test_a_signal_to_labavg_train_ends_the_elastic_job(corpus, tmp_path, signum, code):
    """The launcher, its lighthouse and every worker end with the command the user started."""
    out = tmp_path / "run"
    job = _train(corpus, out, "--ranks", "2", "--epochs", "40")
    _rounds_seen(out, job, 2)
    job.send_signal(signum)
    _, err = job.communicate(timeout=60)
    assert job.returncode == code, err[-2000:]
    assert err.count("\n") <= 1, err
    assert wait_until(lambda: not processes_naming(out), 15, 0.1), processes_naming(out)
    assert not (out / ".elastic.json").exists()
