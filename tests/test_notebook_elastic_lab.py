"""Notebook 09's "Losing a worker and taking it back" in real JupyterLab (labavg issue 43).

The section's cells (after 09's parameters and set-up cells; the sweeps before them are
tests/test_notebooks.py's) are opened in JupyterLab at 1366 x 768 in chromium and run by Kernel >
Restart Kernel and Run All, at the small size: a real elastic run of 4 worker processes under
the torchft lighthouse, rank 3 killed, a new process joined from the kernel. No cell may show a
traceback or write on stderr, no request may leave localhost, the figure is drawn, and no
process of the run may be left once the cell is done. A screenshot goes to
tests/artifacts/jupyterlab/.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import nbformat
import pytest

from jupyterlab import BROWSER_ARGS, CHROMIUM, LabPage, jupyter_lab, shut_down_kernels
from support import processes_naming

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SHOTS = REPO / "tests" / "artifacts" / "jupyterlab"
SECTION = "## 3 · Losing a worker and taking it back"
# Every code cell's outputs as text, from the notebook's model (JupyterLab renders lazily).
_OUTPUTS = """() => {
  const cells = window.jupyterapp.shell.currentWidget.content.model.cells, out = [];
  for (let i = 0; i < cells.length; i++) {
    const cell = cells.get(i);
    out.push(cell.type !== 'code' ? [] : (cell.toJSON().outputs || []).map(o =>
      o.output_type === 'stream' ? 'text:' + o.text
        : Object.keys(o.data || {}).includes('image/png') ? 'image/png' : o.output_type));
  }
  return out;
}"""


def _section_notebook(root: Path) -> str:
    """09's introduction, parameters and set-up cells, then the section up to the exercises."""
    nb = nbformat.read(REPO / "notebooks" / "09-beyond-the-paper.ipynb", as_version=4)
    (start,) = [i for i, c in enumerate(nb.cells) if c.source.startswith(SECTION)]
    end = next(i for i, c in enumerate(nb.cells) if c.source.startswith("## Exercises"))
    nb.cells = nb.cells[:3] + nb.cells[start:end]
    nbformat.write(nb, root / "09-elastic.ipynb")
    return "09-elastic.ipynb"



@pytest.mark.timeout(420)
def test_losing_and_taking_back_a_worker_runs_all_in_jupyterlab(tmp_path):
    from playwright import sync_api  # a dev dependency: missing, the test fails

    assert CHROMIUM.exists(), f"{CHROMIUM} not installed (run scripts/install-browser.sh)"
    notebook = _section_notebook(tmp_path)
    env = {"LABAVG_NOTEBOOK_SIZE": "small", "PYTHONWARNINGS": "ignore"}
    for name in ("LABAVG_NOTEBOOK_SMALL", "LABAVG_NOTEBOOK_WORK", "LABAVG_RESULTS_DIR"):
        os.environ.pop(name, None)
    SHOTS.mkdir(parents=True, exist_ok=True)
    run_dir = (tmp_path / "labavg-work" / "runs" / "09-elastic").resolve()
    with jupyter_lab(tmp_path, env) as port, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS,
                                     headless=True)
        try:
            page = LabPage(browser, port, notebook)
            started = time.monotonic()
            try:
                page.restart_and_run_all(300)
            finally:
                page.page.screenshot(path=str(SHOTS / "09-elastic-after-run-all.png"))
            print(f"{notebook}: Restart and Run All in {time.monotonic() - started:.0f} s")
            assert page.unrun() == [], "cells that did not run"
            assert page.problems() == []  # no traceback, nothing on stderr
            assert page.outside == [], f"asked the network for {page.outside[:4]}"
            outputs = page.page.evaluate(_OUTPUTS)
            text = "".join(o[5:] for cell in outputs for o in cell if o.startswith("text:"))
            assert "rank 3 is back: a new process (pid " in text, text[-2000:]
            assert "labavg: rank 3 left the job (signal SIGKILL); 3 workers go on" in text
            assert "workers 4 -> 3 -> 4 (from steps 0, 360, " in text, text[-2000:]
            plot = page.source_index("teaching_elastic.loss_pieces(")
            assert outputs[plot] == ["image/png"], outputs[plot]
            image = page.cell(plot).locator("img")
            image.scroll_into_view_if_needed()
            box = image.bounding_box()
            assert box and box["x"] >= 0 and box["x"] + box["width"] <= 1366, box
            page.page.set_viewport_size({"width": 1366, "height": 1400})  # the figure whole
            image.screenshot(path=str(SHOTS / "09-elastic-loss-and-workers.png"))
            summary = json.loads((run_dir / "summary.json").read_text())
            assert summary["worker_counts"] == [4, 3, 4]
            assert processes_naming(run_dir) == [], "the run's processes outlived it"
            shut_down_kernels(port)
        finally:
            browser.close()
