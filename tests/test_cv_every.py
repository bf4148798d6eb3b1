"""`cv_every`: held-out CV checks inside epochs (labavg.training.cv_check), at the right steps
on every backend, off the training clock, and without changing what is trained."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from labavg.averaging.settings import AveragingConfig
from labavg.base.errors import UserError
from labavg.base.events import CVChecked, EpochDone, RunStarted, event_from_dict
from labavg.data.settings import DataConfig
from labavg.jobs.runs import run_training
from labavg.training.config import TrainConfig, check_values, validate
from labavg.training.model import ModelConfig
from tests.support import child_env, stopped_then_resumed


def _config(corpus: Path, out: Path, **changes) -> TrainConfig:
    cfg = TrainConfig(
        out=str(out), ranks=2, averaging=AveragingConfig(average_every=3), minibatch=64,
        epochs=2, lr=0.004, checkpoint_every=2, tensorboard=False, speedup_pairs=0,
        model=ModelConfig(hidden_layers=1, hidden_dim=32),
        data=DataConfig(data=str(corpus), context=2, buffer_frames=2048))
    return validate(replace(cfg, **changes))


def _events(run: Path) -> list:
    lines = (run / "events.jsonl").read_text().splitlines()
    return [e for e in map(event_from_dict, map(json.loads, lines)) if e is not None]


def _checks(run: Path) -> dict[int, list[CVChecked]]:
    """The run's checks by rank."""
    found: dict[int, list[CVChecked]] = {}
    for e in _events(run):
        if isinstance(e, CVChecked):
            found.setdefault(e.rank, []).append(e)
    return found


def _expected_steps(run: Path, every: int, epochs: int) -> list[int]:
    per_epoch = next(e for e in _events(run) if isinstance(e, RunStarted)).steps_per_epoch
    ends = {per_epoch * (i + 1) for i in range(epochs)}
    return sorted({s for s in range(1, per_epoch * epochs + 1) if s % every == 0} | ends)


def _final(run: Path) -> bytes:
    return (run / "final.pt").read_bytes()


@pytest.mark.parametrize("averaging", [AveragingConfig(average_every=3),
                                       AveragingConfig(average_every=3, overlap="eager"),
                                       AveragingConfig(average_every=3, method="bmuf")],
                         ids=["model", "eager", "bmuf"])
def test_checks_come_at_their_steps_and_leave_the_model_as_without(corpus, tmp_path, averaging):
    off = _config(corpus, tmp_path / "off", averaging=averaging)
    on = _config(corpus, tmp_path / "on", averaging=averaging, cv_every=4)
    run_training(off, progress=False)
    run_training(on, progress=False)
    assert _final(tmp_path / "on") == _final(tmp_path / "off")  # bitwise: final.pt's bytes
    assert not _checks(tmp_path / "off")  # off by default: no 'cv' event at all
    checks = _checks(tmp_path / "on")
    steps = _expected_steps(tmp_path / "on", 4, 2)
    assert sorted(checks) == [0, 1]
    for rank in (0, 1):
        assert [c.step for c in checks[rank]] == steps
    for mine, other in zip(*checks.values()):  # one global CV, the same on every rank
        assert mine.cv_frame_accuracy == other.cv_frame_accuracy and 0 < mine.cv_loss
    ours = checks[0]
    clock = [c.train_seconds for c in ours]
    assert all(0 < a < b for a, b in zip(clock, clock[1:]))
    assert all(c.cv_seconds > 0 for c in ours)
    # The epoch ends' checks are the epoch events' CV, at 1.0 and 2.0 epochs.
    epochs = [e for e in _events(tmp_path / "on") if isinstance(e, EpochDone) and e.rank == 0]
    ends = [c for c in ours if c.epoch_end]
    assert [c.epochs for c in ends] == [1.0, 2.0]
    assert [c.cv_frame_accuracy for c in ends] == [e.cv_frame_accuracy for e in epochs]
    inside = [c.epochs for c in ours if not c.epoch_end]
    assert all(0 < x < 2 and x != 1.0 for x in inside) and inside == sorted(inside)


def test_the_clock_leaves_the_checks_out(corpus, tmp_path):
    """The training clock at a check is the time up to it less every CV pass before it."""
    run_training(_config(corpus, tmp_path / "on", ranks=1, cv_every=2), progress=False)
    ours = _checks(tmp_path / "on")[0]
    for before, after in zip(ours, ours[1:]):
        assert after.train_seconds > before.train_seconds
    finished = next(e for e in _events(tmp_path / "on") if e.type == "run_finished")
    assert ours[-1].train_seconds + sum(c.cv_seconds for c in ours) < finished.wall_seconds


@pytest.mark.parametrize("every, stop, round_", [(5, 7, 9), (6, 4, 6)],
                         ids=["between", "at-a-check"])
def test_a_resumed_run_checks_at_the_same_steps(corpus, tmp_path, every, stop, round_):
    """Stopped at the round after `stop` (K = 3: step 9, or step 6, a check's step, where the
    stop skips the check and the resume takes it), then resumed to the end."""
    whole = _config(corpus, tmp_path / "whole", cv_every=every)
    run_training(whole, progress=False)
    cut = _config(corpus, tmp_path / "cut", cv_every=every)
    stopped_then_resumed(cut, at_step=stop)
    assert _final(tmp_path / "cut") == _final(tmp_path / "whole")
    steps = _expected_steps(tmp_path / "whole", every, 2)
    assert [e.step for e in _events(tmp_path / "cut") if e.type == "message" and e.rank == 0
            and e.text == "stopped on request"] == [round_]
    for rank in (0, 1):
        # A resume goes on from its checkpoint: the steps from there are checked again.
        assert sorted({c.step for c in _checks(tmp_path / "cut")[rank]}) == steps
    resumed = _checks(tmp_path / "cut")[0]
    assert resumed[-1].train_seconds > resumed[0].train_seconds  # the clock goes on


@pytest.mark.parametrize("value", [-1, 10**9 + 1])
def test_an_out_of_range_cv_every_is_refused_in_one_line(value):
    with pytest.raises(UserError) as caught:
        check_values(TrainConfig(cv_every=value))
    message = str(caught.value)
    assert "cv_every" in message and "0 turns the checks off" in message
    assert "\n" not in message


@pytest.mark.slow  # end to end: out of the fast suite's 10 minutes
def test_two_mpi_ranks_check_as_the_in_process_ones(corpus, tmp_path):
    """Real MPI ranks (mpiexec started by the CLI): the same checks, the same model."""
    small = ["--data", str(corpus), "--ranks", "2", "--minibatch", "64", "--epochs", "1",
             "--hidden-layers", "1", "--hidden-dim", "32", "--context", "2",
             "--average-every", "3", "--cv-every", "4", "--no-progress", "--speedup-pairs", "0",
             "--set", "tensorboard=false", "--set", "data.buffer_frames=2048"]
    for backend in ("mpi", "inproc"):
        done = subprocess.run([sys.executable, "-m", "labavg", "train", *small, "--backend",
                               backend, "--out", str(tmp_path / backend)], capture_output=True,
                              text=True, env=child_env(), timeout=240)
        assert done.returncode == 0, done.stderr[-2000:]
    assert _final(tmp_path / "mpi") == _final(tmp_path / "inproc")
    mpi, inproc = _checks(tmp_path / "mpi"), _checks(tmp_path / "inproc")
    assert sorted(mpi) == [0, 1]
    assert [c.step for c in mpi[1]] == [c.step for c in inproc[1]] == _expected_steps(
        tmp_path / "mpi", 4, 1)
    assert ([c.cv_frame_accuracy for c in mpi[0]]
            == pytest.approx([c.cv_frame_accuracy for c in inproc[0]]))


@pytest.mark.slow
def test_an_elastic_run_checks_among_the_workers_present(corpus, tmp_path):
    """torchft's elastic communicator: every collective is a round among the workers present.
    A worker lost at step 20 leaves; the others check at the same steps as before, over the
    whole CV set split among them, and train the same model as without the checks."""
    runs = {}
    for every in ("0", "7"):
        out = tmp_path / f"cv{every}"
        done = subprocess.run(
            [sys.executable, "-m", "labavg", "train", "--data", str(corpus), "--out", str(out),
             "--hidden-layers", "2", "--hidden-dim", "64", "--minibatch", "32", "--no-progress",
             "--speedup-pairs", "0", "--backend", "torch", "--average-every", "5", "--ranks",
             "3", "--epochs", "1", "--cv-every", every, "--set", 'on_rank_loss="continue"',
             "--set", 'inject_fault="kill@rank2:step20"', "--set", "tensorboard=false"],
            capture_output=True, text=True, env=child_env(), timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "rank 2 left the job" in done.stderr
        runs[every] = out
    assert _final(runs["7"]) == _final(runs["0"])
    checks = _checks(runs["7"])
    steps = _expected_steps(runs["7"], 7, 1)
    assert [c.step for c in checks[0]] == [c.step for c in checks[1]] == steps
    assert [c.step for c in checks[2]] == [7, 14]  # lost after step 20
    for mine, other in zip(checks[0], checks[1]):
        assert mine.cv_frame_accuracy == other.cv_frame_accuracy and 0 < mine.cv_loss
    assert [c.cv_frame_accuracy for c in checks[2]] == [c.cv_frame_accuracy for c in checks[0][:2]]
