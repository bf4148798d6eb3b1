"""The dashboard on a run whose K changes (averaging.schedule, issue 46), without a browser:
the K plot only for such a run, its rows from rank 0's rounds, an older log's 0 as a gap, the
schedule's boxes in the settings and its refusals under them. (The browser test that starts a
scheduled run from the sidebar is tests/test_dashboard_schedule_browser.py.)"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dashboard.buffers import RunBuffers
from dashboard.controls import SETTINGS_ORDER
from dashboard.live import LiveRun
from dashboard.live_plots import LIVE_PLOTS, RunKind
from dashboard.live_view import LivePlots, StepCurves, rows_of
from dashboard.membership import run_kind
from dashboard.settings import CONTROLS, GENERAL, RunSettings, describe_config
from labavg.base.events import Averaged
from labavg.base.settings import to_dict, with_overrides
from labavg.training.config import TrainConfig

from test_dashboard_state import corpus, tiny_settings  # noqa: F401 (fixture: a tiny corpus)

K_PLOT = next(plot for plot in LIVE_PLOTS if plot.name == "k")


def _config(**overrides) -> dict:
    return to_dict(with_overrides(TrainConfig(), overrides))


def _round(rank: int, n: int, step: int, k: int) -> Averaged:
    return Averaged(rank=rank, round=n, step=step, divergence=0.1, compute_seconds=0.1,
                    comm_seconds=0.01, frames_per_second=100.0, average_every=k)


def _rounds(ks: list[int], ranks: int = 2) -> list[Averaged]:
    """Every rank's rounds of a schedule whose rounds carry `ks`: each round K steps on."""
    events, step = [], 0
    for n, k in enumerate(ks):
        step += ks[n - 1] if n else ks[0]
        events += [_round(rank, n, step, k) for rank in range(ranks)]
    return events


def _live(config: dict) -> LiveRun:
    live = LiveRun()
    live.config = config
    return live


def test_the_k_plot_is_shown_only_for_a_run_whose_k_changes():
    assert run_kind(_config()) == RunKind(elastic=False, scheduled=False)
    assert run_kind({}) == RunKind()  # no run on screen
    for schedule in ("post_local", "adacomm"):
        assert run_kind(_config(**{"averaging.schedule": schedule})).scheduled
    constant = LivePlots(_live(_config()))
    # A constant run builds and shows exactly the plots it did before schedules: no K plot.
    assert "k" not in constant.figures
    assert [plot.name for plot in LIVE_PLOTS if plot.name in constant.figures] == [
        "loss", "divergence", "speedup", "times", "fps", "cv", "cv_checks"]
    assert constant.panes["k"] not in constant.flex.objects
    assert len(constant.flex.objects) == 6
    scheduled = LivePlots(_live(_config(**{"averaging.schedule": "adacomm"})))
    assert isinstance(scheduled.figures["k"], StepCurves)
    assert scheduled.flex.objects[1] is scheduled.panes["k"]  # beside the loss
    assert len(scheduled.flex.objects) == 7
    figure = scheduled.figures["k"].element
    assert figure.title.text == "Averaging interval K"
    assert figure.yaxis[0].axis_label == "K (minibatches)"
    assert not figure.legend  # one curve: no legend
    # The page's run changes kind: the K plot comes and goes with it, built once.
    live = _live(_config())
    plots = LivePlots(live)
    live.config = _config(**{"averaging.schedule": "post_local",
                             "averaging.post_local_frames": 1000})
    assert plots.panes["k"] in plots.flex.objects and "k" in plots.figures
    live.config = _config()
    assert plots.panes["k"] not in plots.flex.objects


def test_the_k_rows_are_rank_0s_rounds_drawn_as_steps():
    buffers = RunBuffers(2)
    ks = [4, 4, 3, 3, 2]
    for event in _rounds(ks):
        if event.rank == 1:  # rank 1's K is never read: give it another to tell
            event = _round(1, event.round, event.step, 99)
        buffers.add(event)
    rows = rows_of(K_PLOT, buffers)
    assert list(rows.columns) == ["step", "average_every"]
    assert rows["step"].tolist() == [4, 8, 12, 15, 18]
    assert rows["average_every"].tolist() == ks
    figure = StepCurves("step", [("average_every", "K", {})], 100, "K", "step", "K", legend=False)
    figure.stream(rows.iloc[:3])
    figure.stream(rows.iloc[3:])
    data = figure.sources["average_every"][0].data
    # Each round's K holds until the next round: a change is a vertical step at its round.
    segments = list(zip(data["step_from"], data["average_every_from"], data["step"],
                        data["average_every"]))
    assert segments == [(4, 4, 4, 4), (4, 4, 4, 4), (4, 4, 8, 4), (8, 4, 8, 4),
                        (8, 4, 12, 4), (12, 4, 12, 3), (12, 3, 15, 3), (15, 3, 15, 3),
                        (15, 3, 18, 3), (18, 3, 18, 2)]  # across the two streams too
    assert sorted(set(figure.data["average_every"])) == [2, 3, 4]
    figure.clear()
    assert len(figure.data) == 0 and len(figure.sources["average_every"][0].data["step"]) == 0


def test_an_older_logs_k_of_0_is_a_gap_not_k_0():
    buffers = RunBuffers(1)
    for n, (step, k) in enumerate(((10, 10), (20, 0), (30, 0), (40, 8), (48, 8))):
        buffers.add(_round(0, n, step, k))
    rows = rows_of(K_PLOT, buffers)
    # Every row out at once (NaN in the buffers would have kept them waiting for a rank).
    assert rows["step"].tolist() == [10, 20, 30, 40, 48]
    values = rows["average_every"].tolist()
    assert values[0] == 10 and math.isnan(values[1]) and math.isnan(values[2]) and values[3:] == [8, 8]
    figure = StepCurves("step", [("average_every", "K", {})], 100, "K", "step", "K", legend=False)
    figure.stream(rows)
    data = figure.sources["average_every"][0].data
    drawn = [(x0, x1) for x0, y0, x1, y1 in zip(data["step_from"], data["average_every_from"],
                                                 data["step"], data["average_every"])
             if np.isfinite([y0, y1]).all() and x1 > x0]
    assert drawn == [(10, 20), (40, 48)]  # K = 10 up to the gap; nothing drawn at K = 0
    assert 0 not in data["average_every"]


def test_the_schedule_boxes_build_the_runs_config(corpus, tmp_path):
    assert CONTROLS["average_schedule"] == "averaging.schedule"
    assert CONTROLS["post_local_frames"] == "averaging.post_local_frames"
    assert CONTROLS["schedule"] == "schedule"  # the learning rate's, as before
    # Under K, two to a row: the schedule and its frames share the row below K's.
    order = ("preset", *SETTINGS_ORDER)
    assert order.index("average_schedule") == order.index("average_every") + 1
    assert order.index("average_schedule") % 2 == 0  # starts a row
    settings = tiny_settings(corpus, tmp_path / "runs", average_schedule="adacomm")
    assert settings.errors == {}
    cfg = settings.to_config(tmp_path / "r")
    assert (cfg.averaging.schedule, cfg.averaging.average_every) == ("adacomm", 2)
    assert cfg.schedule == TrainConfig().schedule  # the learning rate's schedule untouched
    assert "K=2 (adacomm)" in describe_config(cfg)
    assert "(" not in describe_config(TrainConfig()).split("·")[1]  # constant: K alone
    # The frames box is greyed out (not used) unless the schedule is post_local.
    settings.post_local_frames = 5000
    assert settings.key_of("post_local_frames") is None
    assert settings.to_config(tmp_path / "r").averaging.post_local_frames == 0
    settings.average_schedule = "post_local"
    cfg = settings.to_config(tmp_path / "r")
    assert (cfg.averaging.schedule, cfg.averaging.post_local_frames) == ("post_local", 5000)


def test_post_local_without_frames_is_refused_under_the_frames_box(corpus, tmp_path):
    settings = tiny_settings(corpus, tmp_path / "runs", average_schedule="post_local")
    # AveragingConfig.problem's words, with the boxes' labels, under the box to change.
    assert settings.errors == {"post_local_frames": (
        'K schedule = "post_local" needs post-local frames > 0 (the frames averaged every '
        "minibatch before K takes over)")}
    assert LiveRun().start(settings) is False
    settings.post_local_frames = -5  # the box's own rule first
    assert settings.errors == {"post_local_frames": "post-local frames must be >= 0; got -5"}
    settings.post_local_frames = 2000
    assert settings.errors == {}
    # A schedule that another setting rules out: under the schedule's box, the one to change
    # back, and the key named is the schedule's, not the learning rate's `schedule`.
    settings.overrides = {**settings.overrides, "averaging.overlap": "eager"}
    assert settings.errors == {"average_schedule": (
        "K schedule = 'post_local' does not combine with overlap = 'eager' yet (set K schedule "
        '= "constant")')}
    assert GENERAL not in settings.errors
    settings.average_schedule = "constant"
    assert settings.errors == {}


def test_a_preset_keeps_the_schedule_as_it_keeps_k(corpus, tmp_path):
    settings = tiny_settings(corpus, tmp_path / "runs", average_every=7,
                             average_schedule="post_local", post_local_frames=3000)
    settings.preset = "teaching"
    assert (settings.average_every, settings.average_schedule, settings.post_local_frames) == (
        7, "post_local", 3000)
    settings.preset = "defaults"
    assert (settings.average_schedule, settings.post_local_frames) == ("post_local", 3000)


def test_a_reload_shows_the_scheduled_runs_boxes(corpus, tmp_path):
    config = _config(**{"averaging.schedule": "post_local", "averaging.post_local_frames": 640,
                        "data.data": str(corpus)})
    settings = RunSettings(data=str(corpus))
    settings.show_run(config)
    assert (settings.average_schedule, settings.post_local_frames) == ("post_local", 640)
    assert "averaging.schedule" not in settings.overrides


@pytest.mark.slow  # keeps README's fast command under 10 minutes; CI runs it
@pytest.mark.parametrize("schedule", ["adacomm", "post_local"])
def test_a_scheduled_run_from_the_settings_draws_its_k(corpus, tmp_path, schedule):
    """A real 2-rank run (a job process) started from the settings: its rank 0's rounds are the
    K plot's rows, each round's K as its event says."""
    import json

    from test_dashboard_state import run_to_end

    # adacomm: a learning rate at which the tiny model's loss halves within the run.
    settings = tiny_settings(corpus, tmp_path / "runs", average_every=12, epochs=3, lr=0.1,
                             average_schedule=schedule, post_local_frames=1024)
    live = LiveRun()
    assert live.start(settings), live.status
    plots = LivePlots(live)
    run_to_end(live)
    assert plots.kind.scheduled and "k" in plots.figures
    rows = rows_of(K_PLOT, live.buffers)
    events = [json.loads(line) for line in (Path(live.run_dir) / "events.jsonl").open()]
    ks = [(e["step"], e["average_every"]) for e in events
          if e["type"] == "average" and e["rank"] == 0]
    assert list(zip(rows["step"], rows["average_every"])) == ks
    assert len({k for _, k in ks}) >= 2, ks  # K changed during the run
