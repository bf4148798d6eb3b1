"""Fault injection: diverged, crashing, killed and stopped ranks; checkpoints killed mid-save."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from labavg.base import checkpoint
from labavg.comm.inproc import RankFailed
from labavg.data.dataset import open_dataset
from labavg.base.errors import UserError
from labavg.base.events import Message, RunFinished
from labavg.base.faults import parse_fault
from labavg.jobs.index import read_events
from labavg.jobs.runs import run_training
from labavg.jobs.summary import load_summary
from labavg.training.runner import train

from test_train import SMALL, _cli, final_params, small_config

PYTHON = sys.executable


def test_parse_fault():
    f = parse_fault("nan@rank1:step20")
    assert (f.kind, f.rank, f.step) == ("nan", 1, 20)
    with pytest.raises(UserError, match="KIND@rankR:stepS"):
        parse_fault("nan@1:20")


@pytest.mark.parametrize("nan_step", [2, 4])
def test_nan_rank_is_left_out_of_the_average(corpus, tmp_path, nan_step):
    cfg = small_config(corpus, tmp_path / "run", inject_fault=f"nan@rank1:step{nan_step}")
    source = open_dataset(cfg.data.data)
    events = list(train(cfg, source, Path(cfg.out)))
    notes = [e for e in events if isinstance(e, Message) and "left out" in e.text]
    next_round = -(-nan_step // 3) * 3
    assert [(e.rank, e.step) for e in notes] == [(1, next_round)]
    finished = [e for e in events if isinstance(e, RunFinished)]
    assert len(finished) == 2 and all(e.cv_loss == e.cv_loss for e in finished)  # not NaN
    a, b = final_params(Path(cfg.out), 0), final_params(Path(cfg.out), 1)
    assert torch.isfinite(a).all() and torch.equal(a, b)


def test_all_ranks_nan_restores_previous_average():
    from labavg.averaging.mean import average_parameters
    from labavg.comm.inproc import run_inproc

    def work(comm):
        flat = torch.full((4,), float("nan"))
        fallback = torch.arange(4.0)
        stats = average_parameters(flat, comm, fallback=fallback)
        return flat, stats.dropped

    for flat, dropped in run_inproc(2, work):
        assert torch.equal(flat, torch.arange(4.0)) and dropped == 2


def test_exception_on_one_inproc_rank_names_it(corpus, tmp_path):
    cfg = small_config(corpus, tmp_path / "run", inject_fault="raise@rank1:step5")
    with pytest.raises(RankFailed) as info:
        list(train(cfg, open_dataset(cfg.data.data), Path(cfg.out)))
    assert info.value.rank == 1 and "step 5" in str(info.value)


def test_stop_request_stops_all_ranks_at_one_round_and_resume_finishes(corpus, tmp_path):
    full = small_config(corpus, tmp_path / "full")
    run_training(full, progress=False)
    cfg = small_config(corpus, tmp_path / "run")
    flag = threading.Event()

    def on_event(event):
        if getattr(event, "step", 0) >= 4:
            flag.set()

    summary = run_training(cfg, progress=False, on_event=on_event, should_stop=flag.is_set)
    assert summary.stopped is True and summary.steps % 3 == 0
    assert summary.steps < load_summary(tmp_path / "full").steps
    ends = [e for e in read_events(tmp_path / "run") if e["type"] == "run_finished"]
    assert {e["step"] for e in ends} == {summary.steps} and len(ends) == 2
    (tmp_path / "run" / "summary.json").unlink()
    run_training(cfg, resume=True, progress=False)
    assert torch.equal(final_params(tmp_path / "run"), final_params(tmp_path / "full"))


@pytest.mark.slow  # end to end: out of the fast suite's 10 minutes
@pytest.mark.parametrize("kind, step", [("raise", 5), ("kill", 4), ("kill", 9)])
def test_mpi_rank_failure_ends_the_job(corpus, tmp_path, kind, step):
    args = ["train", "--data", str(corpus), "--ranks", "2", "--backend", "mpi", *SMALL,
            "--epochs", "3", "--out", str(tmp_path / "run"), "--set", f'inject_fault="{kind}@rank1:step{step}"']
    start = time.monotonic()
    proc = _cli(*args, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 60, elapsed
    if kind == "raise":
        assert f"rank 1 failed: RuntimeError: injected fault on rank 1 at step {step}" in proc.stderr
    else:  # hydra reports the lost process; labavg names its rank from the run's log
        assert "rank 1 (pid " in proc.stderr and ") was lost" in proc.stderr
    assert "rank 1" in proc.stderr and "last event at step" in proc.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow
def test_mpi_run_killed_then_resumed_matches_uninterrupted(corpus, tmp_path):
    common = ["--data", str(corpus), "--ranks", "2", "--backend", "mpi", *SMALL, "--epochs", "2",
              "--checkpoint-every", "1"]
    full = _cli("train", *common, "--out", str(tmp_path / "full"))
    assert full.returncode == 0, full.stderr
    killed = _cli("train", *common, "--out", str(tmp_path / "cut"), "--set",
                  'inject_fault="kill@rank0:step8"')
    assert killed.returncode != 0
    step, _ = checkpoint.latest_step(tmp_path / "cut")
    assert step == 6  # the last averaging round (K=3) before the kill
    resumed = _cli("train", "--resume", str(tmp_path / "cut"), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert torch.equal(final_params(tmp_path / "cut"), final_params(tmp_path / "full"))


@pytest.mark.slow  # end to end: out of the fast suite's 10 minutes
@pytest.mark.parametrize("fault", ["raise@rank1:step5", "kill@rank1:step5"])
def test_torchrun_rank_failure_ends_the_job(corpus, tmp_path, fault):
    torchrun = Path(PYTHON).parent / "torchrun"
    args = ["train", "--data", str(corpus), "--ranks", "2", "--backend", "torch", *SMALL,
            "--epochs", "3", "--out", str(tmp_path / "run"), "--set", f'inject_fault="{fault}"']
    start = time.monotonic()
    proc = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
         str(30500 + os.getpid() % 1000), "-m", "labavg", *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode != 0 and time.monotonic() - start < 60
    if fault.startswith("raise"):
        assert "rank 1 failed: RuntimeError: injected fault on rank 1 at step 5" in proc.stderr
    else:  # torchrun names the lost process; the event log says where it got to
        assert "local_rank: 1" in proc.stderr
        steps = [e["step"] for e in read_events(tmp_path / "run") if e["rank"] == 1 and "step" in e]
        assert max(steps) == 5


@pytest.mark.slow  # end to end: out of the fast suite's 10 minutes
def test_checkpoint_killed_mid_save_is_never_half_written(tmp_path):
    """SIGKILL a process that saves checkpoints in a loop; the manifest always names a whole one."""
    script = textwrap.dedent(f"""
        import sys, torch
        from pathlib import Path
        from labavg.base import checkpoint
        run = Path({str(tmp_path)!r})
        step = int(sys.argv[1])
        while True:
            step += 1
            state = {{"step": step, "params": torch.full((2_000_000,), float(step))}}
            checkpoint.save_rank_state(run, step, 0, state)
            checkpoint.commit_checkpoint(run, step, 1)
            print(step, flush=True)
    """)
    for attempt, delay in enumerate((0.0, 0.013, 0.037, 0.071)):
        proc = subprocess.Popen([PYTHON, "-c", script, str(1000 * attempt)], stdout=subprocess.PIPE,
                                text=True)
        for _ in range(2):  # wait until it is saving in earnest
            proc.stdout.readline()
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        step, _ = checkpoint.latest_step(tmp_path)
        assert step > 1000 * attempt
        state = checkpoint.load_rank_state(tmp_path, step, 0)
        assert state["step"] == step
        assert torch.equal(state["params"], torch.full((2_000_000,), float(step)))


# -- the faults that went unseen (issue 24): each ends in one line, in the watchdog's time ----


def _events(run_dir: Path) -> list[dict]:
    try:
        return read_events(run_dir)
    except (OSError, UserError, ValueError):
        return []  # not written yet, or a line being written


def _until_step(proc: subprocess.Popen, run_dir: Path, rank: int, step: int,
                timeout: float = 120) -> float:
    """Wait until `rank` logged `step` (monotonic time then); fail if the job ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if any(e["rank"] == rank and e.get("step", 0) >= step for e in _events(run_dir)):
            return time.monotonic()
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"rank {rank} never logged step {step}: {proc.communicate()[1][-2000:]}")


def _train_cli(corpus: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [PYTHON, "-m", "labavg", "train", "--data", str(corpus), "--ranks", "2", *SMALL,
         "--out", str(out), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_inproc_hang_ends_within_the_watchdogs_time(corpus, tmp_path):
    """A hung in-process worker used to cost the watchdog's time twice (250 s at the default
    120 s): once for the collective, once more waiting for the hung thread to finish."""
    limit = 20
    proc = _train_cli(corpus, tmp_path / "run", "--epochs", "3", "--set",
                      'inject_fault="hang@rank1:step20"', "--set", f"watchdog_seconds={limit}")
    hung = _until_step(proc, tmp_path / "run", 1, 20)
    _, stderr = proc.communicate(timeout=4 * limit)
    # limit, the 5 s confirmation, 5 s for the others to end, and slack for a busy machine
    assert time.monotonic() - hung < limit + 17, time.monotonic() - hung
    assert proc.returncode == 3, stderr
    assert stderr.strip().splitlines() == [stderr.strip()]
    assert stderr.startswith("labavg: error: watchdog: rank(s) [1] did not reach")
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow
def test_torchrun_stopped_rank_ends_the_job_in_one_line(corpus, tmp_path):
    """A SIGSTOPped rank ignores the SIGTERM torchrun sends once its peer's watchdog exits;
    torchrun used to wait 30 s more, then end with its own traceback and exit status 1."""
    out, limit = tmp_path / "run", 5
    proc = _train_cli(corpus, out, "--backend", "torch", "--epochs", "300",
                      "--set", f"watchdog_seconds={limit}")
    _until_step(proc, out, 1, 3)
    victim = next(e["pid"] for e in _events(out) if e["type"] == "run_started" and e["rank"] == 1)
    os.kill(victim, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    assert time.monotonic() - stopped < limit + 5 + 20  # was over limit + 5 + 30
    assert proc.returncode == 3, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and f"rank 1 (pid {victim} on " in lines[0] and "silent" in lines[0], stderr
    assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE


# Fast-suite margin: an end-to-end twin of a fast test; CI runs it with -m slow.
@pytest.mark.slow
def test_torchrun_rank_that_raises_is_one_line_naming_it(corpus, tmp_path):
    proc = _train_cli(corpus, tmp_path / "run", "--backend", "torch", "--epochs", "3",
                      "--set", 'inject_fault="raise@rank1:step5"')
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode not in (0, 2, 3), stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr  # torch's ChildFailedError traceback used to follow
    assert lines[0].startswith("labavg: error: rank 1 failed: RuntimeError: injected fault on "
                               "rank 1 at step 5"), lines[0]
    assert "rank 1 last event at step 5" in lines[0]
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize("content, kind", [("[1, 2]", "a list"), ('"done"', "a string"), ("null", "null")])
def test_info_of_a_summary_that_is_not_an_object_is_one_line(tmp_path, content, kind):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "summary.json").write_text(content)
    proc = _cli("info", str(run))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"labavg: error: {run / 'summary.json'}: not a labavg summary "
                                   f"(JSON holding {kind}, expected an object)")
    assert proc.stdout == ""
