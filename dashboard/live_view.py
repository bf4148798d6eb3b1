"""The Live tab: the run on screen's plots (dashboard.live_plots declares them), its speedup line.

Every plot is made from its `LivePlot` entry: streamed curves (`StreamedCurves`, appended to
as rows come; `StepCurves` for a step plot), the accuracy plot (`AccuracyPlot`) or the
speedup plot (`SpeedupPlot`). A fresh `LivePlots` is made for each page (a Viewer, its panes
owned by that page's document).
`LivePlots.stream` is the view half of the page's one periodic flush (dashboard.app): the rows
`LiveRun.drain` collected go to the browser at most once a flush."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import panel as pn

from dashboard.buffers import POINTS_PER_CURVE, RunBuffers
from dashboard.live import LiveRun
from dashboard.live_plots import (ACCURACY, EACH, LIVE_PLOTS, MEAN, RANK0, SPEEDUP, STEPS, SUM,
                                  WORKERS, LivePlot)
from dashboard.membership import run_kind
from dashboard.plots import (
    FLEX_ITEM,
    MIN_PLOT_WIDTH,
    PLOT_HEIGHT,
    AccuracyPlot,
    SpeedupPlot,
    StreamedCurves,
    count_axis,
    counts,
    load_backend,
    rank_curves,
)
from dashboard.speedup import (PREDICTION_NETWORK, RunSpeedup, elastic_text, machine_cores,
                               shown_text)

_LEGEND_MAX_RANKS = 8  # beyond this, a legend would hide the plot
_SETTLE_FLUSHES = 3  # flushes to wait after replacing the plots before streaming into them


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


def curves_of(plot: LivePlot, ranks: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(column, label, style) of the curves of `plot` for a run of `ranks` ranks."""
    if plot.ranks == EACH:
        return [c for s in plot.series for c in rank_curves(s.column, ranks, over=plot.over)]
    return [(s.column, s.label, s.style) for s in plot.series]


def figure_of(plot: LivePlot, ranks: int, maxlen: int) -> Any:
    """The figure `plot` is drawn on, for a run of `ranks` ranks."""
    if plot.draw == SPEEDUP:
        return SpeedupPlot()
    if plot.draw == ACCURACY:
        return AccuracyPlot(maxlen)
    legend = plot.legend is not None and (plot.ranks != EACH or ranks <= _LEGEND_MAX_RANKS)
    curves = StepCurves if plot.draw == STEPS else StreamedCurves
    figure = curves(plot.x, curves_of(plot, ranks), maxlen, plot.title_for(ranks), plot.xlabel,
                    plot.ylabel, legend, plot.legend or "top_right", **count_axis())
    if plot.draw in (WORKERS, STEPS):  # N and K: whole numbers, from 0
        counts(figure.element)
    return figure


class StepCurves(StreamedCurves):
    """Streamed curves drawn as steps (live_plots.STEPS): a row's values hold from its x up to
    the next row's, so each row is sent as two points, the values before it at its x, then its
    own (a gap, NaN, stays a gap on both sides)."""

    def stream(self, rows: pd.DataFrame) -> None:
        if not len(rows):
            return
        rows = rows.reset_index(drop=True)
        before = rows.shift(1)
        for column in self.columns[1:]:
            # The first row continues the curve's last value (its own, on a new curve).
            before.loc[0, column] = self._last.get(column, (None, rows.loc[0, column]))[1]
        before[self.x] = rows[self.x]
        # before_0, row_0, before_1, row_1, ...: a stable sort keeps `before` first at each index.
        super().stream(pd.concat([before, rows]).sort_index(kind="stable").reset_index(drop=True))


def rows_of(plot: LivePlot, buffers: RunBuffers) -> pd.DataFrame | None:
    """The complete rows of `plot` since the last call, as its figure's columns (None: none)."""
    if plot.draw == WORKERS:
        points = buffers.workers.take()
        return pd.DataFrame(points, columns=[plot.x, plot.series[0].column]) if points else None
    taken = [(s, buffers.of(plot.name, s.column).take()) for s in plot.series]
    n = min(len(rows) for _, rows in taken)
    if n == 0:
        return None
    frame = {plot.x: [row[0] for row in taken[0][1][:n]]}
    for s, rows in taken:
        rows = np.asarray(rows[:n], dtype=float)
        if s.gap is not None:
            values = rows[:, 1:]
            values[values == s.gap] = np.nan
        if plot.ranks == EACH:
            for r in range(rows.shape[1] - 2):
                frame[f"{s.column}_r{r}"] = rows[:, 1 + r]
            frame[f"{s.column}_mean"] = rows[:, -1]
        elif plot.ranks == MEAN:
            frame[s.column] = rows[:, -1]
        elif plot.ranks == SUM:
            frame[s.column] = np.nansum(rows[:, 1:-1], axis=1)
        elif plot.ranks == RANK0:
            frame[s.column] = rows[:, 1]
    return pd.DataFrame(frame)


class LivePlots(pn.viewable.Viewer):
    """The live plots of the run on screen; `stream` sends what `LiveRun.drain` collected."""

    def __init__(self, live: LiveRun, maxlen: int = POINTS_PER_CURVE,
                 plots: tuple[LivePlot, ...] = LIVE_PLOTS, controls: Any = None,
                 **params: Any) -> None:
        super().__init__(**params)
        load_backend()
        self.live, self.maxlen, self.plots = live, maxlen, plots
        self.controls = controls  # shown between the speedup line and the plots (a run's actions)
        self.cores = machine_cores()
        self.panes = {plot.name: pn.pane.HoloViews(None, sizing_mode="stretch_width", height=PLOT_HEIGHT + 10,
                                                   linked_axes=False, min_width=MIN_PLOT_WIDTH,
                                                   styles=dict(FLEX_ITEM))
                      if plot.draw in (SPEEDUP, ACCURACY) else
                      pn.pane.Bokeh(None, sizing_mode="stretch_width", height=PLOT_HEIGHT + 10)
                      for plot in plots if plot.onto is None}
        self.speedup_line = pn.pane.Markdown("", sizing_mode="stretch_width", margin=(0, 10),
                                             styles={"font-size": "0.9em"})
        self._generation = live.generation
        self._settle = 0
        self._rebuild: int | None = None  # ranks of the per-rank plots to draw at the next flush
        # The plots are put on the page by the first flush, after the page itself: drawing
        # six plots is most of what a page load costs the server.
        self._shown = False
        self._speedup_shown: RunSpeedup | None = None
        self.figures: dict[str, Any] = {}
        self.kind = run_kind(live.config)
        self._build(live.buffers.ranks, every=True)
        # The old run's curves go the moment a new run replaces it, not at the next flush.
        pn.bind(lambda _: self._new_run(), live.param.generation, watch=True)
        # An elastic run shows its workers present where a run of fixed N shows its speedup; a
        # run whose K changes shows its K.
        self.flex = pn.FlexBox(flex_wrap="wrap", sizing_mode="stretch_width")
        pn.bind(self._show_kind, live.param.config, watch=True)
        self._show_kind(live.config)
        self._show_speedup()

    def _show_kind(self, config: dict[str, Any]) -> None:
        self.kind = run_kind(config)
        # A plot drawn only for another kind of run is drawn when such a run first comes
        # (the N plot built on every page cost a tenth of the Live tab's server time).
        missing = [p.name for p in self.plots if p.shown(self.kind) and p.name not in self.figures]
        for plot in self.plots:
            if plot.name in missing:
                self.figures[plot.name] = self._figure(plot, self.ranks)
        if missing:
            self._show(missing)
            self._speedup_shown = None
            self._settle = _SETTLE_FLUSHES if self._shown else self._settle
        # The plots' box takes the panes of this kind of run. (Not the panes' `visible`: set
        # on a bokeh pane on a served page, Panel re-read the figure's stylesheets and raised.)
        shown = [self.panes[plot.name] for plot in self.plots
                 if plot.shown(self.kind) and plot.name in self.panes]
        if shown != list(self.flex.objects):
            self.flex.objects = shown

    def _new_run(self) -> None:
        self._generation = self.live.generation
        for name, figure in self.figures.items():
            if hasattr(figure, "clear"):
                figure.clear()
        if self.live.buffers.ranks != self.ranks:
            # New per-rank plots, drawn by the next flush: drawn here, they held back the new
            # run's name and status (sent with them) by seconds on a loaded machine.
            self._rebuild = self.live.buffers.ranks
        self._speedup_shown = None
        self._show_speedup()

    def _build(self, ranks: int, every: bool = False) -> None:
        """New figures for a run of `ranks` ranks: the per-rank ones (`every`: all of them;
        the others are drawn once and cleared between runs)."""
        self.ranks = ranks
        self._rebuild = None
        built = [plot.name for plot in self.plots
                 if (every or plot.per_rank) and plot.shown(self.kind)]
        for plot in self.plots:
            if plot.name in built:
                self.figures[plot.name] = self._figure(plot, ranks)
        self._show(built)

    def _figure(self, plot: LivePlot, ranks: int) -> Any:
        # A plot drawn onto another's figure shares it (LIVE_PLOTS lists that one first).
        shared = self.figures.get(plot.onto) if plot.onto else None
        return shared if shared is not None else figure_of(plot, ranks, self.maxlen)

    def _show(self, names: list[str]) -> None:
        drawn = [n for n in names if n in self.figures and n in self.panes]
        for name in drawn if self._shown else ():
            self.panes[name].object = self.figures[name].element

    def __getattr__(self, name: str) -> Any:
        # A plot by its name (plots.loss, plots.cv), for tests and benchmarks.
        figures = self.__dict__.get("figures", {})
        if name in figures:
            return figures[name]
        raise AttributeError(name)

    def __panel__(self) -> pn.Column:
        """The speedup line, then the plots in LIVE_PLOTS' order, three to a row where they fit
        (wrapping where they do not)."""
        return pn.Column(self.speedup_line, *([self.controls] if self.controls is not None else []),
                         self.flex,
                         sizing_mode="stretch_width")

    def _show_speedup(self) -> None:
        if not self.live.config:
            self.speedup_line.object = "**Speedup: -** No run on screen."
            return
        speedup = self.live.speedup()
        if speedup != self._speedup_shown:
            self._speedup_shown = speedup
            measured = speedup.measured
            for plot in self.plots:
                if plot.draw == SPEEDUP and plot.name in self.figures:
                    self.figures[plot.name].show(speedup, (measured.cores if measured else 0) or self.cores)
        text = (elastic_text(self.live.buffers.workers) if self.kind.elastic
                else speedup_text(speedup, self.cores))
        if text != self.speedup_line.object:
            self.speedup_line.object = text

    def stream(self) -> int:
        """Send the rows collected since the last call to the plots; returns how many rows."""
        if self.live.generation != self._generation:
            self._new_run()
        if not self._shown:
            self._shown = True
            self._show(list(self.panes))
            self._settle = _SETTLE_FLUSHES
        if self.live.buffers.ranks != self.ranks:
            # A followed run's buffers take its ranks when its config.json is read, which can
            # come after the new run was announced: following a second 4-rank run kept the
            # 1-rank plots of the wait and failed every update, its plots empty.
            self._rebuild = self.live.buffers.ranks
        if self._rebuild is not None:
            self._build(self._rebuild)
            self._settle = _SETTLE_FLUSHES
            return 0
        if self._settle > 0:
            # A served page swaps in new plots a little later: until then, changes to their
            # bokeh models reach the browser before the models do ("reference isn't known").
            # The rows wait in the state's buffers meanwhile.
            self._settle -= 1
            return 0
        sent = 0
        for plot in self.plots:
            # A plot not drawn (not of this kind of run) leaves its rows in the buffers.
            if (plot.name in self.figures and (plot.feed is not None or plot.draw == WORKERS)
                    and (rows := rows_of(plot, self.live.buffers)) is not None):
                self.figures[plot.name].stream(rows)
                sent += len(rows)
        self._show_speedup()
        return sent
