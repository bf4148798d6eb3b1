"""labavg.jobs.launch: every way of starting a run gives the same handle and the same run directory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from labavg.data.settings import DataConfig
from labavg.base.settings import to_dict
from labavg.base.errors import UserError
from labavg.jobs.job_outcome import JobFailed
from labavg.base.events import MinibatchDone, RunFinished, RunStarted
from labavg.jobs.job_run import LAUNCH_FILE
from labavg.jobs.launch import start_run
from labavg.jobs.run_json import RunSummary
from labavg.jobs.index import read_events, read_run_events

from support import stop_at_first_round
from test_dataset_errors import make_data_dir, small_corpus
from test_train import small_config

REPO = Path(__file__).resolve().parents[1]


def test_threads_stream_every_rank_and_return_the_summary(corpus, tmp_path):
    cfg = small_config(corpus, tmp_path / "t", epochs=1)
    handle = start_run(cfg)
    events = list(handle.events(timeout=120))
    assert handle.done() and list(handle.events()) == []  # each event once, the last included
    summary = handle.result()
    assert isinstance(summary, RunSummary) and summary.ranks == 2 and summary.stopped is False
    assert {e.rank for e in events if isinstance(e, MinibatchDone)} == {0, 1}
    assert events == read_run_events(tmp_path / "t")


def test_events_of_a_failed_run_end_and_result_raises_what_ended_it(corpus, tmp_path):
    cfg = small_config(corpus, tmp_path / "bad", epochs=1)
    cfg = replace(cfg, data=replace(cfg.data, data=str(tmp_path / "no-such-corpus")))
    handle = start_run(cfg, launcher="threads")
    assert list(handle.events(timeout=60)) == [] and handle.done()
    with pytest.raises(UserError, match="no-such-corpus"):
        handle.result()


def test_events_time_out_while_the_run_goes_on(corpus, tmp_path):
    cfg = small_config(corpus, tmp_path / "slow", epochs=40)
    handle = start_run(cfg)
    with pytest.raises(TimeoutError):
        for _ in handle.events(timeout=0.5):
            pass
    with pytest.raises(TimeoutError):
        handle.result(timeout=0.1)
    handle.stop()
    assert handle.result(timeout=120).stopped is True


@pytest.mark.slow  # end to end: out of the fast suite's 10 minutes
def test_mpi_job_streams_stops_on_request_and_cleans_up(corpus, tmp_path):
    out = tmp_path / "mpi"
    cfg = small_config(corpus, out, backend="mpi", epochs=3, checkpoint_every=1)
    handle = start_run(cfg)
    assert json.loads((out / LAUNCH_FILE).read_text())["config"] == to_dict(cfg)
    events = stop_at_first_round(handle)
    events += handle.events(timeout=120)  # the rest, to the end
    summary = handle.result(10)
    per_epoch = next(e.steps_per_epoch for e in events if isinstance(e, RunStarted))
    assert summary.stopped is True and summary.ranks == 2
    assert summary.steps < 3 * per_epoch  # ended before its last epoch
    assert {e.rank for e in events if isinstance(e, RunFinished)} == {0, 1}
    assert events == read_run_events(out)
    assert not (out / LAUNCH_FILE).exists() and not (out / ".stop").exists()
    # the stopped run resumes through the same seam, to its end
    finished = start_run(cfg, resume=True).result(300)
    assert finished.stopped is False and finished.steps == 3 * per_epoch


@pytest.mark.slow  # keeps README's fast command under 10 minutes; CI runs it
def test_torchrun_job_trains_every_rank(corpus, tmp_path):
    cfg = small_config(corpus, tmp_path / "tr", backend="torch", epochs=1)
    summary = start_run(cfg).result(180)
    assert summary.ranks == 2 and summary.backend == "torch"
    ranks = {e["rank"] for e in read_events(tmp_path / "tr") if e["type"] == "run_finished"}
    assert ranks == {0, 1}


def test_cwd_runs_the_ranks_where_relative_paths_mean_something(corpus, tmp_path):
    recipe = tmp_path / "recipe"
    shutil.copytree(corpus, recipe / "data" / "train")
    out = tmp_path / "runs" / "rel"
    cfg = small_config(corpus, out, ranks=1, epochs=1)
    cfg = replace(cfg, data=replace(cfg.data, data="data/train"))
    with pytest.raises(UserError, match="data/train"):  # not from here
        start_run(cfg).result()
    summary = start_run(cfg, cwd=recipe).result(120)
    assert summary.config.data.data == "data/train"
    assert Path.cwd() != recipe and (out / "summary.json").is_file()


def test_a_job_checks_the_data_before_any_rank_starts(tmp_path):
    feats, pdfs = small_corpus()
    folder = make_data_dir(tmp_path / "d", feats, pdfs, num_pdfs=5)
    (folder / "cmvn.scp").write_text("utt0 true |\n")
    cfg = small_config(folder, tmp_path / "p", ranks=1, minibatch=8)
    cfg = replace(cfg, data=DataConfig(data=str(folder), context=1, buffer_frames=2048))
    # the launcher checks before any rank starts: a pipe in a data file is refused there
    with pytest.raises(UserError, match="is a pipe"):
        start_run(cfg, launcher="job")
    assert not (tmp_path / "p").exists()


def test_allow_pipes_never_comes_from_the_launch_file(tmp_path):
    feats, pdfs = small_corpus()
    folder = make_data_dir(tmp_path / "d", feats, pdfs, num_pdfs=5)
    marker = tmp_path / "MARKER"
    (folder / "cmvn.scp").write_text(f"utt0 touch {marker} |\n")
    cfg = small_config(folder, tmp_path / "run", ranks=1, minibatch=8)
    cfg = replace(cfg, data=DataConfig(data=str(folder), context=1, buffer_frames=2048))
    launch = tmp_path / "launch.json"
    launch.write_text(json.dumps({"config": to_dict(cfg), "resume": False, "allow_pipes": True}))
    proc = subprocess.run([sys.executable, "-m", "labavg.jobs.rank_main", str(launch),
                           "--no-progress"], capture_output=True, text=True, timeout=120, cwd=REPO)
    # A key a launch file does not hold is refused before anything runs (labavg issue 44).
    assert proc.returncode == 2 and "unknown key 'allow_pipes'" in proc.stderr
    assert not marker.exists()


def test_job_failure_is_an_exit_status(corpus, tmp_path):
    cfg = small_config(corpus, tmp_path / "f", backend="mpi", inject_fault="raise@rank1:step2")
    handle = start_run(cfg)
    with pytest.raises(JobFailed) as info:
        handle.result(120)
    assert info.value.code != 0 and handle.done()
    assert not (tmp_path / "f" / LAUNCH_FILE).exists()
    # what the job said on stderr travels with the error, for a caller without a terminal
    assert info.value.reason and "injected fault" in info.value.reason, info.value.reason
    assert str(info.value) == info.value.reason


def test_an_in_process_run_leaves_torch_threads_as_they_were(corpus, tmp_path):
    import torch

    before = torch.get_num_threads()
    want = 2 if before != 2 else 1
    torch.set_num_threads(want)
    try:
        cfg = small_config(corpus, tmp_path / "th", ranks=1, epochs=1, threads=1)
        handle = start_run(cfg)
        handle.result()
        assert torch.get_num_threads() == want
    finally:
        torch.set_num_threads(before)
