"""The reproduction's sweeps (labavg.studies.reproduction.pipeline.run_sweeps): run through the
library on threads of this process, several at once, each one's output in its own log, resumable,
and the runs a results file records not trained again."""

from __future__ import annotations

import csv
import json
import shutil

import pytest

from labavg.base.errors import UserError
from labavg.studies.reproduction.pipeline import run_sweeps
from labavg.studies.reproduction.results import collect, write_results_file
from test_sweep import write_sweep


def _table(sweep_dir) -> list[tuple[str, str]]:
    return [(r["run"], r["seed"]) for r in csv.DictReader(open(sweep_dir / "results.csv"))]


def test_sweeps_run_at_once_each_in_its_log_and_again_train_nothing(corpus, tmp_path, capsys):
    # the names of the reproduction's sweeps, so that a results file can record them
    write_sweep(tmp_path / "exp" / "paper.toml", corpus, "seed = [0, 1]")
    write_sweep(tmp_path / "exp" / "regime.toml", corpus, "seed = [2]")
    out = tmp_path / "out"
    jobs = [("paper", tmp_path / "exp" / "paper.toml", out / "paper", None),
            ("regime", tmp_path / "exp" / "regime.toml", out / "regime", None)]
    run_sweeps(jobs, parallel=2)
    printed = capsys.readouterr()
    assert _table(out / "paper") == [("seed_0", "0"), ("seed_1", "1")]
    assert _table(out / "regime") == [("seed_2", "2")]
    for name, points in (("paper", 2), ("regime", 1)):
        log = (out / f"{name}.log").read_text()
        assert f"labavg sweep: {points} points to train" in log
        assert f"{points} runs in {out / name}/runs" in log
        assert f"labavg reproduce: sweep {name} (" in printed.out
    assert "labavg sweep:" not in printed.out + printed.err  # in the logs, not here

    # Again: nothing trained, and a point a results file records is not trained either.
    stamp = (out / "paper/runs/seed_0/summary.json").stat().st_mtime_ns
    results = write_results_file(collect(out), tmp_path / "results.jsonl")
    recorded = json.loads(results.read_text().splitlines()[1])
    assert (recorded["sweep"], recorded["name"]) == ("paper", "seed_1")
    shutil.rmtree(out / "paper/runs/seed_1")
    run_sweeps(jobs, parallel=2, results=results)
    assert (out / "paper/runs/seed_0/summary.json").stat().st_mtime_ns == stamp
    assert not (out / "paper/runs/seed_1").exists()  # its recorded summary is its row
    assert [run for run, _ in _table(out / "paper")] == ["seed_0", "seed_1"]
    assert "were not trained again" in (out / "paper.log").read_text()


def test_a_failed_sweep_is_named_with_its_log_and_the_others_finish(corpus, tmp_path, capfd):
    write_sweep(tmp_path / "ok.toml", corpus, "seed = [0]")
    # a job of 2 MPI ranks whose rank 1 raises: its ranks' lines come back through the job's
    # own threads, and still land in the sweep's log
    write_sweep(tmp_path / "bad.toml", corpus, "seed = [0]", backend='"mpi"', ranks="2",
                inject_fault='"raise@rank1:step2"')
    out = tmp_path / "out"
    jobs = [("bad", tmp_path / "bad.toml", out / "bad", None),
            ("ok", tmp_path / "ok.toml", out / "ok", None)]
    with pytest.raises(UserError) as failed:
        run_sweeps(jobs, parallel=2)
    assert str(failed.value) == (f"sweeps failed: bad (sweep point {out / 'bad/runs/seed_0'} "
                                 f"failed (exit status 1); see {out / 'bad.log'})")
    assert _table(out / "ok") == [("seed_0", "0")]
    log = (out / "bad.log").read_text()
    assert "injected fault" in log and "labavg: error: sweep point" in log
    printed = capfd.readouterr()
    assert "injected fault" not in printed.out + printed.err


def test_a_sweep_in_a_recipe_directory_runs_there_and_alone(corpus, tmp_path):
    recipe = tmp_path / "recipe"
    shutil.copytree(corpus, recipe / "data" / "train")
    write_sweep(recipe / "yesno.toml", "data/train", "seed = [0]")  # relative to the recipe
    write_sweep(tmp_path / "paper.toml", corpus, "seed = [0]")
    out = tmp_path / "out"
    jobs = [("yesno", recipe / "yesno.toml", out / "yesno", recipe),
            ("paper", tmp_path / "paper.toml", out / "paper", None)]
    run_sweeps(jobs, parallel=2)
    assert _table(out / "yesno") == [("seed_0", "0")] and _table(out / "paper") == [("seed_0", "0")]
    # it changes this process's directory when it finishes a decode: the other waited
    yesno_ended = (out / "yesno/runs/seed_0/summary.json").stat().st_mtime
    assert (out / "paper/runs/seed_0/config.json").stat().st_mtime >= yesno_ended
