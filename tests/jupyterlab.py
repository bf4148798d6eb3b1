"""Real JupyterLab in Debian's chromium, driven as a class uses it (for the slow tests).

`jupyter_lab(root)` serves `root` on a free localhost port with the news prompt off; `LabPage`
opens a notebook at 1366 x 768, restarts its kernel and runs all cells through JupyterLab's own
commands, runs one cell, finds tracebacks wherever JupyterLab shows them (a cell's outputs, and
what Panel's comm writes into an output after a pressed button) and records every request that
leaves localhost.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil

from support import wait_for

CHROMIUM = Path("/usr/bin/chromium")
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run"]
TOKEN = "labavg-test"
LOCAL = re.compile(r"^(https?|wss?)://(127\.0\.0\.1|localhost)[:/]|^(data|blob|about):")
# JupyterLab's "get notified about Jupyter news?" prompt covers the page's corner: a user
# setting of its notification plugin answers it.
NO_NEWS = ("@jupyterlab/apputils-extension/notification.jupyterlab-settings", {"fetchNews": "false"})


@contextlib.contextmanager
def jupyter_lab(root: Path, env: dict[str, str] | None = None) -> Iterator[int]:
    """JupyterLab serving `root` on a free localhost port, its settings in `root`/.lab."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    home = root / ".lab"
    settings = home / "settings"
    settings.mkdir(parents=True, exist_ok=True)
    news = settings / NO_NEWS[0]
    news.parent.mkdir(parents=True, exist_ok=True)
    news.write_text(json.dumps(NO_NEWS[1]))
    lab_env = {**os.environ, **(env or {}), "JUPYTER_CONFIG_DIR": str(home / "config"),
               "JUPYTERLAB_SETTINGS_DIR": str(settings),
               "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
               "JUPYTER_RUNTIME_DIR": str(home / "runtime")}
    log = open(home / "server.log", "w")
    lab = subprocess.Popen([str(Path(sys.executable).with_name("jupyter")), "lab", "--no-browser",
                            f"--port={port}", f"--ServerApp.token={TOKEN}", f"--ServerApp.root_dir={root}",
                            f"--LabApp.user_settings_dir={settings}",
                            "--LabApp.expose_app_in_browser=True", "--allow-root"],
                           env=lab_env, stdout=log, stderr=subprocess.STDOUT)

    def listening() -> bool:
        assert lab.poll() is None, f"jupyter lab exited with {lab.returncode}"
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    try:
        wait_for(listening, 120, "jupyter lab to listen")
        yield port
    finally:
        lab.terminate()
        try:
            lab.wait(30)
        except subprocess.TimeoutExpired:
            lab.kill()
        log.close()


def kernel_pids(port: int) -> list[int]:
    """Process ids of the server's running kernels (their connection file names the id)."""
    url = f"http://127.0.0.1:{port}/api/kernels?token={TOKEN}"
    with urllib.request.urlopen(url, timeout=30) as response:
        ids = [kernel["id"] for kernel in json.load(response)]
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if any(f"kernel-{i}.json" in part for i in ids for part in (p.info["cmdline"] or []))]


def shut_down_kernels(port: int) -> None:
    """Shut down every kernel of the server (what closing a notebook and its kernel does)."""
    base = f"http://127.0.0.1:{port}/api/kernels"
    with urllib.request.urlopen(f"{base}?token={TOKEN}", timeout=30) as response:
        ids = [kernel["id"] for kernel in json.load(response)]
    for kernel in ids:
        request = urllib.request.Request(f"{base}/{kernel}?token={TOKEN}", method="DELETE")
        urllib.request.urlopen(request, timeout=60).close()


# Outputs of every code cell, from the notebook's model (JupyterLab renders long notebooks
# lazily, so the page alone does not hold them all): errors, stderr, and text with a traceback.
_MODEL_PROBLEMS = """() => {
  const cells = window.jupyterapp.shell.currentWidget.content.model.cells, out = [];
  for (let i = 0; i < cells.length; i++) {
    const cell = cells.get(i);
    if (cell.type !== 'code') continue;
    for (const o of cell.toJSON().outputs || []) {
      const text = o.output_type === 'error' ? (o.traceback || []).join('\\n')
        : o.output_type === 'stream' ? o.text : ((o.data || {})['text/plain'] || '');
      if (o.output_type === 'error' || (o.output_type === 'stream' && o.name === 'stderr')
          || /Traceback/.test(text)) out.push(`cell ${i}: ${String(text).slice(-1500)}`);
    }
  }
  return out;
}"""
# What Panel's comm writes into an output when a callback fails lives only in the page.
_PAGE_TRACEBACKS = """() => [...document.querySelectorAll('.jp-OutputArea-output')]
  .map(e => e.textContent).filter(t => t.includes('Traceback (most recent call last)'))
  .map(t => t.slice(-1500))"""
_IDLE = """() => {
  const panel = window.jupyterapp.shell.currentWidget, kernel = panel.sessionContext.session?.kernel;
  if (!kernel || kernel.status !== 'idle') return false;
  const cells = panel.content.model.cells;
  for (let i = 0; i < cells.length; i++)
    if (cells.get(i).type === 'code' && cells.get(i).executionState === 'running') return false;
  return true;
}"""


class LabPage:
    """One notebook open in JupyterLab in a 1366 x 768 chromium page."""

    def __init__(self, browser, port: int, notebook: str):
        self.page = browser.new_page(viewport={"width": 1366, "height": 768})
        self.outside: list[str] = []
        self.page.on("request", self._note)
        # reset: a workspace of its own, without the notebooks opened before (and their kernels)
        self.page.goto(f"http://127.0.0.1:{port}/lab/tree/{notebook}?reset&token={TOKEN}", timeout=120000)
        self.page.wait_for_function(
            "() => window.jupyterapp?.shell.currentWidget?.sessionContext?.session?.kernel",
            timeout=120000, polling=500)
        self.wait_idle(120)

    def _note(self, request) -> None:
        if not LOCAL.match(request.url):
            self.outside.append(request.url)

    def wait_idle(self, seconds: float) -> None:
        self.page.wait_for_timeout(1000)
        self.page.wait_for_function(_IDLE, timeout=seconds * 1000, polling=500)

    def restart_and_run_all(self, seconds: float) -> None:
        """Kernel > Restart Kernel and Run All Cells, and the dialog's Restart."""
        # not awaited: the command's promise settles only once the dialog is answered
        self.page.evaluate("() => { window.jupyterapp.commands.execute('notebook:restart-run-all'); }")
        self.page.locator(".jp-Dialog-button.jp-mod-accept").click()
        self.page.wait_for_timeout(3000)
        self.wait_idle(seconds)

    def run_cell(self, index: int, seconds: float = 60) -> None:
        """Select the cell and run it (Shift+Enter's command)."""
        self.page.evaluate(f"""() => {{ const panel = window.jupyterapp.shell.currentWidget;
            panel.content.activeCellIndex = {index};
            window.jupyterapp.commands.execute('notebook:run-cell'); }}""")
        self.wait_idle(seconds)

    def cell(self, index: int):
        return self.page.locator(f'.jp-Notebook .jp-Cell[data-windowed-list-index="{index}"]')

    def unrun(self) -> list[int]:
        """Indices of the code cells that have not run (no execution count)."""
        return self.page.evaluate("""() => {
            const cells = window.jupyterapp.shell.currentWidget.content.model.cells, out = [];
            for (let i = 0; i < cells.length; i++)
                if (cells.get(i).type === 'code' && cells.get(i).executionCount == null) out.push(i);
            return out; }""")

    def problems(self) -> list[str]:
        return self.page.evaluate(_MODEL_PROBLEMS) + self.page.evaluate(_PAGE_TRACEBACKS)

    def source_index(self, marker: str) -> int:
        """Index of the first cell whose source holds `marker`."""
        return self.page.evaluate(f"""() => {{
            const cells = window.jupyterapp.shell.currentWidget.content.model.cells;
            for (let i = 0; i < cells.length; i++)
                if (cells.get(i).sharedModel.getSource().includes({json.dumps(marker)})) return i;
            return -1; }}""")
