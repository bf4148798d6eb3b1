"""The labavg dashboard: live plots of a training run, past runs, scaling.

    panel serve dashboard/app.py --args --runs-dir runs --data data/synth   # http://localhost:5006/app
    labavg dashboard                                                        # the same, via serve()

In JupyterLab: `from dashboard.app import create_app; create_app(runs_dir="runs")` shows it inline.
Composition only: the state lives in dashboard.settings (the next run), dashboard.live (the
run on screen), dashboard.runs_table (the past runs) and dashboard.jobs (the server's runs,
shared by its pages); the views (dashboard.controls, live_view, runs_view, scaling_view)
follow the state through `pn.bind` and `param.depends`. One `Dashboard` per page.

The page's one periodic mechanism is its flush (`Dashboard.flush`, every FLUSH_MS): the
events the run's worker thread queued go into the run's buffers (`LiveRun.drain`) and the
rows they made to the browser (`LivePlots.stream`), so a run of thousands of events a second
costs the browser one append per plot per flush. Everything else follows state changes.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

if __name__.startswith("bokeh"):
    # `panel serve dashboard/app.py` runs this file as a script: put the repository on the path.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import panel as pn  # noqa: E402
from panel.theme import Fast  # noqa: E402

from dashboard.controls import RunControls, SettingsPanel  # noqa: E402
from dashboard.elastic import WorkerControls  # noqa: E402
from dashboard.elastic_view import WorkerButtons  # noqa: E402
from dashboard.jobs import JobRegistry, server_jobs  # noqa: E402
from dashboard.live import LiveRun  # noqa: E402
from dashboard.live_view import LivePlots  # noqa: E402
from dashboard.notebook import serve_styles_locally  # noqa: E402
from dashboard.plan_view import PlanView  # noqa: E402
from dashboard.runs_view import RunsView  # noqa: E402
from dashboard.scaling_view import ScalingView  # noqa: E402
from dashboard.runs_table import RunTable  # noqa: E402
from dashboard.settings import RunSettings  # noqa: E402
from labavg.data.settings import DataConfig  # noqa: E402
from labavg.jobs.index import CONFIG  # noqa: E402

TITLE = "labavg · periodic model averaging"


# Panel's Fast design loads one web font (Open Sans) from a font CDN, its only outside
# request: offline a class would wait on it. The machine's own sans-serif (FONT) replaces it.
# (A subclass of the design loses Panel's bundled resources, which are found by class name.)
Fast._resources = {key: value for key, value in Fast._resources.items() if key != "font"}


DATA = DataConfig.data  # labavg train's default data directory
# The machine's own sans-serif: the template's default is a web font from a CDN.
FONT = "'DejaVu Sans', 'Segoe UI', Helvetica, Arial, sans-serif"
FLUSH_MS = 500  # the page's flush: twice a second


class Dashboard:
    """The state objects and views of one browser session (or one notebook cell); `jobs` is
    the server's registry of runs (dashboard.jobs), shared with its other pages."""

    def __init__(self, runs_dir: str = "runs", data: str = DATA,
                 jobs: JobRegistry | None = None) -> None:
        self.settings = RunSettings(runs_dir=runs_dir, data=data)
        self.live = LiveRun(jobs=jobs)
        # The sidebar says what the run on screen trains when this page did not start it (a
        # reload, a second page, a followed run), so that Start trains what is on screen.
        pn.bind(self._show_run_settings, self.live.param.config, watch=True)
        # A reload, or a second page, shows the server's run in progress, else its last run:
        # before the plots and boxes are made, so they are made for it, once.
        self.live.attach(last=True)
        self.table = RunTable(runs_dir=self.settings.runs_dir)
        # An elastic run's "Lose a worker" and "Add a worker" (shown only for one).
        self.workers = WorkerControls(self.live)
        self.plots = LivePlots(self.live, controls=WorkerButtons(self.workers))
        self.runs = RunsView(self.table)
        self.scaling = ScalingView(self.table, self.settings)
        self.controls = RunControls(self.settings, self.live)
        self.plan = PlanView(self.table, self.settings, self.live)
        pn.bind(lambda runs_dir: setattr(self.table, "runs_dir", runs_dir),
                self.settings.param.runs_dir, watch=True)
        # The table is rescanned when what it lists can have changed: another runs directory,
        # a run's config.json written (its rank 0 has started), a run ended.
        pn.bind(lambda *_: self.runs.refresh(), self.table.param.runs_dir, self.live.param.running,
                self.live.param.started, watch=True)
        self.runs.refresh()
        self.scaling.refresh()

    def _show_run_settings(self, config: dict[str, Any]) -> None:
        if config and not self.live.own:
            # A run of this server: where it was written too (another page may have changed it).
            runs_dir = str(Path(self.live.run_dir).parent) if self.live.from_server else None
            self.settings.show_run(config, runs_dir)

    def flush(self) -> None:
        """The page's flush (see the module's docstring): queued events into the run's
        buffers, their rows to the plots."""
        self.live.drain()
        self.workers.refresh()
        self.plots.stream()

    def _main(self) -> pn.Column:
        # dynamic: a tab's plots are drawn when it is shown, not all of them with the page (9
        # HoloViews plots took most of a first load's 25 s under load) nor on each rescan.
        tabs = pn.Tabs(("Live", self.plots), ("Runs", self.runs), ("Scaling", self.scaling),
                       ("Plan", self.plan), ("Communication", self.runs.communication_view()),
                       dynamic=True, sizing_mode="stretch_width")
        self.plan.show_live = lambda: setattr(tabs, "active", 0)  # its train button's run
        return pn.Column(self.controls.status_view(), tabs, sizing_mode="stretch_width")

    def view(self) -> pn.template.FastListTemplate:
        """The page: settings in the sidebar; live plots, runs, scaling and communication in tabs."""
        return pn.template.FastListTemplate(
            title=TITLE,
            sidebar=[self.controls, SettingsPanel(self.settings)],
            main=[self._main()],
            sidebar_width=330, header_background="#2f4f6f", accent_base_color="#2f4f6f",
            main_layout=None, font=FONT,
        )

    def inline_view(self) -> pn.Row:
        """The same page as one cell's output: the settings beside the tabs, no template."""
        sidebar = pn.Column(pn.pane.Markdown(f"### {TITLE}"), self.controls,
                            SettingsPanel(self.settings), width=330)
        return pn.Row(sidebar, self._main(), sizing_mode="stretch_width")


def newest_run(runs_dir: Path) -> Path | None:
    """The run directory under `runs_dir` whose config.json was written last, if any."""
    runs = [run for run in runs_dir.iterdir() if (run / CONFIG).is_file()] if runs_dir.is_dir() else []
    return max(runs, key=lambda run: (run / CONFIG).stat().st_mtime, default=None)


def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (where the page is a cell's output)."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return getattr(shell, "kernel", None) is not None


def create_app(runs_dir: str | os.PathLike = "runs", data: str | os.PathLike = DATA,
               period_ms: int = FLUSH_MS, preset: str | None = None,
               inline: bool | None = None, jobs: JobRegistry | None = None) -> pn.viewable.Viewable:
    """A servable dashboard page with its flush running; `jobs` the registry of runs its
    pages share (by default this process's, `dashboard.jobs.server_jobs`). `preset` selects a named
    preset first (a notebook passes its size's, so its runs pair up). `inline` (the default
    in a Jupyter kernel): the page as a cell's output, its JavaScript and stylesheets in the
    notebook, so a class without internet sees it styled (a template there took its styles
    from a CDN, and offline showed a screen-high bare icon)."""
    inline = in_notebook() if inline is None else inline
    # Offline too: Panel's own resources, never a CDN's (the server serves them itself).
    pn.extension("tabulator", notifications=False, inline=inline)
    if inline:
        serve_styles_locally()  # and so are the models its callbacks make later
    dashboard = Dashboard(runs_dir=str(runs_dir), data=str(data),
                          jobs=jobs if jobs is not None else server_jobs())
    if preset is not None:
        dashboard.settings.preset = preset
    if inline and not dashboard.live.run_dir:
        # A notebook's runs are not jobs of this page: its newest run is on screen rather
        # than "Idle · No run on screen" (notebook 03's inline dashboard, below its first run).
        newest = newest_run(Path(runs_dir))
        if newest is not None:
            dashboard.live.follow(newest)
    page = dashboard.inline_view() if inline else dashboard.view()
    pn.state.add_periodic_callback(dashboard.flush, period=period_ms)
    if pn.state.curdoc is not None:
        # Served: the session ends when its page is closed; its run must not queue for it.
        pn.state.curdoc.on_session_destroyed(lambda _context: dashboard.live.close())
    page.dashboard = dashboard  # for tests and notebooks: the state behind the page
    return page


def serve(port: int = 5006, open_browser: bool = True, runs_dir: str | os.PathLike = "runs",
          address: str = "127.0.0.1", data: str | os.PathLike = DATA, **kwargs: Any) -> None:
    """Serve the dashboard until interrupted (localhost only unless `address` says otherwise).

    Extra keyword arguments go to `panel.serve` (e.g. basic_auth="...", websocket_origin=[...]).
    An address that is not a loopback one needs basic_auth: whoever reaches the page can start
    runs and read paths (dashboard/exposure.py, which `labavg dashboard` plans it with). The
    password is then checked by dashboard.gate, not by Panel: in constant time, with failed
    logins limited per client, and every anonymous request answered before Panel's handlers.
    """
    from dashboard.exposure import is_loopback
    from labavg.base.errors import UserError

    password = kwargs.pop("basic_auth", None)
    if not is_loopback(address) and not password:
        raise UserError(f"address {address!r} is not a loopback address: serving it needs a "
                        f"password (basic_auth=...), or anyone on the network could start runs")
    if password is not None and not isinstance(password, str):
        raise UserError("basic_auth: one password (a str); the dashboard takes any user name")
    origins = kwargs.pop("websocket_origin", [f"localhost:{port}", f"127.0.0.1:{port}", f"{address}:{port}"])
    if password:
        import secrets

        from dashboard.gate import PasswordAuth

        kwargs["auth_provider"] = PasswordAuth(password)
        kwargs.setdefault("cookie_secret", secrets.token_urlsafe(32))
    server = pn.serve({"app": lambda: create_app(runs_dir=runs_dir, data=data)}, port=port,
                      address=address, show=False, start=False, title=TITLE,
                      websocket_origin=origins, **kwargs)
    if password:
        from dashboard.gate import LOGIN, install_gate

        install_gate(server._tornado, pn.config.cookie_secret, pn.config.oauth_expiry)
    if open_browser:
        server.io_loop.add_callback(server.show, LOGIN if password else "/")
    server.start()
    server.io_loop.start()


def _script_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="panel serve dashboard/app.py --args")
    parser.add_argument("--runs-dir", default=os.environ.get("LABAVG_RUNS_DIR", "runs"))
    parser.add_argument("--data", default=os.environ.get("LABAVG_DATA", DATA))
    return parser.parse_known_args(argv)[0]


if __name__.startswith("bokeh"):
    _args = _script_args(sys.argv[1:])
    create_app(runs_dir=_args.runs_dir, data=_args.data).servable(title=TITLE)
