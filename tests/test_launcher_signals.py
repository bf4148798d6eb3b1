"""SIGINT or SIGTERM to `labavg train --backend mpi`'s own process, not its process group: the
job ends as Ctrl-C ends it (every rank gone, one line saying it was interrupted, exit status
128 + the signal), also when the launcher started with SIGINT ignored as a shell's background
job does, and `--resume` finishes the run."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import psutil
import pytest

from tests.support import PYTHON, child_env


def _trained_steps(run) -> int:
    try:
        lines = (run / "events.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return sum(1 for line in lines if '"type": "minibatch"' in line)


def _start(corpus, run, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [PYTHON, "-m", "labavg", "train", "--data", str(corpus), "--out", str(run), "--ranks", "2",
         "--backend", "mpi", "--minibatch", "64", "--no-progress", "--set", "model.hidden_layers=1",
         "--set", "model.hidden_dim=32", "--checkpoint-every", "1", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
        # What a shell does to a job started with `&`: SIGINT ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))


@pytest.mark.slow  # two MPI ranks started and ended: ~30 s under load
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_launcher_alone_ends_the_job_as_ctrl_c_does(corpus, tmp_path, signum):
    run = tmp_path / "run"
    proc = _start(corpus, run, "--epochs", "40")
    deadline = time.monotonic() + 180
    while (_trained_steps(run) < 20 or not (run / "checkpoints" / "latest.json").exists()) \
            and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.3)
    assert proc.poll() is None, proc.communicate()
    family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    assert len(family) >= 4  # mpiexec, its proxy and two ranks
    sent = time.monotonic()
    proc.send_signal(signum)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{signal.Signals(signum).name} to the launcher was ignored: the job went on")
    took = time.monotonic() - sent
    assert proc.returncode == 128 + signum, err
    lines = err.strip().splitlines()
    # One line, the one every long command says (labavg.cli.signals), once the job has ended.
    assert lines == [f"labavg: interrupted ({signal.Signals(signum).name}): rerun "
                     f"`labavg train --resume {run}` to go on"], err
    assert "exit status" not in err and "Ctrl-C" not in out
    left = [p for p in family if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert left == [], f"processes left after {took:.1f} s"
    assert took < 30
    # The run continues where it was cut, to the end.
    if signum == signal.SIGTERM:
        resumed = subprocess.run([PYTHON, "-m", "labavg", "train", "--resume", str(run),
                                  "--no-progress", "--backend", "inproc"],
                                 capture_output=True, text=True, env=child_env(), timeout=1200)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert json.loads((run / "summary.json").read_text())["resumed"] is True
