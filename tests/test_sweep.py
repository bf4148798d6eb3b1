"""`labavg sweep`: a grid of runs, a results table, resumable."""

from __future__ import annotations

import csv

import pytest

from labavg.base.errors import UserError
from labavg.studies.sweep import load_sweep, run_sweep

from test_train import _cli


def write_sweep(path, corpus, grid: str, **base: str) -> None:
    """A sweep file of a tiny model on `corpus`; `base` adds top-level [base] settings."""
    extra = "".join(f"{k} = {v}\n" for k, v in base.items())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""
[base]
epochs = 1
minibatch = 64
tensorboard = false
{extra}[base.model]
hidden_layers = 1
hidden_dim = 32
[base.data]
data = "{corpus}"
context = 2
buffer_frames = 2048
[grid]
{grid}
""")


def test_sweep_runs_grid_writes_table_and_skips_finished(corpus, tmp_path):
    spec = tmp_path / "s.toml"
    write_sweep(spec, corpus, 'ranks = [1, 2]\noptimizer = ["sgd", "ngsgd"]')
    sweep = load_sweep(spec)
    assert [n for n, _ in sweep.points()] == [
        "ranks_1-optimizer_sgd", "ranks_1-optimizer_ngsgd", "ranks_2-optimizer_sgd",
        "ranks_2-optimizer_ngsgd"]
    rows = run_sweep(sweep, tmp_path / "out")
    table = list(csv.DictReader(open(tmp_path / "out" / "results.csv")))
    assert [(r["ranks"], r["optimizer"]) for r in table] == [
        ("1", "sgd"), ("1", "ngsgd"), ("2", "sgd"), ("2", "ngsgd")]
    assert all(0 < float(r["cv_acc_pct"]) < 100 for r in table)  # a percentage, as results.md
    assert all(0 < r["cv_frame_accuracy"] < 1 for r in rows)  # the rows: summary.json's fraction
    # Each run measured its own speedup (1 for a 1-rank run), with the range of its pairs.
    assert rows[0]["speedup"] == 1.0 and rows[2]["speedup"] > 0
    assert rows[2]["speedup_low"] <= rows[2]["speedup"] <= rows[2]["speedup_high"]
    # Running again trains nothing: the summaries stay untouched.
    stamp = (tmp_path / "out/runs/ranks_1-optimizer_sgd/summary.json").stat().st_mtime_ns
    calls = []
    run_sweep(sweep, tmp_path / "out", train_point=lambda cfg, resume: calls.append(cfg))
    assert calls == []
    assert (tmp_path / "out/runs/ranks_1-optimizer_sgd/summary.json").stat().st_mtime_ns == stamp
    assert "CV acc % (mean)" in (tmp_path / "out" / "results.md").read_text()


def test_sweep_rejects_bad_grid(corpus, tmp_path):
    spec = tmp_path / "bad.toml"
    write_sweep(spec, corpus, '"averaging.average_every" = [10, 0]')
    with pytest.raises(UserError, match="average_every_0"):
        load_sweep(spec)
    proc = _cli("sweep", str(spec), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "averaging.average_every must be positive" in proc.stderr


@pytest.mark.slow  # keeps README's fast command under 10 minutes; CI runs it
def test_sweep_cli_with_mpi_points(corpus, tmp_path):
    spec = tmp_path / "s.toml"
    write_sweep(spec, corpus,
                'backend = ["mpi"]\nranks = [2]\n"averaging.average_every" = [2, 8]')
    proc = _cli("sweep", str(spec), "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    table = list(csv.DictReader(open(tmp_path / "out" / "results.csv")))
    assert [(r["ranks"], r["average_every"]) for r in table] == [("2", "2"), ("2", "8")]


def test_several_grids_share_runs(corpus, tmp_path):
    spec = tmp_path / "s.toml"
    write_sweep(spec, corpus, "")
    text = spec.read_text().replace("[grid]\n", "")
    text = text.replace("[base]\n", '[base]\noptimizer = "sgd"\n', 1)
    text += '[[grid]]\nranks = [1, 2]\n[[grid]]\nranks = [2]\noptimizer = ["sgd", "ngsgd"]\n'
    spec.write_text(text)
    names = [n for n, _ in load_sweep(spec).points()]
    # ranks 2 + sgd (the base optimizer) is reached by both grids and trained once
    assert names == ["ranks_1", "ranks_2", "ranks_2-optimizer_ngsgd"]


def test_points_run_seed_by_seed(corpus, tmp_path):
    spec = tmp_path / "s.toml"
    write_sweep(spec, corpus, "")
    text = spec.read_text().replace("[grid]\n", "")
    text += ('[[grid]]\nseed = [0, 1]\nranks = [1, 2]\n'
             '[[grid]]\nseed = [0, 1]\nranks = [2]\noptimizer = ["ngsgd", "sgd"]\n')
    spec.write_text(text)
    names = [n for n, _ in load_sweep(spec).points()]
    # every setting once (seed 0, in the file's order) before any a second time
    assert names == ["seed_0-ranks_1", "seed_0-ranks_2", "seed_0-ranks_2-optimizer_sgd",
                     "seed_1-ranks_1", "seed_1-ranks_2", "seed_1-ranks_2-optimizer_sgd"]


def test_a_sweep_makes_its_missing_corpora_once(corpus, tmp_path):
    spec = tmp_path / "s.toml"
    made = tmp_path / "tiny"
    write_sweep(spec, made, "ranks = [1]")
    spec.write_text(f'[[corpus]]\nout = "{made}"\nhours = 0.02\ndev_hours = 0\ntest_hours = 0\n'
                    + spec.read_text())
    sweep = load_sweep(spec)
    rows = run_sweep(sweep, tmp_path / "out")
    assert (made / "corpus.json").is_file() and 0 < rows[0]["cv_frame_accuracy"] < 1
    stamp = (made / "feats.ark").stat().st_mtime_ns
    run_sweep(sweep, tmp_path / "out", train_point=lambda cfg, resume: None)
    assert (made / "feats.ark").stat().st_mtime_ns == stamp  # there already: not made again


@pytest.mark.parametrize("table, message", [
    ('[[corpus]]\nhours = 1\n', "out must be the corpus directory"),
    ('[[corpus]]\nout = "x"\nhours = 0\n', "hours = 0 is not a valid hours"),
    ('[[corpus]]\nout = "x"\nsize = 1\n', "unknown keys ['size']"),
])
def test_a_bad_corpus_table_is_refused_naming_it(corpus, tmp_path, table, message):
    spec = tmp_path / "s.toml"
    write_sweep(spec, corpus, "ranks = [1]")
    spec.write_text(table + spec.read_text())
    with pytest.raises(UserError) as err:
        load_sweep(spec)
    assert "[[corpus]] 1" in str(err.value) and message in str(err.value)


@pytest.mark.slow
def test_a_run_stopped_while_it_decoded_is_decoded_when_the_sweep_resumes(tmp_path):
    """The summary is written before the decode (so a failed decode keeps the training result);
    a sweep resumed after a stop in the decode must decode the run, not take it as done."""
    import json

    from labavg.data.synth import synthesize

    corpus = tmp_path / "c"
    synthesize(corpus, hours=0.03, seed=0, dev_hours=0.005, test_hours=0.01)
    spec = tmp_path / "s.toml"
    write_sweep(spec, corpus, "ranks = [1]")
    spec.write_text(spec.read_text().replace("[base]\n", f'[base]\ndecode_data = "{corpus}"\n'))
    sweep = load_sweep(spec)
    run_sweep(sweep, tmp_path / "out")
    run = tmp_path / "out" / "runs" / "ranks_1"
    decoded = json.loads((run / "summary.json").read_text())
    assert decoded["wer"] is not None
    # as the summary stood before its decode
    undecoded = {k: v for k, v in decoded.items()
                 if k not in ("wer", "wer_ci", "per", "per_ci", "acwt", "decode_set")}
    (run / "summary.json").write_text(json.dumps(undecoded))
    rows = run_sweep(sweep, tmp_path / "out", train_point=lambda cfg, resume: None)
    assert rows[0]["wer"] == decoded["wer"]
    assert json.loads((run / "summary.json").read_text())["wer"] == decoded["wer"]


def test_a_point_another_job_holds_is_passed_by_and_trained_later(corpus, tmp_path, capsys):
    """Two sweeps of one directory (two processes, or two nodes) share its points."""
    from labavg.jobs.run_dir import run_dir_lock

    spec = tmp_path / "s.toml"
    write_sweep(spec, corpus, "ranks = [1, 2]")
    sweep = load_sweep(spec)
    held = tmp_path / "out" / "runs" / "ranks_1"
    with run_dir_lock(held):  # as another sweep training it would
        rows = run_sweep(sweep, tmp_path / "out")
        assert [r["name"] for r in rows] == ["ranks_2"]
        assert not (held / "summary.json").exists() and not (held / "events.jsonl").exists()
    assert "1 point(s) are being trained by another job (ranks_1)" in capsys.readouterr().out
    rows = run_sweep(sweep, tmp_path / "out")
    assert [r["name"] for r in rows] == ["ranks_1", "ranks_2"]


def test_points_recorded_elsewhere_with_the_same_settings_are_not_trained_again(corpus, tmp_path):
    from labavg.studies.reproduction.results import load_runs, read_results_file, write_results_file

    spec = tmp_path / "beyond.toml"
    write_sweep(spec, corpus, 'ranks = [1, 2]')
    sweep = load_sweep(spec)
    run_sweep(sweep, tmp_path / "first")
    results = write_results_file({"beyond": load_runs(tmp_path / "first")}, tmp_path / "r.jsonl")
    recorded = {r.name: {"settings": r.settings, "summary": r.summary}
                for r in read_results_file(results)["beyond"]}
    # A fresh machine: no run directories, the results file only.
    calls = []
    rows = run_sweep(sweep, tmp_path / "again", recorded=recorded,
                     train_point=lambda cfg, resume: calls.append(cfg.out))
    assert calls == [] and [r["name"] for r in rows] == ["ranks_1", "ranks_2"]
    assert rows[1]["cv_frame_accuracy"] == recorded["ranks_2"]["summary"].cv_frame_accuracy
    # A recorded run of other settings (another base) is trained.
    recorded["ranks_2"]["settings"]["minibatch"] = 128
    run_sweep(sweep, tmp_path / "again", recorded=recorded)
    # Only that one was trained; nothing was made up as a run directory for the other.
    assert [r.name for r in load_runs(tmp_path / "again")] == ["ranks_2"]
    assert not (tmp_path / "again" / "runs" / "ranks_1").exists()


def test_sweep_cli_takes_a_results_file_of_recorded_runs(corpus, tmp_path):
    from labavg.studies.reproduction.results import load_runs, write_results_file

    spec = tmp_path / "beyond.toml"
    write_sweep(spec, corpus, 'ranks = [1]')
    run_sweep(load_sweep(spec), tmp_path / "first")
    results = write_results_file({"beyond": load_runs(tmp_path / "first")}, tmp_path / "r.jsonl")
    proc = _cli("sweep", str(spec), "--out", str(tmp_path / "again"), "--recorded", str(results))
    assert proc.returncode == 0, proc.stderr
    assert "1 point(s) recorded as finished elsewhere were not trained again" in proc.stdout
    assert not (tmp_path / "again" / "runs" / "ranks_1").exists()
