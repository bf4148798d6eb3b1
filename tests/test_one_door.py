"""start_run is the one door to a run: every start validates the settings once, there, and
the ranks of a job run their own entry (labavg.jobs.rank_main), never the command line."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

import labavg.training.config as config_module
from labavg.base.settings import to_dict
from labavg.cli.main import main
from labavg.jobs.job_run import RANK_MODULE, rank_argv
from labavg.jobs.index import SUMMARY
# Imported before any test counts validations: a module first imported during a test would
# keep that test's counting `validate` as its own for the tests after it.
from labavg.jobs.launch import start_run  # noqa: F401

from test_train import small_config

# What `labavg train` is told in these tests: the small model of test_train.small_config.
SMALL = ["--epochs", "1", "--minibatch", "64", "--average-every", "3", "--hidden-layers", "1",
         "--hidden-dim", "32", "--no-progress", "--set", "data.buffer_frames=2048",
         "--set", "tensorboard=false", "--set", "data.context=2"]


@pytest.fixture
def validations(monkeypatch) -> list[str]:
    """The `out` of every configuration validated in this process from now on, wherever
    `validate` was imported (a module's own name for it, and the config module's)."""
    real = config_module.validate
    seen: list[str] = []

    def counted(cfg):
        seen.append(cfg.out)
        return real(cfg)

    for module in list(sys.modules.values()):
        if getattr(module, "validate", None) is real:
            monkeypatch.setattr(module, "validate", counted)
    return seen


def test_the_command_line_validates_once_per_start(corpus, tmp_path, validations, capsys):
    out = tmp_path / "cli"
    assert main(["train", "--data", str(corpus), "--out", str(out), "--ranks", "2", *SMALL]) == 0
    assert validations == [str(out)] and (out / SUMMARY).is_file()
    assert f"run directory: {out}" in capsys.readouterr().out


def test_a_bad_setting_is_refused_by_that_one_validation(corpus, tmp_path, validations, capsys):
    out = tmp_path / "bad"
    code = main(["train", "--data", str(corpus), "--out", str(out), *SMALL, "--set", "lr=-1"])
    assert code == 2 and validations == [str(out)] and not out.exists()
    assert capsys.readouterr().err == ("labavg: error: --set lr=-1: lr must be positive and "
                                       "finite; got -1.0\n")


def test_a_rank_reads_its_launch_file_without_validating_again(corpus, tmp_path, validations):
    from labavg.jobs.rank_main import main as rank_main

    cfg = small_config(corpus, tmp_path / "rank", epochs=1)
    launch = tmp_path / "launch.json"
    launch.write_text(json.dumps({"config": to_dict(cfg), "resume": False}))
    validations.clear()  # small_config validated above; what follows is the rank's part
    assert rank_main([str(launch), "--no-progress"]) == 0
    assert validations == [] and (tmp_path / "rank" / SUMMARY).is_file()


def test_a_damaged_launch_file_is_one_message_and_status_2(tmp_path, capsys):
    from labavg.jobs.rank_main import main as rank_main

    launch = tmp_path / "launch.json"
    launch.write_text(json.dumps({"config": {"ranks": "two"}}))
    assert rank_main([str(launch)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"labavg: error: {launch}: ranks") and err.count("\n") == 1


def test_a_dashboard_start_validates_once(corpus, tmp_path, validations):
    from dashboard.live import LiveRun
    from test_dashboard_state import run_to_end, tiny_settings

    settings = tiny_settings(corpus, tmp_path / "runs")
    assert settings.errors == {}  # the form's own check, made as its boxes were set
    validations.clear()
    live = LiveRun()
    assert live.start(settings), live.status
    run_to_end(live)
    assert validations == [live.run_dir] and (Path(live.run_dir) / SUMMARY).is_file(), live.status


def test_a_sweep_validates_each_point_once_where_it_starts(corpus, tmp_path, validations):
    from labavg.studies.sweep import load_sweep, run_sweep
    from test_sweep import write_sweep

    spec = tmp_path / "s.toml"
    write_sweep(spec, corpus, '"averaging.average_every" = [2, 4]')
    sweep = load_sweep(spec)  # checks every point before any trains: not a start
    validations.clear()
    run_sweep(sweep, tmp_path / "out")
    runs = tmp_path / "out" / "runs"
    assert validations == [str(runs / "average_every_2"), str(runs / "average_every_4")]


def test_a_jobs_ranks_run_their_own_entry_not_the_command_line():
    argv = rank_argv(Path("/r/.launch.json"), progress=False, allow_pipes=True)
    assert argv == ["-m", RANK_MODULE, "/r/.launch.json", "--no-progress", "--allow-pipes"]
    assert RANK_MODULE == "labavg.jobs.rank_main" and "train" not in argv


def test_mpi_ranks_started_from_the_command_line_never_import_it(corpus, tmp_path, monkeypatch,
                                                                 capfd, validations):
    """A real 2-rank MPI job: each rank's Python lists what it imports (-X importtime, through
    the environment the job inherits); labavg.cli is not among it, the rank's entry is."""
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")
    out = tmp_path / "mpi"
    assert main(["train", "--data", str(corpus), "--out", str(out), "--ranks", "2",
                 "--backend", "mpi", *SMALL]) == 0
    assert validations == [str(out)]  # in this process; the ranks are checked above
    err = capfd.readouterr().err
    imported = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)$", err, re.MULTILINE)
    assert "labavg.jobs.runs" in imported and "labavg.training.rank" in imported
    assert not [name for name in imported if name.startswith("labavg.cli")]
