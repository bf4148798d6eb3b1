"""The elastic launcher on real processes: a lost worker, a join, signals, nothing left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from labavg.comm.elastic_launch import request_join

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def _launch(tmp_path: Path, nproc: int, *worker: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "labavg.comm.elastic_launch", "--nproc", str(nproc),
           "--state-file", str(tmp_path / "state.json"), "--join-socket", str(tmp_path / "join"),
           "--", str(ROOT / "tests" / "elastic_worker.py"), *worker]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, start_new_session=True)


def _state(tmp_path: Path, timeout: float = 60) -> dict:
    path = tmp_path / "state.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
    raise AssertionError(f"no {path}")


def _lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _gone(pids) -> bool:
    return not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in pids)


def test_a_lost_worker_is_reported_once_the_others_finish_and_a_join_takes_its_place(tmp_path):
    job = _launch(tmp_path, 3, "80", "--admit", "--die-rank", "2", "--die-at", "10",
                  "--pause", "0.1")
    pids = {int(p) for p in _state(tmp_path)["workers"].values()}
    deadline = time.monotonic() + 90
    while len(_state(tmp_path)["workers"]) == 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sorted(_state(tmp_path)["workers"]) == ["0", "1"]
    # Every place is taken but rank 2's: the join gets it.
    answer = request_join(tmp_path / "join")
    assert answer["rank"] == 2 and psutil.pid_exists(answer["pid"])
    assert "error" in request_join(tmp_path / "join")  # all 3 running again
    out, err = job.communicate(timeout=180)
    assert job.returncode == 0, err[-1500:]
    assert err.count("left the job") == 1
    assert "labavg: rank 2 left the job (exit status 1); 2 workers go on" in err
    rounds = _lines(out)
    healed = [d for d in rounds if d["healed"]]
    assert [d["rank"] for d in healed] == [2]
    last = {d["rank"]: d for d in rounds if d["round"] == 80}
    assert sorted(last) == [0, 1, 2] and last[0]["x"] == last[1]["x"] == last[2]["x"]
    assert not (tmp_path / "state.json").exists() and not (tmp_path / "join").exists()
    assert _gone(pids | {answer["pid"]})


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_the_launcher_ends_every_worker(tmp_path, signum, code):
    job = _launch(tmp_path, 2, "100000", "--pause", "0.05")
    state = _state(tmp_path)
    pids = {int(p) for p in state["workers"].values()}
    time.sleep(3)
    job.send_signal(signum)
    out, err = job.communicate(timeout=60)
    assert job.returncode == code, err[-1500:]
    assert "left the job" not in err
    assert _gone(pids)
    assert not (tmp_path / "state.json").exists()


def test_a_worker_killed_by_a_signal_is_named_so(tmp_path):
    job = _launch(tmp_path, 2, "60", "--pause", "0.1")
    state = _state(tmp_path)
    seen = [job.stdout.readline() for _ in range(6)]  # three rounds of both: started
    os.kill(int(state["workers"]["1"]), signal.SIGKILL)
    out, err = job.communicate(timeout=120)
    out = "".join(seen) + out
    assert job.returncode == 0, err[-1500:]
    assert "labavg: rank 1 left the job (signal SIGKILL); 1 worker goes on" in err
    assert max(d["round"] for d in _lines(out) if d["rank"] == 0) == 60
