"""The Runs tab's overlay of many finished runs: how long it takes to draw, and where (never a
timed test).

    .venv/bin/python benchmarks/bench_overlay.py [--runs-dir DIR | --runs 16] [--repeats 3]
                                                [--no-browser] [--json out.json]
                                                [--screenshot overlay.png]

Without --runs-dir, trains `--runs` small real runs first (a 0.2 h synthetic corpus; 1-4 ranks,
K 5-40, two learning rates; 3 epochs each: several minutes on 2 cores) in a temporary folder.

In this process (what the server does when runs are ticked): the Runs tab (RunsView) rendered
into a bokeh Document as a served page does, then all runs selected at once, `--repeats` times:
reading their events (RunTable.overlay), drawing the overlay (the selection's whole handler,
reading included) and serialising the model changes into the PATCH-DOC message a browser gets.

In the browser: the dashboard served (`panel serve dashboard/app.py`) and opened in headless
chromium at 1366 x 768 (as tests/test_dashboard_browser.py does); on the Runs tab, the table's
select-all box is clicked, and the seconds until every run's legend entry is in the page and
the next frame is painted are measured, with the server's CPU seconds meanwhile; then the
selection is cleared, `--repeats` times.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # dashboard/ from the checkout

CHROMIUM = Path("/usr/bin/chromium")
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run"]
# (ranks, K, lr) of the runs trained without --runs-dir: what a class compares in the overlay.
RUN_SPECS = [(r, k, lr) for r in (1, 2, 3, 4) for k in (5, 20) for lr in (0.008, 0.016)] + \
            [(2, 40, 0.008), (4, 40, 0.008), (2, 10, 0.008), (4, 10, 0.008)]

# The labels of every bokeh legend entry on the page (the models reachable from the roots), and
# the most lines a multi-line data source holds ("xs": the overlay's, one line per run).
LEGENDS_JS = """
() => {
  const out = {labels: [], lines: 0};
  for (const doc of window.Bokeh.documents) {
    for (const root of doc.roots()) {
      for (const model of root.references()) {
        const kind = model.constructor.__name__;
        if (kind === "LegendItem") {
          const label = model.label;
          out.labels.push(label !== null && typeof label === "object" ? (label.value ?? label.field) : label);
        } else if (kind === "ColumnDataSource") {
          const xs = model.data instanceof Map ? model.data.get("xs") : model.data["xs"];
          if (xs !== undefined) out.lines = Math.max(out.lines, xs.length);
        }
      }
    }
  }
  return out;
}
"""
PAINTED_JS = "() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(() => r(true))))"


def make_runs(dest: Path, count: int) -> None:
    """Train `count` small real runs into dest/ (labavg train, one after another)."""
    corpus = dest.parent / "corpus"
    labavg = [sys.executable, "-m", "labavg"]
    subprocess.run([*labavg, "corpus", "synth", str(corpus), "--hours", "0.2", "--dev-hours",
                    "0.02", "--test-hours", "0", "--seed", "2"], cwd=REPO, check=True,
                   capture_output=True)
    for i, (ranks, k, lr) in enumerate(RUN_SPECS[:count]):
        out = dest / f"run-{i:02d}-n{ranks}-K{k}-lr{lr}"
        subprocess.run([*labavg, "train", "--data", str(corpus), "--out", str(out), "--ranks",
                        str(ranks), "--average-every", str(k), "--lr", str(lr), "--epochs", "3",
                        "--hidden-layers", "2", "--hidden-dim", "128", "--no-progress"],
                       cwd=REPO, check=True, capture_output=True)
        print(f"trained {out.name}", flush=True)


def server_side(runs_dir: Path, repeats: int) -> dict:
    """Seconds the server spends when every run is ticked: reading, the whole handler, the
    message to the browser; and that message's size."""
    import panel as pn
    from bokeh.document import Document
    from bokeh.protocol import Protocol

    from dashboard.runs_table import RunTable
    from dashboard.runs_view import RunsView

    table = RunTable(runs_dir=str(runs_dir))
    view = RunsView(table)
    view.refresh()
    doc = Document()
    doc.add_root(pn.panel(view).get_root(doc))
    events: list = []
    doc.on_change(events.append)
    everything = list(range(len(table.rows)))
    reads, handler, serialise, sizes = [], [], [], []
    for _ in range(repeats):
        view.tabulator.selection = []
        table.selected = [row["run"] for row in table.rows]
        began = time.perf_counter()
        table.overlay()
        reads.append(time.perf_counter() - began)
        events.clear()
        began = time.perf_counter()
        view.tabulator.selection = everything
        handler.append(time.perf_counter() - began)
        began = time.perf_counter()
        message = Protocol().create("PATCH-DOC", list(events))
        serialise.append(time.perf_counter() - began)
        sizes.append(len(message.content_json) + sum(memoryview(b.data).nbytes for b in message.buffers))
    return {"runs": len(everything), "read_events_s": reads, "select_handler_s": handler,
            "serialise_s": serialise, "patch_kib": [s / 1024 for s in sizes]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait(what: str, check, timeout: float = 300.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise TimeoutError(f"no {what} after {timeout} s")


def _serve(runs_dir: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    panel = Path(sys.executable).with_name("panel")
    server = subprocess.Popen(
        [str(panel), "serve", str(REPO / "dashboard" / "app.py"), "--port", str(port),
         "--address", "127.0.0.1", "--allow-websocket-origin", f"127.0.0.1:{port}",
         "--args", "--runs-dir", str(runs_dir)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    _wait("server", listening, 240)
    return server, f"http://127.0.0.1:{port}/app"


def in_browser(runs_dir: Path, labels: set[str], repeats: int, screenshot: Path | None) -> dict:
    """Seconds from clicking select-all to every run's legend entry painted, and the server's
    CPU seconds meanwhile."""
    from playwright.sync_api import sync_playwright

    server, url = _serve(runs_dir)
    walls, cpus = [], []
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS, headless=True)
            page = browser.new_page(viewport={"width": 1366, "height": 768})
            page.goto(url, timeout=240000)
            page.get_by_role("button", name="Start").wait_for(timeout=240000)
            page.locator(".bk-tab", has_text="Runs").click()
            rows = page.locator(".tabulator-row")
            _wait("table rows", lambda: rows.count() >= len(labels))
            select_all = page.locator(".tabulator-col input[type=checkbox]").first

            def overlaid() -> set[str]:
                # The legend: bokeh's entries, or the HTML one above the plots (dashboard.overlay)
                # once its lines are in the plots' data too.
                found = page.evaluate(LEGENDS_JS)
                html = set(page.locator(".run").all_inner_texts())
                return set(found["labels"]) | (html if found["lines"] >= len(html) else set())

            for _ in range(repeats):
                cpu, began = _server_cpu(server.pid), time.monotonic()
                select_all.click()
                _wait("legend", lambda: labels <= overlaid())
                page.evaluate(PAINTED_JS)
                walls.append(time.monotonic() - began)
                cpus.append(_server_cpu(server.pid) - cpu)
                if screenshot is not None and len(walls) == 1:
                    page.mouse.move(850, 500)
                    page.mouse.wheel(0, 400)
                    page.evaluate(PAINTED_JS)
                    page.screenshot(path=str(screenshot))
                select_all.click()  # clears the selection again
                _wait("empty overlay", lambda: not labels & overlaid())
            browser.close()
    finally:
        server.terminate()
        server.wait(10)
    return {"select_all_to_painted_s": walls, "server_cpu_s": cpus}


def _labels(runs_dir: Path) -> set[str]:
    from dashboard.runs_table import RunTable

    table = RunTable(runs_dir=str(runs_dir))
    table.refresh()
    table.selected = [row["run"] for row in table.rows]
    return {curve["label"] for curve in table.overlay().values()}


def main() -> None:
    """Parse arguments, make or find the runs, measure, print (and optionally save)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs-dir", type=Path, help="finished runs to overlay (else trained)")
    parser.add_argument("--runs", type=int, default=16, help="runs to train without --runs-dir")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-browser", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--screenshot", type=Path, help="PNG of the page with every run overlaid")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs_dir = args.runs_dir
        if runs_dir is None:
            runs_dir = Path(tmp) / "runs"
            make_runs(runs_dir, args.runs)
        result = {"load_average": os.getloadavg()[0], **server_side(runs_dir, args.repeats)}
        if not args.no_browser:
            result.update(in_browser(runs_dir, _labels(runs_dir), args.repeats, args.screenshot))
    for key, value in result.items():
        if isinstance(value, list):
            shown = " ".join(f"{v:.3f}" for v in value)
            print(f"{key:26s} median {statistics.median(value):8.3f}   ({shown})")
        else:
            print(f"{key:26s} {value}")
    print(f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f} at the end")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
