"""A scheduled run from the sidebar in real headless chromium (`pytest -m slow`): the K schedule
box and its frames box with the refusal under the right one, then a 2-rank adacomm run whose K
plot the page draws with the K of each round, read from the page's bokeh data.

Saves tests/artifacts/dashboard-schedule.png (docs/figures/dashboard-schedule.png is that
screenshot, copied by hand: a test run leaves the repository as committed).
"""

from __future__ import annotations

import json

import pytest

from support import wait_for
from test_dashboard_browser import corpus, page, served  # noqa: F401 (fixtures: the served page)
from test_dashboard_browser import (ARTIFACTS, MODELS_JS, _finish, _message_below, _set_number,
                                    _start, _start_disabled)

pytestmark = pytest.mark.slow

# The K plot's points as the page holds them: (step, K) of the data source with both columns
# (dashboard.live_plots: the "k" plot's x and series), in order; [] while it is not drawn.
K_POINTS_JS = """
() => {
  const out = [];""" + MODELS_JS + """
  {
    for (const model of models) {
      if (model.constructor.__name__ !== "ColumnDataSource") continue;
      const data = model.data;
      const get = (k) => data instanceof Map ? data.get(k) : data[k];
      const xs = get("step"), ks = get("average_every");
      if (xs === undefined || ks === undefined) continue;
      for (let i = 0; i < xs.length; i++) out.push([xs[i], ks[i]]);
    }
  }
  return out;
}
"""

# The titles of the plots on the page (bokeh draws them on its canvas, not as text).
TITLES_JS = """
() => {
  const out = [];""" + MODELS_JS + """
  for (const model of models) {
    if (model.constructor.__name__ === "Title") out.push(model.text);
  }
  return out;
}
"""


def test_a_schedule_chosen_in_the_sidebar_trains_and_its_k_is_plotted(page, served):
    _, runs = served
    # No run on screen is a run of constant K: no K plot on the page.
    assert page.evaluate(K_POINTS_JS) == []
    assert "Averaging interval K" not in page.evaluate(TITLES_JS)
    schedule = page.get_by_label("K schedule", exact=True)
    frames = page.get_by_label("post-local frames", exact=True)
    assert frames.is_disabled()  # used by post_local only
    schedule.select_option("post_local")
    wait_for(frames.is_enabled, 30, "the frames box on")
    # post_local without frames: refused under the frames box, in its words, Start off.
    _message_below(page, "post-local frames", 'K schedule = "post_local" needs post-local frames > 0')
    wait_for(lambda: _start_disabled(page), 30, "Start to be disabled")
    _set_number(page, "post-local frames", 4096)
    wait_for(lambda: not _start_disabled(page), 30, "Start on with frames")

    # adacomm, at a learning rate where the tiny model's loss falls enough for K to shrink.
    schedule.select_option("adacomm")
    wait_for(frames.is_disabled, 30, "the frames box off")
    for label, value in (("hidden layers", 1), ("hidden units", 32), ("minibatch", 64),
                         ("epochs", 4), ("context", 2), ("ranks", 2), ("K (average every)", 12),
                         ("learning rate", 0.1)):
        _set_number(page, label, value)
    wait_for(lambda: not _start_disabled(page), 30, "Start on")
    name = _start(page)
    _finish(page, name, ranks=2)
    config = json.loads((runs / name / "config.json").read_text())
    assert config["averaging"]["schedule"] == "adacomm"
    events = [json.loads(line) for line in (runs / name / "events.jsonl").open()]
    rounds = [(e["step"], e["average_every"]) for e in events
              if e["type"] == "average" and e["rank"] == 0]
    assert len({k for _, k in rounds}) >= 2, rounds  # K changed in the run

    def drawn():
        points = page.evaluate(K_POINTS_JS)
        # A step plot: each round is its x twice (the K before it, then its own).
        ends = sorted({(x, k) for x, k in points})
        return points if {x for x, _ in ends} >= {x for x, _ in rounds} else None

    points = wait_for(drawn, 60, "every round in the K plot")
    assert set(rounds) <= {(x, k) for x, k in points}
    assert len({k for _, k in points}) >= 2 and 0 not in {k for _, k in points}
    assert "Averaging interval K" in page.evaluate(TITLES_JS)
    on_screen = page.get_by_text("On screen:").first.inner_text()
    assert "K=12 (adacomm)" in on_screen, on_screen
    page.mouse.move(0, 0)
    page.screenshot(path=str(ARTIFACTS / "dashboard-schedule.png"))
