"""The dashboard's HoloViews plots: streamed live curves, the speedup plot, and the plots of
past runs (scaling, communication; the overlay is dashboard.overlay).

Live curves are HoloViews (bokeh) plots built once and then streamed: each update appends only
the new rows to bokeh's ColumnDataSources (`ColumnDataSource.stream`, rolling over at
`POINTS_PER_CURVE` points per curve), so old points are never re-sent or re-rendered. One row
carries every rank's value at a step (or averaging round), so 32 ranks cost one append, not 32.
The scaling and communication plots are redrawn when the runs table changes."""

from __future__ import annotations

from typing import Any

import holoviews as hv
# The bokeh renderer, imported with the dashboard (at the server's start) rather than during
# the first page's load, where it took seconds on a loaded machine.
import holoviews.plotting.bokeh  # noqa: F401
import numpy as np
import pandas as pd
from bokeh.models import BasicTicker, ColumnDataSource, FixedTicker, NumeralTickFormatter
from bokeh.plotting import figure as bokeh_figure

from dashboard.speedup import PREDICTED_RANKS, PREDICTION_NETWORK, RunSpeedup

# Two rows of plots and their axis labels within a 1366 x 768 screen (215 cut the bottom
# row's "epoch").
PLOT_HEIGHT = 200
# Each plot at least this wide (px), in rows that wrap: narrower (the inline dashboard beside
# JupyterLab's file browser) three plots to a row cut their titles and axis labels.
MIN_PLOT_WIDTH = 280
FLEX_ITEM = {"flex": f"1 1 {MIN_PLOT_WIDTH}px"}
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf")



def load_backend() -> None:
    """Make bokeh HoloViews' plotting backend (no notebook output, unlike hv.extension).

    Once: switching backends re-runs HoloViews' hooks (0.3 s of each page load here)."""
    if hv.Store.current_backend != "bokeh" or "bokeh" not in hv.Store.renderers:
        hv.Store.set_current_backend("bokeh")


# Legends small enough to leave a third-of-the-page plot mostly visible.
_LEGEND = {"label_text_font_size": "8pt", "glyph_height": 12, "glyph_width": 16, "spacing": 0,
           "padding": 4, "margin": 4, "background_fill_alpha": 0.7}


def _plot_opts(title: str, xlabel: str, ylabel: str, **extra: Any) -> dict[str, Any]:
    # No active wheel zoom: the mouse wheel over a plot scrolls the page (the zoom stays in
    # the toolbar, one click away).
    return dict(title=title, xlabel=xlabel, ylabel=ylabel, responsive=True, height=PLOT_HEIGHT,
                show_grid=True, toolbar="above", legend_opts=_LEGEND, active_tools=["pan"],
                hooks=[_autohide_toolbar], **{"framewise": False, **extra})


def _autohide_toolbar(plot, element) -> None:
    # Shown while the mouse is over the plot: at MIN_PLOT_WIDTH its icons covered the title.
    plot.state.toolbar.autohide = True


# What hover tooltips call the columns (not their names in the data, like mb_sent).
DIMENSIONS = {name: hv.Dimension(name, label=label) for name, label in {
    "mb_sent": "MB sent per rank", "cv_acc_pct": "CV frame accuracy (%)", "wer_pct": "WER (%)",
    "speedup": "speedup (×)", "efficiency": "efficiency (%)", "low": "lowest pair",
    "high": "highest pair", "text": "as measured",
    "run": "run", "K": "K", "ranks": "ranks"}.items()}


def _dims(*names: str) -> list[hv.Dimension]:
    return [DIMENSIONS[name] for name in names]


def count_axis() -> dict[str, Any]:
    """x-axis options for counts (steps, rounds, epochs): ticks on whole numbers only, few of
    them, and thousands as 1.2k (bokeh's default wrote colliding 1.000e+4 labels, and "0,0"
    ran "1,000" and "1,200" together on a third of the page)."""
    return {"xticks": BasicTicker(min_interval=1, num_minor_ticks=0, desired_num_ticks=5),
            "xformatter": NumeralTickFormatter(format="0.[0]a")}


def counts(figure: Any) -> None:
    """A bokeh figure's y axis for a count from 0 (workers): whole numbers only."""
    figure.yaxis.ticker = BasicTicker(min_interval=1, num_minor_ticks=0, desired_num_ticks=4)
    figure.y_range.start = 0


ACCURACY_RANGE = (0, 100)  # frame accuracy in %, on its whole scale so runs compare by eye


def rank_curves(prefix: str, ranks: int, over: bool = False) -> list[tuple[str, str, dict[str, Any]]]:
    """(column, label, style) of one thin curve per rank and a thick black mean; with `over`,
    thick rank curves under a thin dashed mean (2 ranks are as far from their average: the
    thick mean once hid both)."""
    width, mean = (2.5, {"line_width": 1.5, "line_dash": "dashed"}) if over else (1, {"line_width": 2.5})
    thin = [(f"{prefix}_r{r}", f"rank {r}", {"color": _PALETTE[r % len(_PALETTE)], "line_width": width,
                                             "alpha": 0.7}) for r in range(ranks)]
    return [*thin, (f"{prefix}_mean", "mean", {"color": "black", **mean})]


def rank_columns(prefix: str, ranks: int) -> list[str]:
    """Column names of one quantity's per-rank values and their mean."""
    return [f"{prefix}_r{r}" for r in range(ranks)] + [f"{prefix}_mean"]


class StreamedCurves:
    """Curves over one x column: a plain bokeh figure, streamed straight into its sources.

    A HoloViews Buffer/DynamicMap update re-runs the callback and rebuilds, re-styles and
    re-ranges every element: with 32 ranks (33 curves) that took 1.2-1.5 s per update, and
    0.2-0.4 s even for a 2-curve plot, on this 2-core machine (benchmarks/bench_dashboard.py).
    Even drawn once through HoloViews, four such plots were a second of each page load on a
    loaded machine. So the figure is bokeh's own: one ColumnDataSource per curve, and `stream`
    appends only the new rows (`ColumnDataSource.stream`), rolling over at `maxlen` points per
    curve; the axes follow the data in the browser (DataRange1d).
    """

    def __init__(self, x: str, curves: list[tuple[str, str, dict[str, Any]]], maxlen: int,
                 title: str, xlabel: str, ylabel: str, legend: bool = True,
                 legend_position: str = "top_right", **axis: Any) -> None:
        self.x, self.maxlen = x, maxlen
        self.columns = [x, *(column for column, _, _ in curves)]
        self.data = pd.DataFrame({c: [] for c in self.columns}, dtype=float)
        # No active wheel zoom: the mouse wheel over a plot scrolls the page.
        figure = bokeh_figure(title=title, x_axis_label=xlabel, y_axis_label=ylabel,
                              height=PLOT_HEIGHT, sizing_mode="stretch_width",
                              toolbar_location="above", active_drag="pan", active_scroll=None,
                              tools="pan,box_zoom,wheel_zoom,reset,save",
                              min_width=MIN_PLOT_WIDTH, styles=dict(FLEX_ITEM))
        figure.toolbar.autohide = True  # its icons covered the title at MIN_PLOT_WIDTH
        self.sources: dict[str, list] = {}
        self._last: dict[str, tuple[float, float]] = {}  # each curve's last point, where it goes on
        for column, label, style in curves:
            source = ColumnDataSource(self._empty(column))
            line = {("line_alpha" if k == "alpha" else k): v for k, v in style.items()}
            # Segments from each point's predecessor, not a `line` glyph: a figure put on a page
            # after it was shown came back from the browser with the Line's scalar line_color as
            # Value(...), which bokeh refuses (bokeh/bokeh#14364); in a notebook the traceback
            # stood above the dashboard. A segment's colour is a spec that takes a Value.
            figure.segment(f"{x}_from", f"{column}_from", x, column, source=source, **line,
                           **({"legend_label": label} if legend else {}))
            self.sources[column] = [source]
        if "xticks" in axis:
            figure.xaxis.ticker = axis["xticks"]
        if "xformatter" in axis:
            figure.xaxis.formatter = axis["xformatter"]
        if legend:
            figure.legend.location = legend_position
            figure.legend.update(**_LEGEND)
        self.element = figure

    def _empty(self, column: str) -> dict[str, np.ndarray]:
        return {name: np.array([], dtype=float) for name in (f"{self.x}_from", f"{column}_from", self.x, column)}

    def stream(self, rows: pd.DataFrame) -> None:
        """Append rows (columns `self.columns`) to every curve: one segment per row, from the
        curve's previous point (the first point of a curve: a segment of length 0)."""
        if not len(rows):
            return
        self.data = pd.concat([self.data, rows], ignore_index=True).iloc[-self.maxlen:]
        xs = rows[self.x].to_numpy(dtype=float)
        for column, sources in self.sources.items():
            values = rows[column].to_numpy(dtype=float)
            last_x, last_y = self._last.get(column, (xs[0], values[0]))
            self._last[column] = (xs[-1], values[-1])
            new = {f"{self.x}_from": np.concatenate([[last_x], xs[:-1]]),
                   f"{column}_from": np.concatenate([[last_y], values[:-1]]), self.x: xs, column: values}
            for source in sources:
                source.stream(new, rollover=self.maxlen)

    def clear(self) -> None:
        """Empty every curve (a new run of as many ranks reuses the plots)."""
        self.data = self.data.iloc[0:0]
        self._last = {}
        for column, sources in self.sources.items():
            for source in sources:
                source.data = self._empty(column)


class AccuracyPlot:
    """Rank 0's CV and training frame accuracy at each epoch's end, and the CV checks inside
    epochs (`cv_every`) at the epochs trained so far: a few points per run, so the whole of
    both frames goes to an `hv.streams.Pipe` on each new point (the axes follow it)."""

    COLUMNS = ("epoch", "cv_acc_pct", "train_acc_pct")
    CHECK_COLUMNS = ("epochs", "cv_check_pct")

    def __init__(self, maxlen: int = 5000) -> None:
        self.maxlen = maxlen
        self.data = pd.DataFrame({c: [] for c in self.COLUMNS}, dtype=float)
        self.checks = pd.DataFrame({c: [] for c in self.CHECK_COLUMNS}, dtype=float)
        self.pipe = hv.streams.Pipe(data=(self.data, self.checks))

        def draw(data):
            epochs, checks = data
            dim = hv.Dimension("cv_acc_pct", label="frame accuracy (%)")
            acc = hv.Curve(epochs, "epoch", dim, label="CV")
            train = hv.Curve(epochs, "epoch", hv.Dimension("train_acc_pct", label="frame accuracy (%)"),
                             label="train")
            points = hv.Scatter(epochs, "epoch", dim)
            inside = hv.Curve(checks.rename(columns={"epochs": "epoch", "cv_check_pct": "cv_acc_pct"}),
                              "epoch", dim, label="CV checks")
            # Checks start inside the first epoch: the axis then starts at 0, not at epoch 1.
            low = 0.0 if len(checks) else 0.5
            high = max(1.5, len(epochs) + 0.5, float(checks["epochs"].max()) + 0.1 if len(checks) else 0)
            # framewise: the whole frame is replaced on each epoch, so the axes must follow it.
            return (acc.opts(color="#9467bd", framewise=True)
                    * points.opts(color="#9467bd", size=7, framewise=True)
                    * inside.opts(color="#9467bd", alpha=0.6, line_width=1, framewise=True)
                    * train.opts(color="#7f7f7f", line_dash="dashed", framewise=True)).opts(
                **_plot_opts("Frame accuracy", "epoch", "frame accuracy (%)", framewise=True,
                             legend_position="top_left", ylim=ACCURACY_RANGE,
                             xlim=(low, high), **count_axis()))

        self.element = hv.DynamicMap(draw, streams=[self.pipe])

    def stream(self, rows: pd.DataFrame) -> None:
        """Add rows, of the epoch ends (epoch, CV and training accuracy in %) or of the checks
        (epochs, CV accuracy in %), and redraw."""
        if not len(rows):
            return
        if "cv_check_pct" in rows.columns:
            self.checks = pd.concat([self.checks, rows], ignore_index=True).iloc[-self.maxlen:]
        else:
            self.data = pd.concat([self.data, rows], ignore_index=True).iloc[-self.maxlen:]
        self.pipe.send((self.data, self.checks))

    def clear(self) -> None:
        """No epoch yet (a new run)."""
        self.data, self.checks = self.data.iloc[0:0], self.checks.iloc[0:0]
        self.pipe.send((self.data, self.checks))


SPEEDUP_TICKS = (0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)


class SpeedupPlot:
    """Speedup against ranks: what the cores here allow, the cost model's prediction for N
    machines, and the run's measured point with its interval (labavg.jobs.speedup).

    Drawn once per run; `show` replaces the small data sources' contents (a handful of
    points), so the page gets a few numbers per update rather than a new plot.
    """

    COLUMNS = ("bound", "predicted", "interval", "measured")

    def __init__(self) -> None:
        self.sources: dict[str, list] = {c: [] for c in self.COLUMNS}
        self.data: dict[str, tuple[list, list]] = {c: ([], []) for c in self.COLUMNS}

        def dim(column: str) -> hv.Dimension:
            return hv.Dimension(column, label="speedup")

        bound = hv.Curve(([], []), "ranks", dim("bound"), label="the cores here: min(N, cores)").opts(
            color="gray", line_dash="dashed", hooks=[self._capture])
        predicted = hv.Curve(([], []), "ranks", dim("predicted"),
                             label=f"cost model, N machines ({PREDICTION_NETWORK.name})").opts(
            color="#1f77b4", hooks=[self._capture])
        interval = hv.Curve(([], []), "ranks", dim("interval")).opts(
            color="#d62728", line_width=3, hooks=[self._capture])
        measured = hv.Scatter(([], []), "ranks", dim("measured"), label="this run (pairs' range)").opts(
            color="#d62728", size=12, marker="diamond", hooks=[self._capture])
        ticks = FixedTicker(ticks=list(SPEEDUP_TICKS))
        self.element = (bound * predicted * interval * measured).opts(
            # top left: above the diagonal, where no speedup can be (N ranks gain at most N),
            # so the legend never covers a point (bottom right covered the measured one)
            **_plot_opts("Speedup vs 1 worker", "ranks", "speedup (×)",
                         legend_position="top_left", logx=True, logy=True,
                         xlim=(0.9, 70), ylim=(0.1, 80), xticks=FixedTicker(ticks=list(PREDICTED_RANKS)),
                         yticks=ticks, yformatter=NumeralTickFormatter(format="0.[000]")))

    def _capture(self, plot, element) -> None:
        column = element.vdims[0].name
        source = plot.handles["source"]
        xs, ys = self.data[column]
        source.data = {"ranks": np.asarray(xs, dtype=float), column: np.asarray(ys, dtype=float)}
        self.sources[column].append(source)

    def show(self, speedup: RunSpeedup, cores: int) -> None:
        """Put `speedup`'s prediction and measured point, and the bound of `cores`, in the plot."""
        measured = speedup.measured
        n = measured.ranks if measured is not None else None
        values = {
            "bound": (list(PREDICTED_RANKS), [float(min(p, cores)) for p in PREDICTED_RANKS]),
            "predicted": ([p for p, _ in speedup.predicted], [v for _, v in speedup.predicted]),
            "measured": ([n], [measured.value]) if n and measured.value is not None else ([], []),
            "interval": (([n, n], [measured.low, measured.high])
                         if n and measured.value is not None and n > 1 else ([], [])),
        }
        for column, value in values.items():
            if self.data[column] == value:
                continue
            self.data[column] = value
            for source in self.sources[column]:
                source.data = {"ranks": np.asarray(value[0], dtype=float),
                               column: np.asarray(value[1], dtype=float)}


SCALING_COLUMNS = ["ranks", "speedup", "low", "high", "efficiency", "K", "run", "text"]


def scaling_plot(points: list[dict[str, Any]], cores: int,
                 predicted: list[tuple[int, float]] = ()) -> hv.Layout:
    """Measured speedup (labavg.jobs.speedup: each point with its pairs' range) and parallel
    efficiency against ranks, beside what `cores` cores allow (min(N, cores)) and the cost
    model's `predicted` speedup for N machines."""
    frame = pd.DataFrame(points, columns=SCALING_COLUMNS)
    top = max([4, *frame["ranks"].tolist()])
    xs = list(range(1, top + 1))
    ranks_axis = {"xticks": BasicTicker(min_interval=1, num_minor_ticks=0), "xlim": (0.5, top + 0.5)}
    bound = hv.Curve((xs, [float(min(x, cores)) for x in xs]), "ranks", "speedup",
                     label=f"the cores here: min(N, {cores})").opts(color="gray", line_dash="dashed")
    model = [(p, v) for p, v in predicted if p <= top]
    layers = [bound, hv.Curve(model, "ranks", "speedup",
                              label=f"cost model, N machines ({PREDICTION_NETWORK.name})").opts(
        color="#2ca02c")]
    errors = frame.assign(minus=frame["speedup"] - frame["low"], plus=frame["high"] - frame["speedup"])
    layers.append(hv.ErrorBars(errors, "ranks", ["speedup", "minus", "plus"]).opts(color="#1f77b4"))
    layers.append(hv.Scatter(frame, "ranks", _dims("speedup", "low", "high", "K", "run", "text"),
                             label="measured (pairs' range)").opts(size=9, color="#1f77b4",
                                                                   tools=["hover"]))
    ideal_eff = hv.Curve((xs, [100.0 * min(x, cores) / x for x in xs]), "ranks", "efficiency",
                         label="the cores here").opts(color="gray", line_dash="dashed")
    efficiency = hv.Scatter(frame, "ranks", _dims("efficiency", "K", "run", "text"),
                            label="measured").opts(size=9, color="#ff7f0e", tools=["hover"])
    return (
        hv.Overlay(layers).opts(**_plot_opts("Speedup vs 1 worker (paired, in each run)", "ranks",
                                             "speedup (×)", legend_position="top_left",
                                             **ranks_axis))
        + (ideal_eff * efficiency).opts(**_plot_opts("Parallel efficiency", "ranks",
                                                     "efficiency (%)",
                                                     legend_position="bottom_left", ylim=(0, 110),
                                                     **ranks_axis))
    ).opts(shared_axes=False)


_MARKERS = ("circle", "triangle", "square", "diamond", "inverted_triangle", "hex")


def communication_plot(points: list[dict[str, Any]],
                       one_rank: dict[str, float | None] | None = None) -> hv.Layout:
    """CV frame accuracy and WER of the finished multi-rank runs against the megabytes each
    rank sent (log scale): one colour per averaging method and payload, one marker per number
    of ranks; `one_rank` ({"cv_acc_pct": ..., "wer_pct": ...}) draws a 1-rank run's results as
    dashed lines, what averaging would ideally keep."""
    frame = pd.DataFrame(points, columns=["method", "payload", "ranks", "K", "mb_sent",
                                          "cv_acc_pct", "wer_pct", "run"])
    frame["payload"] = frame["payload"].fillna("fp32")
    frame["sends"] = frame["method"] + frame["payload"].map(lambda p: "" if p == "fp32" else f" {p}")
    kinds = sorted(set(frame["sends"]))
    ranks = sorted(set(frame["ranks"]))
    acc, wer = [], []
    for (sends, n), group in frame.groupby(["sends", "ranks"], sort=True):
        style = {"color": _PALETTE[kinds.index(sends) % len(_PALETTE)],
                 "marker": _MARKERS[ranks.index(n) % len(_MARKERS)], "size": 9, "tools": ["hover"]}
        label = f"{sends}, {n} ranks"
        acc.append(hv.Scatter(group, DIMENSIONS["mb_sent"], _dims("cv_acc_pct", "K", "run"),
                              label=label).opts(**style))
        decoded = group.dropna(subset=["wer_pct"])
        if len(decoded):
            wer.append(hv.Scatter(decoded, DIMENSIONS["mb_sent"], _dims("wer_pct", "K", "run"),
                                  label=label).opts(**style))
    if not acc:
        acc = [hv.Scatter([], "mb_sent", "cv_acc_pct")]
    wer_title = "WER vs bytes sent (decoded runs)"
    if not wer:
        # Said in the title: an empty plot alone reads as a broken one.
        wer = [hv.Scatter([], "mb_sent", "wer_pct")]
        wer_title = "WER: no decoded run yet"
    for layers, key in ((acc, "cv_acc_pct"), (wer, "wer_pct")):
        if one_rank and one_rank.get(key) is not None:
            layers.append(hv.HLine(one_rank[key]).opts(color="gray", line_dash="dashed"))
    x = "MB sent per rank (all rounds, log scale)"
    sent = frame["mb_sent"].astype(float)
    # Bokeh's own log ticks collide (40 50 60) or, within a decade, leave one "10^0": ticks at
    # 1-2-5 steps written as numbers, over the data's range (an empty plot's too, which bokeh
    # left at a range whose one tick sat under the legend).
    ticks = {"xticks": FixedTicker(ticks=[0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50,
                                          100, 200, 500, 1000, 2000, 5000]),
             "xformatter": NumeralTickFormatter(format="0.[00]"),
             "xlim": (float(sent.min()) / 1.5, float(sent.max()) * 1.5) if len(sent) else (0.1, 10)}
    return (
        # Legends beside the plots: the points that sent the most sit at the right edge.
        hv.Overlay(acc).opts(**_plot_opts("CV frame accuracy vs bytes sent", x, "frame accuracy (%)",
                                          logx=True, legend_position="right", **ticks))
        + hv.Overlay(wer).opts(**_plot_opts(wer_title, x, "WER (%)",
                                            logx=True, legend_position="right", **ticks))
    ).opts(shared_axes=False)
