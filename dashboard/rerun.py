"""A small control for a notebook: rerun one configuration with another K and learning rate,
and see it beside the runs before it (a table of results and the divergence before each round).

It trains through `labavg.jobs.launch.start_run` on what the notebook already has (the MPI
engines of its cluster, or threads in the kernel) and checks each box with the CLI's rules
(`check_setting`) before anything starts, so a bad value is named under its box, in the box's
words, instead of failing a run.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import holoviews as hv
import pandas as pd
import panel as pn

from dashboard.plots import load_backend
from labavg.training.config import TrainConfig, check_setting
from labavg.base.settings import with_overrides
from labavg.base.errors import UserError
from labavg.jobs.summary import format_table
from labavg.jobs.index import read_events
from labavg.jobs.run_json import as_summary
from labavg.jobs.launch import start_run

# What a refusal calls each box: its label's words, not the setting's key.
BOX_WORDS = {"averaging.average_every": "K (average every)", "lr": "learning rate"}
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


def run_label(cfg: TrainConfig) -> str:
    """What a rerun changes: K and the learning rate (the ranks come with the notebook)."""
    return f"K={cfg.averaging.average_every}, lr {cfg.lr:g}"


def divergence_curve(run_dir: str | Path, label: str, color: str) -> hv.Curve:
    """Rank 0's divergence before each averaging round, by step (minibatches per worker)."""
    events = pd.DataFrame(read_events(run_dir))
    rounds = events[(events["type"] == "average") & (events["rank"] == 0)] if len(events) else events
    if not len(rounds):
        rounds = pd.DataFrame({"step": [], "divergence": []})
    return hv.Curve(rounds, "step", "divergence", label=label).opts(color=color)


class RerunControl(pn.viewable.Viewer):
    """K and learning-rate boxes, a Run button, and the runs made so far side by side."""

    def __init__(self, base: TrainConfig, runs_dir: str | Path, cluster: Any = None, **params: Any):
        super().__init__(**params)
        if cluster is not None:
            cluster.check_open()  # after cluster.shutdown(): one line, before anything is read
        load_backend()
        self.base = base
        self.runs_dir = Path(runs_dir)
        self.cluster = cluster
        self.runs: list[tuple[str, dict[str, Any]]] = []  # (label, summary), in run order
        self.k = pn.widgets.IntInput(label="K (minibatches between averaging rounds)",
                                     value=base.averaging.average_every, width=300)
        self.lr = pn.widgets.FloatInput(label="learning rate per frame (before x N)",
                                        value=base.lr, width=300, format="0.[00000]")
        self.k_message = pn.pane.Markdown("", styles={"color": "#b00020"})
        self.lr_message = pn.pane.Markdown("", styles={"color": "#b00020"})
        self.button = pn.widgets.Button(label="Run", color="primary", width=120)
        self.status = pn.pane.Markdown("")
        self.table = pn.pane.Markdown("")
        self.plot = pn.pane.HoloViews(self._divergence(), sizing_mode="fixed")
        self.k.param.watch(self._check, "value")
        self.lr.param.watch(self._check, "value")
        self.button.on_click(lambda _event: self.run())
        self._check()

    def errors(self) -> dict[str, str]:
        """What is wrong with each box, with the CLI's rules in the box's words."""
        found = {}
        for key, widget in (("averaging.average_every", self.k), ("lr", self.lr)):
            problem = check_setting(key, widget.value)
            if problem:
                found[key] = problem.replace(key, BOX_WORDS[key], 1)
        return found

    def _check(self, *_: Any) -> None:
        problems = self.errors()
        self.k_message.object = problems.get("averaging.average_every", "")
        self.lr_message.object = problems.get("lr", "")
        self.button.disabled = bool(problems)

    def add(self, run_dir: str | Path, summary: dict[str, Any], label: str | None = None) -> None:
        """Show a run made elsewhere (e.g. the notebook's first run) for comparison."""
        typed = as_summary(summary)
        lr = typed.config.lr if typed.config is not None else typed.lr
        label = label or f"K={typed.average_every}, lr {lr:g}"
        self.runs.append((label, {**summary, "run": label, "run_dir": str(run_dir)}))
        self._refresh()

    def run(self, average_every: int | None = None, lr: float | None = None) -> dict[str, Any]:
        """Train the base configuration with this K and learning rate (the boxes' when None)."""
        if average_every is not None:
            self.k.value = average_every
        if lr is not None:
            self.lr.value = lr
        problems = self.errors()
        if problems:
            raise UserError("; ".join(problems.values()))
        stamp = time.strftime("%Y%m%d-%H%M%S")
        cfg = with_overrides(self.base, {"averaging.average_every": self.k.value,
                                         "lr": self.lr.value})
        out = self.runs_dir / f"rerun-k{cfg.averaging.average_every}-lr{cfg.lr:g}-{stamp}"
        cfg = with_overrides(cfg, {"out": str(out.resolve())})  # start_run validates it
        self.button.disabled = True
        self.status.object = f"training {run_label(cfg)} on {cfg.ranks} {cfg.backend} ranks ..."
        try:
            summary = start_run(cfg, cluster=self.cluster).wait()
        except Exception as exc:
            self.status.object = f"**the run failed:** {exc}"
            raise
        finally:
            self._check()
        done = as_summary(summary)
        self.status.object = (f"{run_label(cfg)}: CV frame accuracy "
                              f"{100 * done.cv_frame_accuracy:.2f} % in {done.wall_seconds:.0f} s")
        self.add(out, summary, run_label(cfg))
        return summary

    def _divergence(self) -> hv.Overlay:
        curves = [divergence_curve(s["run_dir"], label, _PALETTE[i % len(_PALETTE)])
                  for i, (label, s) in enumerate(self.runs)]
        if not curves:
            curves = [hv.Curve([], "step", "divergence")]
        # Options as keywords: the hv.opts.Curve builder needs hooks that importing HoloViews'
        # bokeh backend alone (load_backend, once) does not run.
        axes = dict(width=560, height=300, logy=True, xlabel="step (minibatches per worker)",
                    ylabel="divergence (relative RMS)", show_grid=True)
        return hv.Overlay([curve.opts(**axes) for curve in curves]).opts(
            title="divergence before each averaging round (rank 0)", legend_position="bottom_right")

    def _refresh(self) -> None:
        self.table.object = format_table([s for _, s in self.runs])
        self.plot.object = self._divergence()

    def __panel__(self) -> pn.viewable.Viewable:
        boxes = pn.Row(pn.Column(self.k, self.k_message), pn.Column(self.lr, self.lr_message),
                       pn.Column(pn.Spacer(height=18), self.button))
        return pn.Column(boxes, self.status, self.table, self.plot)
