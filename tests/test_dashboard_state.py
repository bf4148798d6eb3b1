"""The dashboard's state classes, without a browser: settings, live runs, monitor mode, run table."""

from __future__ import annotations

import csv
import io
import json
import math
import shutil
import sys
import time
from pathlib import Path

import pytest

# dashboard/ sits beside labavg/ but is not (yet) an installed package: import it from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dashboard.live import LiveRun, RankSeries, RunBuffers
from dashboard.runs_table import RunTable
from dashboard.settings import RunSettings, describe_config
from labavg.index import EventTail
from labavg.errors import UserError


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
    """Drain like the UI's periodic callback until the run has ended."""
    deadline = time.monotonic() + timeout
    while live.running:
        assert time.monotonic() < deadline, f"run did not end: {live.status}"
        live.drain()
        time.sleep(0.05)
    live.drain()


@pytest.fixture(scope="module")
def finished_runs(corpus, tmp_path_factory):
    """A 1-rank and a 3-rank run of the same configuration, run through LiveRun."""
    runs = tmp_path_factory.mktemp("runs")
    lives = []
    for ranks in (1, 3):
        live = LiveRun()
        assert live.start(tiny_settings(corpus, runs, ranks=ranks)), live.status
        run_to_end(live)
        lives.append(live)
        time.sleep(1.01)  # run directories are named by the second
    return runs, lives


def test_bounds_reject_bad_ranks_and_k_with_a_message():
    settings = RunSettings()
    with pytest.raises(ValueError, match="ranks.*at least 1"):
        settings.ranks = 0
    with pytest.raises(ValueError, match="average_every.*at least 1"):
        settings.average_every = 0
    with pytest.raises(ValueError, match="lr"):
        settings.lr = 0.0
    assert (settings.ranks, settings.average_every) == (2, 10)  # unchanged


def test_invalid_settings_become_a_message_not_a_crash(corpus, tmp_path):
    settings = tiny_settings(tmp_path / "missing", tmp_path / "runs")
    assert "missing" in settings.check() and "does not exist" in settings.check()
    live = LiveRun()
    assert live.start(settings) is False
    assert live.status.startswith("Cannot start:") and "missing" in live.status
    assert not live.running and not (tmp_path / "runs").exists()

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
    assert (cfg.out, cfg.backend, cfg.ranks, cfg.average_every) == (str(tmp_path / "r"), "mpi", 4, 7)
    assert (cfg.lr, cfg.final_lr, cfg.schedule, cfg.optimizer) == (0.01, 0.0005, "newbob", "ngsgd")
    assert (cfg.minibatch, cfg.epochs, cfg.model.hidden_layers, cfg.model.hidden_dim) == (128, 3, 2, 48)
    assert (cfg.data.data, cfg.data.context, cfg.data.buffer_frames) == (str(corpus), 2, 2048)
    assert cfg.tensorboard is False and cfg.final_learning_rate() == 0.0005


def test_live_run_fills_every_ranks_buffers(finished_runs):
    runs, (one, three) = finished_runs
    buffers = three.buffers
    assert buffers.ranks == 3
    steps = buffers.finished["step"]
    assert steps > 5
    for rank in range(3):
        points = list(buffers.loss.points[rank])
        assert [x for x, _ in points] == list(range(1, steps + 1))
        assert all(0 < y < 10 for _, y in points)  # cross-entropy of 120 pdfs starts near ln 120
    assert buffers.divergence.points[0] and all(d >= 0 for _, d in buffers.divergence.points[2])
    assert len(buffers.cv) == 1 and 0 <= buffers.cv[0][1] <= 1
    rows = buffers.loss.take()  # complete rows: step, 3 ranks, mean
    assert len(rows) == steps and len(rows[0]) == 5
    assert rows[0][4] == pytest.approx(sum(rows[0][1:4]) / 3)
    assert three.status.startswith("Finished:") and three.summary["ranks"] == 3
    assert three.config["ranks"] == 3 and "K=2" in describe_config(three.config)
    assert (Path(three.run_dir) / "summary.json").is_file()


def test_stop_ends_the_run_early(corpus, tmp_path):
    live = LiveRun()
    assert live.start(tiny_settings(corpus, tmp_path, epochs=50))
    deadline = time.monotonic() + 60
    while live.buffers.last_step < 4:
        assert time.monotonic() < deadline and live.running, live.status
        live.drain()
        time.sleep(0.02)
    live.stop()
    assert live.join(60)
    run_to_end(live)
    summary = json.loads((Path(live.run_dir) / "summary.json").read_text())
    per_epoch = summary["steps"]
    assert summary["stopped"] is True
    assert live.buffers.finished["step"] < 10 * per_epoch  # 50 epochs planned
    assert live.status.startswith("Stopped:")
    assert not live.running


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
    assert all(r["status"] == "finished" and r["K"] == 2 and r["model"] == "1x32" for r in rows)
    assert rows[1]["speedup"] == pytest.approx(one.summary["wall_seconds"] / three.summary["wall_seconds"])
    assert rows[1]["efficiency"] == pytest.approx(rows[1]["speedup"] / 3)
    assert [p["ranks"] for p in table.scaling()] == [1, 3]

    table.selected = [r["run"] for r in rows]
    curves = table.overlay()
    assert set(curves) == set(table.selected)
    for row, live in zip(rows, (one, three)):
        c = curves[row["run"]]
        assert len(c["loss"]) == live.buffers.finished["step"]
        assert c["frames"][0] == 64 * row["ranks"]  # step 1 x minibatch x ranks
        assert c["cv_acc_pct"] == pytest.approx([100 * live.buffers.cv[0][1]])

    parsed = list(csv.DictReader(io.StringIO(table.to_csv())))
    assert [p["run"] for p in parsed] == [r["run"] for r in rows]
    assert float(parsed[1]["wall_s"]) == pytest.approx(three.summary["wall_seconds"])
    assert float(parsed[0]["cv_acc_pct"]) == pytest.approx(100 * one.summary["cv_frame_accuracy"], abs=0.01)


def test_monitor_mode_follows_a_run_directory_being_written(finished_runs, tmp_path):
    runs, (_, three) = finished_runs
    source = Path(three.run_dir)
    lines = (source / "events.jsonl").read_bytes().splitlines(keepends=True)
    target = tmp_path / "followed"
    target.mkdir()
    live = LiveRun()
    assert live.follow(target) and live.mode == "monitor"
    live.drain()
    assert not live.config  # no config.json yet: waiting
    shutil.copy(source / "config.json", target / "config.json")
    half = len(lines) // 2
    with open(target / "events.jsonl", "wb") as f:
        f.writelines(lines[:half])
        f.write(lines[half][:7])  # a line still being written
        f.flush()
        live.drain()
        assert live.buffers.ranks == 3 and live.config["ranks"] == 3
        seen = sum(len(p) for p in live.buffers.loss.points)
        expected = sum(json.loads(line)["type"] == "minibatch" for line in lines[:half])
        assert seen == expected
        f.write(lines[half][7:])
        f.writelines(lines[half + 1:])
    assert live.running
    shutil.copy(source / "summary.json", target / "summary.json")
    live.drain()
    assert [len(p) for p in live.buffers.loss.points] == [len(p) for p in three.buffers.loss.points]
    assert live.buffers.finished["step"] == three.buffers.finished["step"]
    assert not live.running and live.status.startswith("Finished:")


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
            buffers.add({"type": "minibatch", "rank": rank, "step": step, "loss": 1.0})
    assert all(len(p) == 5000 for p in buffers.loss.points)
    assert len(buffers.loss.take()) == 5000


def test_live_plots_stream_rows_into_bounded_buffers(finished_runs):
    pytest.importorskip("holoviews")
    from dashboard.components import LivePlots

    runs, (_, three) = finished_runs
    live = LiveRun(maxlen=10)
    live.follow(three.run_dir)
    plots = LivePlots(live, maxlen=10)
    live.drain()
    sent = [plots.update() for _ in range(5)]  # a few updates pass while new plots settle
    assert sum(sent) > 0
    data = plots.loss.data
    assert list(data.columns) == ["step", "loss_r0", "loss_r1", "loss_r2", "loss_mean"]
    steps = three.buffers.finished["step"]
    assert len(data) == 10 and data["step"].tolist() == list(range(steps - 9, steps + 1))
    assert plots.fps.data["frames_per_s"].gt(0).all() and len(plots.times.data) == len(plots.fps.data)
    assert plots.cv_pipe.data["cv_acc_pct"].tolist() == pytest.approx([100 * three.buffers.cv[0][1]])


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
        deadline, page = time.monotonic() + 90, None
        while time.monotonic() < deadline and page is None:
            try:
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}/app", timeout=10).read()
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
                             overrides={"data.buffer_frames": 2048, "average_every_frames": 256})
    live = LiveRun()
    assert live.start(settings), live.status
    assert "K=4" in live.status and Path(live.run_dir).name.endswith("-n1-k4")
    assert "K=4 ·" in describe_config(live.config)
    run_to_end(live)
    assert live.summary["average_every"] == 4
    [row] = RunTable(runs_dir=str(tmp_path / "runs")).refresh()
    assert row["K"] == 4
    from labavg.runs import format_table

    assert "| 1 | 4 |" in format_table([{"run": "r", **live.summary}])
