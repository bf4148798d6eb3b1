"""The Live tab: the run on screen's curves, streamed, and its speedup line.

The CV-accuracy plot (a few points per run) is fed by an `hv.streams.Pipe`; the other curves
are `StreamedCurves`, appended to as `LiveRun.drain` collects rows."""

from __future__ import annotations

from typing import Any

import holoviews as hv
import numpy as np
import pandas as pd
import panel as pn

from dashboard.buffers import POINTS_PER_CURVE
from dashboard.live import LiveRun
from dashboard.plots import (
    ACCURACY_RANGE,
    FLEX_ITEM,
    MIN_PLOT_WIDTH,
    PLOT_HEIGHT,
    SpeedupPlot,
    StreamedCurves,
    _plot_opts,
    count_axis,
    load_backend,
    rank_curves,
)
from dashboard.speedup import PREDICTION_NETWORK, RunSpeedup, machine_cores, shown_text

_LEGEND_MAX_RANKS = 8  # beyond this, a legend would hide the plot
_SETTLE_TICKS = 3  # updates to wait after replacing the plots before streaming into them


def speedup_text(speedup: RunSpeedup, cores: int) -> str:
    """One or two lines on the Live tab: the measured speedup (labavg.jobs.speedup's, the Runs
    table's and the Scaling tab's text), then the cost model's for N machines and what the
    cores here allow."""
    measured = speedup.measured
    if measured is not None and measured.value is not None and measured.ranks > 1:
        head = (f"**Speedup {shown_text(measured)}**, efficiency "
                f"{100 * measured.efficiency:.0f} % (measured in pairs inside this run).")
    elif measured is not None and measured.ranks == 1:
        head = f"**Speedup {shown_text(measured)}**"
    else:
        head = f"**Speedup: -** {speedup.note}"
    predicted = dict(speedup.predicted)
    n = measured.ranks if measured is not None else None
    if predicted:
        shown = ", ".join(f"{predicted[p]:.1f}× at {p}" for p in sorted({n or 2, 8, 32})
                          if p in predicted and p > 1)
        bound = ""
        if measured is not None and n > 1:
            bound = (f"; the {measured.cores or cores} cores it ran on allow at most "
                     f"{measured.bound:g}×")
        head += (f"  \nCost model ({PREDICTION_NETWORK.name}, one rank per machine, "
                 f"K={speedup.K}, this run's costs): {shown} machines{bound}.")
    return head


class LivePlots(pn.viewable.Viewer):
    """The live plots of the run on screen; `update` streams what `LiveRun.drain` collected."""

    def __init__(self, live: LiveRun, maxlen: int = POINTS_PER_CURVE, **params: Any) -> None:
        super().__init__(**params)
        load_backend()
        self.live = live
        self.maxlen = maxlen
        self.cores = machine_cores()
        names = ("loss", "divergence", "speedup", "times", "fps", "cv")
        self.panes = {name: pn.pane.HoloViews(None, sizing_mode="stretch_width", height=PLOT_HEIGHT + 10,
                                              linked_axes=False, min_width=MIN_PLOT_WIDTH,
                                              styles=dict(FLEX_ITEM))
                      if name in ("speedup", "cv") else
                      pn.pane.Bokeh(None, sizing_mode="stretch_width", height=PLOT_HEIGHT + 10)
                      for name in names}
        self.speedup_line = pn.pane.Markdown("", sizing_mode="stretch_width", margin=(0, 10),
                                             styles={"font-size": "0.9em"})
        self._generation = -1
        self._settle = 0
        self._rebuild: int | None = None  # ranks of the per-rank plots to draw at the next update
        # The plots are put on the page by the first periodic update, after the page itself:
        # drawing six HoloViews plots is most of what a page load costs the server.
        self._shown = False
        self._build_shared()
        self._build(live.buffers.ranks)
        # The old run's curves go the moment a new run replaces it, not at the next update.
        live.param.watch(lambda _: self._new_run(), "generation")
        self._show_speedup()

    def _new_run(self) -> None:
        if self.live.generation == self._generation:
            return
        self._generation = self.live.generation
        self._clear()
        if self.live.buffers.ranks != self.ranks:
            # New per-rank plots, drawn by the next periodic update: drawn here, they held back
            # the new run's name and status (sent with them) by seconds on a loaded machine.
            self._rebuild = self.live.buffers.ranks
        self._speedup_shown = None
        self._show_speedup()

    def _clear(self) -> None:
        for curves in (self.loss, self.divergence, self.times, self.fps):
            curves.clear()
        self.cv_pipe.send(self._cv_frame([]))
        self._cv_count = 0

    @staticmethod
    def _cv_frame(rows: list) -> pd.DataFrame:
        cv = np.asarray(rows, dtype=float).reshape(-1, 3)
        return pd.DataFrame({"epoch": cv[:, 0] + 1, "cv_acc_pct": 100 * cv[:, 1],
                             "train_acc_pct": 100 * cv[:, 2]})

    def _build(self, ranks: int) -> None:
        """New per-rank plots (loss, divergence) for a run of `ranks` ranks."""
        self.ranks = ranks
        self._rebuild = None
        legend = ranks <= _LEGEND_MAX_RANKS
        self.loss = StreamedCurves("step", rank_curves("loss", ranks), self.maxlen, "Training loss per rank",
                                   "step (minibatches)", "loss (nats/frame)", legend, **count_axis())
        # One rank has nothing to diverge from: its flat zero is said in the title.
        title = "Divergence: 0 with one rank" if ranks == 1 else "Divergence per rank"
        self.divergence = StreamedCurves("round", rank_curves("div", ranks, over=True), self.maxlen,
                                         title, "averaging round",
                                         "relative RMS distance", legend, **count_axis())
        self._show(("loss", "divergence"))

    def _build_shared(self) -> None:
        """The plots every run has whatever its ranks, drawn once and cleared between runs."""
        self.times = StreamedCurves(
            "round", [("compute_s", "compute", {"color": "#1f77b4"}), ("comm_s", "communication", {"color": "#d62728"})],
            self.maxlen, "Compute vs comm", "averaging round", "seconds per round", legend_position="top_left",
            **count_axis())
        self.fps = StreamedCurves("round", [("frames_per_s", "all ranks", {"color": "#2ca02c"})], self.maxlen,
                                  "Frames/s (all ranks)", "averaging round", "frames/s", legend=False,
                                  **count_axis())
        self.speedup = SpeedupPlot()
        self.cv_pipe = hv.streams.Pipe(data=self._cv_frame([]))

        def cv(data):
            dim = hv.Dimension("cv_acc_pct", label="frame accuracy (%)")
            acc = hv.Curve(data, "epoch", dim, label="CV")
            train = hv.Curve(data, "epoch", hv.Dimension("train_acc_pct", label="frame accuracy (%)"),
                             label="train")
            points = hv.Scatter(data, "epoch", dim)
            # framewise: the whole frame is replaced on each epoch, so the axes must follow it.
            return (acc.opts(color="#9467bd", framewise=True)
                    * points.opts(color="#9467bd", size=7, framewise=True)
                    * train.opts(color="#7f7f7f", line_dash="dashed", framewise=True)).opts(
                **_plot_opts("Frame accuracy", "epoch", "frame accuracy (%)", framewise=True,
                             legend_position="top_left", ylim=ACCURACY_RANGE,
                             xlim=(0.5, max(1.5, len(data) + 0.5)), **count_axis()))

        self.cv = hv.DynamicMap(cv, streams=[self.cv_pipe])
        self._show(("times", "fps", "speedup", "cv"))
        self._cv_count = 0
        self._speedup_shown: RunSpeedup | None = None

    def _show(self, names: tuple[str, ...]) -> None:
        for name in names if self._shown else ():
            plot = getattr(self, name)
            self.panes[name].object = plot if name == "cv" else plot.element

    def __panel__(self) -> pn.Column:
        """The speedup line; loss, divergence and speedup; compute vs comm, frames/s, accuracy
        (three to a row where they fit, wrapping where they do not)."""
        p = self.panes
        plots = (p["loss"], p["divergence"], p["speedup"], p["times"], p["fps"], p["cv"])
        return pn.Column(self.speedup_line,
                         pn.FlexBox(*plots, flex_wrap="wrap", sizing_mode="stretch_width"),
                         sizing_mode="stretch_width")

    def _show_speedup(self) -> None:
        if not self.live.config:
            self.speedup_line.object = "**Speedup: -** No run on screen."
            return
        speedup = self.live.speedup()
        if speedup != self._speedup_shown:
            self._speedup_shown = speedup
            measured = speedup.measured
            self.speedup.show(speedup, (measured.cores if measured else 0) or self.cores)
        text = speedup_text(speedup, self.cores)
        if text != self.speedup_line.object:
            self.speedup_line.object = text

    def update(self) -> int:
        """Stream the rows collected since the last call; returns how many rows were sent."""
        if self.live.generation != self._generation:
            self._new_run()
        if not self._shown:
            self._shown = True
            self._show(tuple(self.panes))
            self._settle = _SETTLE_TICKS
        if self.live.buffers.ranks != self.ranks:
            # A followed run's buffers take its ranks when its config.json is read, which can
            # come after the new run was announced: following a second 4-rank run kept the
            # 1-rank plots of the wait and failed every update, its plots empty.
            self._rebuild = self.live.buffers.ranks
        if self._rebuild is not None:
            self._build(self._rebuild)
            self._settle = _SETTLE_TICKS
            return 0
        if self._settle > 0:
            # A served page swaps in new plots a little later: until then, changes to their
            # bokeh models reach the browser before the models do ("reference isn't known").
            # The rows wait in the state's buffers meanwhile.
            self._settle -= 1
            return 0
        buffers = self.live.buffers
        sent = 0
        rows = buffers.loss.take()
        if rows:
            self.loss.stream(pd.DataFrame(rows, columns=self.loss.columns))
            sent += len(rows)
        div, compute, comm, fps = (s.take() for s in (buffers.divergence, buffers.compute,
                                                       buffers.comm, buffers.fps))
        if div:
            self.divergence.stream(pd.DataFrame(div, columns=self.divergence.columns))
            # The four series are filled by the same events, so their rows line up.
            n = min(len(div), len(compute), len(comm), len(fps))
            self.times.stream(pd.DataFrame({"round": [row[0] for row in compute[:n]],
                                            "compute_s": [row[-1] for row in compute[:n]],
                                            "comm_s": [row[-1] for row in comm[:n]]}))
            self.fps.stream(pd.DataFrame({"round": [row[0] for row in fps[:n]],
                                          "frames_per_s": [float(np.nansum(row[1:-1])) for row in fps[:n]]}))
            sent += n
        if len(buffers.cv) != self._cv_count:
            self._cv_count = len(buffers.cv)
            frame = self._cv_frame(list(buffers.cv))
            self.cv_pipe.send(frame)
            sent += len(frame)
        self._show_speedup()
        return sent


