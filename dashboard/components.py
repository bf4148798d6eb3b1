"""The dashboard's pieces: streaming HoloViews plots, the runs table, controls, status line.

Live curves are HoloViews (bokeh) plots built once and then streamed: each update appends only
the new rows to bokeh's ColumnDataSources (`ColumnDataSource.stream`, rolling over at
`POINTS_PER_CURVE` points per curve), so old points are never re-sent or re-rendered. One row
carries every rank's value at a step (or averaging round), so 32 ranks cost one append, not 32.
The CV-accuracy plot (a few points per run) is fed by an `hv.streams.Pipe`; the runs overlay
and scaling plots are redrawn when the runs table changes."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import holoviews as hv
import numpy as np
import pandas as pd
import panel as pn
import param
from bokeh.models import BasicTicker, FixedTicker, NumberFormatter, NumeralTickFormatter

from dashboard.live import (
    POINTS_PER_CURVE,
    PREDICTED_RANKS,
    PREDICTION_NETWORK,
    LiveRun,
    Speedup,
)
from dashboard.runs_table import TABLE_COLUMNS, TABLE_TITLES, RunTable
from dashboard.settings import GENERAL, RunSettings, describe_config

PLOT_HEIGHT = 215
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf")
_LEGEND_MAX_RANKS = 8  # beyond this, a legend would hide the plot
_SETTLE_TICKS = 3  # updates to wait after replacing the plots before streaming into them


def load_backend() -> None:
    """Make bokeh HoloViews' plotting backend (no notebook output, unlike hv.extension)."""
    import holoviews.plotting.bokeh  # noqa: F401 - registers the bokeh renderer

    hv.Store.set_current_backend("bokeh")


# Legends small enough to leave a third-of-the-page plot mostly visible.
_LEGEND = {"label_text_font_size": "8pt", "glyph_height": 12, "glyph_width": 16, "spacing": 0,
           "padding": 4, "margin": 4, "background_fill_alpha": 0.7}


def _plot_opts(title: str, xlabel: str, ylabel: str, **extra: Any) -> dict[str, Any]:
    return dict(title=title, xlabel=xlabel, ylabel=ylabel, responsive=True, height=PLOT_HEIGHT,
                show_grid=True, toolbar="above", legend_opts=_LEGEND,
                **{"framewise": False, **extra})


def count_axis() -> dict[str, Any]:
    """x-axis options for counts (steps, rounds, epochs): ticks on whole numbers only, and
    thousands as 12,000 (bokeh's default turns them into colliding 1.000e+4 labels)."""
    return {"xticks": BasicTicker(min_interval=1, num_minor_ticks=0),
            "xformatter": NumeralTickFormatter(format="0,0")}


def frames_axis() -> dict[str, Any]:
    """x-axis options for frame counts: 500k, 1.2m, from 0 (one CV point alone would get a
    range of a few frames, ticked 6.1k 6.1k 6.1k)."""
    return {"xformatter": NumeralTickFormatter(format="0.[0]a"), "xlim": (0, None)}


ACCURACY_RANGE = (0, 100)  # frame accuracy in %, on its whole scale so runs compare by eye


def rank_curves(prefix: str, ranks: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(column, label, style) of one thin curve per rank and a thick black mean."""
    thin = [(f"{prefix}_r{r}", f"rank {r}", {"color": _PALETTE[r % len(_PALETTE)], "line_width": 1,
                                             "alpha": 0.7}) for r in range(ranks)]
    return [*thin, (f"{prefix}_mean", "mean", {"color": "black", "line_width": 2.5})]


def rank_columns(prefix: str, ranks: int) -> list[str]:
    """Column names of one quantity's per-rank values and their mean."""
    return [f"{prefix}_r{r}" for r in range(ranks)] + [f"{prefix}_mean"]


class StreamedCurves:
    """Curves over one x column: drawn once by HoloViews, then streamed straight into bokeh.

    A HoloViews Buffer/DynamicMap update re-runs the callback and rebuilds, re-styles and
    re-ranges every element: with 32 ranks (33 curves) that took 1.2-1.5 s per update, and
    0.2-0.4 s even for a 2-curve plot, on this 2-core machine (benchmarks/bench_dashboard.py).
    Here HoloViews builds the plot once; a hook keeps each curve's bokeh ColumnDataSource,
    and `stream` appends only the new rows with bokeh's `ColumnDataSource.stream` (what a
    HoloViews Buffer does in the end), rolling over at `maxlen` points per curve.
    """

    def __init__(self, x: str, curves: list[tuple[str, str, dict[str, Any]]], maxlen: int,
                 title: str, xlabel: str, ylabel: str, legend: bool = True,
                 legend_position: str = "top_right", **axis: Any) -> None:
        self.x, self.maxlen = x, maxlen
        self.columns = [x, *(column for column, _, _ in curves)]
        self.data = pd.DataFrame({c: [] for c in self.columns}, dtype=float)
        self.sources: dict[str, list] = {}
        self.figures: list = []
        elements = [hv.Curve(self.data, x, hv.Dimension(column, label=ylabel), label=label).opts(
                        hooks=[self._capture], **style)
                    for column, label, style in curves]
        self.element = hv.Overlay(elements).opts(
            **_plot_opts(title, xlabel, ylabel, show_legend=legend, legend_position=legend_position,
                         **axis))

    def _capture(self, plot, element) -> None:
        column = element.vdims[0].name
        source = plot.handles["source"]
        if all(plot.state is not f for f in self.figures):
            self.figures.append(plot.state)
        # A plot rendered after data arrived (a notebook cell shown later) starts with it.
        source.data = {self.x: self.data[self.x].to_numpy(), column: self.data[column].to_numpy()}
        self.sources.setdefault(column, []).append(source)

    def stream(self, rows: pd.DataFrame) -> None:
        """Append rows (columns `self.columns`) to every rendered curve."""
        self.data = pd.concat([self.data, rows], ignore_index=True).iloc[-self.maxlen:]
        xs = rows[self.x].to_numpy()
        for column, sources in self.sources.items():
            values = rows[column].to_numpy()
            for source in sources:
                source.stream({self.x: xs, column: values}, rollover=self.maxlen)
        self._fit_ranges()

    def clear(self) -> None:
        """Empty every curve (a new run of as many ranks reuses the plots)."""
        self.data = self.data.iloc[0:0]
        for column, sources in self.sources.items():
            for source in sources:
                source.data = {self.x: np.array([], dtype=float), column: np.array([], dtype=float)}

    def _fit_ranges(self) -> None:
        """Fit the axes to the data held (the plot's ranges were fixed when it was empty)."""
        x = self.data[self.x].to_numpy()
        y = self.data[self.columns[1:]].to_numpy()
        if not np.isfinite(y).any():
            return
        x0, x1 = float(np.nanmin(x)), float(np.nanmax(x))
        y0, y1 = float(np.nanmin(y)), float(np.nanmax(y))
        pad = 0.05 * (y1 - y0) or 0.5 * abs(y1) or 1.0
        for figure in self.figures:
            figure.x_range.update(start=x0, end=x1 if x1 > x0 else x0 + 1)
            figure.y_range.update(start=y0 - pad, end=y1 + pad)


SPEEDUP_TICKS = (0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)


class SpeedupPlot:
    """Speedup against ranks: the ideal, the cost model's prediction and the run's own point.

    Drawn once per run; `show` replaces the two small data sources' contents (a handful of
    points), so the page gets a few numbers per update rather than a new plot.
    """

    def __init__(self) -> None:
        self.sources: dict[str, list] = {"predicted": [], "measured": []}
        self.figures: list = []
        self.data = {"predicted": ([], []), "measured": ([], [])}
        xs = list(PREDICTED_RANKS)
        ideal = hv.Curve((xs, xs), "ranks", "speedup", label="ideal").opts(
            color="gray", line_dash="dashed")
        predicted = hv.Curve(([], []), "ranks", hv.Dimension("predicted", label="speedup"),
                             label=f"cost model, {PREDICTION_NETWORK.name}").opts(
            color="#1f77b4", hooks=[self._capture])
        predicted_points = hv.Scatter(([], []), "ranks", hv.Dimension("predicted", label="speedup")).opts(
            color="#1f77b4", size=5, hooks=[self._capture])
        measured = hv.Scatter(([], []), "ranks", hv.Dimension("measured", label="speedup"),
                              label="this run").opts(color="#d62728", size=12, marker="diamond",
                                                     hooks=[self._capture])
        ticks = FixedTicker(ticks=list(SPEEDUP_TICKS))
        self.element = (ideal * predicted * predicted_points * measured).opts(
            **_plot_opts("Speedup vs 1 rank", "ranks", "speedup (×)",
                         legend_position="bottom_right", logx=True, logy=True,
                         xlim=(0.9, 70), ylim=(0.1, 80), xticks=FixedTicker(ticks=list(PREDICTED_RANKS)),
                         yticks=ticks, yformatter=NumeralTickFormatter(format="0.[000]")))

    def _capture(self, plot, element) -> None:
        column = element.vdims[0].name
        source = plot.handles["source"]
        xs, ys = self.data[column]
        source.data = {"ranks": np.asarray(xs, dtype=float), column: np.asarray(ys, dtype=float)}
        self.sources[column].append(source)

    def show(self, speedup: Speedup) -> None:
        """Put the prediction and the measured point of `speedup` into the plot."""
        predicted = ([p for p, _ in speedup.predicted], [v for _, v in speedup.predicted])
        measured = (([speedup.ranks], [speedup.speedup]) if speedup.speedup is not None
                    else ([], []))
        for column, value in (("predicted", predicted), ("measured", measured)):
            if self.data[column] == value:
                continue
            self.data[column] = value
            for source in self.sources[column]:
                source.data = {"ranks": np.asarray(value[0], dtype=float),
                               column: np.asarray(value[1], dtype=float)}


def speedup_text(speedup: Speedup, summary: dict[str, Any] | None = None) -> str:
    """One or two lines on the Live tab: the speedup as measured so far and the prediction."""
    if speedup.speedup is not None:
        head = (f"**Speedup {speedup.speedup:.2f}×, efficiency {100 * speedup.efficiency:.0f} %** "
                f"— {speedup.frames_per_second:,.0f} frames/s on {speedup.ranks} ranks vs "
                f"{speedup.baseline_frames_per_second:,.0f} on 1-rank run `{speedup.baseline_name}` "
                "(training time; any K, lr, epochs).")
    elif speedup.note:
        head = f"**Speedup: -** {speedup.note}"
    else:
        head = "**Speedup: -**"
    more = []
    predicted = dict(speedup.predicted)
    if predicted:
        shown = ", ".join(f"{predicted[p]:.1f}× at {p}" for p in (8, 32) if p in predicted)
        more.append(f"Cost model ({PREDICTION_NETWORK.name}, a rank per machine, K={speedup.K}, "
                    f"{speedup.predicted_from}'s costs): {shown} ranks.")
    if summary and summary.get("speedup") is not None:
        more.append(f"Wall time with start-up and CV (labavg info): {summary['speedup']:.2f}×.")
    if more:
        head += "  \n" + " ".join(more)
    return head


class LivePlots(pn.viewable.Viewer):
    """The live plots of the run on screen; `update` streams what `LiveRun.drain` collected."""

    def __init__(self, live: LiveRun, maxlen: int = POINTS_PER_CURVE, **params: Any) -> None:
        super().__init__(**params)
        load_backend()
        self.live = live
        self.maxlen = maxlen
        names = ("loss", "divergence", "speedup", "times", "fps", "cv")
        self.panes = {name: pn.pane.HoloViews(None, sizing_mode="stretch_width", height=PLOT_HEIGHT + 10,
                                              linked_axes=False)
                      for name in names}
        self.speedup_line = pn.pane.Markdown("", sizing_mode="stretch_width", margin=(0, 10),
                                             styles={"font-size": "0.9em"})
        self._generation = -1
        self._settle = 0
        self._build(live.buffers.ranks)
        # The old run's curves go the moment a new run replaces it, not at the next update.
        live.param.watch(lambda _: self._new_run(), "generation")
        self._show_speedup()

    def _new_run(self) -> None:
        if self.live.generation == self._generation:
            return
        if self.live.buffers.ranks == self.ranks:
            self._generation = self.live.generation
            self._clear()
        else:
            self._build(self.live.buffers.ranks)
            self._settle = _SETTLE_TICKS
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
        """New plots for a run of `ranks` ranks."""
        self.ranks = ranks
        self._generation = self.live.generation
        legend = ranks <= _LEGEND_MAX_RANKS
        self.loss = StreamedCurves("step", rank_curves("loss", ranks), self.maxlen, "Training loss per rank",
                                   "step (minibatches)", "loss (nats/frame)", legend, **count_axis())
        self.divergence = StreamedCurves("round", rank_curves("div", ranks), self.maxlen,
                                         "Divergence per rank", "averaging round",
                                         "relative RMS distance", legend, **count_axis())
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

        for name in ("loss", "divergence", "times", "fps", "speedup"):
            self.panes[name].object = getattr(self, name).element
        self.panes["cv"].object = hv.DynamicMap(cv, streams=[self.cv_pipe])
        self._cv_count = 0
        self._speedup_shown: Speedup | None = None

    def __panel__(self) -> pn.Column:
        """The speedup line; loss, divergence and speedup; compute vs comm, frames/s, accuracy."""
        p = self.panes
        return pn.Column(
            self.speedup_line,
            pn.Row(p["loss"], p["divergence"], p["speedup"], sizing_mode="stretch_width"),
            pn.Row(p["times"], p["fps"], p["cv"], sizing_mode="stretch_width"),
            sizing_mode="stretch_width",
        )

    def _show_speedup(self) -> None:
        if not self.live.config:
            self.speedup_line.object = "**Speedup: -** No run on screen."
            return
        speedup = self.live.speedup()
        if speedup != self._speedup_shown:
            self._speedup_shown = speedup
            self.speedup.show(speedup)
        text = speedup_text(speedup, self.live.summary)
        if text != self.speedup_line.object:
            self.speedup_line.object = text

    def update(self) -> int:
        """Stream the rows collected since the last call; returns how many rows were sent."""
        if self.live.generation != self._generation:
            self._new_run()
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


def scaling_plot(points: list[dict[str, Any]]) -> hv.Layout:
    """Speedup and parallel efficiency vs number of ranks of the finished runs, with the ideal."""
    frame = pd.DataFrame(points, columns=["ranks", "speedup", "efficiency", "K", "run"])
    top = max([2, *frame["ranks"].tolist()])
    xs = list(range(1, top + 1))
    ranks_axis = {"xticks": BasicTicker(min_interval=1, num_minor_ticks=0), "xlim": (0.5, top + 0.5)}
    ideal = hv.Curve((xs, xs), "ranks", "speedup", label="ideal").opts(color="gray", line_dash="dashed")
    speedup = hv.Scatter(frame, "ranks", ["speedup", "K", "run"], label="runs").opts(
        size=9, color="#1f77b4", tools=["hover"])
    ideal_eff = hv.Curve((xs, [100.0] * len(xs)), "ranks", "efficiency", label="ideal").opts(
        color="gray", line_dash="dashed")
    efficiency = hv.Scatter(frame.assign(efficiency=100 * frame["efficiency"].astype(float)), "ranks",
                            ["efficiency", "K", "run"], label="runs").opts(
        size=9, color="#ff7f0e", tools=["hover"])
    return (
        (ideal * speedup).opts(**_plot_opts("Speedup vs 1 rank (wall time)", "ranks",
                                            "speedup (x faster than 1 rank)",
                                            legend_position="top_left", **ranks_axis))
        + (ideal_eff * efficiency).opts(**_plot_opts("Parallel efficiency", "ranks",
                                                     "efficiency (% of ideal)",
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
        acc.append(hv.Scatter(group, "mb_sent", ["cv_acc_pct", "K", "run"], label=label).opts(**style))
        decoded = group.dropna(subset=["wer_pct"])
        if len(decoded):
            wer.append(hv.Scatter(decoded, "mb_sent", ["wer_pct", "K", "run"], label=label).opts(**style))
    if not acc:
        acc = [hv.Scatter([], "mb_sent", "cv_acc_pct")]
    if not wer:
        wer = [hv.Scatter([], "mb_sent", "wer_pct")]
    for layers, key in ((acc, "cv_acc_pct"), (wer, "wer_pct")):
        if one_rank and one_rank.get(key) is not None:
            layers.append(hv.HLine(one_rank[key]).opts(color="gray", line_dash="dashed"))
    x = "MB sent per rank (all rounds, log scale)"
    ticks = {"xticks": FixedTicker(ticks=[0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500,
                                          1000])}  # bokeh's own log ticks collide (40 50 60)
    return (
        # Legends beside the plots: the points that sent the most sit at the right edge.
        hv.Overlay(acc).opts(**_plot_opts("CV frame accuracy vs bytes sent", x, "frame accuracy (%)",
                                          logx=True, legend_position="right", **ticks))
        + hv.Overlay(wer).opts(**_plot_opts("WER vs bytes sent (decoded runs)", x, "WER (%)",
                                            logx=True, legend_position="right", **ticks))
    ).opts(shared_axes=False)


def overlay_plot(curves: dict[str, dict[str, Any]]) -> hv.Layout:
    """Mean training loss, divergence and CV accuracy of the selected runs, by frames trained;
    each run's legend names what sets it apart from the others (`RunTable.overlay`)."""
    losses, divs, accs = [], [], []
    for i, (name, c) in enumerate(curves.items()):
        color = _PALETTE[i % len(_PALETTE)]
        label = c.get("label", name)
        losses.append(hv.Curve((c["frames"], c["loss"]), "frames", "loss", label=label).opts(color=color))
        divs.append(hv.Curve((c["div_frames"], c["divergence"]), "frames", "divergence",
                             label=label).opts(color=color))
        accs.append(hv.Curve((c["cv_frames"], c["cv_acc_pct"]), "frames", "cv_acc", label=label).opts(color=color)
                    * hv.Scatter((c["cv_frames"], c["cv_acc_pct"]), "frames", "cv_acc").opts(color=color, size=6))
    if not losses:
        losses = [hv.Curve([], "frames", "loss")]
        divs = [hv.Curve([], "frames", "divergence")]
        accs = [hv.Curve([], "frames", "cv_acc")]
    x = "frames trained (all ranks)"
    return (
        hv.Overlay(losses).opts(**_plot_opts("Mean training loss", x, "loss (nats/frame)",
                                             legend_position="top_right", **frames_axis()))
        + hv.Overlay(divs).opts(**_plot_opts("Divergence (mean of ranks)", x,
                                             "relative RMS distance", legend_position="top_right",
                                             **frames_axis()))
        + hv.Overlay(accs).opts(**_plot_opts("CV frame accuracy", x, "frame accuracy (%)",
                                             legend_position="top_left", ylim=ACCURACY_RANGE,
                                             **frames_axis()))
    ).opts(shared_axes=False).cols(3)


def _number(format: str) -> NumberFormatter:
    # "-" for a run without the result yet, never "NaN".
    return NumberFormatter(format=format, nan_format="-", null_format="-", text_align="right")


TABLE_FORMATS = {"lr": "0.[00000]", "wer_pct": "0.00", "per_pct": "0.00", "cv_acc_pct": "0.00",
                 "cv_loss": "0.000", "speedup": "0.00", "efficiency": "0%", "wall_s": "0.0",
                 "comm_pct": "0.0", "mb_sent": "0,0.0"}
NUMERIC_COLUMNS = (*TABLE_FORMATS, "ranks", "K", "minibatch", "epochs")
# Pixels: a title with its sort arrow, so that run ... speedup fit the ~970 px beside the
# sidebar at 1366 px (fit_data_table once sized "status" at 140 px and pushed CV accuracy off).
# Through "efficiency" the columns must fit the 1366 px page beside the sidebar (about 960 px).
# 13 px text (the page's is 15 px) keeps every title and run name whole at these widths.
TABLE_WIDTHS = {"run": 166, "ranks": 78, "K": 46, "method": 96, "lr": 58, "wer_pct": 88, "per_pct": 82,
                "cv_acc_pct": 100, "cv_loss": 90, "speedup": 100, "efficiency": 106, "status": 90}
_TABLE_CSS = (".tabulator, .tabulator .tabulator-header, .tabulator .tabulator-row, "
              ".tabulator .tabulator-cell, .tabulator .tabulator-col-title { font-size: 13px !important; }")
_TABLE_MAX_HEIGHT = 250


def table_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """The runs table's rows as the Tabulator shows them: numbers as numbers, None as NaN."""
    frame = pd.DataFrame(rows, columns=list(TABLE_COLUMNS))
    for column in NUMERIC_COLUMNS:
        frame[column] = pd.to_numeric(frame[column], errors="coerce").astype(float)
    return frame


class RunsView(pn.viewable.Viewer):
    """The runs table (Tabulator, checkbox selection to overlay), CSV download, scaling plots."""

    def __init__(self, table: RunTable, **params: Any) -> None:
        super().__init__(**params)
        load_backend()
        self.table = table
        formatters = {c: _number(f) for c, f in TABLE_FORMATS.items()}
        formatters.update({c: _number("0") for c in ("ranks", "K", "minibatch", "epochs")})
        self.tabulator = pn.widgets.Tabulator(
            table_frame([]), selectable="checkbox", disabled=True,
            show_index=False, sizing_mode="stretch_width", height=250, layout="fit_data_table",
            titles=TABLE_TITLES, formatters=formatters, frozen_columns=["run"], widths=TABLE_WIDTHS,
            stylesheets=[_TABLE_CSS],
        )
        self.tabulator.param.watch(self._on_select, "selection")
        self.download = pn.widgets.FileDownload(callback=self._csv, filename="labavg-runs.csv",
                                                label="Download CSV", color="default", width=150)
        self.refresh_button = pn.widgets.Button(label="Refresh", width=100)
        self.refresh_button.on_click(lambda _: self.refresh())
        self.overlay = pn.pane.HoloViews(overlay_plot({}), sizing_mode="stretch_width")
        self.scaling = pn.pane.HoloViews(scaling_plot([]), sizing_mode="stretch_width")
        self.scaling_note = pn.pane.Markdown("", margin=(0, 10))
        self.communication = pn.pane.HoloViews(communication_plot([]), sizing_mode="stretch_width")

    def __panel__(self) -> pn.Column:
        """The runs table with its buttons, and the overlay of the selected runs."""
        return pn.Column(
            pn.Row(pn.pane.Markdown("Tick runs to overlay them below; legends name what differs "
                                    "between them.", margin=(8, 10)),
                   pn.layout.HSpacer(), self.refresh_button, self.download),
            self.tabulator, self.overlay, sizing_mode="stretch_width",
        )

    def scaling_view(self) -> pn.Column:
        """Speedup and efficiency against ranks, of the runs with a 1-rank baseline."""
        return pn.Column(
            pn.pane.Markdown("Speedup = wall time of a 1-rank run of the same model and data (any "
                             "K) / wall time with N ranks, start-up and CV included, as `labavg "
                             "info` shows it; efficiency = speedup / N.", margin=(8, 10)),
            self.scaling_note, self.scaling, sizing_mode="stretch_width",
        )

    def communication_view(self) -> pn.Column:
        """Accuracy and WER against bytes sent, by averaging method and ranks."""
        return pn.Column(
            pn.pane.Markdown("What each finished multi-rank run bought with what it sent: bytes "
                             "per rank over all averaging rounds (4 bytes per parameter per round "
                             "for fp32). Hover a point for its run and K.", margin=(8, 10)),
            self.communication, sizing_mode="stretch_width",
        )

    def _csv(self) -> io.StringIO:
        return io.StringIO(self.table.to_csv())

    def _on_select(self, event: param.parameterized.Event) -> None:
        frame = self.tabulator.value
        self.table.selected = [frame.iloc[i]["run"] for i in event.new if i < len(frame)]
        self.overlay.object = overlay_plot(self.table.overlay())

    def refresh(self) -> None:
        """Rescan the runs directory and redraw the table and the scaling plots."""
        selected = list(self.table.selected)
        rows = self.table.refresh()
        frame = table_frame(rows)
        self.tabulator.value = frame
        # As tall as its rows, so that the overlay below starts on screen.
        self.tabulator.height = min(_TABLE_MAX_HEIGHT, 64 + 32 * len(frame))
        names = frame["run"].tolist()
        self.tabulator.selection = [names.index(n) for n in selected if n in names]
        points = self.table.scaling()
        self.scaling.object = scaling_plot(points)
        self.communication.object = communication_plot(self.table.communication())
        finished = [r for r in rows if r["status"] == "finished"]
        if not any(r["ranks"] == 1 for r in finished):
            note = ("_No point yet: no finished 1-rank run in this runs directory. Run one with "
                    "ranks = 1 and the same settings (any K); every run of that model and data "
                    "then gets its speedup._")
        elif len(points) <= sum(r["ranks"] == 1 for r in finished):
            note = ("_No multi-rank run pairs with a 1-rank run yet: they must differ only in "
                    "ranks, K, backend or logging._")
        else:
            note = ""
        self.scaling_note.object = note


SETTINGS_ORDER = ("backend", "ranks", "average_every", "averaging", "momentum", "reduce",
                  "payload", "payload_bits", "lr", "final_lr", "schedule", "optimizer", "pretrain",
                  "epochs", "minibatch", "context", "hidden_layers", "hidden_dim")
_ERROR_STYLE = {"color": "#b00020", "font-size": "0.85em", "line-height": "1.25"}
# Markdown's paragraph margins would leave a blank line under every message.
_ERROR_SHEET = ["p { margin: 0; }"]


class SettingsPanel(pn.viewable.Viewer):
    """The controls of the next run (`RunSettings`)."""

    def __init__(self, settings: RunSettings, **params: Any) -> None:
        super().__init__(**params)
        self.settings = settings

    def __panel__(self) -> pn.Column:
        return settings_panel(self.settings)


def _widget_type(parameter: param.Parameter) -> type:
    if isinstance(parameter, param.Selector):
        return pn.widgets.Select
    if isinstance(parameter, param.Integer):
        return pn.widgets.IntInput
    if isinstance(parameter, param.Number):
        return pn.widgets.FloatInput
    return pn.widgets.TextInput


def settings_panel(settings: RunSettings) -> pn.Column:
    """The controls, two to a row (so they fit at 1366x768), number boxes instead of sliders;
    under each, what is wrong with its value (RunSettings.errors), shown only when something is."""
    names = ("preset", *SETTINGS_ORDER, "data", "runs_dir")
    # Number boxes instead of sliders, with steps and formats that suit each setting.
    options = {
        "momentum": {"step": 0.05, "format": "0.[0000]"},
        "lr": {"step": 0.001, "format": "0.[00000]"},
        "final_lr": {"step": 0.0001, "format": "0.[000000]", "placeholder": "0.01 × lr"},
    }
    # Widget.from_param links both ways: a preset that sets a parameter shows in its box.
    # (pn.Param(...).widget(name) makes a fresh widget that follows the box, not the parameter.)
    widgets = {name: _widget_type(settings.param[name]).from_param(
        settings.param[name], **options.get(name, {})) for name in names}
    for name in ("data", "runs_dir"):
        # Checked as typed: a path is judged on each keystroke, not when the box loses focus.
        widgets[name].param.watch(lambda e, name=name: setattr(settings, name, e.new), "value_input")
    messages = {name: pn.pane.Markdown("", visible=False, sizing_mode="stretch_width",
                                       margin=(0, 8, 4, 8), styles=_ERROR_STYLE,
                                       stylesheets=_ERROR_SHEET, css_classes=["labavg-error"],
                                       name=f"error-{name}")
                for name in names}

    def show(errors: dict[str, str]) -> None:
        for name, pane in messages.items():
            text = errors.get(name, "")
            pane.param.update(object=text.replace("*", "\\*").replace("_", "\\_"), visible=bool(text))

    settings.param.watch(lambda e: show(e.new), "errors")
    show(settings.errors)

    def enable(*_: Any) -> None:
        # A box the chosen method or payload has no use for is greyed out, not hidden.
        for name in ("momentum", "payload_bits"):
            widgets[name].disabled = settings.key_of(name) is None

    settings.param.watch(enable, ["averaging", "payload"])
    enable()

    def cell(name: str) -> pn.Column:
        widgets[name].param.update(sizing_mode="stretch_width", margin=(2, 5))
        return pn.Column(widgets[name], messages[name], sizing_mode="stretch_width", margin=0)

    names_in_rows = ("preset", *SETTINGS_ORDER)
    pairs = [pn.Row(*map(cell, names_in_rows[i:i + 2]), sizing_mode="stretch_width")
             for i in range(0, len(names_in_rows), 2)]
    return pn.Column(*pairs, cell("data"), cell("runs_dir"), sizing_mode="stretch_width")


class RunControls(pn.viewable.Viewer):
    """Start / Stop / Follow buttons and the status and run-configuration lines."""

    def __init__(self, settings: RunSettings, live: LiveRun, **params: Any) -> None:
        super().__init__(**params)
        self.settings, self.live = settings, live
        self.start_button = pn.widgets.Button(label="Start", color="primary", sizing_mode="stretch_width")
        self.stop_button = pn.widgets.Button(label="Stop", color="danger", disabled=True,
                                             sizing_mode="stretch_width")
        self.follow_input = pn.widgets.TextInput(placeholder="run dir to follow",
                                                 sizing_mode="stretch_width")
        self.follow_button = pn.widgets.Button(label="Follow", sizing_mode="stretch_width")
        self.start_button.on_click(lambda _: self.live.start(self.settings))
        self.stop_button.on_click(lambda _: self.live.stop())
        self.follow_button.on_click(lambda _: self.live.follow(self.follow_input.value))
        self.live.param.watch(self._on_running, "running")
        self.problem = pn.pane.Markdown("", visible=False, sizing_mode="stretch_width",
                                        margin=(0, 8), styles=_ERROR_STYLE, stylesheets=_ERROR_SHEET,
                                        css_classes=["labavg-error"])
        self.settings.param.watch(lambda _: self._enable(), "errors")
        self._enable()
        self.status = pn.pane.Markdown(self._text(), sizing_mode="stretch_width", margin=(0, 10),
                                       styles={"font-size": "0.95em"})
        self.live.param.watch(lambda *_: setattr(self.status, "object", self._text()),
                              ["status", "error", "config", "run_dir", "mode"])

    def _enable(self) -> None:
        errors = self.settings.errors
        # Start stays off while any setting is wrong: a run never starts with a value the
        # page shows as refused (or with the value it had before).
        self.start_button.disabled = self.live.running or bool(errors)
        if errors:
            general = errors.get(GENERAL)
            text = general or (f"Fix {len(errors)} setting{'s' if len(errors) > 1 else ''} "
                               "marked below to start.")
        else:
            text = ""
        self.problem.param.update(object=text.replace("_", "\\_"), visible=bool(text))

    def _on_running(self, event: param.parameterized.Event) -> None:
        self._enable()
        self.follow_button.disabled = event.new
        self.stop_button.disabled = not event.new

    def _text(self) -> str:
        """The status line, then what the run on screen is (not what the settings say)."""
        icon = {"live": "▶", "monitor": "👁", "idle": "■"}[self.live.mode]
        if not self.live.config:
            on_screen = "No run on screen."
        else:
            on_screen = f"On screen: `{Path(self.live.run_dir).name}` — {describe_config(self.live.config)}."
        return f"**{icon} {self.live.status}**  \n{on_screen} _Settings changes apply to the next run._"

    def status_view(self) -> pn.pane.Markdown:
        """The status line and what the run on screen is, kept up to date."""
        return self.status

    def __panel__(self) -> pn.Column:
        """Start/Stop side by side, why Start is off, then the monitor-mode input."""
        return pn.Column(pn.Row(self.start_button, self.stop_button, sizing_mode="stretch_width"),
                         self.problem,
                         pn.Row(self.follow_input, self.follow_button,
                                sizing_mode="stretch_width"),
                         sizing_mode="stretch_width")

