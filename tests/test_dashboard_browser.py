"""A real browser against the served dashboard: start runs by clicking, read the plots' data.

Serves dashboard/app.py with `panel serve` on a free localhost port, drives Debian's chromium
through Playwright (scripts/install-browser.sh installs both), and saves
tests/artifacts/dashboard.png (and dashboard-runs.png) at 1366x768.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = REPO / "tests" / "artifacts"
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run"]

# Per rank: how many points the loss plot's data source holds (bokeh ColumnDataSources are
# named by their columns: "step" + "loss_r<rank>").
LOSS_POINTS_JS = """
() => {
  const counts = {};
  for (const doc of window.Bokeh.documents) {
    for (const model of doc.all_models) {
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


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"panel serve exited with {proc.returncode}: {proc.stdout.read()}")
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from labavg.data.synth import synthesize

    out = tmp_path_factory.mktemp("corpus") / "c"
    synthesize(out, hours=0.02, seed=0)
    return out


@pytest.fixture()
def served(tmp_path, corpus):
    """(url, runs_dir) of `panel serve dashboard/app.py` on a free localhost port."""
    port = _free_port()
    runs = tmp_path / "runs"
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


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _set_number(page, label: str, value: int) -> None:
    box = page.get_by_label(label, exact=True)
    box.fill(str(value))
    box.press("Enter")


def _run_once(page, ranks: int) -> dict[str, int]:
    page.get_by_role("button", name="Start").click()
    # The loss plot holds points for every rank once the run is on.
    counts = _wait_for(
        lambda: (lambda c: c if len(c) == ranks and min(c.values()) > 0 else None)(page.evaluate(LOSS_POINTS_JS)),
        60, f"loss points of {ranks} ranks")
    _wait_for(lambda: "Finished" in page.get_by_text("Finished:").first.inner_text()
              if page.get_by_text("Finished:").count() else False, 90, "the run to finish")
    return counts


@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} not installed (run scripts/install-browser.sh)")
def test_dashboard_in_browser(served):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed "
                                   "(run scripts/install-browser.sh)")
    url, runs = served
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1366, "height": 768})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(url)
            page.get_by_role("button", name="Start").wait_for(timeout=30000)
            _wait_for(lambda: page.evaluate("() => !!(window.Bokeh && window.Bokeh.documents.length)"),
                      30, "the bokeh document")

            # Run 1: 2 ranks, K = 3.
            _set_number(page, "ranks", 2)
            _set_number(page, "K (average every)", 3)
            _set_number(page, "hidden layers", 1)
            _set_number(page, "hidden units", 64)
            counts = _run_once(page, ranks=2)
            assert set(counts) == {"0", "1"}

            # Run 2: K changed (and 3 ranks); the plots start again with a curve per rank.
            _set_number(page, "ranks", 3)
            _set_number(page, "K (average every)", 7)
            counts = _run_once(page, ranks=3)
            assert set(counts) == {"0", "1", "2"}
            on_screen = page.get_by_text("On screen:").first.inner_text()
            assert "K=7" in on_screen and "3 ranks" in on_screen
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"))

            # The runs table lists both configurations.
            page.locator(".bk-tab", has_text="Runs").click()
            rows = page.locator(".tabulator-row")
            _wait_for(lambda: rows.count() >= 2, 20, "two rows in the runs table")
            texts = [rows.nth(i).inner_text() for i in range(rows.count())]
            assert any("-n2-k3" in t for t in texts), texts
            assert any("-n3-k7" in t for t in texts), texts
            page.screenshot(path=str(ARTIFACTS / "dashboard-runs.png"))
            assert not errors, errors
        finally:
            browser.close()
    run_dirs = sorted(p.name for p in runs.iterdir())
    assert len(run_dirs) == 2 and all((runs / d / "summary.json").is_file() for d in run_dirs)
