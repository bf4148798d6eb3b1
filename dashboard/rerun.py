"""A small control for a notebook: rerun one configuration with another K and learning rate,
and see it beside the runs before it (a table of results and the divergence before each round).

It trains through `labavg.jobs.launch.start_run` on what the notebook already has (the MPI
engines of its cluster, or threads in the kernel) and checks each box with the CLI's rules
(`check_setting`) before anything starts, so a bad value is named under its box, in the box's
words, instead of failing a run.

`RerunControl` holds the runs; every display of it, and every `control.view(...)` an exercise
cell makes, is a fresh `RerunView` with its own boxes, built for the document it is shown in.
One set of widgets and panes shown in two cells (a rerun, an exercise, the inline dashboard
beside it) broke the class's Run button: Panel updated the second cell's models with the first
cell's cached stylesheets ("Models must be owned by only a single document").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import holoviews as hv
import pandas as pd
import panel as pn
import param

from dashboard.notebook import serve_styles_locally
from dashboard.plots import load_backend
from labavg.training.config import TrainConfig, check_setting
from labavg.base.settings import with_overrides
from labavg.base.errors import UserError
from labavg.jobs.summary import format_table
from labavg.base.events import Averaged
from labavg.jobs.index import read_run_events
from labavg.jobs.run_json import RunSummary, as_summary
from labavg.jobs.launch import start_run

K_KEY = "averaging.average_every"
# The boxes' labels; a refusal names the box in the same words.
K_LABEL = "K (minibatches between averaging rounds)"
LR_LABEL = "learning rate per frame (before x N)"
BOX_WORDS = {K_KEY: K_LABEL, "lr": "learning rate"}
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
_ERROR_STYLE = {"color": "#b00020"}


def run_label(cfg: TrainConfig) -> str:
    """What a rerun changes: K and the learning rate (the ranks come with the notebook)."""
    return f"K={cfg.averaging.average_every}, lr {cfg.lr:g}"


def box_errors(average_every: Any, lr: Any) -> dict[str, str]:
    """What is wrong with each box's value, with the CLI's rules in the box's words; all of
    them at once, so a class fixes every box in one go."""
    found = {}
    for key, value in ((K_KEY, average_every), ("lr", lr)):
        problem = check_setting(key, value)
        if problem:
            found[key] = problem.replace(key, BOX_WORDS[key], 1)
    return found


def divergence_curve(run_dir: str | Path, label: str, color: str) -> hv.Curve:
    """Rank 0's divergence before each averaging round, by step (minibatches per worker)."""
    rounds = [e for e in read_run_events(Path(run_dir)) if isinstance(e, Averaged) and e.rank == 0]
    frame = pd.DataFrame({"step": [e.step for e in rounds],
                          "divergence": [e.divergence for e in rounds]})
    return hv.Curve(frame, "step", "divergence", label=label).opts(color=color)


def divergence_overlay(runs: list[tuple[str, dict[str, Any]]]) -> hv.Overlay:
    """Every run's divergence curve, in run order, one colour each."""
    curves = [divergence_curve(s["run_dir"], label, _PALETTE[i % len(_PALETTE)])
              for i, (label, s) in enumerate(runs)]
    if not curves:
        curves = [hv.Curve([], "step", "divergence")]
    # Options as keywords: the hv.opts.Curve builder needs hooks that importing HoloViews'
    # bokeh backend alone (load_backend, once) does not run.
    axes = dict(width=720, height=300, logy=True, xlabel="step (minibatches per worker)",
                ylabel="divergence (relative RMS)", show_grid=True)
    return hv.Overlay([curve.opts(**axes) for curve in curves]).opts(
        title="divergence before each averaging round (rank 0)", legend_position="right")


def runs_table(runs: list[tuple[str, dict[str, Any]]]) -> str:
    return format_table([s for _, s in runs])


class RerunControl(pn.viewable.Viewer):
    """The runs a notebook made so far, and how to make the next: shown, a fresh `RerunView`
    with the base configuration's K and learning rate in its boxes."""

    runs = param.List(default=[], doc="(label, summary) of every run shown, in run order")
    status = param.String(default="", doc="what the last or current run is doing")
    busy = param.Boolean(default=False, doc="a run is going: every view's Run waits")

    def __init__(self, base: TrainConfig, runs_dir: str | Path, cluster: Any = None, **params: Any):
        super().__init__(**params)
        if cluster is not None:
            cluster.check_open()  # after cluster.shutdown(): one line, before anything is read
        load_backend()
        serve_styles_locally()
        self.base = base
        self.runs_dir = Path(runs_dir)
        self.cluster = cluster
        self._lock = threading.Lock()

    def view(self, average_every: int | None = None, lr: float | None = None,
             train: bool = False) -> RerunView:
        """A control with its own boxes set to this K and learning rate (the base's when None);
        `train` also presses its Run (the lecturer's choice for an exercise under Run All)."""
        shown = RerunView(self, self.base.averaging.average_every if average_every is None else average_every,
                          self.base.lr if lr is None else lr)
        if train:
            shown.run()
        return shown

    def add(self, run_dir: str | Path, summary: RunSummary | Mapping[str, Any],
            label: str | None = None) -> None:
        """Show a run made elsewhere (e.g. the notebook's first run, `run_training`'s summary
        or summary.json's object) for comparison."""
        typed = as_summary(summary)
        lr = typed.config.lr if typed.config is not None else typed.lr
        label = label or f"K={typed.average_every}, lr {lr:g}"
        values = typed.to_dict() if isinstance(summary, RunSummary) else dict(summary)
        self.runs = [*self.runs, (label, {**values, "run": label, "run_dir": str(run_dir)})]

    def run(self, average_every: int | None = None, lr: float | None = None) -> dict[str, Any]:
        """Train the base configuration with this K and learning rate (the base's when None)
        and return its summary (summary.json's object); every view shows it when it is done."""
        result: dict[str, Any] = {}
        thread = self.start(average_every, lr, result)
        thread.join()
        if "error" in result:
            raise result["error"]
        return result["summary"]

    def start(self, average_every: int | None = None, lr: float | None = None,
              result: dict[str, Any] | None = None) -> threading.Thread:
        """What a view's Run does: the run in a thread, so the kernel stays free for the class.

        Every change of the control's state is made in that thread too: a pressed button's
        callback runs inside its own cell's document, and Panel updated the other cells' views
        with that document's stylesheets ("Models must be owned by only a single document")."""
        k = self.base.averaging.average_every if average_every is None else average_every
        lr = self.base.lr if lr is None else lr
        problems = box_errors(k, lr)
        if problems:
            raise UserError("; ".join(problems.values()))
        if not self._lock.acquire(blocking=False):
            raise UserError("a run is still going in this control: wait for it, then press Run")
        cfg = with_overrides(self.base, {K_KEY: k, "lr": lr})
        stamp = time.strftime("%Y%m%d-%H%M%S")
        out = self.runs_dir / f"rerun-k{k}-lr{lr:g}-{stamp}"
        try:
            cfg = with_overrides(cfg, {"out": str(out.resolve())})  # start_run validates it
        except BaseException:
            self._lock.release()
            raise
        thread = threading.Thread(target=self._train, args=(cfg, out, {} if result is None else result),
                                  name=f"labavg-rerun-{stamp}", daemon=True)
        thread.start()
        return thread

    def say(self, status: str) -> None:
        """Show `status` in every view, from outside any one cell's document (see `start`)."""
        thread = threading.Thread(target=setattr, args=(self, "status", status), daemon=True)
        thread.start()
        thread.join()

    def _train(self, cfg: TrainConfig, out: Path, result: dict[str, Any]) -> None:
        try:
            self.busy = True
            self.status = f"training {run_label(cfg)} on {cfg.ranks} {cfg.backend} ranks ..."
            done = start_run(cfg, cluster=self.cluster).result()
        except Exception as exc:  # noqa: BLE001 - said under the boxes, and raised by run()
            result["error"] = exc
            self.status = f"**the run failed:** {exc}"
            return
        finally:
            self.busy = False
            self._lock.release()
        summary = done.to_dict()  # summary.json's object: what the notebook's tables take
        self.status = (f"{run_label(cfg)}: CV frame accuracy "
                       f"{100 * done.cv_frame_accuracy:.2f} % in {done.wall_seconds:.0f} s")
        self.add(out, summary, run_label(cfg))
        result["summary"] = summary

    def __panel__(self) -> pn.viewable.Viewable:
        return self.view().__panel__()


class RerunView(pn.viewable.Viewer):
    """One display of a RerunControl: its own K and learning-rate boxes and Run button, and the
    control's runs (table and divergence), built anew for each document it is shown in."""

    def __init__(self, control: RerunControl, average_every: int, lr: float, **params: Any):
        super().__init__(**params)
        self.control = control
        self.k = pn.widgets.IntInput(label=K_LABEL, value=average_every, width=300)
        self.lr = pn.widgets.FloatInput(label=LR_LABEL, value=lr, width=300, format="0.[00000]")

    def errors(self) -> dict[str, str]:
        """What is wrong with each box now."""
        return box_errors(self.k.value, self.lr.value)

    def run(self) -> dict[str, Any]:
        """Train what the boxes say (what pressing Run does, waiting for the result)."""
        return self.control.run(self.k.value, self.lr.value)

    def _press(self, _event: Any) -> None:
        try:
            self.control.start(self.k.value, self.lr.value)
        except UserError as exc:
            self.control.say(f"**{exc}**")

    def __panel__(self) -> pn.viewable.Viewable:
        def message(key: str):
            return pn.bind(lambda k, lr: box_errors(k, lr).get(key, ""), self.k, self.lr)

        button = pn.widgets.Button(label="Run", color="primary", width=120, disabled=pn.bind(
            lambda k, lr, busy: busy or bool(box_errors(k, lr)), self.k, self.lr, self.control.param.busy))
        button.on_click(self._press)
        boxes = pn.Row(pn.Column(self.k, pn.pane.Markdown(message(K_KEY), styles=_ERROR_STYLE)),
                       pn.Column(self.lr, pn.pane.Markdown(message("lr"), styles=_ERROR_STYLE)),
                       pn.Column(pn.Spacer(height=18), button))
        runs = self.control.param.runs
        return pn.Column(boxes, pn.pane.Markdown(self.control.param.status),
                         pn.pane.Markdown(pn.bind(runs_table, runs)),
                         pn.pane.HoloViews(pn.bind(divergence_overlay, runs), sizing_mode="fixed"))
