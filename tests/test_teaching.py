"""The notebooks' sizes (labavg.studies.teaching) and notebook 03's rerun control (dashboard.rerun)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from labavg.studies import teaching
from labavg.training.config import TrainConfig, preset_config
from labavg.base.settings import with_overrides
from labavg.base.errors import UserError


def test_the_size_comes_from_the_environment_and_a_bad_one_is_named():
    assert teaching.size_name({}) == "class"
    assert teaching.size_name({"LABAVG_NOTEBOOK_SMALL": "1"}) == "small"
    assert teaching.size_name({"LABAVG_NOTEBOOK_SIZE": "full", "LABAVG_NOTEBOOK_SMALL": "1"}) == "full"
    with pytest.raises(UserError) as err:
        teaching.size_name({"LABAVG_NOTEBOOK_SIZE": "huge"})
    assert str(err.value) == "LABAVG_NOTEBOOK_SIZE='huge' is not a notebook size; choose one of small, class, full"


def test_the_sizes_share_the_cli_and_dashboard_defaults():
    # class = the dashboard's teaching preset, full = the CLI's run: their runs pair for a speedup
    assert teaching.SIZES["class"].base == preset_config("teaching")
    assert teaching.SIZES["full"].base == TrainConfig()
    assert teaching.corpus_dir(teaching.Path("w"), teaching.SIZES["class"]) == \
        teaching.corpus_dir(teaching.Path("w"), teaching.SIZES["full"])
    small = teaching.SIZES["small"].base
    assert (small.model.hidden_layers, small.model.hidden_dim, small.epochs) == (1, 32, 1)


TIMINGS = {"machine": "a 2-core x86_64 machine",
           "sizes": {"class": {
               "plain": {"date": "2026-12-01", "load_average": 0.2,
                         "notebooks": {"03-model-averaging-on-mpi-engines": 245.0, "04-ngsgd-vs-sgd": 61.0}},
               "loaded": {"date": "2026-12-01", "load_average": 2.3,
                          "notebooks": {"03-model-averaging-on-mpi-engines": 480.0}}}}}


def test_the_banner_prints_the_measured_times_or_says_there_are_none():
    size = teaching.SIZES["class"]
    text = teaching.banner("03", size, TIMINGS)
    assert text.splitlines()[0] == ("Size 'class': 1 h corpus, 2 x 256 sigmoid, 2 epoch(s), NG-SGD, "
                                    "4 workers (the dashboard's teaching preset; half its class slot "
                                    "per notebook on 2 cores).")
    assert ("Expected time: about 4 min on a 2-core x86_64 machine, about 8 min beside a 2-core "
            "load (measured 2026-12-01)") in text
    assert "Expected time: about 61 s on a 2-core x86_64 machine (measured" in teaching.banner("04", size, TIMINGS)
    assert "not measured at this size" in teaching.banner("05", size, TIMINGS)
    assert "LABAVG_NOTEBOOK_SIZE=small or full" in text


def test_a_notebook_measured_again_on_its_own_says_its_own_date():
    """benchmarks/bench_notebooks.py --only 09 records 09's date and load apart: the others'
    record keeps the day they were measured."""
    timings = json.loads(json.dumps(TIMINGS))
    plain = timings["sizes"]["class"]["plain"]
    plain["notebooks"]["04-ngsgd-vs-sgd"] = 70.0
    plain["remeasured"] = {"04-ngsgd-vs-sgd": {"date": "2026-12-05", "load_average": 7.9,
                                               "command": "... --only 04"}}
    size = teaching.SIZES["class"]
    assert "about 70 s on a 2-core x86_64 machine (measured 2026-12-05)" in teaching.banner(
        "04", size, timings)
    assert "(measured 2026-12-01)" in teaching.banner("03", size, timings)


def test_the_notebooks_folder_is_the_clones():
    # labavg/studies/teaching.py sits two folders below the repository root: a wrong parent
    # finds no notebook, every banner then says "not measured" and the benchmark times nothing.
    stems = sorted(p.stem for p in teaching.NOTEBOOKS.glob("[0-9][0-9]-*.ipynb"))
    assert len(stems) == 9 and stems[0] == "01-data-and-kaldi-formats", teaching.NOTEBOOKS
    assert teaching.TIMINGS_FILE.is_file()
    assert teaching.expected_seconds("01", "class") is not None, "the committed timings are read"


def test_each_notebook_may_compute_for_half_its_slot():
    assert teaching.budget_seconds("01-data-and-kaldi-formats") == 300  # 10 minutes in the plan
    assert teaching.budget_seconds("03") == 600 and teaching.budget_seconds("02") == 450
    assert teaching.budget_seconds("09-beyond-the-paper") == 600  # homework


def test_missing_or_slow_measurements_are_named():
    stems = ["03-model-averaging-on-mpi-engines", "04-ngsgd-vs-sgd"]
    # Both conditions (teaching.CONDITIONS) are required: 04 has only its plain
    # measurement here.
    assert teaching.timing_problems(stems, TIMINGS) == [
        "04-ngsgd-vs-sgd: not measured at the class size beside a 2-core load"]
    unmeasured = json.loads(json.dumps(TIMINGS))
    del unmeasured["sizes"]["class"]["plain"]["notebooks"]["04-ngsgd-vs-sgd"]
    assert teaching.timing_problems(stems, unmeasured) == [
        "04-ngsgd-vs-sgd: not measured at the class size alone",
        "04-ngsgd-vs-sgd: not measured at the class size beside a 2-core load"]
    slow = json.loads(json.dumps(TIMINGS))
    slow["sizes"]["class"]["loaded"]["notebooks"]["03-model-averaging-on-mpi-engines"] = 601.0
    assert teaching.timing_problems(stems[:1], slow) == [
        "03-model-averaging-on-mpi-engines: 601 s beside a 2-core load, over its budget of "
        "600 s (half its 20-minute slot)"]
    assert teaching.timing_problems(stems[:1], {}) == [
        "03-model-averaging-on-mpi-engines: not measured at the class size alone",
        "03-model-averaging-on-mpi-engines: not measured at the class size beside a 2-core load"]


def test_the_committed_timings_cover_every_notebook_within_its_budget():
    # a record of the benchmark's measurements, checked here so that a notebook cannot be
    # committed unmeasured, or slower than its banner and the plan promise
    stems = sorted(p.stem for p in teaching.NOTEBOOKS.glob("[0-9][0-9]-*.ipynb"))
    assert stems, f"no notebook in {teaching.NOTEBOOKS}"
    assert teaching.timing_problems(stems) == []


def test_base_config_makes_the_corpus_once(tmp_path):
    size = dataclasses.replace(teaching.SIZES["small"], hours=0.01, dev_hours=0.005, test_hours=0.005)
    cfg = teaching.base_config(tmp_path, size)
    feats = tmp_path / "corpus-0.01h" / "feats.scp"
    assert cfg.data.data == str((tmp_path / "corpus-0.01h").resolve()) and feats.is_file()
    assert (cfg.ranks, cfg.backend, cfg.model.hidden_dim) == (1, "inproc", 32)
    stamp = feats.stat().st_mtime_ns
    again = teaching.base_config(tmp_path, size)
    assert again == cfg and feats.stat().st_mtime_ns == stamp, "the second notebook reuses the corpus"


@pytest.fixture
def rerun_base(corpus, tmp_path):
    return with_overrides(teaching.SIZES["small"].base, {
        "data.data": str(corpus), "ranks": 2, "backend": "inproc", "averaging.average_every": 2,
        "tensorboard": False, "out": str(tmp_path / "base")})


def test_the_rerun_control_refuses_bad_boxes_before_anything_starts(rerun_base, tmp_path):
    from dashboard.rerun import RerunControl, box_errors

    control = RerunControl(rerun_base, tmp_path / "runs")
    shown = control.view()
    assert shown.errors() == {}
    shown.k.value, shown.lr.value = 0, -0.1
    # every refusal at once, in the words of its box's label
    assert shown.errors() == {"averaging.average_every": "K (minibatches between averaging rounds) must be "
                                                         "positive; got 0",
                              "lr": "learning rate must be positive and finite; got -0.1"}
    assert box_errors(0, -0.1) == shown.errors()
    with pytest.raises(UserError, match=r"K \(minibatches between averaging rounds\) must be positive; got 0"):
        shown.run()
    assert not (tmp_path / "runs").exists(), "nothing started"
    shown.k.value, shown.lr.value = 3, 0.004
    assert shown.errors() == {}


def test_each_view_of_the_rerun_control_keeps_its_own_boxes(rerun_base, tmp_path):
    from dashboard.rerun import RerunControl

    control = RerunControl(rerun_base, tmp_path / "runs")
    first, second = control.view(average_every=1), control.view(average_every=2, lr=0.016)
    assert (first.k.value, first.lr.value) == (1, rerun_base.lr), "the second view left the first alone"
    assert (second.k.value, second.lr.value) == (2, 0.016)
    a, b = control.__panel__(), control.__panel__()
    assert a is not b and not set(map(id, a.select())) & set(map(id, b.select())), \
        "two displays share no Panel object"


def test_the_rerun_control_trains_and_shows_each_run(rerun_base, tmp_path):
    from dashboard.rerun import RerunControl, divergence_overlay, runs_table

    control = RerunControl(rerun_base, tmp_path / "runs")
    first = control.run()
    second = control.view(average_every=8, lr=0.004).run()
    assert [label for label, _ in control.runs] == ["K=2, lr 0.008", "K=8, lr 0.004"]
    (made_second,) = (tmp_path / "runs").glob("rerun-k8-lr0.004-*")
    written = json.loads((made_second / "summary.json").read_text())
    assert written["config"]["averaging"]["average_every"] == 8 and written["config"]["lr"] == 0.004
    assert second["cv_frame_accuracy"] == written["cv_frame_accuracy"]
    assert first["config"]["averaging"]["average_every"] == 2
    table = " ".join(runs_table(control.runs).split())  # without the padding that aligns columns
    assert "| K=2, lr 0.008 |" in table and "| K=8, lr 0.004 |" in table
    curves = divergence_overlay(control.runs).values()
    assert [c.label for c in curves] == ["K=2, lr 0.008", "K=8, lr 0.004"]
    assert len(curves[0]) > len(curves[1]) > 0, "K=2 averages more often than K=8"
    assert control.status.startswith("K=8, lr 0.004: CV frame accuracy ") and not control.busy


def test_the_shipped_yesno_run_opens_in_a_plain_clone(monkeypatch):
    # notebook 01's real-data section reads examples/kaldi-yesno, not ../shared (absent in a clone)
    from labavg.data.alignment import read_gzip_ark
    from labavg.data.dataset import open_dataset
    from labavg.data.transition import read_transition_model

    monkeypatch.chdir(teaching.YESNO)
    yesno = open_dataset("data/train_yesno", ali_dir="exp/mono0a")
    assert (len(yesno.keys), yesno.feat_dim, yesno.num_pdfs) == (8, 13, 11)
    model = read_transition_model("exp/mono0a/final.mdl")
    assert (model.num_transition_ids, model.num_pdfs) == (30, 11)
    ali = read_gzip_ark(teaching.YESNO / "exp/mono0a/ali.1.gz")
    for key in yesno.keys:
        feats, pdfs = yesno.load(key)
        assert len(feats) == len(pdfs) == len(ali[key]) > 0
        assert (pdfs == model.pdfs_of(ali[key])).all()
    # the words of each utterance are in its id (0 = NO, 1 = YES), as Kaldi's recipe names them
    for line in (teaching.YESNO / "data/train_yesno/text").read_text().splitlines():
        key, *words = line.split()
        assert words == ["YES" if b == "1" else "NO" for b in key.split("_")]
    readme = " ".join((teaching.YESNO / "README.md").read_text().split())
    assert "Apache License 2.0" in readme and "SLR1" in readme
    assert (teaching.YESNO / "COPYING.kaldi").is_file()


def test_the_learning_rate_is_said_in_words():
    cfg = teaching.SIZES["class"].base
    assert teaching.lr_words(cfg) == "learning rate 0.008 per frame, decaying to 0.00008"
    four = with_overrides(cfg, {"ranks": 4, "schedule": "newbob"})
    assert teaching.lr_words(four) == "learning rate 0.008 per frame (x 4 workers: 0.032), newbob schedule"


def test_train_prints_a_line_per_epoch_and_reads_a_finished_run_back(corpus, tmp_path, capsys):
    cfg = with_overrides(teaching.SIZES["small"].base, {
        "data.data": str(corpus), "epochs": 2, "tensorboard": False, "out": str(tmp_path / "run")})
    summary = teaching.train(cfg)
    printed = capsys.readouterr()
    lines = printed.out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["epoch 1 of 2", "epoch 2 of 2"]
    assert lines[-1].startswith(f"epoch 2 of 2: CV frame accuracy {100 * summary.cv_frame_accuracy:.2f} %")
    assert printed.err == "", "no progress bars"
    stamp = (tmp_path / "run" / "summary.json").stat().st_mtime_ns
    assert teaching.train(cfg) == summary and capsys.readouterr().out == ""
    assert (tmp_path / "run" / "summary.json").stat().st_mtime_ns == stamp, "read back, not trained"
