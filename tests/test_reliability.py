"""No hang, no stray job, no resume that changes results: the job owns its ranks.

Every test here that starts a job bounds it in time: a regression shows as a failure, never as a
hung test run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import kaldiio
import numpy as np
import pytest
import torch

from labavg.base import checkpoint
from labavg.training.config import TrainConfig
from labavg.base.settings import to_dict
from labavg.data.dataset import open_dataset
from labavg.data.frames import split_cv
from labavg.base.errors import UserError
from labavg.base.events import CheckpointSaved, EpochDone
from labavg.jobs.index import read_events
from labavg.jobs.processes import pid_alive as _alive
from labavg.jobs.run_dir import accept_run_dir, run_dir_lock
from labavg.jobs.runs import run_training
from labavg.jobs.summary import load_summary
from labavg.training.runner import train

from support import wait_for
from test_train import small_config

REPO = Path(__file__).resolve().parents[1]


def _cli(*args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "labavg", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, **kwargs)


def _train_args(corpus: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(corpus), "--out", str(out), "--minibatch", "64",
            "--hidden-layers", "1", "--hidden-dim", "32", "--context", "1", "--no-progress",
            "--set", "tensorboard=false", *extra]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def _rank_pids(run_dir: Path) -> dict[int, int]:
    if not (run_dir / "events.jsonl").is_file():
        return {}
    return {e["rank"]: e["pid"] for e in read_events(run_dir) if e["type"] == "run_started"}


def _max_step(run_dir: Path) -> int:
    if not (run_dir / "events.jsonl").is_file():
        return 0
    return max((e.get("step", 0) for e in read_events(run_dir)), default=0)


def _clean_up(proc: subprocess.Popen, pids: list[int]) -> None:
    """However a test ended: no rank it started and no launcher is left running."""
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture
def poisoned_corpus(corpus, tmp_path) -> tuple[Path, str]:
    """A copy of the tiny corpus where one CV utterance that only rank 1 evaluates holds a NaN.

    Every rank checks the whole CV set before training (a NaN there used to surface only at
    the first CV pass, at the epoch's end): the job ends once, before any minibatch. (A tiny
    corpus cannot hide a NaN in a training utterance from rank 0: the input normalisation
    reads every training utterance on every rank. An error one rank alone meets mid-run is
    tests/test_faults.py's injected `raise@rank1`.)"""
    import shutil

    copy = tmp_path / "poisoned"
    shutil.copytree(corpus, copy)
    keys = sorted(line.split()[0] for line in (copy / "feats.scp").read_text().splitlines())
    _, cv = split_cv(keys, 0.1, seed=0)
    victim = cv[1::2][0]  # rank 1's share of the CV set at 2 ranks
    feats = dict(kaldiio.load_scp(str(copy / "feats.scp")))
    bad = np.array(feats[victim], dtype=np.float32)
    bad[3, 2] = np.nan
    kaldiio.save_ark(str(copy / "bad.ark"), {victim: bad}, scp=str(copy / "bad.scp"))
    lines = [line if line.split()[0] != victim else (copy / "bad.scp").read_text().strip()
             for line in (copy / "feats.scp").read_text().splitlines()]
    (copy / "feats.scp").write_text("\n".join(lines) + "\n")
    return copy, victim


# -- any error on any rank ends the whole job, printed once ----------------------------------


@pytest.mark.parametrize("launch", ["labavg", "mpiexec"])
def test_a_nan_in_the_cv_set_ends_the_job_once_before_training(poisoned_corpus, tmp_path, launch):
    data, victim = poisoned_corpus
    args = _train_args(data, tmp_path / "run", "--backend", "mpi", "--epochs", "1")
    if launch == "labavg":
        command = [sys.executable, "-m", "labavg", *args, "--ranks", "2"]
    else:
        from labavg.comm.launchers import mpiexec_command

        command = mpiexec_command(2, ["-m", "labavg", *args])
    start = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert time.monotonic() - start < 90
    assert proc.returncode == 2, proc.stderr
    mine = [line for line in proc.stderr.splitlines() if line.startswith("labavg: error:")]
    assert len(mine) == 1, proc.stderr
    assert victim in mine[0] and "NaN" in mine[0], mine[0]
    assert not (tmp_path / "run" / "events.jsonl").exists() or '"minibatch"' not in (
        tmp_path / "run" / "events.jsonl").read_text()  # found before training
    if launch == "labavg":  # labavg's launcher relays the one message and nothing else
        assert _error_lines(proc.stderr) == mine, proc.stderr
        assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("flags, says", [
    (["--minibatch", "20000", "--set", "data.buffer_frames=20000"], "too little training data"),
    (["--minibatch", "100000000"], "data.buffer_frames (32768) must be at least"),  # a setting
    (["--ali", "ark:/nonexistent/ali.ark"], "/nonexistent/ali.ark"),  # the data
])
def test_error_on_every_rank_is_printed_once(corpus, tmp_path, flags, says):
    """Direct mpiexec, every rank meets the same bad input: one message, exit 2, no run dir."""
    from labavg.comm.launchers import mpiexec_command

    out = tmp_path / "run"
    args = _train_args(corpus, out, "--backend", "mpi", *flags)
    proc = subprocess.run(mpiexec_command(2, ["-m", "labavg", *args]), capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    mine = [line for line in proc.stderr.splitlines() if line.startswith("labavg: error:")]
    assert len(mine) == 1 and says in mine[0], proc.stderr
    assert not out.exists()


# -- the watchdog ----------------------------------------------------------------------------


@pytest.mark.slow
def test_hang_fault_is_ended_by_the_watchdog(corpus, tmp_path):
    out = tmp_path / "run"
    start = time.monotonic()
    proc = _cli(*_train_args(corpus, out, "--backend", "mpi", "--ranks", "2", "--epochs", "2",
                             "--set", 'inject_fault="hang@rank1:step4"',
                             "--set", "watchdog_seconds=3"), timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 3, proc.stderr
    assert elapsed < 60
    assert "watchdog: rank 1 made no progress" in proc.stderr and "after step 4" in proc.stderr
    assert len([l for l in proc.stderr.splitlines() if l.startswith("labavg: error:")]) == 1


@pytest.mark.slow
def test_stopped_rank_is_named_by_the_watchdog(corpus, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "labavg", *_train_args(
            corpus, out, "--backend", "mpi", "--ranks", "2", "--epochs", "200",
            "--set", "watchdog_seconds=3")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    victim = None
    try:
        wait_for(lambda: len(_rank_pids(out)) == 2 and _max_step(out) >= 3, 60, "training")
        victim = _rank_pids(out)[1]
        os.kill(victim, signal.SIGSTOP)
        start = time.monotonic()
        _, stderr = proc.communicate(timeout=60)
        assert time.monotonic() - start < 30
        assert proc.returncode == 3, stderr
        assert f"rank 1 (pid {victim}" in stderr and "silent" in stderr, stderr
    finally:
        _clean_up(proc, [victim] if victim is not None else [])


@pytest.mark.slow
def test_torchrun_hang_is_ended_by_the_watchdog(corpus, tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", "29731", "-m", "labavg",
               *_train_args(corpus, out, "--backend", "torch", "--ranks", "2",
                            "--set", 'inject_fault="hang@rank1:step4"', "--set", "watchdog_seconds=3")]
    start = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=150, cwd=REPO)
    assert proc.returncode != 0
    assert time.monotonic() - start < 100
    assert "watchdog: rank 1 made no progress" in proc.stderr, proc.stderr[-3000:]


def test_watchdog_names_a_silent_peer_and_waits_for_a_busy_one(tmp_path):
    """The verdicts themselves, on a fake clock and hand-written heartbeat files."""
    from labavg.comm.watchdog import Watchdog

    class Comm:
        rank, size = 0, 3

        def abort(self, *args, **kwargs):
            raise AssertionError("check() must not end the job itself")

    dog = Watchdog(Comm(), limit=10, run_dir=tmp_path)
    dog.dir.mkdir()

    def heartbeat(rank: int, count: int, collective=None) -> None:
        (dog.dir / f"rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "pid": 100 + rank, "host": "h", "step": 7, "collective": collective,
             "count": count}))

    dog.enter("allreduce")
    since = dog._collective_since
    heartbeat(1, 1)
    heartbeat(2, 1)
    assert dog.check(since + 5) is None  # not waited long enough
    assert dog.check(since + 11) is None  # peers first seen now: fresh
    heartbeat(1, 2)  # rank 1 keeps beating (busy), rank 2 does not (stopped)
    assert dog.check(since + 15) is None
    heartbeat(1, 3)
    verdict = dog.check(since + 22)
    assert verdict is not None and "rank 2 (pid 102 on h, last step 7)" in verdict
    assert "rank 1" not in verdict.split("silent")[0]
    dog.leave()
    assert dog.check(time.monotonic() + 5) is None
    verdict = dog.check(time.monotonic() + 11)
    assert verdict is not None and "rank 0 made no progress" in verdict


# -- the launcher owns its job ---------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGKILL, pytest.param(signal.SIGTERM, marks=pytest.mark.slow),
                                 signal.SIGINT])  # SIGTERM slow: fast-suite margin
@pytest.mark.slow  # end to end: out of the fast suite's 10 minutes
def test_killing_the_launcher_ends_its_ranks(corpus, tmp_path, sig):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "labavg", *_train_args(corpus, out, "--backend", "mpi",
                                                       "--ranks", "2", "--epochs", "200")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    pids = {}
    try:
        wait_for(lambda: len(_rank_pids(out)) == 2 and _max_step(out) >= 2, 60, "training")
        pids = _rank_pids(out)
        proc.send_signal(sig)
        proc.wait(timeout=30)
        wait_for(lambda: not any(_alive(p) for p in pids.values()), 20,
                  f"ranks {pids} to end after {sig.name}")
        # The run directory is free again: a resume may take it.
        with run_dir_lock(out):
            pass
    finally:
        _clean_up(proc, list(pids.values()))


@pytest.mark.slow  # keeps README's fast command under 10 minutes; CI runs it
def test_second_job_on_a_run_directory_is_refused(corpus, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "labavg", *_train_args(corpus, out, "--backend", "mpi",
                                                       "--ranks", "2", "--epochs", "200",
                                                       "--checkpoint-every", "1")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        wait_for(lambda: checkpoint.latest_step(out) is not None, 60, "a checkpoint")
        second = _cli("train", "--resume", str(out), "--no-progress", timeout=60)
        assert second.returncode == 2, second.stderr
        assert _error_lines(second.stderr) == [
            line for line in second.stderr.splitlines() if "is in use by another job" in line]
        assert f"pid {proc.pid}" in second.stderr
        inproc = _cli(*_train_args(corpus, out, "--epochs", "1"), timeout=60)
        assert inproc.returncode == 2 and "in use by another job" in inproc.stderr
        assert proc.poll() is None  # the first job trains on, untouched
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_lock_is_exclusive_and_cleans_up_a_directory_it_made(tmp_path):
    out = tmp_path / "fresh"
    with run_dir_lock(out):
        assert (out / ".lock").is_file()
        accept_run_dir(out)  # the holder is named once the command's checks have passed
        with pytest.raises(UserError, match=r"in use by another job \(pid \d+ on "):
            with run_dir_lock(out):
                pass
    assert not out.exists()  # it held nothing but the lock
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file, not a directory"):
        with run_dir_lock(tmp_path / "file"):
            pass


# -- resume refuses what would change results, and is exact for every schedule --------------


@pytest.mark.slow  # end to end: out of the fast suite's 10 minutes
def test_resume_of_a_finished_run_is_refused_and_leaves_it_as_it_was(corpus, tmp_path):
    out = tmp_path / "run"
    assert _cli(*_train_args(corpus, out, "--epochs", "1")).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"}
    proc = _cli("train", "--resume", str(out), "--no-progress")
    assert proc.returncode == 2
    assert _error_lines(proc.stderr) == [f"labavg: error: --resume: {out} has finished "
                                         f"(step {load_summary(out).steps}, summary.json); "
                                         "nothing to resume: start a new run with another --out "
                                         "to train more"]
    assert {p.name: p.read_bytes() for p in out.iterdir()
            if p.is_file() and p.name != ".lock"} == before


def _interrupted(cfg: TrainConfig, after_saves: int) -> Path:
    """Train `cfg` in-process and stop it after rank 1's `after_saves`-th checkpoint."""
    run_dir = Path(cfg.out)
    stream = train(cfg, open_dataset(cfg.data.data), run_dir)
    saved = 0
    for event in stream:
        if isinstance(event, CheckpointSaved) and event.rank == 1:
            saved += 1
            if saved == after_saves:
                break
    stream.close()
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg)))
    return run_dir


@pytest.mark.slow  # keeps README's fast command under 10 minutes; CI runs it
def test_resume_with_other_settings_is_refused(corpus, tmp_path):
    cfg = small_config(corpus, tmp_path / "cut")
    run_dir = _interrupted(cfg, 2)
    for flags, named in ((["--ranks", "4"], "ranks = 2 -> 4"),
                         (["--hidden-dim", "64"], "model.hidden_dim = 48 -> 64"),
                         (["--lr", "0.01"], "lr = 0.004 -> 0.01")):
        proc = _cli("train", "--resume", str(run_dir), "--no-progress", *flags)
        assert proc.returncode == 2, proc.stderr
        assert len(_error_lines(proc.stderr)) == 1 and named in proc.stderr, proc.stderr
    proc = _cli("train", "--resume", str(run_dir), "--no-progress", "--threads", "1",
                "--backend", "inproc")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow  # end to end: out of the fast suite's 10 minutes
def test_resume_refuses_a_truncated_config_and_a_resized_model(corpus, tmp_path):
    cfg = small_config(corpus, tmp_path / "cut")
    run_dir = _interrupted(cfg, 2)
    good = (run_dir / "config.json").read_text()
    (run_dir / "config.json").write_text(good[: len(good) // 2])
    proc = _cli("train", "--resume", str(run_dir), "--no-progress")
    assert proc.returncode == 2 and len(_error_lines(proc.stderr)) == 1
    assert "config.json: not a valid labavg configuration" in proc.stderr
    # A checkpoint whose parameters do not fit the configured model (an edited run directory).
    step, _ = checkpoint.latest_step(run_dir)
    (run_dir / "config.json").write_text(good)
    for rank in range(2):
        state = checkpoint.load_rank_state(run_dir, step, rank)
        state["params"] = state["params"][:-5].clone()
        checkpoint.save_rank_state(run_dir, step, rank, state)
    proc = _cli("train", "--resume", str(run_dir), "--no-progress")
    assert proc.returncode == 2 and len(_error_lines(proc.stderr)) == 1, proc.stderr
    assert "parameters but the configured model has" in proc.stderr


def test_newbob_resume_in_mid_epoch_equals_the_uninterrupted_run(corpus, tmp_path):
    # A learning rate this high, without max-change, makes Newbob reject the first epoch
    # (measured: CV loss 6.7 against 4.8 at the start): its rollback target, the initial
    # model, must survive an interruption in that epoch.
    changes = dict(schedule="newbob", optimizer="sgd", lr=0.5, epochs=3, checkpoint_every=1,
                   max_change_per_sample=1e6, max_param_change=1e6)
    full = small_config(corpus, tmp_path / "full", **changes)
    events = []
    run_training(full, progress=False, on_event=events.append)
    rejected = [e.epoch for e in events if isinstance(e, EpochDone) and e.rank == 0 and not e.accepted]
    assert rejected, "the test needs an epoch that Newbob rejects"

    cut = small_config(corpus, tmp_path / "cut", **changes)
    source = open_dataset(cut.data.data)
    steps_per_epoch = next(e for e in events if e.type == "run_started").steps_per_epoch
    stream = train(cut, source, Path(cut.out))
    for event in stream:  # stop at the first checkpoint inside a rejected epoch
        if (isinstance(event, CheckpointSaved) and event.rank == 1
                and event.step // steps_per_epoch == rejected[0] and event.step % steps_per_epoch):
            break
    stream.close()
    (Path(cut.out) / "events.jsonl").touch()
    run_training(cut, resume=True, progress=False)
    step, _ = checkpoint.latest_step(Path(full.out))
    assert checkpoint.latest_step(Path(cut.out))[0] == step
    for rank in range(2):
        assert torch.equal(checkpoint.load_rank_state(Path(cut.out), step, rank)["params"],
                           checkpoint.load_rank_state(Path(full.out), step, rank)["params"])


def test_resume_removes_orphaned_files_and_keeps_wall_time(corpus, tmp_path):
    cfg = small_config(corpus, tmp_path / "cut")
    run_dir = _interrupted(cfg, 2)
    step, _ = checkpoint.latest_step(run_dir)
    before = checkpoint.load_rank_state(run_dir, step, 0)["progress"]["wall_seconds"]
    assert before > 0
    root = checkpoint.checkpoint_dir(run_dir)
    orphans = [root / ".latest.json.abc.tmp", root / f"{step:09d}" / ".rank0.pt.x.tmp",
               root / f"{step + 3:09d}" / "rank0.pt"]
    for path in orphans:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half")
    (run_dir / "events.jsonl").touch()
    summary = run_training(cfg, resume=True, progress=False)
    assert not any(p.exists() for p in orphans)
    assert not list(run_dir.rglob("*.tmp"))
    assert summary.resumed is True and summary.wall_seconds > before


@pytest.mark.slow  # end to end: out of the fast suite's 10 minutes
def test_torchrun_says_a_cv_data_error_once(poisoned_corpus, tmp_path):
    data, victim = poisoned_corpus
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", "29733", "-m", "labavg",
               *_train_args(data, tmp_path / "run", "--backend", "torch", "--ranks", "2",
                            "--epochs", "1")]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=150, cwd=REPO)
    assert proc.returncode != 0
    mine = [line for line in proc.stderr.splitlines() if line.startswith("labavg:")]
    assert len(mine) == 1, proc.stderr[-3000:]
    assert mine[0].startswith("labavg: error: ") and victim in mine[0] and "NaN" in mine[0]


@pytest.mark.slow  # keeps README's fast command under 10 minutes; CI runs it
def test_inproc_hang_is_ended_by_the_watchdog(corpus, tmp_path):
    """The dashboard's in-process workers: a hung thread breaks the group instead of the class."""
    from labavg.comm.inproc import RankFailed
    from labavg.comm.inproc_group import CollectiveTimeout

    cfg = small_config(corpus, tmp_path / "run", inject_fault="hang@rank1:step4",
                       watchdog_seconds=2.0)
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_training(cfg, progress=False)
    assert time.monotonic() - start < 30
    assert isinstance(info.value.exc, CollectiveTimeout)
    assert "rank(s) [1] did not reach" in str(info.value)


# Fast-suite margin: an end-to-end twin of a fast test; CI runs it with -m slow.
@pytest.mark.slow
def test_inproc_hang_from_the_command_line_is_one_line(corpus, tmp_path):
    proc = _cli(*_train_args(corpus, tmp_path / "run", "--ranks", "2", "--set",
                             'inject_fault="hang@rank1:step3"', "--set", "watchdog_seconds=2"),
                timeout=90)
    assert proc.returncode == 3, proc.stderr
    assert _error_lines(proc.stderr) == [l for l in proc.stderr.splitlines()
                                         if l.startswith("labavg: error: watchdog: rank(s) [1]")]


def test_a_slow_consumer_is_not_a_hung_rank(tmp_path):
    """Time spent by the consumer of the trainer's events does not count against the rank."""
    from labavg.comm.watchdog import Watchdog

    class Comm:
        rank, size = 0, 2

    dog = Watchdog(Comm(), limit=10)
    dog.leave()  # armed
    dog.suspend()
    assert dog.check(time.monotonic() + 60) is None
    dog.resume()
    assert dog.check(time.monotonic() + 5) is None
    assert "made no progress" in dog.check(time.monotonic() + 11)
