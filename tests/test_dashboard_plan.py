"""The dashboard's Plan tab without a browser: its rows and recommendation follow the widgets,
its plot draws what the rows say, bad input is named beside its box, and its button trains the
recommended point at the class size through the sidebar's path."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import holoviews as hv
import panel as pn
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dashboard.live import LiveRun
from dashboard.plan_plot import METHOD_STYLE, STAR
from dashboard.plan_view import CLASS_PRESET, RANK_CHOICES, RECORDED, PlanView
from dashboard.runs_table import RunTable
from dashboard.settings import RunSettings
from test_dashboard_state import tiny_settings
from labavg.studies.plan import DEFAULT_KS, METHODS, recommend
from labavg.training.config import PRESETS


def _tiny(corpus: Path, runs: Path, **values) -> RunSettings:
    return tiny_settings(corpus, runs, **{"ranks": 1, **values})  # the session's tiny corpus


def _run_to_end(live: LiveRun, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while live.running:
        assert time.monotonic() < deadline, f"run did not end: {live.status}"
        live.drain()
        time.sleep(0.05)
    live.drain()


def test_the_rows_follow_n_and_the_network():
    view = PlanView()
    assert view.costs == RECORDED and not view.errors
    for n in RANK_CHOICES:
        view.ranks = n
        assert {r.ranks for r in view.rows} == {n}
        assert {(r.K, r.method) for r in view.rows} == {(k, m) for k in DEFAULT_KS
                                                        for m in METHODS}
    view.ranks = 16
    ethernet = {(r.K, r.method): r for r in view.rows}
    view.network = "infiniband"
    infiniband = {(r.K, r.method): r for r in view.rows}
    # A faster network: every row faster, most at K = 1 where communication weighs most; the
    # accuracy prediction knows nothing of the network.
    assert all(infiniband[key].speedup > ethernet[key].speedup for key in ethernet)
    assert all(infiniband[key].acc_change == ethernet[key].acc_change for key in ethernet)
    gain = {k: infiniband[(k, "model")].speedup / ethernet[(k, "model")].speedup
            for k in DEFAULT_KS}
    assert gain[1] == max(gain.values())


def test_a_larger_budget_never_recommends_a_slower_point_among_points_alike():
    """A larger budget never recommends a slower point: recommend() takes only points the fits
    cover, so it never switches to or from an extrapolated one."""
    view = PlanView()
    for n in RANK_CHOICES:
        view.ranks = n
        last: dict[bool, float] = {}
        switches = 0
        previous = None
        for quarter in range(0, 49):
            view.budget = f"{quarter / 4:g}"
            best = view.best
            assert best == recommend(view.rows, quarter / 4)
            if best is None:
                assert previous is None, f"N = {n}: a larger budget lost the recommendation"
                continue
            assert best.acc_change >= -quarter / 4
            outside = bool(best.extrapolated)
            assert best.speedup >= last.get(outside, 0.0), (n, quarter / 4, best)
            last[outside] = best.speedup
            if previous is not None and bool(previous.extrapolated) != outside:
                assert not outside, f"N = {n}: back to an extrapolated point at {quarter / 4}"
                switches += 1
            previous = best
        assert switches == 0
        # A budget that takes every row recommends the fastest row the fits cover.
        covered = [r for r in view.rows if not r.extrapolated]
        if covered:
            view.budget = "1000"
            assert view.best.speedup == max(r.speedup for r in covered)


def _layers(overlay: hv.Overlay, kind: type) -> list:
    return [e for e in overlay if type(e) is kind]


def test_the_plot_has_a_curve_per_method_the_star_at_the_recommendation_and_k_labels():
    view = PlanView(budget="3")
    for n in (2, 8, 16):
        view.ranks = n
        figure = view.figure()
        curves = _layers(figure, hv.Curve)
        assert sorted(c.label for c in curves) == sorted(METHOD_STYLE[m][1] for m in METHODS)
        for curve in curves:
            assert len(curve) == len(DEFAULT_KS)  # one point per K
        stars = [s for s in _layers(figure, hv.Scatter) if s.label == STAR]
        assert len(stars) == 1
        best = view.best
        assert stars[0].iloc[0, 0] == pytest.approx(best.acc_change)
        assert stars[0].iloc[0, 1] == pytest.approx(best.speedup)
        labels = [k for layer in _layers(figure, hv.Labels)
                  for k in layer.dimension_values("label")]
        assert sorted(labels) == sorted(str(r.K) for r in view.rows)  # each point's K
        # The points outside what the fits saw are one hollow layer, with the reason on hover.
        hollow = [s for s in _layers(figure, hv.Scatter) if s.label.startswith("outside")]
        outside = sorted(r.acc_change for r in view.rows if r.extrapolated)
        if outside:
            assert sorted(hollow[0].dimension_values(0)) == pytest.approx(outside)
            assert all(hollow[0].dimension_values("extrapolated"))
        else:
            assert not hollow
        # The budget is the dashed line.
        assert _layers(figure, hv.VLine)[0].data == -3.0
    view.budget = "0"
    view.ranks = 32
    assert view.best is None
    assert not [s for s in _layers(view.figure(), hv.Scatter) if s.label == STAR]
    assert view.recommendation_text().startswith("**No (K, method) at N = 32")


@pytest.mark.parametrize("typed, words", [
    ("abc", "accuracy budget must be a number; got 'abc'"),
    ("1,5", "(with a decimal point: 1.5)"),
    ("-1", "accuracy budget must be >= 0; got -1"),
    ("", "accuracy budget must be a number; got ''"),
])
def test_a_bad_budget_is_named_beside_its_box_and_nothing_is_recommended(typed, words):
    view = PlanView()
    page = pn.panel(view)
    view.budget = typed
    assert words in view.errors["budget"]
    assert view.best is None and not view.can_train()
    assert view.recommendation_text().startswith("_Fix the value")
    shown = [p for p in page.select(pn.pane.Markdown) if p.visible and words in str(p.object)]
    assert len(shown) == 1, "the message is shown once, under the budget box"
    view.budget = "1.5"
    assert not view.errors and view.best is not None
    assert not [p for p in page.select(pn.pane.Markdown) if p.visible and words in str(p.object)]


def test_bad_epochs_are_refused_and_epochs_change_the_accuracy_not_the_speed():
    view = PlanView(ranks=8)
    one = {(r.K, r.method): r for r in view.rows}
    view.epochs = "4"
    four = {(r.K, r.method): r for r in view.rows}
    assert all(four[k].speedup == pytest.approx(one[k].speedup) for k in one)
    # More updates per worker: averaging costs less (the regime line).
    assert four[(10, "model")].acc_change > one[(10, "model")].acc_change
    view.epochs = "0"
    assert view.errors["epochs"] == "epochs must be > 0; got 0"


@pytest.fixture(scope="module")
def one_rank_run(corpus, tmp_path_factory):
    """A finished 1-rank run, the runs table that lists it and the settings that trained it."""
    runs = tmp_path_factory.mktemp("plan-runs")
    live = LiveRun()
    settings = _tiny(corpus, runs, epochs=2)
    assert live.start(settings), live.status
    _run_to_end(live)
    table = RunTable(runs_dir=str(runs))
    table.refresh()
    return runs, table, Path(live.run_dir).name


@pytest.mark.slow  # end to end: out of the fast suite's 10 minutes
def test_the_costs_can_come_from_a_finished_run_of_the_table(one_rank_run):
    runs, table, name = one_rank_run
    view = PlanView(table)
    assert view.param.costs.objects == [RECORDED, name]
    recorded = {(r.K, r.method): r.speedup for r in view.rows}
    view.costs = name
    assert not view.errors
    assert name in view.source and view.epochs == "2"  # the run's own epochs
    assert {(r.K, r.method): r.speedup for r in view.rows} != recorded
    assert name in view.explanation()
    # A run gone from the table is no longer offered; the view goes back to the recording.
    table.rows = []
    assert view.param.costs.objects == [RECORDED] and view.costs == RECORDED


def test_the_button_trains_the_recommended_point_at_the_class_size(corpus, tmp_path):
    settings = _tiny(corpus, tmp_path, hidden_dim=48)
    live = LiveRun()
    shown = []
    view = PlanView(RunTable(runs_dir=str(tmp_path)), settings, live, ranks=2, budget="3")
    view.show_live = lambda: shown.append(True)
    best = view.best
    assert best.ranks == 2 and view.can_train()
    assert view.train(), view.train_text
    try:
        assert shown == [True] and view.train_text.startswith("**Started N = 2")
        assert (settings.preset, settings.ranks, settings.average_every, settings.averaging) == (
            CLASS_PRESET, 2, best.K, best.method)
        assert settings.hidden_dim == PRESETS[CLASS_PRESET]["model.hidden_dim"]
        written = Path(live.run_dir) / "config.json"
        deadline = time.monotonic() + 120
        while not written.is_file():  # the job writes it as its rank 0 starts
            assert time.monotonic() < deadline and live.running, live.status
            live.drain()
            time.sleep(0.05)
        config = json.loads(written.read_text())
        assert config["ranks"] == 2 and config["averaging"]["average_every"] == best.K
        assert config["averaging"]["method"] == best.method
        assert config["model"]["hidden_dim"] == PRESETS[CLASS_PRESET]["model.hidden_dim"]
        assert config["epochs"] == PRESETS[CLASS_PRESET]["epochs"]
        assert not view.can_train()  # one run at a time, as Start
        assert not view.train() and view.train_text.startswith("**Not started")
    finally:
        live.stop()
        assert live.join(120)
        _run_to_end(live)


def test_the_button_says_why_it_cannot_start(corpus, tmp_path):
    settings = _tiny(corpus, tmp_path)
    view = PlanView(None, settings, LiveRun(), ranks=32, budget="20")
    assert view.best.ranks == 32
    # 32 workers do not fit this 0.02 h corpus: refused in the sidebar's words, nothing starts.
    assert not view.train()
    assert view.train_text.startswith("**Cannot start:**") and "ranks" in view.train_text
    assert not list(tmp_path.iterdir())
