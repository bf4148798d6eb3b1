"""The Plan tab in real headless chromium: the served dashboard's Plan tab at 1366 x 768, its
slider and budget box driven as a student would, the plot's data read from the page, and the
train button's run checked in its config.json (`pytest -m slow`).

Saves tests/artifacts/dashboard-plan.png (docs/figures/dashboard-plan.png is that screenshot,
copied by hand: a test run leaves the repository as committed).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support import wait_for
from test_dashboard_browser import corpus, served  # noqa: F401 (fixtures: panel serve on a tiny corpus)
from test_dashboard_browser import ARTIFACTS, BROWSER_ARGS, CHROMIUM, MODELS_JS, _on_screen

pytestmark = pytest.mark.slow


# The plot's points as the page holds them: per data source with both axes' columns, its
# columns and its (accuracy change, speedup) pairs. The star's source is the one with only
# the axes, K and method.
PLAN_POINTS_JS = """
() => {
  const out = [];""" + MODELS_JS + """
  {
    for (const model of models) {
      if (model.constructor.__name__ !== "ColumnDataSource") continue;
      const data = model.data;
      const keys = data instanceof Map ? [...data.keys()] : Object.keys(data);
      const get = (k) => data instanceof Map ? data.get(k) : data[k];
      if (!keys.includes("acc_change") || !keys.includes("speedup")) continue;
      out.push({keys: keys.sort(), x: Array.from(get("acc_change")),
                y: Array.from(get("speedup"))});
    }
  }
  return out;
}
"""




def _star(page) -> tuple[float, float] | None:
    """The star's (accuracy change, speedup) as drawn, once the plot is on the page."""
    for source in page.evaluate(PLAN_POINTS_JS):
        if source["keys"] == ["K", "acc_change", "method", "speedup"] and len(source["x"]) == 1:
            return source["x"][0], source["y"][0]
    return None


def _recommended(page, n: int) -> str:
    found = page.locator("p", has_text=f"Recommended at N = {n}:")
    wait_for(lambda: found.count() > 0, 120, f"the recommendation at N = {n}")
    return found.first.inner_text()


def _run_dirs(runs: Path) -> list[Path]:
    if not runs.is_dir():
        return []
    return sorted(p for p in runs.iterdir() if (p / "config.json").is_file())


def test_the_plan_tab_follows_its_slider_and_trains_the_recommended_point(served):
    from playwright import sync_api  # a dev dependency: missing, the test fails
    assert CHROMIUM.exists(), f"{CHROMIUM} not installed (run scripts/install-browser.sh)"
    url, runs = served
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS,
                                     headless=True)
        try:
            page = browser.new_page(viewport={"width": 1366, "height": 768})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error"
                    and not msg.text.startswith("Failed to load resource") else None)
            page.goto(url, timeout=180000)
            page.get_by_role("button", name="Start").wait_for(timeout=180000)
            page.locator(".bk-tab", has_text="Plan").click()

            # The default plan: N = 16 on 10GbE, at most 2 points lost.
            text = _recommended(page, 16)
            assert "speedup" in text and "points against one worker" in text
            star = wait_for(lambda: _star(page), 60, "the star in the plot")
            assert star[1] > 14  # 16 machines
            assert page.locator("canvas").count() > 0  # bokeh drew the plot

            # The slider, moved by keyboard as a student could: 16 -> 8.
            page.get_by_role("slider").first.focus()
            page.keyboard.press("ArrowLeft")
            _recommended(page, 8)
            wait_for(lambda: (s := _star(page)) is not None and 7 < s[1] < 8.1, 60,
                     "the star at N = 8")

            # A budget that is no number: said under its box, the button off, no star.
            box = page.get_by_label("accuracy budget (points lost at most)")
            box.fill("abc")
            message = page.get_by_text("accuracy budget must be a number; got 'abc'")
            wait_for(lambda: message.count() > 0 and message.first.is_visible(), 30,
                     "the budget's message")
            under = message.first.bounding_box()
            where = box.bounding_box()
            assert 0 <= under["y"] - (where["y"] + where["height"]) < 40, (where, under)
            button = page.get_by_role("button", name="Train the recommended point here")
            wait_for(lambda: button.is_disabled(), 30, "the train button off")
            wait_for(lambda: _star(page) is None, 30, "no star without a budget")

            box.fill("3")
            _recommended(page, 8)
            wait_for(lambda: not button.is_disabled(), 30, "the train button on")
            page.mouse.move(0, 0)
            page.screenshot(path=str(ARTIFACTS / "dashboard-plan.png"))

            # N = 2: a run this small corpus can hold, trained at the class size.
            page.get_by_role("slider").first.focus()
            page.keyboard.press("ArrowLeft")
            page.keyboard.press("ArrowLeft")
            text = _recommended(page, 2)
            k = int(text.split("K = ")[1].split(",")[0])
            method = text.split(f"K = {k}, ")[1].split(":")[0].strip()
            wait_for(lambda: not button.is_disabled(), 30, "the train button on")
            button.click()
            run_dir = wait_for(lambda: (found := _run_dirs(runs)) and found[-1], 240,
                               "the run's config.json")
            config = json.loads((run_dir / "config.json").read_text())
            assert config["ranks"] == 2 and config["averaging"]["average_every"] == k
            assert config["averaging"]["method"] == method
            assert config["model"]["hidden_dim"] == 256  # the class size's model
            # The page shows the run: the Live tab, its name on screen.
            wait_for(lambda: _on_screen(page) == run_dir.name, 60, "the run on screen")
            assert "bk-active" in (page.locator(".bk-tab", has_text="Live").get_attribute("class")
                                   or "")
            page.get_by_role("button", name="Stop").click()
            wait_for(lambda: (run_dir / "summary.json").is_file(), 300, "the run to end")
            assert not errors, errors
        finally:
            browser.close()
