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

from dashboard.live import POINTS_PER_CURVE, LiveRun
from dashboard.runs_table import TABLE_COLUMNS, RunTable
from dashboard.settings import RunSettings, describe_config

PLOT_HEIGHT = 225
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf")
_LEGEND_MAX_RANKS = 8  # beyond this, a legend would hide the plot
_SETTLE_TICKS = 3  # updates to wait after replacing the plots before streaming into them


def load_backend() -> None:
    """Make bokeh HoloViews' plotting backend (no notebook output, unlike hv.extension)."""
    import holoviews.plotting.bokeh  # noqa: F401 - registers the bokeh renderer

    hv.Store.set_current_backend("bokeh")


def _plot_opts(title: str, xlabel: str, ylabel: str, **extra: Any) -> dict[str, Any]:
    return dict(title=title, xlabel=xlabel, ylabel=ylabel, responsive=True, height=PLOT_HEIGHT,
                show_grid=True, toolbar="above", **{"framewise": False, **extra})


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
                 legend_position: str = "top_right") -> None:
        self.x, self.maxlen = x, maxlen
        self.columns = [x, *(column for column, _, _ in curves)]
        self.data = pd.DataFrame({c: [] for c in self.columns}, dtype=float)
        self.sources: dict[str, list] = {}
        self.figures: list = []
        elements = [hv.Curve(self.data, x, hv.Dimension(column, label=ylabel), label=label).opts(
                        hooks=[self._capture], **style)
                    for column, label, style in curves]
        self.element = hv.Overlay(elements).opts(
            **_plot_opts(title, xlabel, ylabel, show_legend=legend, legend_position=legend_position))

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


class LivePlots(pn.viewable.Viewer):
    """The live plots of the run on screen; `update` streams what `LiveRun.drain` collected."""

    def __init__(self, live: LiveRun, maxlen: int = POINTS_PER_CURVE, **params: Any) -> None:
        super().__init__(**params)
        load_backend()
        self.live = live
        self.maxlen = maxlen
        names = ("loss", "divergence", "times", "fps", "cv")
        self.panes = {name: pn.pane.HoloViews(None, sizing_mode="stretch_width", height=PLOT_HEIGHT + 10,
                                              linked_axes=False)
                      for name in names}
        self._generation = -1
        self._settle = 0
        self._build(live.buffers.ranks)

    def _build(self, ranks: int) -> None:
        """New Buffers and DynamicMaps for a run of `ranks` ranks."""
        self.ranks = ranks
        self._generation = self.live.generation
        legend = ranks <= _LEGEND_MAX_RANKS
        self.loss = StreamedCurves("step", rank_curves("loss", ranks), self.maxlen, "Training loss per rank",
                                   "step (minibatches)", "loss (nats/frame)", legend)
        self.divergence = StreamedCurves("round", rank_curves("div", ranks), self.maxlen,
                                         "Parameter divergence before averaging", "averaging round",
                                         "relative RMS distance", legend)
        self.times = StreamedCurves(
            "round", [("compute_s", "compute", {"color": "#1f77b4"}), ("comm_s", "communication", {"color": "#d62728"})],
            self.maxlen, "Compute vs comm", "averaging round", "seconds per round", legend_position="top_left")
        self.fps = StreamedCurves("round", [("frames_per_s", "all ranks", {"color": "#2ca02c"})], self.maxlen,
                                  "Frames/s (all ranks)", "averaging round", "frames/s", legend=False)
        self.cv_pipe = hv.streams.Pipe(data=pd.DataFrame({"epoch": [], "cv_acc_pct": [], "train_acc_pct": []}))

        def cv(data):
            acc = hv.Curve(data, "epoch", hv.Dimension("cv_acc_pct", label="frame accuracy %"), label="CV")
            train = hv.Curve(data, "epoch", hv.Dimension("train_acc_pct", label="frame accuracy %"), label="train")
            points = hv.Scatter(data, "epoch", hv.Dimension("cv_acc_pct", label="frame accuracy %"))
            # framewise: the whole frame is replaced on each epoch, so the axes must follow it.
            return (acc.opts(color="#9467bd", framewise=True) * points.opts(color="#9467bd", size=7, framewise=True)
                    * train.opts(color="#7f7f7f", line_dash="dashed", framewise=True)).opts(
                **_plot_opts("Frame accuracy", "epoch", "frame accuracy %",
                             legend_position="bottom_right", framewise=True))

        for name in ("loss", "divergence", "times", "fps"):
            self.panes[name].object = getattr(self, name).element
        self.panes["cv"].object = hv.DynamicMap(cv, streams=[self.cv_pipe])
        self._cv_count = 0

    def __panel__(self) -> pn.Column:
        """Loss and divergence, then compute vs communication, frames/s and CV accuracy."""
        p = self.panes
        return pn.Column(
            pn.Row(p["loss"], p["divergence"], sizing_mode="stretch_width"),
            pn.Row(p["times"], p["fps"], p["cv"], sizing_mode="stretch_width"),
            sizing_mode="stretch_width",
        )

    def update(self) -> int:
        """Stream the rows collected since the last call; returns how many rows were sent."""
        if self.live.generation != self._generation:
            self._build(self.live.buffers.ranks)
            self._settle = _SETTLE_TICKS
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
            cv = np.asarray(list(buffers.cv), dtype=float).reshape(-1, 3)
            self.cv_pipe.send(pd.DataFrame({"epoch": cv[:, 0] + 1, "cv_acc_pct": 100 * cv[:, 1],
                                            "train_acc_pct": 100 * cv[:, 2]}))
            sent += len(cv)
        return sent


def scaling_plot(points: list[dict[str, Any]]) -> hv.Layout:
    """Speedup and parallel efficiency vs number of ranks of the finished runs, with the ideal."""
    frame = pd.DataFrame(points, columns=["ranks", "speedup", "efficiency", "K", "run"])
    top = max([1, *frame["ranks"].tolist()])
    xs = list(range(1, top + 1))
    ideal = hv.Curve((xs, xs), "ranks", "speedup", label="ideal").opts(color="gray", line_dash="dashed")
    speedup = hv.Scatter(frame, "ranks", ["speedup", "K", "run"], label="runs").opts(
        size=9, color="#1f77b4", tools=["hover"])
    ideal_eff = hv.Curve((xs, [1.0] * len(xs)), "ranks", "efficiency", label="ideal").opts(
        color="gray", line_dash="dashed")
    efficiency = hv.Scatter(frame, "ranks", ["efficiency", "K", "run"], label="runs").opts(
        size=9, color="#ff7f0e", tools=["hover"])
    return (
        (ideal * speedup).opts(**_plot_opts("Speedup vs 1 rank", "ranks", "speedup",
                                            legend_position="top_left"))
        + (ideal_eff * efficiency).opts(**_plot_opts("Parallel efficiency", "ranks", "speedup / ranks",
                                                     legend_position="bottom_left", ylim=(0, None)))
    ).opts(shared_axes=False)


def overlay_plot(curves: dict[str, dict[str, list[float]]]) -> hv.Layout:
    """Mean training loss and CV accuracy of the selected runs, by frames trained."""
    losses, accs = [], []
    for i, (name, c) in enumerate(curves.items()):
        color = _PALETTE[i % len(_PALETTE)]
        losses.append(hv.Curve((c["frames"], c["loss"]), "frames", "loss", label=name).opts(color=color))
        accs.append(hv.Curve((c["cv_frames"], c["cv_acc_pct"]), "frames", "cv_acc", label=name).opts(color=color)
                    * hv.Scatter((c["cv_frames"], c["cv_acc_pct"]), "frames", "cv_acc").opts(color=color, size=6))
    if not losses:
        losses = [hv.Curve([], "frames", "loss")]
        accs = [hv.Curve([], "frames", "cv_acc")]
    return (
        hv.Overlay(losses).opts(**_plot_opts("Mean training loss (selected runs)", "frames trained (all ranks)",
                                             "cross-entropy", legend_position="top_right"))
        + hv.Overlay(accs).opts(**_plot_opts("CV frame accuracy (selected runs)", "frames trained (all ranks)",
                                             "frame accuracy %", legend_position="bottom_right"))
    ).opts(shared_axes=False)


class RunsView(pn.viewable.Viewer):
    """The runs table (Tabulator, checkbox selection to overlay), CSV download, scaling plots."""

    def __init__(self, table: RunTable, **params: Any) -> None:
        super().__init__(**params)
        load_backend()
        self.table = table
        self.tabulator = pn.widgets.Tabulator(
            pd.DataFrame(columns=list(TABLE_COLUMNS)), selectable="checkbox", disabled=True,
            show_index=False, sizing_mode="stretch_width", height=250, layout="fit_data_table",
            titles={"cv_acc_pct": "cv acc %", "comm_pct": "comm %", "wall_s": "wall s"},
            formatters={c: {"type": "number", "precision": 3}
                        for c in ("cv_loss", "wall_s", "speedup", "efficiency")},
        )
        self.tabulator.param.watch(self._on_select, "selection")
        self.download = pn.widgets.FileDownload(callback=self._csv, filename="labavg-runs.csv",
                                                label="Download CSV", button_type="default", width=150)
        self.refresh_button = pn.widgets.Button(name="Refresh", width=100)
        self.refresh_button.on_click(lambda _: self.refresh())
        self.overlay = pn.pane.HoloViews(overlay_plot({}), sizing_mode="stretch_width")
        self.scaling = pn.pane.HoloViews(scaling_plot([]), sizing_mode="stretch_width")

    def __panel__(self) -> pn.Column:
        """The runs table with its buttons, and the overlay of the selected runs."""
        return pn.Column(
            pn.Row(pn.pane.Markdown("Tick runs to overlay them below.", margin=(8, 10)),
                   pn.layout.HSpacer(), self.refresh_button, self.download),
            self.tabulator, self.overlay, sizing_mode="stretch_width",
        )

    def scaling_view(self) -> pn.Column:
        """Speedup and efficiency against ranks, of the runs with a 1-rank baseline."""
        return pn.Column(
            pn.pane.Markdown("Speedup = wall time of a 1-rank run of the same configuration / "
                             "wall time with N ranks; efficiency = speedup / N.", margin=(8, 10)),
            self.scaling, sizing_mode="stretch_width",
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
        frame = pd.DataFrame(rows, columns=list(TABLE_COLUMNS))
        self.tabulator.value = frame
        names = frame["run"].tolist()
        self.tabulator.selection = [names.index(n) for n in selected if n in names]
        self.scaling.object = scaling_plot(self.table.scaling())


SETTINGS_ORDER = ("backend", "ranks", "average_every", "lr", "final_lr", "schedule", "optimizer",
                  "pretrain", "epochs", "minibatch", "context", "hidden_layers", "hidden_dim")


class SettingsPanel(pn.viewable.Viewer):
    """The controls of the next run (`RunSettings`)."""

    def __init__(self, settings: RunSettings, **params: Any) -> None:
        super().__init__(**params)
        self.settings = settings

    def __panel__(self) -> pn.Column:
        return settings_panel(self.settings)


def settings_panel(settings: RunSettings) -> pn.Column:
    """The controls, two to a row (so they fit at 1366x768), number boxes instead of sliders."""
    number = {"type": pn.widgets.IntInput}
    param_pane = pn.Param(
        settings,
        parameters=[*SETTINGS_ORDER, "data", "runs_dir"],
        widgets={
            "ranks": number, "average_every": number, "minibatch": number, "epochs": number,
            "hidden_layers": number, "hidden_dim": number, "context": number,
            "lr": {"type": pn.widgets.FloatInput, "step": 0.001, "format": "0.[00000]"},
            "final_lr": {"type": pn.widgets.FloatInput, "step": 0.0001, "format": "0.[000000]",
                         "placeholder": "0.01 × lr"},
        },
        show_name=False,
    )
    widgets = {name: param_pane.widget(name) for name in (*SETTINGS_ORDER, "data", "runs_dir")}
    for widget in widgets.values():
        widget.param.update(sizing_mode="stretch_width", margin=(2, 5))
    pairs = [pn.Row(widgets[a], widgets[b], sizing_mode="stretch_width")
             for a, b in zip(SETTINGS_ORDER[1::2], SETTINGS_ORDER[2::2])]
    return pn.Column(widgets["backend"], *pairs, widgets["data"], widgets["runs_dir"],
                     sizing_mode="stretch_width")


class RunControls(pn.viewable.Viewer):
    """Start / Stop / Follow buttons and the status and run-configuration lines."""

    def __init__(self, settings: RunSettings, live: LiveRun, **params: Any) -> None:
        super().__init__(**params)
        self.settings, self.live = settings, live
        self.start_button = pn.widgets.Button(name="Start", button_type="primary", sizing_mode="stretch_width")
        self.stop_button = pn.widgets.Button(name="Stop", button_type="danger", disabled=True,
                                             sizing_mode="stretch_width")
        self.follow_input = pn.widgets.TextInput(placeholder="run dir to follow",
                                                 sizing_mode="stretch_width")
        self.follow_button = pn.widgets.Button(name="Follow", sizing_mode="stretch_width")
        self.start_button.on_click(lambda _: self.live.start(self.settings))
        self.stop_button.on_click(lambda _: self.live.stop())
        self.follow_button.on_click(lambda _: self.live.follow(self.follow_input.value))
        self.live.param.watch(self._on_running, "running")
        self.status = pn.pane.Markdown(self._text(), sizing_mode="stretch_width", margin=(0, 10),
                                       styles={"font-size": "0.95em"})
        self.live.param.watch(lambda *_: setattr(self.status, "object", self._text()),
                              ["status", "error", "config", "run_dir", "mode"])

    def _on_running(self, event: param.parameterized.Event) -> None:
        self.start_button.disabled = event.new
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
        """Start/Stop side by side, then the monitor-mode input."""
        return pn.Column(pn.Row(self.start_button, self.stop_button, sizing_mode="stretch_width"),
                         pn.Row(self.follow_input, self.follow_button,
                                sizing_mode="stretch_width"),
                         sizing_mode="stretch_width")

