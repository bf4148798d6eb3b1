"""The trainer end to end: averaging, backends agreeing, resume, run directories, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from labavg.base import checkpoint
from labavg.averaging.interface import AveragerInfo
from labavg.averaging.mean import average_parameters, flatten_parameters
from labavg.averaging.settings import AveragingConfig
from labavg.comm.inproc import run_inproc
from labavg.data.settings import DataConfig
from labavg.training.config import TrainConfig, validate
from labavg.data.dataset import open_dataset
from labavg.base.events import Averaged, CheckpointSaved, EpochDone, MinibatchDone, RunStarted
from labavg.training.model import DNN, ModelConfig
from labavg.jobs.index import read_events
from labavg.jobs.runs import run_training
from labavg.jobs.summary import load_summary
from labavg.training.rank import train_rank
from labavg.training.runner import train

PYTHON = sys.executable


def small_config(corpus: Path, out: Path, **changes) -> TrainConfig:
    cfg = TrainConfig(
        out=str(out), ranks=2, averaging=AveragingConfig(average_every=3), minibatch=64,
        epochs=2, lr=0.004, checkpoint_every=2, tensorboard=False,
        model=ModelConfig(hidden_layers=2, hidden_dim=48),
        data=DataConfig(data=str(corpus), context=2, buffer_frames=2048),
    )
    return validate(replace(cfg, **changes))


def final_params(run_dir: Path, rank: int = 0) -> torch.Tensor:
    step, _ = checkpoint.latest_step(run_dir)
    return checkpoint.load_rank_state(run_dir, step, rank)["params"]


def test_flatten_parameters_makes_views_of_one_buffer():
    model = DNN(10, 4, ModelConfig(hidden_layers=2, hidden_dim=8))
    before = [p.detach().clone() for p in model.parameters()]
    flat = flatten_parameters([model])
    assert flat.numel() == sum(p.numel() for p in model.parameters())
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    flat.zero_()
    assert all(torch.count_nonzero(p) == 0 for p in model.parameters())


def test_average_parameters_gives_mean_and_divergence():
    bufs = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 2.0, 1.0])]

    def work(comm):
        buf = bufs[comm.rank].clone()
        stats = average_parameters(buf, comm)
        return buf, stats

    (b0, s0), (b1, s1) = run_inproc(2, work)
    assert torch.equal(b0, torch.tensor([2.0, 2.0, 2.0])) and torch.equal(b0, b1)
    # rank 0 is sqrt(2) away from the mean, whose norm is sqrt(12)
    assert s0.divergence == pytest.approx((2 ** 0.5) / (12 ** 0.5))
    assert s1.divergence == pytest.approx(s0.divergence)


def test_inproc_training_averages_ranks_into_one_model(corpus, tmp_path):
    cfg = small_config(corpus, tmp_path / "run")
    source = open_dataset(cfg.data.data)
    events = list(train(cfg, source, Path(cfg.out)))
    started = [e for e in events if isinstance(e, RunStarted)]
    assert sorted(e.rank for e in started) == [0, 1]
    assert started[0].effective_lr == pytest.approx(2 * cfg.lr)  # linear scaling, num_jobs 2
    rounds = [e for e in events if isinstance(e, Averaged)]
    steps = started[0].steps_per_epoch * cfg.epochs
    # every 3rd minibatch plus each epoch end, on both ranks
    expected = {s for s in range(1, steps + 1) if s % 3 == 0 or s % started[0].steps_per_epoch == 0}
    assert {e.step for e in rounds if e.rank == 0} == expected
    assert all(e.divergence > 0 for e in rounds)
    # Both ranks hold the same model at the end
    assert torch.equal(final_params(Path(cfg.out), 0), final_params(Path(cfg.out), 1))
    epochs = [e for e in events if isinstance(e, EpochDone) and e.rank == 0]
    assert len(epochs) == 2 and all(0 < e.cv_frame_accuracy < 1 for e in epochs)
    losses = [e.loss for e in events if isinstance(e, MinibatchDone) and e.rank == 0]
    assert sum(losses[-5:]) < sum(losses[:5])  # it learns


def test_resume_matches_uninterrupted_run(corpus, tmp_path):
    full = small_config(corpus, tmp_path / "full")
    run_training(full, progress=False)

    cut = small_config(corpus, tmp_path / "cut")
    source = open_dataset(cut.data.data)
    stream = train(cut, source, Path(cut.out))
    saved = 0
    for event in stream:
        if isinstance(event, CheckpointSaved) and event.rank == 1:
            saved += 1
            if saved == 2:  # mid first epoch: a kill at a random point loses work after it
                break
    stream.close()
    step, _ = checkpoint.latest_step(Path(cut.out))
    assert 0 < step < load_summary(Path(full.out)).steps
    (Path(cut.out) / "events.jsonl").touch()
    run_training(replace(cut), resume=True, progress=False)
    assert torch.equal(final_params(Path(cut.out)), final_params(Path(full.out)))


def test_run_directory_and_speedup(corpus, tmp_path):
    base = small_config(corpus, tmp_path / "r1", ranks=1)
    run_training(base, progress=False)
    par = small_config(corpus, tmp_path / "r2", ranks=2)
    summary = run_training(par, progress=False)
    on_disk = load_summary(tmp_path / "r2")
    assert summary == on_disk
    for key in ("ranks", "backend", "average_every", "optimizer", "minibatch", "epochs",
                "frames_trained", "averaging_rounds", "cv_frame_accuracy", "cv_loss",
                "wall_seconds", "compute_seconds", "comm_seconds"):
        assert getattr(on_disk, key) is not None, key
    assert on_disk.ranks == 2 and on_disk.frames_trained == on_disk.steps * 64 * 2
    # The speedup is the run's own paired measurement (tests/test_speedup.py), not the 1-rank
    # run's wall time over this one's.
    assert on_disk.speedup_pairs and on_disk.speedup > 0
    assert on_disk.parallel_efficiency == pytest.approx(on_disk.speedup / 2)
    assert load_summary(tmp_path / "r1").speedup == 1.0
    types = {e["type"] for e in read_events(tmp_path / "r2")}
    assert {"run_started", "minibatch", "average", "epoch", "checkpoint", "run_finished"} <= types
    assert json.loads((tmp_path / "r2" / "config.json").read_text())["ranks"] == 2


def _cli(*args, cwd=None, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "labavg", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


SMALL = ["--minibatch", "64", "--epochs", "1", "--hidden-layers", "1", "--hidden-dim", "32",
         "--context", "2", "--average-every", "3", "--no-progress", "--set", "tensorboard=false",
         "--set", "data.buffer_frames=2048"]


@pytest.mark.slow  # end to end: out of the fast suite's 10 minutes
def test_mpi_ranks_match_inproc_workers(corpus, tmp_path):
    """2 real MPI ranks (mpiexec started by the CLI) and 2 simulated workers: same parameters."""
    common = ["--data", str(corpus), "--ranks", "2", *SMALL]
    mpi = _cli("train", *common, "--backend", "mpi", "--out", str(tmp_path / "mpi"))
    assert mpi.returncode == 0, mpi.stderr
    inproc = _cli("train", *common, "--backend", "inproc", "--out", str(tmp_path / "inproc"))
    assert inproc.returncode == 0, inproc.stderr
    a, b = final_params(tmp_path / "mpi"), final_params(tmp_path / "inproc")
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    ranks = {e["rank"] for e in read_events(tmp_path / "mpi") if e["type"] == "average"}
    assert ranks == {0, 1}
    table = " ".join(mpi.stdout.split())  # without the padding that aligns the columns
    assert "| 2 |" in table  # the results table
    assert table.count("| run |") == 1, "printed once, by labavg, not also by rank 0"


# Fast-suite margin: an end-to-end twin of a fast test; CI runs it with -m slow.
@pytest.mark.slow
def test_torchrun_ranks_match_inproc_workers(corpus, tmp_path):
    torchrun = Path(PYTHON).parent / "torchrun"
    common = ["--data", str(corpus), "--ranks", "2", *SMALL]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
         "0" if False else str(29500 + os.getpid() % 1000), "-m", "labavg", "train", *common,
         "--backend", "torch", "--out", str(tmp_path / "torch")],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    inproc = _cli("train", *common, "--backend", "inproc", "--out", str(tmp_path / "inproc"))
    assert inproc.returncode == 0, inproc.stderr
    torch.testing.assert_close(final_params(tmp_path / "torch"), final_params(tmp_path / "inproc"),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "/nonexistent/data"], "/nonexistent/data"),
        (["--lr", "-1"], "lr must be positive"),
        (["--backend", "carrier-pigeon"], "backend must be one of"),
        (["--ranks", "1000"], "1000"),
        (["--set", "model.widht=3"], "model.widht"),
    ],
)
def test_cli_bad_input_exits_2_with_one_message(corpus, tmp_path, args, message):
    full = ["train", "--data", str(corpus), "--out", str(tmp_path / "run"), *SMALL, *args]
    proc = _cli(*full)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


def test_cli_bad_config_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("ranks = 2\n[model]\nhidden_dim = 'wide'\n")
    proc = _cli("train", str(bad))
    assert proc.returncode == 2 and "model.hidden_dim" in proc.stderr and str(bad) in proc.stderr
    broken = tmp_path / "broken.toml"
    broken.write_text("ranks = = 2\n")
    proc = _cli("train", str(broken))
    assert proc.returncode == 2 and "line 1" in proc.stderr


@pytest.mark.slow  # end to end: out of the fast suite's 10 minutes
def test_cli_refuses_to_overwrite_a_run(corpus, tmp_path):
    args = ["train", "--data", str(corpus), "--out", str(tmp_path / "run"), *SMALL, "--ranks", "1"]
    assert _cli(*args).returncode == 0
    again = _cli(*args)
    assert again.returncode == 2 and "--resume" in again.stderr
    info = _cli("info", str(tmp_path / "run"))
    assert info.returncode == 0 and "| 1 |" in " ".join(info.stdout.split())


def test_config_file_and_flags(tmp_path):
    from labavg.cli.commands import train_config
    from labavg.cli.parser import build_parser

    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('ranks = 4\noptimizer = "ngsgd"\n[model]\nhidden_dim = 256\n'
                        '[ngsgd]\nrank_in = 10\n[averaging]\nmethod = "bmuf"\n'
                        'average_every = 5\n[averaging.bmuf]\nmomentum = 0.5\n')
    args = build_parser().parse_args(["train", str(cfg_file), "--ranks", "8", "--set", "lr=0.01",
                                      "--average-every", "7"])
    cfg = train_config(args)
    assert (cfg.ranks, cfg.optimizer, cfg.model.hidden_dim, cfg.ngsgd.rank_in, cfg.lr) == (
        8, "ngsgd", 256, 10, 0.01)
    # The [averaging] section's flags override its table, as the top level's do.
    assert (cfg.averaging.method, cfg.averaging.average_every, cfg.averaging.table().momentum) \
        == ("bmuf", 7, 0.5)


@pytest.mark.slow  # end to end: out of the fast suite's 10 minutes
def test_train_on_real_kaldi_yesno_recipe(shared_data, tmp_path):
    """Run from the recipe dir like Kaldi: transition ids mapped through final.mdl, 11 pdfs."""
    recipe = shared_data / "kaldi-yesno"
    args = ["train", "--data", "data/train_yesno", "--ali-dir", "exp/mono0a", "--out",
            str(tmp_path / "yes"), "--ranks", "2", "--minibatch", "64", "--epochs", "4",
            "--hidden-layers", "2", "--hidden-dim", "64", "--lr", "0.002", "--no-progress",
            "--set", "tensorboard=false"]
    proc = _cli(*args, cwd=recipe)
    assert proc.returncode == 0, proc.stderr
    summary = load_summary(tmp_path / "yes")
    assert summary.num_pdfs == 11
    # The most frequent pdf covers 29% of the training frames; a trained net does far better.
    assert summary.cv_frame_accuracy > 0.5


def test_cli_data_errors_exit_2(shared_data, tmp_path):
    """Kaldi data errors surface from the CLI as one message and status 2."""
    recipe = shared_data / "kaldi-yesno"
    # The test set has no alignments in exp/mono0a: every key mismatches.
    proc = _cli("train", "--data", "data/test_yesno", "--ali-dir", "exp/mono0a", "--out",
                str(tmp_path / "x"), *SMALL, cwd=recipe)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "align" in proc.stderr.lower()
    # Run from the wrong directory: the scp's relative ark paths point nowhere.
    proc = _cli("train", "--data", str(recipe / "data/train_yesno"), "--ali-dir",
                str(recipe / "exp/mono0a"), "--out", str(tmp_path / "y"), *SMALL, cwd=tmp_path)
    assert proc.returncode == 2 and "feats.scp" in proc.stderr and "working directory" in proc.stderr


class _MeanEveryOtherStep:
    """Implements labavg.averaging.interface.RoundAverager and nothing more: a plain mean every
    2nd minibatch and at epoch ends, whose stats claim node and overlap figures."""

    average_every = 2

    def __init__(self, comm):
        self.comm, self.scopes, self.frames = comm, [], 0

    def observe(self, loss_sum, frames):
        self.frames += frames

    def due(self, step, end_of_epoch):
        return "toy" if step % 2 == 0 or end_of_epoch else None

    def round(self, flat, stop=False, scope="all"):
        self.scopes.append(scope)
        stats = average_parameters(flat, self.comm, stop=stop)
        return replace(stats, within_node=True, overlap_seconds=0.5, overlap_bytes=3,
                       wait_seconds=0.25, in_flight_seconds=1.5)

    def describe(self, flat):
        return AveragerInfo("toy", "allreduce", "fp32", 7, fragment_bytes=(1, 2))

    def restart(self, flat):
        raise AssertionError("no Newbob here")

    def state_dict(self):
        return {}

    def load_state_dict(self, state, flat):
        raise AssertionError("no resume here")


def test_a_minimal_averager_drives_train_rank(corpus, tmp_path):
    """train_rank asks the averager only through its interface and reports what it returns."""
    cfg = small_config(corpus, tmp_path / "run", epochs=1)
    source = open_dataset(cfg.data.data)
    averagers = {}

    def new_averager(plan, minibatch, flat, comm, sizes):
        averagers[comm.rank] = _MeanEveryOtherStep(comm)
        return averagers[comm.rank]

    results = run_inproc(2, lambda comm: list(train_rank(comm, cfg, source,
                                                         new_averager=new_averager)))
    for rank, events in enumerate(results):
        started = next(e for e in events if isinstance(e, RunStarted))
        assert (started.averaging, started.bytes_per_round, started.fragment_bytes) == (
            "toy", 7, (1, 2))
        steps = started.steps_per_epoch
        expected = [s for s in range(1, steps + 1) if s % 2 == 0 or s == steps]
        rounds = [e for e in events if isinstance(e, Averaged)]
        assert [e.step for e in rounds] == expected
        assert {e.scope for e in rounds} == {"toy"} and averagers[rank].scopes == ["toy"] * len(
            expected)
        assert all(e.wait_seconds == 0.25 and e.in_flight_seconds == 1.5 for e in rounds)
        assert {e.average_every for e in rounds} == {2}  # the K it says it keeps
        finished = events[-1]
        assert averagers[rank].frames == finished.frames_trained // cfg.ranks  # observed each
        n = len(expected)
        assert (finished.averaging_rounds, finished.node_rounds) == (n, n)
        assert finished.node_bytes_sent == finished.bytes_sent > 0
        assert (finished.overlap_bytes_sent, finished.overlap_seconds, finished.wait_seconds) == (
            3 * n, 0.5 * n, 0.25 * n)
    cv = [next(e for e in events if isinstance(e, EpochDone)).cv_loss for events in results]
    assert cv[0] == cv[1]  # the last round left one model on both ranks
