"""The dashboard's state classes, without a browser: settings, live runs, monitor mode, run table."""

from __future__ import annotations

import csv
import io
import json
import math
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

# dashboard/ sits beside labavg/ but is not (yet) an installed package: import it from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dashboard.buffers import RankSeries, RunBuffers
from dashboard.live import LiveRun
from dashboard.runs_table import RunTable
from dashboard.settings import (
    BACKEND_LABELS,
    CONTROLS,
    GENERAL,
    RunSettings,
    describe_config,
)
from dashboard.settings import _default as _setting_default
from labavg.training.config import TrainConfig, config_from_dict, preset_config, validate
from labavg.base.settings import with_overrides
from labavg.base.errors import UserError
from dashboard.jobs import JobRegistry
from labavg.base.events import MinibatchDone
from labavg.jobs.index import EventTail


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from labavg.data.synth import synthesize

    out = tmp_path_factory.mktemp("dash") / "c"
    synthesize(out, hours=0.02, seed=0)
    return out


def tiny_settings(corpus: Path, runs: Path, **values) -> RunSettings:
    """Settings of a run that takes well under a second on one core."""
    base = dict(data=str(corpus), runs_dir=str(runs), ranks=2, average_every=2, minibatch=64,
                epochs=1, hidden_layers=1, hidden_dim=32, context=2,
                overrides={"data.buffer_frames": 2048})
    base.update(values)
    return RunSettings(**base)


def run_to_end(live: LiveRun, timeout: float = 60.0) -> None:
    """Drain like the page's flush until the run has ended."""
    deadline = time.monotonic() + timeout
    while live.running:
        assert time.monotonic() < deadline, f"run did not end: {live.status}"
        live.drain()
        time.sleep(0.05)
    live.drain()


def until(live: LiveRun, condition, timeout: float = 60.0) -> None:
    """Drain like the page's flush until `condition()` holds (a worker thread reads the run)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not reached: {live.status}"
        live.drain()
        time.sleep(0.02)


@pytest.fixture(scope="module")
def finished_runs(corpus, tmp_path_factory):
    """A 1-rank run (K=2) and a 3-rank run (K=4) of the same model and data, through LiveRun."""
    runs = tmp_path_factory.mktemp("runs")
    lives = []
    for ranks, k in ((1, 2), (3, 4)):
        live = LiveRun()
        assert live.start(tiny_settings(corpus, runs, ranks=ranks, average_every=k)), live.status
        run_to_end(live)
        lives.append(live)
        time.sleep(1.01)  # run directories are named by the second
    return runs, lives


def _cli_words(key: str, value) -> str:
    """What `labavg train` says about one bad value (validate's message, which the CLI prints)."""
    with pytest.raises(UserError) as info:
        validate(with_overrides(TrainConfig(), {key: value}))
    return str(info.value)


def _box_words(key: str, label: str, value) -> str:
    """The CLI's words about a bad value, with the box's label where the CLI names the key."""
    words = _cli_words(key, value)
    assert words.startswith(key), words
    return label + words[len(key):]


def test_bad_values_are_kept_and_named_in_the_boxes_words(corpus, tmp_path):
    settings = tiny_settings(corpus, tmp_path / "runs")
    assert settings.errors == {} and settings.check() is None
    settings.param.update(ranks=0, average_every=0, lr=-0.1)
    # The typed values stay (nothing puts the old ones back) and each has its message.
    assert (settings.ranks, settings.average_every, settings.lr) == (0, 0, -0.1)
    assert settings.errors == {
        "ranks": _box_words("ranks", "ranks", 0),
        "average_every": _box_words("averaging.average_every", "K (average every)", 0),
        "lr": _box_words("lr", "learning rate", -0.1)}
    assert settings.errors["average_every"] == "K (average every) must be positive; got 0"
    live = LiveRun()
    assert live.start(settings) is False and not live.running
    assert live.status == "Cannot start: ranks must be positive; got 0"
    settings.param.update(ranks=2, average_every=3, lr=0.01)
    assert settings.errors == {}
    settings.final_lr = None  # an emptied optional box means the default
    settings.minibatch = None  # an emptied box of a required one does not
    assert settings.errors == {"minibatch": "minibatch needs a value"}


def test_every_refusal_is_shown_at_once_and_more_ranks_than_cores_are_warned_before_start(
        corpus, tmp_path, monkeypatch):
    # labavg issue 41: with K = 0, lr = -1 and ranks = 1000 the page flagged two boxes, and the
    # ranks only once the other two were fixed; 4 ranks on 2 cores got no word before Start.
    import dashboard.settings as dashboard_settings

    monkeypatch.setattr(dashboard_settings, "usable_cores", lambda: 2)
    settings = tiny_settings(corpus, tmp_path / "runs", backend="in-process workers")
    settings.param.update(ranks=1000, average_every=0, lr=-1.0)
    assert set(settings.errors) == {"ranks", "average_every", "lr"}, settings.errors
    assert settings.errors["ranks"].startswith("ranks 1000: ")
    settings.param.update(ranks=4, average_every=2, lr=0.008)
    assert settings.errors == {}
    assert settings.warnings["ranks"].startswith("4 ranks on this machine's 2 cores take turns: "
                                                 "a speedup of at most 2x here")
    settings.ranks = 2
    assert "ranks" not in settings.warnings


def test_settings_that_contradict_each_other_are_one_general_message(corpus, tmp_path):
    settings = tiny_settings(corpus, tmp_path / "runs", minibatch=4096)
    assert settings.errors == {GENERAL: "data.buffer_frames (2048) must be at least the minibatch (4096)"}


def test_typed_text_that_is_no_number_is_refused_in_the_boxs_words(corpus, tmp_path):
    settings = tiny_settings(corpus, tmp_path / "runs", lr=0.008)
    settings.type_text("lr", "0,01")  # a decimal comma: the browser's number box read 1
    assert settings.lr == 0.008 and settings.errors == {
        "lr": "learning rate must be a number; got '0,01' (with a decimal point: 0.01)"}
    assert LiveRun().start(settings) is False  # refused before anything starts
    settings.type_text("lr", "abc")  # once dropped without a word
    assert settings.errors == {"lr": "learning rate must be a number; got 'abc'"}
    settings.type_text("lr", "0.01")
    assert settings.lr == 0.01 and settings.errors == {}
    settings.type_text("ranks", "2.5")
    assert settings.errors == {"ranks": "ranks must be a whole number; got '2.5'"}
    settings.type_text("ranks", "3")
    assert settings.ranks == 3 and settings.errors == {}


def test_in_a_notebook_the_page_is_a_plain_layout_with_its_resources_inline(corpus, tmp_path):
    import panel as pn

    from dashboard.app import create_app

    page = create_app(runs_dir=str(tmp_path), data=str(corpus), inline=True)
    # No template (whose styles came from a CDN); Panel's stylesheets go into the notebook.
    assert isinstance(page, pn.Row) and pn.config.inline is True
    assert page.dashboard.settings.data == str(corpus)
    page.dashboard.settings.type_text("lr", "0,01")
    page.dashboard.settings.preset = "teaching"  # a preset replaces refused text too
    assert page.dashboard.settings.errors == {}


@pytest.mark.slow  # end to end: out of the fast suite's 10 minutes
def test_the_inline_dashboard_shows_the_notebooks_newest_run_not_idle(finished_runs):
    # labavg issue 41: below notebook 03's first run its inline dashboard said "Idle · No run
    # on screen": a notebook's runs are not jobs of the page (none of this process here).
    from dashboard.app import create_app

    runs, (_, three) = finished_runs
    page = create_app(runs_dir=str(runs), inline=True, jobs=JobRegistry())  # no run of its own
    live = page.dashboard.live
    assert live.run_dir == three.run_dir, "the newest run of the runs directory"
    run_to_end(live)
    assert live.status.startswith("Finished: ") and live.buffers.ranks == 3


def test_a_model_or_ranks_too_big_for_this_corpus_are_refused_beside_their_box(corpus, tmp_path):
    from labavg.data.dataset import open_dataset

    source = open_dataset(str(corpus))
    inputs, pdfs = source.feat_dim * 5, source.num_pdfs  # context 2: 5 frames
    settings = tiny_settings(corpus, tmp_path / "runs", hidden_dim=100_000_000)
    message = settings.errors["hidden_dim"]
    assert set(settings.errors) == {"hidden_dim"}, settings.errors
    # This corpus's sizes, not validate's smallest corpus ("143 inputs and 2 pdfs").
    assert message.startswith("hidden units 100000000 × hidden layers 1 on this corpus's "
                              f"{inputs} inputs ({source.feat_dim} features × 5 frames) and "
                              f"{pdfs} pdfs"), message
    assert "model.hidden_dim" not in message and "GiB" in message
    settings.hidden_dim = 32
    settings.ranks = 100_000
    assert set(settings.errors) == {"ranks"} and settings.errors["ranks"].startswith("ranks 100000")
    settings.ranks = 1000  # fits in memory, but not in the data: each rank needs a minibatch
    assert "too many for this corpus" in settings.errors["ranks"], settings.errors
    settings.ranks = 2
    assert settings.errors == {}


def test_a_huge_learning_rate_is_allowed_with_a_warning_that_teaches_max_change(corpus, tmp_path):
    settings = tiny_settings(corpus, tmp_path / "runs", lr=1e9, optimizer="ngsgd")
    assert settings.errors == {}  # it runs: that is the lesson
    assert "max-change clips every update" in settings.warnings["lr"]
    settings.optimizer = "sgd"  # nnet1's SGD has no max-change
    assert "no max-change" in settings.warnings["lr"]
    settings.lr = 0.008
    assert settings.warnings == {}


def test_defaults_are_train_configs_and_a_preset_changes_only_what_is_trained(corpus):
    settings = RunSettings(data=str(corpus))
    for name, key in CONTROLS.items():
        if name != "data":
            assert getattr(settings, name) == _setting_default(key), name
    assert BACKEND_LABELS[settings.backend] == TrainConfig().backend
    settings.param.update(ranks=3, average_every=7, epochs=9)
    settings.preset = "teaching"
    teaching = preset_config("teaching")
    assert (settings.hidden_layers, settings.hidden_dim, settings.epochs) == (
        teaching.model.hidden_layers, teaching.model.hidden_dim, teaching.epochs)
    assert (settings.ranks, settings.average_every) == (3, 7)  # what a comparison varies stays
    assert settings.to_config("x").model == teaching.model
    settings.preset = "defaults"
    assert (settings.hidden_layers, settings.epochs) == (TrainConfig().model.hidden_layers,
                                                         TrainConfig().epochs)


def test_data_and_runs_directories_are_checked_before_a_run_with_one_short_line(corpus, tmp_path):
    settings = tiny_settings(tmp_path / "missing", tmp_path / "runs")
    assert "missing" in settings.errors["data"] and "not found" in settings.errors["data"]
    live = LiveRun()
    assert live.start(settings) is False
    assert live.status.startswith("Cannot start:") and "missing" in live.status
    assert not live.running and not (tmp_path / "runs").exists()

    # A folder that is not a corpus: one line naming it, not its 60 files.
    folder = tmp_path / "notes"
    folder.mkdir()
    for i in range(60):
        (folder / f"file{i:02d}.txt").write_text("")
    settings.data = str(folder)
    message = settings.errors["data"]
    assert message.startswith(f"{folder}: no feats.scp") and "not a Kaldi data directory" in message
    assert "(60 in all)" in message and message.count("file") <= 3 and len(message) < 300
    settings.data = str(corpus)
    assert settings.errors == {}

    # A runs directory that cannot be made (a file is in the way): its own message, no run.
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    settings.runs_dir = str(blocker / "runs")
    assert settings.errors == {"runs_dir": f"runs directory {str(blocker / 'runs')!r} cannot be "
                                           f"created: {blocker} is a file, not a directory"}
    assert live.start(settings) is False and "is a file, not a directory" in live.status
    settings.runs_dir = str(blocker)
    assert "is an existing file" in settings.errors["runs_dir"]


def test_invalid_settings_become_a_message_not_a_crash(corpus, tmp_path):

    bad = tiny_settings(corpus, tmp_path / "runs", overrides={"data.cv_fraction": 1.5})
    assert "data.cv_fraction must be in [0, 1)" in bad.check()
    with pytest.raises(UserError, match="cv_fraction"):
        bad.to_config(tmp_path / "runs" / "x")
    rbm = tiny_settings(corpus, tmp_path / "runs", pretrain="rbm", overrides={"model.nonlinearity": "relu"})
    assert "sigmoid" in rbm.check()


def test_to_config_maps_every_control(corpus, tmp_path):
    settings = tiny_settings(corpus, tmp_path, backend="MPI engines", ranks=4, average_every=7,
                             lr=0.01, final_lr=0.0005, schedule="newbob", optimizer="ngsgd",
                             minibatch=128, epochs=3, hidden_layers=2, hidden_dim=48)
    cfg = settings.to_config(tmp_path / "r")
    assert (cfg.out, cfg.backend, cfg.ranks, cfg.averaging.average_every) == (
        str(tmp_path / "r"), "mpi", 4, 7)
    assert (cfg.lr, cfg.final_lr, cfg.schedule, cfg.optimizer) == (0.01, 0.0005, "newbob", "ngsgd")
    assert (cfg.minibatch, cfg.epochs, cfg.model.hidden_layers, cfg.model.hidden_dim) == (128, 3, 2, 48)
    assert (cfg.data.data, cfg.data.context, cfg.data.buffer_frames) == (str(corpus), 2, 2048)
    assert cfg.tensorboard is False and cfg.final_learning_rate() == 0.0005
    assert (cfg.averaging.method, cfg.averaging.reduce) == ("model", "allreduce")


def test_the_momentum_box_sets_the_chosen_methods_momentum(corpus, tmp_path):
    settings = tiny_settings(corpus, tmp_path, averaging="bmuf", momentum=0.75, reduce="ring")
    cfg = settings.to_config(tmp_path / "r")
    default = TrainConfig().averaging
    assert (cfg.averaging.method, cfg.averaging.reduce, cfg.averaging.table("bmuf").momentum) == (
        "bmuf", "ring", 0.75)
    assert cfg.averaging.table("diloco").momentum == default.table("diloco").momentum
    settings.averaging = "diloco"
    cfg = settings.to_config(tmp_path / "r")
    assert (cfg.averaging.table().momentum, cfg.averaging.table("bmuf").momentum) == (
        0.75, default.table("bmuf").momentum)
    settings.momentum = 1.0
    # Named in the box's words, by the rule of the setting the box stands for now.
    assert settings.errors == {"momentum": _box_words("averaging.diloco.momentum",
                                                      "method momentum", 1.0)}
    assert settings.errors["momentum"].startswith("method momentum must be")
    settings.averaging = "model"  # plain averaging has no momentum: the box is not used
    assert settings.errors == {} and settings.key_of("momentum") is None
    assert (settings.to_config(tmp_path / "r").averaging.table("bmuf").momentum
            == default.table("bmuf").momentum)


def test_the_payload_bits_box_is_used_only_for_integer_codes(corpus, tmp_path):
    settings = tiny_settings(corpus, tmp_path, payload="bf16", payload_bits=5)
    assert settings.errors == {} and settings.key_of("payload_bits") is None  # bf16 has no bits
    assert (settings.to_config(tmp_path / "r").averaging.payload_bits
            == TrainConfig().averaging.payload_bits)
    settings.payload = "int"
    assert settings.errors == {"payload_bits": _box_words("averaging.payload_bits",
                                                          "payload bits (int)", 5)}
    settings.payload_bits = 4
    cfg = settings.to_config(tmp_path / "r")
    assert (cfg.averaging.payload, cfg.averaging.payload_bits) == ("int", 4)
    from labavg.base.settings import to_dict

    line = describe_config(to_dict(with_overrides(cfg, {"averaging.method": "bmuf"})))
    assert "K=10 · bmuf · int4 payload · ngsgd" in line.replace(
        f"K={cfg.averaging.average_every}", "K=10")
    assert "payload" not in describe_config(to_dict(TrainConfig()))  # the paper's: not said


def test_live_run_fills_every_ranks_buffers(finished_runs):
    _, (_, three) = finished_runs
    buffers = three.buffers
    assert buffers.ranks == 3
    steps = buffers.finished.step
    assert steps > 5
    for rank in range(3):
        points = list(buffers.of("loss").points[rank])
        assert [x for x, _ in points] == list(range(1, steps + 1))
        assert all(0 < y < 10 for _, y in points)  # cross-entropy of 120 pdfs starts near ln 120
    divergence = buffers.of("divergence").points
    assert divergence[0] and all(d >= 0 for _, d in divergence[2])
    cv = list(buffers.of("cv").points[0])  # (epoch + 1, CV frame accuracy %)
    assert cv[0][0] == 1 and len(cv) == 1 and 0 <= cv[0][1] <= 100
    rows = buffers.of("loss").take()  # complete rows: step, 3 ranks, mean
    assert len(rows) == steps and len(rows[0]) == 5
    assert rows[0][4] == pytest.approx(sum(rows[0][1:4]) / 3)
    assert three.status.startswith("Finished:") and three.summary.ranks == 3
    assert three.config["ranks"] == 3 and "K=4" in describe_config(three.config)
    assert (Path(three.run_dir) / "summary.json").is_file()


def test_the_live_speedup_is_the_runs_own_paired_measurement(finished_runs):
    """labavg.jobs.speedup reads the run: from its events while it trains, from its summary
    once it has one; both give the same number and interval. No 1-rank run is needed."""
    from dashboard.speedup import live_speedup, shown_text

    _, (one, three) = finished_runs
    first = one.speedup().measured
    assert (first.value, first.ranks) == (1.0, 1) and "reference" in shown_text(first)
    speedup = three.speedup()
    measured = speedup.measured
    assert measured.ranks == 3 and measured.pairs >= 1 and measured.value is not None
    assert measured.low <= measured.value <= measured.high and measured.threads
    assert measured.cores >= 1 and measured.bound == min(3, measured.cores)
    from_events = live_speedup(three.buffers, config_from_dict(three.config)).measured
    assert (from_events.value, from_events.low, from_events.high, from_events.pairs) == (
        measured.value, measured.low, measured.high, measured.pairs)
    assert "threads of one process" in shown_text(measured)
    ranks = [p for p, _ in speedup.predicted]
    values = [v for _, v in speedup.predicted]
    assert ranks == [1, 2, 4, 8, 16, 32, 64] and values[0] == pytest.approx(1.0)
    # The costs are this run's, measured on a shared machine: where its allreduce was slow the
    # predicted curve may turn down at large N, so only what any costs give is held here.
    assert all(0 < v <= n for n, v in zip(ranks, values)) and speedup.K == 4


def test_plots_of_the_last_run_go_the_moment_a_new_one_starts(finished_runs, corpus, tmp_path):
    from dashboard.live_view import LivePlots

    _, (_, three) = finished_runs
    live = LiveRun()
    plots = LivePlots(live)
    live.follow(three.run_dir)
    until(live, lambda: not live.running)
    for _ in range(5):
        plots.stream()
    plots.panes["cv"].get_root()  # as a page shows it
    [source] = plots.loss.sources["loss_r0"]
    assert len(source.data["loss_r0"]) == three.buffers.finished.step
    assert live.start(tiny_settings(corpus, tmp_path, ranks=3)), live.status
    try:
        # No drain and no update yet: starting alone emptied the plots.
        assert len(plots.loss.data) == 0 and len(source.data["loss_r0"]) == 0
        assert len(plots.cv.data) == 0
    finally:
        run_to_end(live)


def test_stop_ends_the_run_early(corpus, tmp_path):
    live = LiveRun()
    assert live.start(tiny_settings(corpus, tmp_path, epochs=50))
    assert live.status.startswith("Starting ") and "reading the data" in live.status
    # Alone in its runs directory, a 2-rank run has nothing to be measured against.
    assert live.speedup().note.startswith("Measuring")
    deadline = time.monotonic() + 60
    while live.buffers.last_step < 4:
        assert time.monotonic() < deadline and live.running, live.status
        live.drain()
        time.sleep(0.02)
    live.stop()
    assert live.join(60)
    run_to_end(live)
    summary = json.loads((Path(live.run_dir) / "summary.json").read_text())
    assert summary["speedup_pairs"] == []  # stopped long before the first of its 50 epochs' pairs
    assert live.speedup().note.startswith("Not measured: the run ended before its first pair")
    per_epoch = summary["steps"]
    assert summary["stopped"] is True
    assert live.buffers.finished.step < 10 * per_epoch  # 50 epochs planned
    assert live.status.startswith("Stopped:")
    assert not live.running


def test_a_failed_job_says_why_in_the_page_not_only_on_the_servers_stderr(corpus, tmp_path):
    live = LiveRun()
    # In-process workers run as a job of their own, whose reason was printed on the server's
    # stderr alone; the page said "the job writing ... failed (exit status 1)".
    settings = tiny_settings(corpus, tmp_path, overrides={"data.buffer_frames": 2048,
                                                         "inject_fault": "raise@rank1:step2"})
    assert live.start(settings), live.status
    run_to_end(live, timeout=180)
    assert live.status.startswith("Run failed: ") and "injected fault on rank 1" in live.status, \
        live.status


def test_stop_ends_the_run_at_the_next_round_even_an_epoch_end_without_cv(corpus, tmp_path):
    """docs/averaging.md: a stop request ends the run at the next averaging round. With K
    beyond the epoch that round is the first epoch's end: the run must end there, with its
    checkpoint, and run neither the epoch's CV nor the final model's (they once took seconds
    after Stop on a class corpus)."""
    from labavg.jobs.index import read_events

    live = LiveRun()
    assert live.start(tiny_settings(corpus, tmp_path, epochs=50, average_every=1000))
    live.stop()  # before the first round: reading the data takes longer than the stop's relay
    assert live.join(60)
    run_to_end(live)
    events = read_events(Path(live.run_dir))
    per_epoch = next(e for e in events if e["type"] == "run_started")["steps_per_epoch"]
    summary = json.loads((Path(live.run_dir) / "summary.json").read_text())
    assert summary["stopped"] is True
    assert summary["steps"] == per_epoch and summary["averaging_rounds"] == 1
    assert [e for e in events if e["type"] == "epoch"] == []
    assert math.isnan(summary["cv_frame_accuracy"])  # no CV ran after the request
    assert any(e["type"] == "checkpoint" for e in events)  # resumable from where it stopped
    assert live.status.startswith("Stopped:") and "no CV" in live.status


def test_measure_speedup_follows_the_views_state(corpus, tmp_path):
    """The study's button and line are bound to the view's state (the study's thread sets it):
    off while measuring, and a refusal said in the line before anything starts."""
    from dashboard.scaling_view import ScalingView

    settings = tiny_settings(corpus, tmp_path / "runs", data=str(tmp_path / "no-such-data"))
    view = ScalingView(RunTable(runs_dir=str(tmp_path / "runs")), settings)
    pane = view.study_status
    assert not view.measure_button.disabled and "trains 2 and 4 MPI ranks" in pane.object
    assert view.measure() is False and not view.measuring
    assert pane.object.startswith("**Cannot measure:**") and "no-such-data" in pane.object
    view.measuring = True
    assert view.measure_button.disabled
    assert not (tmp_path / "runs").exists(), "nothing started"


def test_an_oversubscribed_run_says_so_beside_the_cost_models_n_machines(finished_runs,
                                                                           tmp_path):
    """3 workers on 2 cores: at most 2x here, said in the table's text (labavg.jobs.speedup's
    flag) and beside the cost model's speedup for 3 machines on the Scaling tab."""
    from dashboard.scaling_view import ScalingView

    runs, (_, three) = finished_runs
    copy = tmp_path / "runs"
    shutil.copytree(runs, copy)
    path = copy / Path(three.run_dir).name / "summary.json"
    summary = json.loads(path.read_text())
    summary["cores"] = 2
    path.write_text(json.dumps(summary))
    table = RunTable(runs_dir=str(copy))
    rows = table.refresh()
    assert "3 threads on 2 cores: at most 2x here" in rows[1]["speedup_note"]
    view = ScalingView(table, tiny_settings(three_corpus(three), copy))
    view.refresh()
    note = view.note.object
    assert "3 threads on 2 cores: at most 2x here; the cost model predicts" in note
    assert "for 3 machines" in note and dict(table.predicted())[3] > 1


def test_runs_the_table_cannot_read_are_named_above_it(finished_runs, tmp_path):
    """A run an older labavg wrote (K at its config's top level) is left out and a damaged
    summary.json leaves its run without results; the Runs tab names both files."""
    from dashboard.runs_view import RunsView

    runs, _ = finished_runs
    copy = tmp_path / "runs"
    shutil.copytree(runs, copy)
    old, damaged = sorted(copy.iterdir())
    config = json.loads((old / "config.json").read_text())
    config["average_every"] = config.pop("averaging")["average_every"]
    (old / "config.json").write_text(json.dumps(config))
    (damaged / "summary.json").write_text("{")
    (copy / "not-a-run-yet").mkdir()  # a run directory before its config.json: no problem
    table = RunTable(runs_dir=str(copy))
    view = RunsView(table)
    view.refresh()
    assert [r["run"] for r in table.rows] == [damaged.name]
    assert table.rows[0]["status"] != "finished"
    assert len(table.problems) == 2
    assert table.problems[0] == (f"{old / 'config.json'}: settings have moved: average_every "
                                 "is now averaging.average_every")
    assert table.problems[1].startswith(f"{damaged / 'summary.json'}: ")
    assert view.problems.visible and all(p in view.problems.object for p in table.problems)
    for run, file in ((old, "config.json"), (damaged, "summary.json")):  # mended
        (run / file).write_text((runs / run.name / file).read_text())
    view.refresh()
    assert table.problems == [] and not view.problems.visible and len(table.rows) == 2


def three_corpus(live: LiveRun) -> Path:
    return Path(live.config["data"]["data"])


def test_another_page_attaches_to_the_servers_run_and_can_stop_it(corpus, tmp_path):
    """A reload is a new session: it finds the run the server is training, refuses a second
    Start beside it, and its Stop stops that run."""
    first = LiveRun()
    assert first.start(tiny_settings(corpus, tmp_path, epochs=50))
    second = LiveRun(jobs=first.jobs)  # a page of the same server
    try:
        assert second.attach() and second.running and second.mode == "monitor"
        assert second.run_dir == first.run_dir and "started from another page" in second.status
        assert second.start(tiny_settings(corpus, tmp_path)) is False
        assert "already in progress" in second.status
        third = LiveRun(jobs=first.jobs)  # a page that has not attached yet: Start shows the run
        assert third.start(tiny_settings(corpus, tmp_path)) is False
        assert "started from another page" in third.status and third.run_dir == first.run_dir
        deadline = time.monotonic() + 60
        while second.buffers.last_step < 4:
            assert time.monotonic() < deadline and second.running, second.status
            second.drain()
            first.drain()
            time.sleep(0.05)
        second.stop()
        assert second.status.startswith("Stopping ")
        assert first.join(60)
        run_to_end(first)
        while second.running:
            assert time.monotonic() < deadline + 60, second.status
            second.drain()
            time.sleep(0.05)
    finally:
        first.stop()
        first.join(60)
    assert json.loads((Path(first.run_dir) / "summary.json").read_text())["stopped"] is True
    assert second.status.startswith("Stopped:") and first.status.startswith("Stopped:")
    assert first.jobs.active() is None and not second.attach()
    assert LiveRun().jobs.last() is None  # another server's registry knows none of it


def test_a_closed_page_stops_queueing_its_runs_events_and_the_run_goes_on(corpus, tmp_path):
    """Nothing drains a closed page's queue: the events of a run it started must not pile up
    in the server for as long as the run lasts. The run itself is not stopped."""
    from bokeh.document import Document
    from panel.io.state import set_curdoc

    from dashboard.app import create_app

    doc = Document()
    with set_curdoc(doc):
        page = create_app(runs_dir=str(tmp_path), data=str(corpus), inline=False)
    live = page.dashboard.live
    settings = tiny_settings(corpus, tmp_path, epochs=3)
    assert live.start(settings), live.status
    deadline = time.monotonic() + 60
    while live._inbox.empty():
        assert time.monotonic() < deadline, live.status
        time.sleep(0.02)
    for callback in doc.session_destroyed_callbacks:  # what the server does when the page goes
        callback(None)
    assert live.join(120)
    assert live._inbox.empty()
    summary = json.loads((Path(live.run_dir) / "summary.json").read_text())
    assert summary["stopped"] is False and summary["steps"] > 0


def test_a_second_start_while_running_is_refused(corpus, tmp_path):
    live = LiveRun()
    assert live.start(tiny_settings(corpus, tmp_path, epochs=50))
    try:
        assert live.start(tiny_settings(corpus, tmp_path)) is False
        assert "already in progress" in live.status
    finally:
        live.stop()
        live.join(60)
        run_to_end(live)


def test_run_table_lists_runs_overlays_and_exports_csv(finished_runs):
    runs, (one, three) = finished_runs
    table = RunTable(runs_dir=str(runs))
    rows = table.refresh()
    assert [r["ranks"] for r in rows] == [1, 3]
    assert all(r["status"] == "finished" and r["model"] == "1x32" for r in rows)
    assert [r["average_every"] for r in rows] == [2, 4]
    # One speedup per run, the Live tab's number, interval and conditions (one function).
    from dashboard.speedup import shown_text

    measured = three.speedup().measured
    assert rows[1]["speedup"] == pytest.approx(measured.value, rel=1e-5)  # 6 digits
    assert rows[1]["speedup_note"] == shown_text(measured)
    assert rows[1]["speedup_range"] == f"{measured.low:.2f}-{measured.high:.2f}"
    assert rows[1]["efficiency_pct"] == pytest.approx(100 * measured.value / 3, rel=1e-5)  # in %
    assert rows[0]["speedup"] == 1.0 and rows[0]["speedup_range"] is None  # one worker
    points = table.scaling()
    assert [(p["ranks"], p["speedup"], p["low"], p["text"]) for p in points] == [
        (1, 1.0, 1.0, shown_text(one.speedup().measured)),
        (3, measured.value, measured.low, shown_text(measured))]

    table.selected = [r["run"] for r in rows]
    curves = table.overlay()
    assert set(curves) == set(table.selected)
    # Legends say what differs between the runs, not when they ran.
    assert [curves[r["run"]]["label"] for r in rows] == ["n1 K=2", "n3 K=4"]
    divergence = curves[rows[1]["run"]]["divergence"]
    assert len(divergence) == len(three.buffers.of("divergence").points[0]) and max(divergence) > 0
    assert curves[rows[1]["run"]]["div_frames"][0] == 4 * 64 * 3  # first round: K x minibatch x ranks
    for row, live in zip(rows, (one, three)):
        c = curves[row["run"]]
        assert len(c["loss"]) == live.buffers.finished.step
        assert c["frames"][0] == 64 * row["ranks"]  # step 1 x minibatch x ranks
        assert c["cv_acc_pct"] == pytest.approx([live.buffers.of("cv").points[0][0][1]])

    parsed = list(csv.DictReader(io.StringIO(table.to_csv())))
    assert [p["run"] for p in parsed] == [r["run"] for r in rows]
    assert float(parsed[1]["wall_seconds"]) == pytest.approx(three.summary.wall_seconds, rel=1e-5)  # 6 digits
    assert float(parsed[0]["cv_acc_pct"]) == pytest.approx(100 * one.summary.cv_frame_accuracy, abs=0.01)
    # As the table shows them: efficiency a percentage, numbers to six significant digits.
    assert float(parsed[1]["efficiency_pct"]) == pytest.approx(rows[1]["efficiency_pct"], rel=1e-5)
    assert parsed[1]["speedup_note"] == rows[1]["speedup_note"]
    numbers = [v for p in parsed for v in p.values() if re.fullmatch(r"-?[\d.]+(e-?\d+)?", v)]
    assert numbers and all(len(re.sub(r"[-.]|e.*", "", v).strip("0")) <= 6 for v in numbers), numbers


def test_communication_view_plots_what_each_multi_rank_run_sent(finished_runs):
    from dashboard.plots import communication_plot, load_backend

    load_backend()
    runs, (one, three) = finished_runs
    table = RunTable(runs_dir=str(runs))
    rows = table.refresh()
    assert [r["averaging"] for r in rows] == ["model", "model"]
    # One rank averages nothing: it sends no bytes and is not a point of the view.
    assert rows[0]["mb_sent"] is None or rows[0]["mb_sent"] == 0
    assert rows[1]["mb_sent"] == pytest.approx(three.summary.bytes_sent / 1e6, rel=1e-5)  # 6 digits
    assert three.summary.bytes_sent == (
        three.summary.bytes_per_round * three.summary.averaging_rounds)
    points = table.communication()
    assert [(p["method"], p["ranks"], p["K"]) for p in points] == [("model", 3, 4)]
    assert points[0]["cv_acc_pct"] == pytest.approx(100 * three.summary.cv_frame_accuracy, abs=0.01)
    layout = communication_plot([*points, {**points[0], "method": "bmuf", "mb_sent": 2.0,
                                           "run": "other"}])
    accuracy, wer = layout
    assert sorted(el.label for el in accuracy) == ["bmuf, 3 ranks", "model, 3 ranks"]
    assert accuracy.opts.get().kwargs["logx"] is True
    assert "MB sent per rank" in accuracy.opts.get().kwargs["xlabel"]
    assert len(wer) == 1 and len(wer.get(0)) == 0  # no decoded run: an empty plot, not an error
    import holoviews as hv

    accuracy, wer = communication_plot(points, one_rank={"cv_acc_pct": 61.5, "wer_pct": None})
    lines = [el for el in accuracy if isinstance(el, hv.HLine)]
    assert [line.data for line in lines] == [61.5]  # the 1-rank run, dashed
    assert not any(isinstance(el, hv.HLine) for el in wer)  # no WER: no line


def test_monitor_mode_follows_a_run_directory_being_written(finished_runs, tmp_path):
    _, (_, three) = finished_runs
    source = Path(three.run_dir)
    lines = (source / "events.jsonl").read_bytes().splitlines(keepends=True)
    target = tmp_path / "followed"
    target.mkdir()
    live = LiveRun()
    assert live.follow(target) and live.mode == "monitor"
    time.sleep(0.5)
    live.drain()
    assert not live.config  # no config.json yet: waiting
    shutil.copy(source / "config.json", target / "config.json")
    half = len(lines) // 2
    with open(target / "events.jsonl", "wb") as f:
        f.writelines(lines[:half])
        f.write(lines[half][:7])  # a line still being written
        f.flush()
        expected = sum(json.loads(line)["type"] == "minibatch" for line in lines[:half])
        until(live, lambda: sum(len(p) for p in live.buffers.of("loss").points) >= expected)
        assert live.buffers.ranks == 3 and live.config["ranks"] == 3
        time.sleep(0.5)  # the follower reads again: the line being written stays out
        live.drain()
        assert sum(len(p) for p in live.buffers.of("loss").points) == expected
        f.write(lines[half][7:])
        f.writelines(lines[half + 1:])
    assert live.running
    shutil.copy(source / "summary.json", target / "summary.json")
    until(live, lambda: not live.running)
    assert [len(p) for p in live.buffers.of("loss").points] == [
        len(p) for p in three.buffers.of("loss").points]
    assert live.buffers.finished.step == three.buffers.finished.step
    assert not live.running and live.status.startswith("Finished:")


def test_following_one_finished_run_then_another_fills_the_plots_of_their_ranks(finished_runs):
    # labavg issue 41: following a second finished multi-rank run in the inline dashboard left
    # its loss and divergence plots empty, titled "Divergence: 0 with one rank".
    from dashboard.app import Dashboard

    runs, (_, three) = finished_runs
    dashboard = Dashboard(runs_dir=str(runs))
    for _ in range(2):
        assert dashboard.live.follow(three.run_dir)
        until(dashboard.live, lambda: not dashboard.live.running)
        for _ in range(12):  # the page's flushes
            dashboard.flush()
        plots = dashboard.plots
        assert plots.ranks == 3 and plots.divergence.element.title.text == "Divergence from the average"
        for rank, points in enumerate(three.buffers.of("loss").points):
            assert len(plots.loss.sources[f"loss_r{rank}"][0].data["step"]) == len(points) > 0


def test_event_tail_keeps_a_partial_last_line(tmp_path):
    path = tmp_path / "events.jsonl"
    tail = EventTail(path)
    assert tail.read() == []
    path.write_bytes(b'{"type": "a", "rank": 0}\n{"type": "b", ')
    assert [e["type"] for e in tail.read()] == ["a"]
    with open(path, "ab") as f:
        f.write(b'"rank": 1}\n')
    assert tail.read() == [{"type": "b", "rank": 1}]
    assert tail.read() == []


def test_a_new_live_plot_is_one_entry_of_the_plot_specs(finished_runs):
    """dashboard.live_plots: a plot declared by its feed, x and series is filled by the buffers
    and drawn by the tab with nothing else added (each rank's learning rate here)."""
    from dashboard.live_plots import LIVE_PLOTS, LivePlot, Series
    from dashboard.live_view import figure_of, rows_of
    from labavg.jobs.index import read_run_events

    _, (_, three) = finished_runs
    lr = LivePlot("lr", MinibatchDone, "step", (Series("lr", "lr", lambda e: e.lr),),
                  title="Learning rate per rank", xlabel="step (minibatches)", ylabel="lr")
    buffers = RunBuffers(3, plots=(*LIVE_PLOTS, lr))
    for event in read_run_events(Path(three.run_dir)):
        buffers.add(event)
    rows = rows_of(lr, buffers)
    assert list(rows.columns) == ["step", "lr_r0", "lr_r1", "lr_r2", "lr_mean"]
    assert len(rows) == three.buffers.finished.step and (rows["lr_mean"] > 0).all()
    figure = figure_of(lr, 3, 100)
    figure.stream(rows)
    assert figure.element.title.text == "Learning rate per rank" and len(figure.data) == len(rows)
    assert rows_of(lr, buffers) is None  # taken: the next flush sends nothing again


def test_events_are_routed_by_their_type(finished_runs):
    """The buffers take typed events (labavg.base.events): a type no plot reads is left alone,
    rank 0's run_finished ends the rows, and the same event twice is one point."""
    from labavg.base.events import CheckpointSaved, RunFinished

    buffers = RunBuffers(2)
    buffers.add(CheckpointSaved(rank=0, step=1, path="x"))
    assert buffers.finished is None and buffers.last_step == 0
    for rank in (0, 1):
        buffers.add(MinibatchDone(rank=rank, epoch=0, step=1, loss=2.0, frame_accuracy=0.5,
                                  frames=64, lr=0.008, applied=True, max_change_scale=1.0))
    buffers.add(MinibatchDone(rank=0, epoch=0, step=2, loss=1.0, frame_accuracy=0.5,
                              frames=64, lr=0.008, applied=True, max_change_scale=1.0))
    assert [row[0] for row in buffers.of("loss").take()] == [1]  # step 2 waits for rank 1
    buffers.add(RunFinished(rank=0, step=2, wall_seconds=1.0, compute_seconds=1.0,
                            comm_seconds=0.0, averaging_rounds=0, frames_trained=192,
                            cv_loss=1.0, cv_frame_accuracy=0.5))
    assert buffers.finished.step == 2 and buffers.last_step == 2
    assert [row[0] for row in buffers.of("loss").take()] == [2]  # flushed with a gap


def test_the_pages_of_one_server_share_its_registry_of_runs(corpus, tmp_path):
    """create_app's pages share the server's JobRegistry (Panel's per-process cache); a
    Dashboard built with a registry of its own sees no other's runs."""
    from dashboard.app import Dashboard, create_app
    from dashboard.jobs import server_jobs

    first = create_app(runs_dir=str(tmp_path), data=str(corpus), inline=False)
    second = create_app(runs_dir=str(tmp_path), data=str(corpus), inline=False)
    assert first.dashboard.live.jobs is second.dashboard.live.jobs is server_jobs()
    alone = Dashboard(runs_dir=str(tmp_path), data=str(corpus), jobs=JobRegistry())
    assert alone.live.jobs is not server_jobs()


def test_the_runs_table_lists_a_run_when_it_starts_and_ends_without_a_timer(corpus, tmp_path):
    """The table is rescanned when what it lists changes (rank 0 started: its config.json is
    written; the run ended), by the state it depends on, not every few seconds."""
    from dashboard.app import Dashboard

    runs = tmp_path / "runs"
    dashboard = Dashboard(runs_dir=str(runs), data=str(corpus), jobs=JobRegistry())
    dashboard.settings.param.update(**{k: v for k, v in vars(tiny_settings(corpus, runs)).items()
                                       if k in ("ranks", "average_every", "minibatch", "epochs",
                                                "hidden_layers", "hidden_dim", "context")})
    dashboard.settings.overrides = {"data.buffer_frames": 2048}
    assert dashboard.live.start(dashboard.settings), dashboard.live.status
    assert dashboard.table.rows == []
    until(dashboard.live, lambda: dashboard.live.started)
    [row] = dashboard.table.rows
    assert row["run"] == Path(dashboard.live.run_dir).name and row["status"] != "finished"
    run_to_end(dashboard.live)
    [row] = dashboard.table.rows
    assert row["status"] == "finished"


def test_buffers_are_bounded():
    series = RankSeries(ranks=4, maxlen=100)
    for step in range(1, 1001):
        for rank in range(3):  # rank 3 never reports: rows must not pile up waiting for it
            series.add(rank, step, float(step))
    assert [len(p) for p in series.points] == [100, 100, 100, 0]
    rows = series.take()
    assert len(rows) == 100 and rows[-1][0] <= 1000
    assert math.isnan(rows[-1][4]) and rows[-1][5] == rows[-1][1]
    assert len(series._pending) <= 65

    buffers = RunBuffers(ranks=32, maxlen=5000)
    for step in range(1, 6001):
        for rank in range(32):
            buffers.add(MinibatchDone(rank=rank, epoch=0, step=step, loss=1.0, frame_accuracy=0.5,
                                      frames=64, lr=0.008, applied=True, max_change_scale=1.0))
    assert all(len(p) == 5000 for p in buffers.of("loss").points)
    assert len(buffers.of("loss").take()) == 5000


def test_live_plots_stream_rows_into_bounded_buffers(finished_runs):
    from dashboard.live_view import LivePlots

    _, (_, three) = finished_runs
    live = LiveRun(maxlen=10)
    live.follow(three.run_dir)
    plots = LivePlots(live, maxlen=10)
    until(live, lambda: not live.running)
    sent = [plots.stream() for _ in range(5)]  # a few flushes pass while new plots settle
    assert sum(sent) > 0
    data = plots.loss.data
    assert list(data.columns) == ["step", "loss_r0", "loss_r1", "loss_r2", "loss_mean"]
    steps = three.buffers.finished.step
    assert len(data) == 10 and data["step"].tolist() == list(range(steps - 9, steps + 1))
    assert plots.fps.data["frames_per_s"].gt(0).all() and len(plots.times.data) == len(plots.fps.data)
    assert plots.cv.data["cv_acc_pct"].tolist() == pytest.approx(
        [100 * three.summary.cv_frame_accuracy])


def test_labavg_dashboard_command_serves_the_app(tmp_path):
    """`labavg dashboard --no-browser` serves /app on localhost."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "labavg", "dashboard", "--no-browser", "--port",
                             str(port), "--runs-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # A page takes 10-20 s to build on this 2-core machine under load: a shorter wait per
        # request would give up on every one (each retry a new session to build).
        deadline, page = time.monotonic() + 240, None
        while time.monotonic() < deadline and page is None:
            try:
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}/app", timeout=120).read()
            except OSError:
                time.sleep(0.5)
        assert page is not None, "the dashboard did not answer"
        assert b"bokeh" in page.lower() and b"labavg" in page.lower()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_average_every_frames_shows_the_effective_k_everywhere(corpus, tmp_path):
    # 256 frames of 64-frame minibatches: K = 4, while the K control still says 2.
    settings = tiny_settings(corpus, tmp_path / "runs", ranks=1,
                             overrides={"data.buffer_frames": 2048,
                                        "averaging.average_every_frames": 256})
    live = LiveRun()
    assert live.start(settings), live.status
    assert "K=4" in live.status and Path(live.run_dir).name.endswith("-n1-k4")
    assert "K=4 ·" in describe_config(live.config)
    run_to_end(live)
    assert live.summary.average_every == 4
    [row] = RunTable(runs_dir=str(tmp_path / "runs")).refresh()
    assert row["average_every"] == 4
    from labavg.jobs.summary import format_table

    header, _, line = format_table([{"run": "r", **live.summary.to_dict()}]).splitlines()[:3]
    cells = dict(zip(header.split("|"), line.split("|")))
    assert [cells[t].strip() for t in cells if t.strip() in ("ranks", "K")] == ["1", "4"]


# Fast-suite margin: an end-to-end twin of a fast test; CI runs it with -m slow.
@pytest.mark.slow
def test_mpi_engines_say_they_are_starting_until_they_train(corpus, tmp_path):
    live = LiveRun()
    assert live.start(tiny_settings(corpus, tmp_path, backend="MPI engines")), live.status
    assert live.status.startswith("Starting 2 MPI engines for ") and "the plots fill" in live.status
    seen = {live.status.split(" ")[0]}
    deadline = time.monotonic() + 300
    while live.running:
        assert time.monotonic() < deadline, live.status
        live.drain()
        seen.add(live.status.split(" ")[0])
        time.sleep(0.05)
    live.drain()
    # Until the first step arrives the page says the engines are starting, then what runs.
    assert live.status.startswith("Finished:"), live.status
    assert {"Starting", "Finished:"} <= seen and live.summary.ranks == 2


def test_a_run_started_from_the_page_trains_in_a_job_process_not_the_servers(corpus, tmp_path):
    """In-process workers too: the ranks are threads of one job process, never of the
    server's (training there once held the page for 18-53 s under load)."""
    import os

    from labavg.jobs.index import read_events

    live = LiveRun()
    assert live.start(tiny_settings(corpus, tmp_path, ranks=2))
    assert "in a job process" in live.status
    run_to_end(live)
    started = [e for e in read_events(Path(live.run_dir)) if e["type"] == "run_started"]
    assert {e["rank"] for e in started} == {0, 1}
    assert {e["pid"] for e in started} != {os.getpid()} and len({e["pid"] for e in started}) == 1
    assert live.status.startswith("Finished:") and live.summary.ranks == 2
    assert not (Path(live.run_dir) / ".stop").exists()  # the job's own files are gone


def test_stopped_is_said_when_rank_0_ends_the_run_not_when_its_process_exits(corpus, tmp_path):
    live = LiveRun()
    assert live.start(tiny_settings(corpus, tmp_path, epochs=50))
    try:
        wait = time.monotonic() + 60
        while live.buffers.last_step < 2:
            assert time.monotonic() < wait and live.running, live.status
            live.drain()
            time.sleep(0.02)
        live.stop()
        assert live.status.startswith("Stopping")
        while not live.buffers.finished:
            assert time.monotonic() < wait + 60, live.status
            live.drain()
            time.sleep(0.02)
        # The drain that took rank 0's run_finished says so, whether or not the job's
        # process has exited yet (it still saves the model).
        assert live.status.startswith("Stopped:"), live.status
    finally:
        live.stop()
        live.join(60)
        run_to_end(live)
    assert json.loads((Path(live.run_dir) / "summary.json").read_text())["stopped"] is True


def test_a_reload_shows_the_runs_settings_not_the_defaults(corpus, tmp_path):
    """A reload mid-run (a new Dashboard) shows the server's run and, in its boxes, the
    settings that run trains with; after the run, a new page shows the last run the same way;
    Start then trains what is on screen."""
    from dashboard.app import Dashboard
    from labavg.training.config import config_from_dict

    runs = tmp_path / "runs"
    first = Dashboard(runs_dir=str(tmp_path / "elsewhere"), data=str(corpus))
    first.settings.param.update(**{k: v for k, v in dict(
        data=str(corpus), runs_dir=str(runs), ranks=3, average_every=5, minibatch=64, epochs=50,
        hidden_layers=1, hidden_dim=24, context=2, lr=0.004, averaging="bmuf",
        momentum=0.25).items()}, overrides={"data.buffer_frames": 2048})
    assert first.live.start(first.settings), first.live.status
    config = first.live.config
    try:
        reload = Dashboard(runs_dir=str(tmp_path / "defaults"), jobs=first.live.jobs)
        assert reload.live.run_dir == first.live.run_dir and reload.live.running
        assert not reload.controls.stop_button.disabled and reload.controls.start_button.disabled
        shown = reload.settings
        assert (shown.ranks, shown.average_every, shown.hidden_dim, shown.lr, shown.averaging,
                shown.momentum, shown.epochs) == (3, 5, 24, 0.004, "bmuf", 0.25, 50)
        assert shown.runs_dir == str(runs) and shown.data == str(corpus)
        assert shown.overrides == {"data.buffer_frames": 2048} and not shown.errors
        again = to_dict_of(shown.to_config(Path(config["out"])))
        assert again == config
    finally:
        first.live.stop()
        first.live.join(60)
        run_to_end(first.live)
    after = Dashboard(runs_dir=str(tmp_path / "defaults"), jobs=first.live.jobs)
    assert after.live.run_dir == first.live.run_dir and after.settings.hidden_dim == 24
    assert not after.live.running and after.controls.stop_button.disabled  # read in, not followed
    for _ in range(50):
        after.flush()
        if after.live.mode == "idle":
            break
        time.sleep(0.05)
    assert after.live.status.startswith("Stopped:"), after.live.status
    assert after.live.buffers.finished and after.live.buffers.ranks == 3
    assert config_from_dict(config, "x").model.hidden_dim == 24


def test_show_run_names_the_preset_a_run_has_and_keeps_its_values(corpus, tmp_path):
    from labavg.training.config import PRESETS

    settings = tiny_settings(corpus, tmp_path)
    cfg = to_dict_of(preset_config("teaching", with_overrides(TrainConfig(), {
        "data.data": str(corpus), "ranks": 4, "out": str(tmp_path / "r")})))
    settings.show_run(cfg)
    assert settings.preset == "teaching"
    assert settings.hidden_dim == PRESETS["teaching"]["model.hidden_dim"] and settings.ranks == 4
    assert settings.minibatch == TrainConfig().minibatch and settings.overrides == {}
    assert settings.typed == {}


def to_dict_of(cfg) -> dict:
    from labavg.base.settings import to_dict

    return to_dict(cfg)


def test_the_overlay_draws_the_ticked_runs_as_columns_replaced_on_each_tick(finished_runs):
    """labavg issue 30: one multi-line source per plot (a row per run) and one legend, their
    contents replaced when runs are ticked (no plot rebuilt); accuracy on the runs' own range."""
    from dashboard.overlay import RunsOverlay

    runs, _ = finished_runs
    table = RunTable(runs_dir=str(runs))
    table.selected = [r["run"] for r in table.refresh()]
    curves = table.overlay()
    overlay = RunsOverlay()
    figures = dict(overlay.figures)
    overlay.show(curves)
    loss = overlay.sources["loss"].data
    assert loss["label"] == ["n1 K=2", "n3 K=4"] and len(set(loss["color"])) == 2
    for xs, ys, curve in zip(loss["xs"], loss["ys"], curves.values()):
        assert list(xs) == curve["frames"] and list(ys) == pytest.approx(curve["loss"])
    divergence = overlay.sources["divergence"].data
    assert [list(x) for x in divergence["xs"]] == [c["div_frames"] for c in curves.values()]
    assert len(overlay.points.data["x"]) == sum(len(c["cv_frames"]) for c in curves.values())
    assert overlay.shown == ["n1 K=2", "n3 K=4"]
    assert "n1 K=2" in overlay.legend.object and "n3 K=4" in overlay.legend.object
    # The y axes follow the lines drawn (DataRange1d), accuracy's no longer fixed at 0-100.
    accuracy = overlay.figures["cv"].y_range
    assert type(accuracy).__name__ == "DataRange1d" and math.isnan(accuracy.start) and math.isnan(accuracy.end)
    assert overlay.figures == figures  # the same figures: only their data changed
    overlay.show({})
    assert list(overlay.sources["cv"].data["xs"]) == [] and overlay.legend.object == ""


def test_ticking_one_more_run_rereads_only_the_logs_that_changed(finished_runs, tmp_path,
                                                                  monkeypatch):
    import dashboard.runs_table as runs_table

    runs, _ = finished_runs
    for run in runs.iterdir():
        shutil.copytree(run, tmp_path / run.name)
    table = RunTable(runs_dir=str(tmp_path))
    names = [r["run"] for r in table.refresh()]
    read = []
    real = runs_table.read_run_events
    monkeypatch.setattr(runs_table, "read_run_events",
                        lambda run_dir: read.append(Path(run_dir).name) or real(run_dir))
    table.selected = names[:1]
    first = table.overlay()
    table.selected = names
    both = table.overlay()
    assert read == names  # the first run's log was read once
    assert {**both[names[0]], "label": ""} == {**first[names[0]], "label": ""}
    table.overlay()
    assert read == names  # nothing changed: nothing reread
    events = tmp_path / names[0] / "events.jsonl"
    lines = events.read_text().splitlines(keepends=True)
    events.write_text("".join(lines[: len(lines) // 2]))  # the log changed: read again
    again = table.overlay()
    assert read == [*names, names[0]]
    assert len(again[names[0]]["loss"]) < len(both[names[0]]["loss"])
    assert again[names[1]] == both[names[1]]


def test_cv_checks_inside_epochs_are_drawn_on_the_accuracy_plot():
    """`cv_every`'s checks (events 'cv') go on the accuracy plot of the epoch ends, at the
    epochs trained so far, its axis from 0; the epoch ends keep their own points."""
    import holoviews as hv

    from dashboard.live_plots import LIVE_PLOTS
    from dashboard.live_view import LivePlots, rows_of
    from labavg.base.events import CVChecked, EpochDone

    buffers = RunBuffers(2)
    for rank in (0, 1):
        for step, epochs, accuracy in ((4, 0.5, 0.3), (8, 1.0, 0.4), (12, 1.5, 0.45)):
            buffers.add(CVChecked(rank=rank, epoch=int(epochs - 0.01), step=step, epochs=epochs,
                                  cv_loss=2.0, cv_frame_accuracy=accuracy, train_seconds=step,
                                  cv_seconds=0.1, epoch_end=epochs == 1.0))
        buffers.add(EpochDone(rank=rank, epoch=0, step=8, train_loss=2.0,
                              train_frame_accuracy=0.35, cv_loss=2.0, cv_frame_accuracy=0.4,
                              lr=0.01, accepted=True, seconds=1.0))
    plots = LivePlots(LiveRun())
    assert plots.cv_checks is plots.cv and "cv_checks" not in plots.panes  # one figure
    for plot in LIVE_PLOTS:
        if plot.name in ("cv", "cv_checks"):
            plots.figures[plot.name].stream(rows_of(plot, buffers))
    assert plots.cv.checks["epochs"].tolist() == [0.5, 1.0, 1.5]
    assert plots.cv.checks["cv_check_pct"].tolist() == pytest.approx([30, 40, 45])
    assert plots.cv.data["cv_acc_pct"].tolist() == pytest.approx([40])
    figure = hv.render(plots.cv.element)
    assert figure.x_range.start == 0 and figure.x_range.end >= 1.6
    assert "CV checks" in [item.label["value"] for item in figure.legend[0].items]
    plots.cv.clear()
    assert len(plots.cv.checks) == 0 and len(plots.cv.data) == 0
