"""A real browser against the served dashboard: start runs by clicking, read the plots' data.

Serves dashboard/app.py with `panel serve` on a free localhost port, drives Debian's chromium
through Playwright (scripts/install-browser.sh installs both), and saves
tests/artifacts/dashboard.png (and dashboard-runs.png) at 1366x768.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from support import processes_naming, wait_for

# The dashboard in headless chromium at 1366 x 768 (`pytest -m slow`).
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = REPO / "tests" / "artifacts"
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run"]

# The bokeh models on the page now: reachable from the documents' roots (a document's
# all_models keeps the models of replaced plots until it next recomputes them).
MODELS_JS = """
  const models = [];
  for (const doc of window.Bokeh.documents) {
    for (const root of doc.roots()) models.push(...root.references());
  }
"""

# Per rank: how many points the loss plot's data source holds (bokeh ColumnDataSources are
# named by their columns: "step" + "loss_r<rank>").
LOSS_POINTS_JS = """
() => {
  const counts = {};""" + MODELS_JS + """
  {
    for (const model of models) {
      if (model.constructor.__name__ !== "ColumnDataSource") continue;
      const data = model.data;
      const keys = data instanceof Map ? [...data.keys()] : Object.keys(data);
      for (const key of keys) {
        const m = /^loss_r(\\d+)$/.exec(key);
        if (m && keys.includes("step")) {
          const column = data instanceof Map ? data.get(key) : data[key];
          counts[m[1]] = Math.max(counts[m[1]] || 0, column.length);
        }
      }
    }
  }
  return counts;
}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"panel serve exited with {proc.returncode}: {proc.stdout.read()}")
        try:
            with urllib.request.urlopen(url, timeout=120) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


# The speedup plot's data: the cost model's points and the run's own (SpeedupPlot's sources).
SPEEDUP_JS = """
() => {
  const out = {};""" + MODELS_JS + """
  {
    for (const model of models) {
      if (model.constructor.__name__ !== "ColumnDataSource") continue;
      const data = model.data;
      const get = (k) => data instanceof Map ? data.get(k) : data[k];
      for (const key of ["measured", "predicted"]) {
        const ys = get(key), xs = get("ranks");
        if (ys !== undefined && xs !== undefined) out[key] = [Array.from(xs), Array.from(ys)];
      }
    }
  }
  return out;
}
"""

# The Scaling tab's measured points: [ranks, speedup, text] of the source that has all three.
SCALING_JS = """
() => {
  const out = [];""" + MODELS_JS + """
  {
    for (const model of models) {
      if (model.constructor.__name__ !== "ColumnDataSource") continue;
      const data = model.data;
      const get = (k) => data instanceof Map ? data.get(k) : data[k];
      const ranks = get("ranks"), speedup = get("speedup"), text = get("text");
      if (ranks === undefined || speedup === undefined || text === undefined) continue;
      for (let i = 0; i < ranks.length; i++) out.push([ranks[i], speedup[i], text[i]]);
    }
  }
  return out;
}
"""

# The labels of every legend entry on the page.
LEGENDS_JS = """
() => {
  const out = [];""" + MODELS_JS + """
  {
    for (const model of models) {
      if (model.constructor.__name__ !== "LegendItem") continue;
      const label = model.label;
      out.push(label !== null && typeof label === "object" ? (label.value ?? label.field) : label);
    }
  }
  return out;
}
"""

# The Runs tab's overlay (dashboard.overlay): per plot title, how many lines its multi-line
# source holds, its y range as drawn, and the lowest and highest y of the lines.
OVERLAY_JS = """
() => {
  const out = {};""" + MODELS_JS + """
  {
    for (const model of models) {
      if (!model.title || !model.y_range || !model.renderers) continue;
      for (const renderer of model.renderers) {
        const data = renderer.data_source && renderer.data_source.data;
        if (!data) continue;
        const get = (k) => data instanceof Map ? data.get(k) : data[k];
        const xs = get("xs"), ys = get("ys");
        if (xs === undefined || ys === undefined) continue;
        const all = ys.flatMap((y) => Array.from(y));
        out[model.title.text] = {lines: xs.length, y: [model.y_range.start, model.y_range.end],
                                 low: Math.min(...all), high: Math.max(...all)};
      }
    }
  }
  return out;
}
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from labavg.data.synth import synthesize

    out = tmp_path_factory.mktemp("corpus") / "c"
    synthesize(out, hours=0.02, seed=0)
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory, corpus):
    """(url, runs_dir) of `panel serve dashboard/app.py` on a free localhost port."""
    port = _free_port()
    runs = tmp_path_factory.mktemp("served") / "runs"
    panel = Path(sys.executable).with_name("panel")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [str(panel), "serve", str(REPO / "dashboard" / "app.py"), "--port", str(port),
         "--address", "127.0.0.1", "--allow-websocket-origin", f"127.0.0.1:{port}",
         "--args", "--runs-dir", str(runs), "--data", str(corpus)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}/app"
        _wait_http(url, proc)
        yield url, runs
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture()
def page(served):
    """A 1366 x 768 headless chromium page on the served dashboard; fails on page errors."""
    from playwright import sync_api  # a dev dependency: missing, the test fails
    assert CHROMIUM.exists(), f"{CHROMIUM} not installed (run scripts/install-browser.sh)"
    url, _ = served
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1366, "height": 768})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            # Console errors too ("No such formatter found" is one), but not the template's
            # web fonts, which an offline machine cannot fetch.
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error"
                    and not msg.text.startswith("Failed to load resource") else None)
            page.goto(url, timeout=180000)
            page.get_by_role("button", name="Start").wait_for(timeout=180000)
            wait_for(lambda: page.evaluate("() => !!(window.Bokeh && window.Bokeh.documents.length)"),
                      60, "the bokeh document")
            yield page
            assert not errors, errors
        finally:
            browser.close()


def _events(run_dir: Path, kind: str) -> list[dict]:
    """Rank 0's events of one kind so far (events.jsonl, read as it is written)."""
    path = run_dir / "events.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue  # the line being written
        if event.get("type") == kind and event.get("rank", 0) == 0:
            out.append(event)
    return out


def _set_number(page, label: str, value) -> None:
    box = page.get_by_label(label, exact=True)
    box.fill(str(value))
    box.press("Enter")


def _set_text(page, label: str, value: str) -> None:
    box = page.get_by_label(label, exact=True)
    box.fill(value)


def _start_disabled(page) -> bool:
    return page.get_by_role("button", name="Start").is_disabled()


def _on_screen(page) -> str | None:
    found = page.get_by_text("On screen:")
    if not found.count():
        return None
    match = re.search(r"On screen: (\S+)", found.first.inner_text())
    return match.group(1) if match else None


def _start(page) -> str:
    """Click Start; the name of the run that then comes on screen."""
    before = _on_screen(page)
    page.get_by_role("button", name="Start").click()
    def new_name():
        name = _on_screen(page)
        return name if name and name != before else None

    return wait_for(new_name, 60, "the new run on screen")


def _status(page) -> str:
    found = page.locator("p", has_text="On screen:")
    return found.first.inner_text() if found.count() else ""


def _finish(page, name: str, ranks: int) -> dict[str, int]:
    try:
        wait_for(lambda: page.get_by_text(f"Finished: {name}").count() > 0, 240, f"{name} to finish")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the status says: {_status(page)}") from None
    # The loss plot holds points for every rank of the run, and for no other rank.
    def counts():
        found = page.evaluate(LOSS_POINTS_JS)
        return found if len(found) == ranks and min(found.values()) > 0 else None

    return wait_for(counts, 60, f"loss points of {ranks} ranks")


def _message_below(page, label: str, text: str) -> None:
    """`text` is shown, right under the box labelled `label` and as wide as its column."""
    message = page.get_by_text(text, exact=False).first
    wait_for(lambda: message.is_visible(), 30, f"the message {text!r}")
    box = page.get_by_label(label, exact=True).bounding_box()
    where = message.bounding_box()
    assert 0 <= where["y"] - (box["y"] + box["height"]) < 30, (box, where)
    assert abs(where["x"] - box["x"]) < 30, (box, where)


def test_widgets_say_what_is_wrong_next_to_them_and_start_waits(page, tmp_path, corpus):
    assert not _start_disabled(page)
    _set_number(page, "ranks", 0)
    _message_below(page, "ranks", "ranks must be positive; got 0")
    wait_for(lambda: _start_disabled(page), 30, "Start to be disabled")
    _set_number(page, "learning rate", -0.1)
    _message_below(page, "learning rate", "learning rate must be positive and finite; got -0.1")
    # The typed values stay in their boxes (nothing puts the old value back on blur).
    page.get_by_label("hidden units", exact=True).click()
    assert page.get_by_label("ranks", exact=True).input_value() == "0"
    page.screenshot(path=str(ARTIFACTS / "dashboard-invalid.png"))
    _set_number(page, "ranks", 2)
    _set_number(page, "learning rate", 0.008)
    wait_for(lambda: not _start_disabled(page), 30, "Start to be enabled again")
    assert page.get_by_text("must be positive").count() == 0

    # A folder that is not a corpus: one short message, as it is typed.
    folder = tmp_path / "notes"
    folder.mkdir()
    for i in range(60):
        (folder / f"file{i:02d}.txt").write_text("")
    _set_text(page, "data directory", str(folder))
    _message_below(page, "data directory", "not a Kaldi data directory")
    text = page.get_by_text("not a Kaldi data directory").first.inner_text()
    assert "(60 in all)" in text and text.count("file") <= 3, text
    assert _start_disabled(page)
    page.screenshot(path=str(ARTIFACTS / "dashboard-invalid-data.png"))
    _set_text(page, "data directory", str(corpus))
    wait_for(lambda: not _start_disabled(page), 30, "Start to be enabled again")

    blocker = tmp_path / "blocker"
    blocker.write_text("")
    _set_text(page, "runs directory", str(blocker / "runs"))
    _message_below(page, "runs directory", "is a file, not a directory")
    assert _start_disabled(page)


def _speedup_line(page) -> str:
    found = page.locator("p", has_text=re.compile(r"^Speedup"))
    return found.first.inner_text() if found.count() else ""


def test_runs_live_speedup_table_and_overlay_in_browser(page, served):
    """Each run measures its own speedup in pairs (labavg.jobs.speedup): the Live tab, the
    speedup plot's data, the Runs table and the Scaling tab show the same number, interval and
    conditions; no 1-rank run is needed."""
    _, runs = served
    _set_number(page, "hidden layers", 1)
    _set_number(page, "hidden units", 64)
    _set_number(page, "minibatch", 64)
    _set_number(page, "epochs", 1)
    _set_number(page, "context", 2)

    # Run 1: 2 ranks, K = 3, alone in the runs directory: measured all the same.
    _set_number(page, "ranks", 2)
    _set_number(page, "K (average every)", 3)
    first = _start(page)
    counts = _finish(page, first, ranks=2)
    assert set(counts) == {"0", "1"}
    measured = re.compile(r"Speedup (\d+\.\d\d)x \((?:(\d+\.\d\d)-(\d+\.\d\d) over \d+ pairs|1 pair);"
                          r" 2 threads on \d+ cores?")
    wait_for(lambda: measured.search(_speedup_line(page)), 30, "the measured speedup")
    assert "threads of one process" in _speedup_line(page)

    # Run 2: one worker, the reference by definition.
    _set_number(page, "ranks", 1)
    second = _start(page)
    _finish(page, second, ranks=1)
    wait_for(lambda: "1.00x (one worker: the reference)" in _speedup_line(page), 30,
             "the 1-rank line")

    # Run 3: 2 ranks with another K, long enough to be seen measuring while it trains.
    _set_number(page, "ranks", 2)
    _set_number(page, "K (average every)", 7)
    _set_number(page, "epochs", 5)
    third = _start(page)
    wait_for(lambda: measured.search(_speedup_line(page)), 120, "the live speedup")
    page.screenshot(path=str(ARTIFACTS / "dashboard-live.png"))  # while it trains, mostly
    _finish(page, third, ranks=2)
    line = _speedup_line(page)
    value, low, high = (float(g or "nan") for g in measured.search(line).groups())
    if low == low:  # with one pair there is no range
        assert low <= value <= high, line
    assert "Cost model (10GbE" in line and "machines" in line, line
    data = page.evaluate(SPEEDUP_JS)
    assert data["measured"][0] == [2] and data["measured"][1][0] == pytest.approx(value, abs=0.006)
    assert data["predicted"][0] == [1, 2, 4, 8, 16, 32, 64] and data["predicted"][1][0] == 1
    on_screen = page.get_by_text("On screen:").first.inner_text()
    assert "K=7" in on_screen and "2 ranks" in on_screen
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"))
    measured_text = json.loads((runs / third / "summary.json").read_text())["speedup_text"]
    assert measured_text in line, (measured_text, line)

    # The runs table: every run, numbers formatted, results on screen without scrolling. Its
    # row has the run's results once the job has ended (Start on again), seconds after rank 0
    # said Finished while the job saved the model; until then it lists the run as running.
    wait_for(lambda: not _start_disabled(page), 60, "the job to end")
    page.locator(".bk-tab", has_text="Runs").click()
    rows = page.locator(".tabulator-row")
    try:
        wait_for(lambda: rows.count() >= 3, 30, "three rows in the runs table")
    except AssertionError:
        # Once in a CI run the table, filled while its tab was hidden, drew no rows for 60 s;
        # Refresh (what a user would press) redraws it. Flaky drawing, not missing runs.
        page.get_by_role("button", name="Refresh").click()
        wait_for(lambda: rows.count() >= 3, 60, "three rows in the runs table after Refresh")
    texts = [rows.nth(i).inner_text() for i in range(rows.count())]
    for name in (first, second, third):
        assert any(name in t for t in texts), (name, texts)
    cells = " ".join(texts)
    assert "NaN" not in cells and "null" not in cells, cells
    assert not re.search(r"\d\.\d{6,}", cells), cells
    page.screenshot(path=str(ARTIFACTS / "dashboard-runs.png"))
    # One speedup per run: the table's cells are the Live tab's number and text.
    row = next(i for i, t in enumerate(texts) if third in t)
    cell = rows.nth(row).locator(".tabulator-cell[tabulator-field='speedup']").inner_text()
    assert cell == f"{value:.2f}", (cell, value)
    note = rows.nth(row).locator(".tabulator-cell[tabulator-field='speedup_note']")
    assert note.inner_text() in line and note.evaluate("e => e.scrollHeight <= e.clientHeight + 1")
    table = page.locator(".tabulator").first.bounding_box()
    for title in ("ranks", "method", "lr", "WER %", "PER %", "CV acc %", "speedup", "efficiency"):
        header = page.locator(".tabulator-col", has_text=title).first
        box = header.bounding_box()
        assert box["x"] + box["width"] <= min(1366, table["x"] + table["width"]) + 1, title
        text = header.locator(".tabulator-col-title").first
        assert text.evaluate("e => e.scrollWidth <= e.clientWidth"), f"title {title!r} is cut"
    names = page.locator(".tabulator-cell[tabulator-field='run']")
    assert all(names.nth(i).evaluate("e => e.scrollWidth <= e.clientWidth") for i in range(names.count())), \
        "a run name is cut"

    # Overlay runs 1 and 3: the legends name what differs (K and epochs), not when they ran.
    for i, t in enumerate(texts):
        if first in t or third in t:
            rows.nth(i).locator("input[type=checkbox]").first.click()
    wanted = {"K=3 1 epoch", "K=7 5 epochs"}
    wait_for(lambda: set(page.locator(".run").all_inner_texts()) == wanted, 60, f"the legend {wanted}")
    # A line per run in each plot, and accuracy on the runs' own range (0-100 flattened them).
    plots = wait_for(lambda: (found := page.evaluate(OVERLAY_JS)) and len(found) == 3
                     and all(p["lines"] == 2 for p in found.values()) and found, 60, "the overlay")
    cv = plots["CV frame accuracy"]
    spread = cv["high"] - cv["low"]
    assert cv["y"][0] <= cv["low"] and cv["y"][1] >= cv["high"], cv
    assert cv["y"][1] - cv["y"][0] <= 1.5 * spread + 2, cv
    page.mouse.move(850, 500)
    page.mouse.wheel(0, 400)  # the plots are drawn on canvases: no text to scroll to
    time.sleep(1)
    page.screenshot(path=str(ARTIFACTS / "dashboard-overlay.png"))
    run_dirs = sorted(p.name for p in runs.iterdir())
    assert len(run_dirs) == 3 and all((runs / d / "summary.json").is_file() for d in run_dirs)

    # The Communication tab: the two 2-rank runs (plain averaging) by the bytes they sent.
    page.locator(".bk-tab", has_text="Communication").click()
    wait_for(lambda: "model, 2 ranks" in page.evaluate(LEGENDS_JS), 60, "the communication legend")
    time.sleep(1)
    page.screenshot(path=str(ARTIFACTS / "dashboard-communication.png"))

    # The Scaling tab: the same run's point, number and text, beside the cores' bound.
    page.locator(".bk-tab", has_text="Scaling").click()
    points = wait_for(lambda: page.evaluate(SCALING_JS) or None, 60, "the scaling points")
    assert [2, value] in [[r, round(v, 2)] for r, v, _ in points], points
    assert any(measured_text in t for _, _, t in points), (measured_text, points)
    wait_for(lambda: "the cores here: min(N" in " ".join(map(str, page.evaluate(LEGENDS_JS))),
             30, "the bound's legend")
    time.sleep(1)
    page.screenshot(path=str(ARTIFACTS / "dashboard-scaling.png"))


def test_the_momentum_box_is_used_only_by_a_method_that_has_one(page, served):
    momentum = page.get_by_label("method momentum", exact=True)
    assert momentum.is_disabled()  # plain averaging (the default) has no momentum
    page.get_by_label("averaging method", exact=True).select_option("bmuf")
    wait_for(lambda: momentum.is_enabled(), 30, "the momentum box to be enabled")
    _set_number(page, "method momentum", 1.5)
    _message_below(page, "method momentum", "method momentum must be in [0, 1); got 1.5")
    assert _start_disabled(page)
    page.get_by_label("averaging method", exact=True).select_option("diloco")  # the same rule
    _message_below(page, "method momentum", "method momentum must be in [0, 1); got 1.5")
    _set_number(page, "method momentum", 0.5)
    wait_for(lambda: not page.get_by_text("method momentum must be").count(), 30, "the message to go")
    page.get_by_label("averaging method", exact=True).select_option("model")
    wait_for(lambda: momentum.is_disabled(), 30, "the momentum box to be disabled")


def test_a_preset_shows_in_its_boxes_and_the_server_trains_what_they_show(page, served):
    """Preset "teaching", then ranks and epochs edited: the boxes show the preset's model, and
    the run the server starts has exactly what the boxes show (not the preset's epochs)."""
    _, runs = served
    page.get_by_label("preset", exact=True).select_option("teaching")
    from labavg.training.config import PRESETS

    teaching = PRESETS["teaching"]
    boxes = {"hidden layers": "model.hidden_layers", "hidden units": "model.hidden_dim",
             "epochs": "epochs"}
    for label, key in boxes.items():
        want = str(teaching[key])
        wait_for(lambda: page.get_by_label(label, exact=True).input_value() == want, 30,
                  f"the {label} box to show the preset's {want}")
    _set_number(page, "ranks", 2)
    _set_number(page, "epochs", 1)
    _set_number(page, "minibatch", 64)
    page.screenshot(path=str(ARTIFACTS / "dashboard-preset.png"))
    name = _start(page)
    _finish(page, name, ranks=2)
    cfg = json.loads((runs / name / "summary.json").read_text())["config"]
    assert (cfg["ranks"], cfg["epochs"], cfg["minibatch"]) == (2, 1, 64)
    assert (cfg["model"]["hidden_layers"], cfg["model"]["hidden_dim"]) == (
        teaching["model.hidden_layers"], teaching["model.hidden_dim"])


def test_a_reload_and_a_second_page_find_the_run_and_keep_stop(page, served):
    """Reloading mid-run, and a second page, show the server's run live with Stop, and Start
    stays off; Stop from the reloaded page stops that run."""
    _, runs = served
    _set_number(page, "hidden layers", 1)
    _set_number(page, "hidden units", 64)
    _set_number(page, "minibatch", 64)
    _set_number(page, "epochs", 200)
    _set_number(page, "ranks", 2)
    name = _start(page)
    page.reload()
    page.get_by_role("button", name="Start").wait_for(timeout=180000)
    wait_for(lambda: _on_screen(page) == name, 60, "the running run on the reloaded page")
    assert page.get_by_text("started from another page").count() > 0
    stop = page.get_by_role("button", name="Stop")
    wait_for(lambda: stop.is_enabled() and _start_disabled(page), 30, "Stop on, Start off")
    other = page.context.browser.new_page(viewport={"width": 1366, "height": 768})
    try:
        other.goto(page.url, timeout=180000)
        other.get_by_role("button", name="Start").wait_for(timeout=180000)
        wait_for(lambda: _on_screen(other) == name, 60, "the run on a second page")
        assert other.get_by_role("button", name="Stop").is_enabled()
        other.screenshot(path=str(ARTIFACTS / "dashboard-second-page.png"))
    finally:
        other.close()
    wait_for(lambda: _events(runs / name, "epoch"), 120, "an epoch end before Stop")
    clicked = time.monotonic()
    at_click = max(e["step"] for e in _events(runs / name, "minibatch"))
    stop.click()
    # The server has the request once the page says so; the step then is an upper bound of the
    # step the request reached the trainer at (the click's way to a busy server took seconds).
    # (Or already says it stopped: the two may reach the page in one update.)
    wait_for(lambda: page.get_by_text("at the next averaging round").count() > 0
              or page.get_by_text(f"Stopped: {name}").count() > 0, 60, "the server to take the Stop")
    at_stop = max(e["step"] for e in _events(runs / name, "minibatch"))
    taken = time.monotonic() - clicked
    try:
        wait_for(lambda: page.get_by_text(f"Stopped: {name}").count() > 0, 240, f"{name} to stop")
    except AssertionError as exc:
        # Once in a CI run the page did not say Stopped in 120 s: say what the run and page did.
        steps = max(e["step"] for e in _events(runs / name, "minibatch"))
        raise AssertionError(f"{exc}; summary.json written: {(runs / name / 'summary.json').exists()}, "
                             f"last step {steps} (at Stop {at_stop}), page: "
                             f"{page.locator('body').inner_text()[:400]!r}") from None
    seconds = time.monotonic() - clicked
    summary = json.loads((runs / name / "summary.json").read_text())
    assert summary["stopped"] is True
    # The next averaging round ends it (K = 10): no epoch end, and so no CV, after the request.
    k = summary["average_every"]
    assert summary["steps"] - at_stop <= k + 2, (summary["steps"], at_stop, k)
    assert all(e["step"] <= at_stop for e in _events(runs / name, "epoch"))
    print(f"Stop: taken by the server {taken:.1f} s ({at_stop - at_click} steps) after the click; "
          f"the run ended {summary['steps'] - at_stop} steps and {seconds:.1f} s after the click")


def _busy_cores(n: int) -> list[subprocess.Popen]:
    """`n` busy Python processes: the 2-core load a class laptop or a shared machine has."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    """Wait until the server listens (no request: the first page load is what is measured)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"labavg dashboard exited with {proc.returncode}: {proc.stdout.read()}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s")


def _loaded(page, url: str | None) -> float:
    """Seconds to load (or, without `url`, reload) the page until Start and the plots are there."""
    began = time.monotonic()
    if url is None:
        page.reload(timeout=60000)
    else:
        page.goto(url, timeout=60000)
    page.get_by_role("button", name="Start").wait_for(timeout=60000)
    wait_for(lambda: page.evaluate("() => !!(window.Bokeh && window.Bokeh.documents.length)"),
             60, "the bokeh document")
    return time.monotonic() - began


# The share of a core a busy process gets on the 2-core machine of the issue with its 2-core
# load beside the server and the browser (2 cores, about 4 busy processes).
SHARE_ON_2_CORES = 0.5


def _share(probe: float = 0.3) -> float:
    """The share of a core a busy process gets here now: CPU time over wall time of a short
    busy loop. This machine is shared with other work; its figures are scaled by this to what
    they would be on the issue's machine (`_on_2_cores`)."""
    began, cpu = time.monotonic(), time.thread_time()
    while time.thread_time() - cpu < probe:
        pass
    return min(1.0, probe / (time.monotonic() - began))


def _on_2_cores(seconds: float, share: float) -> float:
    return seconds * min(1.0, share / SHARE_ON_2_CORES)


def _server_cpu(pid: int) -> float:
    """CPU seconds the server process has used (user + system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rounds_seen(run_dir: Path, seen: dict[int, float]) -> None:
    """When each of rank 0's averaging rounds first showed in events.jsonl (the test's clock)."""
    now = time.monotonic()
    for event in _events(run_dir, "average"):
        seen.setdefault(event["round"], now)


def test_under_a_2_core_load_the_page_answers_start_stop_and_reload_in_time(page, corpus,
                                                                              tmp_path):
    """labavg issue 29: the dashboard never trains in its own process. With two busy cores
    beside it: the page loads and reloads, Start shows the new run, Stop says Stopping and then
    Stopped after the round the ranks stopped at, and a reload (or a second page) shows the run
    with its settings, not the defaults. How fast each step is, is measured here and judged by
    benchmarks/bench_dashboard_page.py (PAGE_TARGETS)."""
    port = _free_port()
    runs = tmp_path / "runs"
    load = _busy_cores(2)
    server = subprocess.Popen(
        [sys.executable, "-m", "labavg", "dashboard", "--no-browser", "--port", str(port),
         "--runs-dir", str(runs), "--data", str(corpus)], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    figures, shares, cpu = {}, {}, {}

    def measure(what: str, action) -> Any:
        shares[what] = _share()
        before, began = _server_cpu(server.pid), time.monotonic()
        result = action()
        figures[what] = time.monotonic() - began
        cpu[what] = _server_cpu(server.pid) - before
        return result

    try:
        _wait_port(port, server)
        url = f"http://127.0.0.1:{port}/app"
        fresh = page.context.browser.new_page(viewport={"width": 1366, "height": 768})
        measure("first load", lambda: _loaded(fresh, url))
        time.sleep(2)  # the first periodic update draws the plots
        measure("reload", lambda: _loaded(fresh, None))
        time.sleep(2)
        for label, value in (("hidden layers", 1), ("hidden units", 48), ("minibatch", 64),
                             ("epochs", 200), ("context", 2), ("ranks", 2),
                             ("K (average every)", 10)):
            _set_number(fresh, label, value)
        wait_for(lambda: not _start_disabled(fresh), 30, "Start on")
        name = measure("Start to the new run on screen", lambda: _start(fresh))
        run_dir = runs / name
        seen: dict[int, float] = {}
        wait_for(lambda: (_rounds_seen(run_dir, seen), len(seen) >= 3)[1], 120, "three rounds")
        clicked = time.monotonic()
        measure("Stop to Stopping", lambda: (fresh.get_by_role("button", name="Stop").click(),
                                             wait_for(lambda: fresh.get_by_text("Stopping").count()
                                                      or fresh.get_by_text(f"Stopped: {name}").count(),
                                                      60, "Stopping…")))
        shares["the stopping round to Stopped"] = _share()
        stopped = wait_for(lambda: (_rounds_seen(run_dir, seen), fresh.get_by_text(
            f"Stopped: {name}").count() > 0 and time.monotonic())[1], 120, f"{name} to stop",
                           poll=0.05)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["stopped"] is True
        last = max(e["round"] for e in _events(run_dir, "average"))
        figures["the stopping round to Stopped"] = stopped - seen[last]
        figures["Stop to Stopped"] = stopped - clicked
        fresh.screenshot(path=str(ARTIFACTS / "dashboard-load-stopped.png"))

        time.sleep(2)
        measure("reload after the run", lambda: _loaded(fresh, None))
        wait_for(lambda: _on_screen(fresh) == name, 30, "the run on the reloaded page")
        other = page.context.browser.new_page(viewport={"width": 1366, "height": 768})
        measure("a second page", lambda: _loaded(other, url))
        for shown in (fresh, other):
            for label, value in (("hidden units", "48"), ("epochs", "200"), ("ranks", "2"),
                                 ("K (average every)", "10"), ("minibatch", "64")):
                box = shown.get_by_label(label, exact=True)
                wait_for(lambda: box.input_value() == value, 30, f"{label} = {value} after a reload")
        time.sleep(2)
        other.screenshot(path=str(ARTIFACTS / "dashboard-reload-settings.png"))
        other.close()
        fresh.close()
    finally:
        for proc in load:
            proc.kill()
            proc.wait()
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
    scaled = {k: _on_2_cores(v, shares.get(k, 1.0)) for k, v in figures.items()}
    # The times are benchmark figures, not pass marks (wall times on this shared machine move by a
    # third within minutes): benchmarks/bench_dashboard_page.py repeats this scenario and holds
    # them to PAGE_TARGETS. The test holds what must be true at any speed: every step happened
    # and was seen, in order.
    LOAD_FIGURES.write_text(json.dumps({"seconds": figures, "at_half_a_core": scaled,
                                        "server_cpu": cpu, "share": shares}, indent=1))
    print("under a 2-core load (s: measured here / at a half core's share / server CPU):\n" +
          "\n".join(f"  {k}: {v:.2f} / {scaled[k]:.2f} / {cpu.get(k, float('nan')):.2f} "
                    f"(share {shares.get(k, 1.0):.2f})" for k, v in figures.items()))
    assert set(PAGE_TARGETS) <= set(figures), (set(PAGE_TARGETS) - set(figures))
    # Stopped is said after the ranks' last round, never before it.
    assert figures["the stopping round to Stopped"] >= 0, figures


# What bench_dashboard_page.py holds the scenario above to, in seconds at half a core's share
# (the 2-core machine with two busy processes beside the server and the browser).
PAGE_TARGETS = {"first load": 8.0, "reload": 8.0, "reload after the run": 8.0, "a second page": 8.0,
                "Start to the new run on screen": 2.0, "Stop to Stopping": 2.0,
                "the stopping round to Stopped": 2.0}
LOAD_FIGURES = ARTIFACTS / "dashboard-load.json"


def test_refusals_and_warnings_sit_beside_their_box_in_its_words_before_start(page, served):
    """Typed text is judged as typed (no more "0,01" read as 1, "abc" dropped), each refusal
    under its box with its label and this corpus's sizes; a huge lr is allowed, with a warning
    that teaches max-change; Start is off while a refusal stands."""
    _set_number(page, "learning rate", "0,01")
    _message_below(page, "learning rate", "learning rate must be a number; got '0,01' "
                   "(with a decimal point: 0.01)")
    assert _start_disabled(page)
    _set_number(page, "learning rate", "abc")
    _message_below(page, "learning rate", "learning rate must be a number; got 'abc'")
    _set_number(page, "K (average every)", 0)
    _message_below(page, "K (average every)", "K (average every) must be positive; got 0")
    assert page.get_by_text("average_every").count() == 0
    page.screenshot(path=str(ARTIFACTS / "dashboard-typed.png"))
    _set_number(page, "K (average every)", 10)
    _set_number(page, "learning rate", "1e9")
    _message_below(page, "learning rate", "max-change clips every update")
    wait_for(lambda: not _start_disabled(page), 30, "Start on: a warning does not refuse")
    _set_number(page, "hidden units", 100000000)
    _message_below(page, "hidden units", "hidden units 100000000 × hidden layers")
    text = page.get_by_text("hidden units 100000000 × hidden layers").first.inner_text()
    assert "this corpus's" in text and "143 inputs" not in text, text
    assert _start_disabled(page)
    page.screenshot(path=str(ARTIFACTS / "dashboard-refusals.png"))
    _set_number(page, "hidden units", 64)
    _set_number(page, "ranks", 100000)
    _message_below(page, "ranks", "ranks 100000")
    assert _start_disabled(page)
    _set_number(page, "ranks", 2)
    _set_number(page, "learning rate", 0.008)
    wait_for(lambda: not _start_disabled(page), 30, "Start to be enabled again")


def _offline_page(pw, url: str, outside: list[str]):
    """A 1366 x 768 page that may reach only this machine: every other request is recorded
    in `outside` and refused."""
    browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS, headless=True)
    page = browser.new_page(viewport={"width": 1366, "height": 768})

    def route(request_route):
        where = request_route.request.url
        if where.startswith(("http://127.0.0.1", "ws://127.0.0.1", "file://", "data:", "blob:")):
            request_route.continue_()
        else:
            outside.append(where)
            request_route.abort()

    page.route("**/*", route)
    return browser, page


def test_the_page_is_styled_with_no_request_outside_this_machine(served):
    from playwright import sync_api  # a dev dependency: missing, the test fails
    assert CHROMIUM.exists(), f"{CHROMIUM} not installed (run scripts/install-browser.sh)"
    url, _ = served
    outside: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser, page = _offline_page(pw, url, outside)
        try:
            page.goto(url, timeout=180000)
            start = page.get_by_role("button", name="Start")
            start.wait_for(timeout=180000)
            # Panel's stylesheet, not the browser's default grey button.
            background = start.evaluate("e => getComputedStyle(e).backgroundColor")
            assert background not in ("rgb(239, 239, 239)", "rgba(0, 0, 0, 0)"), background
            height = page.locator("#sidebar-button").bounding_box()["height"]
            assert height < 100, height  # the header, not a screen-high bare icon
            page.screenshot(path=str(ARTIFACTS / "dashboard-offline.png"))
        finally:
            browser.close()
    assert outside == []


def test_an_exported_notebook_typesets_its_equations_offline(tmp_path):
    """labavg.studies.teaching.offline_html_exporter: no script or stylesheet from outside, and
    MathJax (a local copy beside the HTML) typesets with the network blocked."""
    from playwright import sync_api  # a dev dependency: missing, the test fails
    assert CHROMIUM.exists(), f"{CHROMIUM} not installed (run scripts/install-browser.sh)"
    import nbformat

    from labavg.studies.teaching import offline_html_exporter

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(
        "Efficiency $\\eta = S_N / N$, and $$S_N = \\frac{T_1}{T_N}$$")])
    html, _ = offline_html_exporter(tmp_path).from_notebook_node(nb)
    assert not re.search(r"<(script|link)[^>]*(src|href)=\"(https?:)?//", html), "a CDN reference"
    (tmp_path / "nb.html").write_text(html)
    outside: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser, page = _offline_page(pw, "", outside)
        try:
            page.goto((tmp_path / "nb.html").as_uri())
            typeset = page.locator(".MathJax, .MathJax_Display")
            wait_for(lambda: typeset.count() >= 2, 60, "MathJax's output")
            assert "$$" not in page.locator("body").inner_text()
            page.screenshot(path=str(ARTIFACTS / "notebook-offline.png"))
        finally:
            browser.close()
    assert outside == []


# The workers present as the page's N plot draws them: the last point of the source that has
# a "workers" column (dashboard.live_plots' "workers" plot), or null before its first point.
WORKERS_JS = """
() => {
  let last = null;""" + MODELS_JS + """
  {
    for (const model of models) {
      if (model.constructor.__name__ !== "ColumnDataSource") continue;
      const data = model.data;
      const get = (k) => data instanceof Map ? data.get(k) : data[k];
      const n = get("workers");
      if (n !== undefined && n.length) last = n[n.length - 1];
    }
  }
  return last;
}
"""



def test_an_elastic_run_loses_a_worker_and_gains_one_from_the_page(page, corpus, tmp_path):
    """A 4-worker elastic run (labavg train, torch, on_rank_loss = "continue") followed from
    the page: "Lose a worker" kills rank 3 and the N plot drops to 3 with the member_lost;
    "Add a worker" starts a join and N is 4 again. Saves docs/figures/dashboard-elastic.png."""
    from support import child_env

    out = tmp_path / "elastic"
    job = subprocess.Popen(
        [sys.executable, "-m", "labavg", "train", "--data", str(corpus), "--out", str(out),
         "--hidden-layers", "2", "--hidden-dim", "64", "--minibatch", "32", "--no-progress",
         "--speedup-pairs", "0", "--backend", "torch", "--average-every", "5", "--ranks", "4",
         "--epochs", "400", "--set", 'on_rank_loss="continue"',
         # A 1 s heartbeat once dropped a live worker beside the killed one here (load 8 on
         # 2 cores): this test is about the page, not about how soon the others notice.
         "--set", "elastic.heartbeat_ms=3000"],
        env=child_env(), stdout=subprocess.DEVNULL, stderr=(tmp_path / "stderr").open("w"))
    try:
        wait_for(out.is_dir, 60, "the run directory")  # Follow refuses a directory not there
        box = page.get_by_placeholder("run dir to follow")
        box.fill(str(out))
        box.press("Enter")  # the box's value is sent on Enter (or blur), before the click
        page.get_by_role("button", name="Follow").click()
        lose = page.get_by_role("button", name="Lose a worker")
        add = page.get_by_role("button", name="Add a worker")
        wait_for(lambda: lose.is_visible() and lose.is_enabled(), 120, "Lose a worker to be on")
        assert add.is_disabled() and page.get_by_text("all 4 workers are running").count()
        wait_for(lambda: page.evaluate(WORKERS_JS) == 4, 60, "N = 4 in the plot")
        lose.click()
        wait_for(lambda: page.evaluate(WORKERS_JS) == 3, 60, "N = 3 in the plot after Lose")
        lost = [e for e in _read_events(out) if e["type"] == "member_lost"]
        # (Under a load of 8-11 on 2 cores the round after the kill has also dropped live
        # rank 1, lost [1, 3]: a fault of the job, not of the page, named here as such.)
        assert lost and all(e["lost"] == [3] and e["size"] == 3 for e in lost), (
            f"the others dropped more than the killed worker (labavg.comm.elastic): {lost}")
        step = lost[0]["step"]
        wait_for(lambda: page.get_by_text(f"Rank 3 lost at step {step}").count(), 30,
                 "the member_lost beside Lose")
        assert page.get_by_text(f"4 -> 3 workers at step {step} (rank 3 lost)").count()
        assert page.get_by_text("speedup pairs are not taken in elastic runs").count()
        wait_for(add.is_enabled, 30, "Add a worker to be on")
        add.click()
        wait_for(lambda: page.get_by_text("Rank 3 joined").count(), 120, "the join beside Add")
        wait_for(lambda: page.evaluate(WORKERS_JS) == 4, 60, "N = 4 in the plot after Add")
        joined = [e for e in _read_events(out) if e["type"] == "member_joined"]
        assert joined and all(e["joined"] == [3] and e["size"] == 4 for e in joined)
        wait_for(lambda: page.get_by_text("3 -> 4 workers at step").count(), 30, "the change line")
        time.sleep(2)  # a few more steps of every curve for the picture
        # docs/figures/dashboard-elastic.png is this screenshot, copied by hand: a test run
        # leaves the clone's tracked files as they are.
        page.screenshot(path=str(ARTIFACTS / "dashboard-elastic.png"))
        (out / ".stop").touch()  # as Stop would: every worker stops at the next round
        assert job.wait(120) == 0, (tmp_path / "stderr").read_text()[-2000:]
        wait_for(lambda: page.get_by_text("the run has ended").count(), 120, "the buttons off")
        assert lose.is_disabled() and add.is_disabled()
    finally:
        if job.poll() is None:
            job.terminate()
            job.wait(60)
    assert wait_for(lambda: not processes_naming(out), 30, "no process of the run left")


def _read_events(run_dir: Path) -> list[dict]:
    events = []
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the line being written
    return events
