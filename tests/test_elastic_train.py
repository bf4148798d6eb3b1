"""Elastic training end to end: `labavg train --backend torch --set on_rank_loss="continue"`
on real processes under the real lighthouse, a real kill, a real join."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from labavg.base import checkpoint
from labavg.jobs.elastic_join import join
from labavg.jobs.summary import load_summary
from tests.support import child_env, processes_naming

pytestmark = pytest.mark.slow
TINY = ["--hidden-layers", "2", "--hidden-dim", "64", "--minibatch", "32", "--no-progress",
        "--speedup-pairs", "0",
        "--backend", "torch", "--average-every", "5"]
ELASTIC = ["--set", 'on_rank_loss="continue"']


def _train(corpus: Path, out: Path, *args: str, wait: bool = True):
    cmd = [sys.executable, "-m", "labavg", "train", "--data", str(corpus), "--out", str(out),
           *TINY, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env())
    if not wait:
        return proc
    out_text, err = proc.communicate(timeout=600)
    return proc.returncode, out_text, err


def _events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]



def test_a_lost_worker_leaves_and_the_others_finish(corpus, tmp_path):
    out = tmp_path / "run"
    code, _, err = _train(corpus, out, "--ranks", "4", "--epochs", "2", *ELASTIC,
                          "--set", 'inject_fault="kill@rank2:step20"')
    assert code == 0, err[-2000:]
    assert err.count("left the job") == 1
    assert "labavg: rank 2 left the job (signal SIGKILL); 3 workers go on" in err
    events = _events(out)
    lost = [e for e in events if e["type"] == "member_lost"]
    assert sorted(e["rank"] for e in lost) == [0, 1, 3]
    assert all(e["lost"] == [2] and e["size"] == 3 and e["step"] == 20 for e in lost)
    assert all(0 < e["round_seconds"] < 10 for e in lost)
    summary = load_summary(out)
    assert summary.worker_counts == [4, 3] and summary.worker_steps == [0, 20]
    steps = summary.steps
    assert summary.frames_untrained == (steps - 20) * 32  # rank 2's shard from step 20 on
    assert summary.frames_trained == (20 * 4 + (steps - 20) * 3) * 32
    info = subprocess.run([sys.executable, "-m", "labavg", "info", str(out)], capture_output=True,
                          text=True, env=child_env(), check=True).stdout
    assert "4 -> 3" in info
    model = torch.load(out / "final.pt", weights_only=True)
    tensors = [v for v in model.values() if isinstance(v, torch.Tensor)] if isinstance(
        model, dict) else []
    assert (out / "final.pt").stat().st_size > 0
    assert all(torch.isfinite(t).all() for t in tensors)
    assert not processes_naming(out)


def test_the_default_still_stops_the_job_in_one_line(corpus, tmp_path):
    out = tmp_path / "run"
    code, _, err = _train(corpus, out, "--ranks", "3", "--epochs", "2",
                          "--set", 'inject_fault="kill@rank2:step20"')
    assert code != 0
    assert err.count("\n") == 1 and "rank 2 (pid" in err and "was lost" in err, err
    assert not (out / "summary.json").exists()


def test_a_join_takes_the_lost_place_and_holds_the_survivors_state(corpus, tmp_path):
    """BMUF, whose block momentum is the averager's state: after the join, the joiner's
    parameters and averager state are bitwise the survivors'."""
    out = tmp_path / "run"
    job = _train(corpus, out, "--ranks", "3", "--epochs", "15", "--averaging", "bmuf",
                 *ELASTIC, "--set", 'inject_fault="kill@rank2:step10"', wait=False)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if (out / "events.jsonl").exists() and any(
                e["type"] == "member_lost" for e in _events(out)):
            break
        assert job.poll() is None, job.communicate()[1][-2000:]
        time.sleep(0.2)
    joined = join(out, timeout=180)
    assert joined.rank == 2
    out_text, err = job.communicate(timeout=600)
    assert job.returncode == 0, err[-2000:]
    events = _events(out)
    joins = [e for e in events if e["type"] == "member_joined"]
    assert joins and all(e["joined"] == [2] and e["size"] == 3 for e in joins)
    summary = load_summary(out)
    assert summary.worker_counts == [3, 2, 3]
    # The last checkpoint (the run's end): every rank's file, the joiner's included.
    step, _ = checkpoint.latest_step(out)
    states = [checkpoint.load_rank_state(out, step, r) for r in range(3)]
    for r in (1, 2):
        assert torch.equal(states[r]["params"], states[0]["params"])
        for key, value in states[0]["averager"].items():
            other = states[r]["averager"][key]
            assert (torch.equal(value, other) if isinstance(value, torch.Tensor)
                    else value == other), key
        assert states[r]["progress"]["step"] == states[0]["progress"]["step"]
    assert not processes_naming(out)
