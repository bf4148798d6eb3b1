"""The dashboard's pieces: streaming HoloViews plots, the runs table, controls, status line.

Live curves are fed by `hv.streams.Buffer`: each update sends only the new rows, which
HoloViews passes on to bokeh's `ColumnDataSource.stream` (no re-rendering of old points);
a Buffer holds at most `POINTS_PER_CURVE` rows, so the browser never holds more. One row
carries every rank's value at a step (or averaging round), so 32 ranks cost one append, not 32.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import holoviews as hv
import numpy as np
import pandas as pd
import panel as pn
import param

from dashboard.state import (POINTS_PER_CURVE, TABLE_COLUMNS, LiveRun, RunSettings, RunTable,
                             describe_config)

PLOT_HEIGHT = 225
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf")
_LEGEND_MAX_RANKS = 8  # beyond this, a legend would hide the plot


def load_backend() -> None:
    """Make bokeh HoloViews' plotting backend (no notebook output, unlike hv.extension)."""
    import holoviews.plotting.bokeh  # noqa: F401 - registers the bokeh renderer

    hv.Store.set_current_backend("bokeh")


def _plot_opts(title: str, xlabel: str, ylabel: str, **extra: Any) -> dict[str, Any]:
    return dict(title=title, xlabel=xlabel, ylabel=ylabel, responsive=True, height=PLOT_HEIGHT,
                show_grid=True, toolbar="above", **{"framewise": False, **extra})


def rank_columns(prefix: str, ranks: int) -> list[str]:
    """Column names of one quantity's per-rank values and their mean."""
    return [f"{prefix}_r{r}" for r in range(ranks)] + [f"{prefix}_mean"]


def _rank_overlay(data: pd.DataFrame, x: str, prefix: str, ranks: int, title: str,
                  xlabel: str, ylabel: str, logy: bool = False) -> hv.Overlay:
    """One thin curve per rank plus a thick black mean, all over the same streamed frame."""
    legend = ranks <= _LEGEND_MAX_RANKS
    curves = [
        hv.Curve(data, x, hv.Dimension(col, label=ylabel), label=f"rank {r}").opts(
            color=_PALETTE[r % len(_PALETTE)], line_width=1, alpha=0.7)
        for r, col in enumerate(rank_columns(prefix, ranks)[:-1])
    ]
    curves.append(hv.Curve(data, x, hv.Dimension(f"{prefix}_mean", label=ylabel), label="mean").opts(
        color="black", line_width=2.5))
    return hv.Overlay(curves).opts(
        **_plot_opts(title, xlabel, ylabel, show_legend=legend, legend_position="top_right",
                     logy=logy))


class LivePlots(param.Parameterized):
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
        self._build(live.buffers.ranks)

    def _build(self, ranks: int) -> None:
        """New Buffers and DynamicMaps for a run of `ranks` ranks."""
        self.ranks = ranks
        self._generation = self.live.generation
        self.loss_columns = ["step", *rank_columns("loss", ranks)]
        self.round_columns = ["round", *rank_columns("div", ranks), "compute_s", "comm_s", "frames_per_s"]
        self.loss_buffer = hv.streams.Buffer(pd.DataFrame({c: [] for c in self.loss_columns}, dtype=float),
                                             length=self.maxlen, index=False)
        self.round_buffer = hv.streams.Buffer(pd.DataFrame({c: [] for c in self.round_columns}, dtype=float),
                                              length=self.maxlen, index=False)
        self.cv_pipe = hv.streams.Pipe(data=pd.DataFrame({"epoch": [], "cv_acc_pct": [], "train_acc_pct": []}))

        def loss(data):
            return _rank_overlay(data, "step", "loss", ranks, "Training loss per rank",
                                 "step (minibatches)", "loss (nats/frame)")

        def divergence(data):
            return _rank_overlay(data, "round", "div", ranks, "Parameter divergence before averaging",
                                 "averaging round", "relative RMS distance")

        def times(data):
            compute = hv.Curve(data, "round", hv.Dimension("compute_s", label="seconds"), label="compute")
            comm = hv.Curve(data, "round", hv.Dimension("comm_s", label="seconds"), label="communication")
            return (compute.opts(color="#1f77b4") * comm.opts(color="#d62728")).opts(
                **_plot_opts("Compute vs comm", "averaging round",
                             "seconds per round", legend_position="top_left"))

        def fps(data):
            return hv.Curve(data, "round", hv.Dimension("frames_per_s", label="frames/s")).opts(
                color="#2ca02c", **_plot_opts("Frames/s (all ranks)", "averaging round", "frames/s"))

        def cv(data):
            acc = hv.Curve(data, "epoch", hv.Dimension("cv_acc_pct", label="frame accuracy %"), label="CV")
            train = hv.Curve(data, "epoch", hv.Dimension("train_acc_pct", label="frame accuracy %"), label="train")
            points = hv.Scatter(data, "epoch", hv.Dimension("cv_acc_pct", label="frame accuracy %"))
            # framewise: the whole frame is replaced on each epoch, so the axes must follow it.
            return (acc.opts(color="#9467bd", framewise=True) * points.opts(color="#9467bd", size=7, framewise=True)
                    * train.opts(color="#7f7f7f", line_dash="dashed", framewise=True)).opts(
                **_plot_opts("Frame accuracy", "epoch", "frame accuracy %",
                             legend_position="bottom_right", framewise=True))

        self.panes["loss"].object = hv.DynamicMap(loss, streams=[self.loss_buffer])
        self.panes["divergence"].object = hv.DynamicMap(divergence, streams=[self.round_buffer])
        self.panes["times"].object = hv.DynamicMap(times, streams=[self.round_buffer])
        self.panes["fps"].object = hv.DynamicMap(fps, streams=[self.round_buffer])
        self.panes["cv"].object = hv.DynamicMap(cv, streams=[self.cv_pipe])
        self._cv_count = 0

    def update(self) -> int:
        """Stream the rows collected since the last call; returns how many rows were sent."""
        if self.live.generation != self._generation:
            self._build(self.live.buffers.ranks)
        buffers = self.live.buffers
        sent = 0
        rows = buffers.loss.take()
        if rows:
            self.loss_buffer.send(pd.DataFrame(rows, columns=self.loss_columns))
            sent += len(rows)
        div, compute, comm, fps = (s.take() for s in (buffers.divergence, buffers.compute,
                                                       buffers.comm, buffers.fps))
        if div:
            # The four series are filled by the same events, so their rows line up.
            n = min(len(div), len(compute), len(comm), len(fps))
            block = np.empty((n, len(self.round_columns)))
            block[:, : self.ranks + 2] = np.asarray(div[:n])
            block[:, self.ranks + 2] = [row[-1] for row in compute[:n]]
            block[:, self.ranks + 3] = [row[-1] for row in comm[:n]]
            block[:, self.ranks + 4] = [np.nansum(row[1:-1]) for row in fps[:n]]
            self.round_buffer.send(pd.DataFrame(block, columns=self.round_columns))
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


class RunsView(param.Parameterized):
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


class RunControls(param.Parameterized):
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

    def buttons(self) -> pn.Column:
        """Start/Stop side by side, then the monitor-mode input."""
        return pn.Column(pn.Row(self.start_button, self.stop_button, sizing_mode="stretch_width"),
                         pn.Row(self.follow_input, self.follow_button,
                                sizing_mode="stretch_width"),
                         sizing_mode="stretch_width")

