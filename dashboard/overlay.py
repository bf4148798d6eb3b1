"""The Runs tab's overlay: mean training loss, divergence and CV accuracy of the ticked runs by
frames trained, one colour (and dash) per run, named in one legend above the three plots.

Drawn through HoloViews (a Curve per run and plot, the whole layout replaced on each tick), 16
runs took 8 s from ticking them to the painted plots at a load of 3 on 2 cores, 2.6-3 s of it
in the server and the rest in the browser building a view per glyph (benchmarks/bench_overlay.py).
So the three figures are bokeh's own, built once, with one multi-line glyph each: ticking runs
replaces the columns of their data sources (a line per run, columnar) and the legend's text.
"""

from __future__ import annotations

import html
from typing import Any

import numpy as np
import panel as pn
from bokeh.models import ColumnDataSource, HoverTool, NumeralTickFormatter
from bokeh.plotting import figure as bokeh_figure

from dashboard.plots import FLEX_ITEM, MIN_PLOT_WIDTH, PLOT_HEIGHT, _PALETTE

# A run's dash after every colour is taken: 30 runs stay apart.
_DASHES = ("solid", "dashed", "dotted")
X_LABEL = "frames trained (all ranks)"
# (key of the x values, key of the y values in RunTable.overlay's curves, title, y label)
PLOTS = {
    "loss": ("frames", "loss", "Mean training loss", "loss (nats/frame)"),
    "divergence": ("div_frames", "divergence", "Mean divergence", "relative RMS"),
    "cv": ("cv_frames", "cv_acc_pct", "CV frame accuracy", "accuracy (%)"),
}


def style_of(index: int) -> tuple[str, str]:
    """(colour, dash) of the `index`th ticked run."""
    return _PALETTE[index % len(_PALETTE)], _DASHES[(index // len(_PALETTE)) % len(_DASHES)]


def _lines(curves: dict[str, dict[str, Any]], xs: str, ys: str) -> dict[str, list]:
    """One row per run: its x and y arrays, colour, dash and legend label."""
    out: dict[str, list] = {"xs": [], "ys": [], "color": [], "dash": [], "label": []}
    for i, curve in enumerate(curves.values()):
        color, dash = style_of(i)
        out["xs"].append(np.asarray(curve[xs], dtype=float))
        out["ys"].append(np.asarray(curve[ys], dtype=float))
        out["color"].append(color)
        out["dash"].append(dash)
        out["label"].append(curve["label"])
    return out


def _points(lines: dict[str, list]) -> dict[str, Any]:
    """The lines' points, one row each (the CV plot marks its few epochs)."""
    counts = [len(x) for x in lines["xs"]]
    return {"x": np.concatenate([np.zeros(0), *lines["xs"]]),
            "y": np.concatenate([np.zeros(0), *lines["ys"]]),
            "color": np.repeat(lines["color"], counts).tolist() if counts else [],
            "label": np.repeat(lines["label"], counts).tolist() if counts else []}


def legend_html(curves: dict[str, dict[str, Any]]) -> str:
    """A line sample and the label of each run, wrapping as the page's width allows."""
    items = []
    for i, curve in enumerate(curves.values()):
        color, dash = style_of(i)
        items.append(f'<span class="run"><span class="sample" style="border-top: 3px {dash} '
                     f'{color}"></span>{html.escape(curve["label"])}</span>')
    return "".join(items)


_LEGEND_CSS = (".run { display: inline-flex; align-items: center; margin-right: 14px; "
               "white-space: nowrap; font-size: 12px; } "
               ".sample { display: inline-block; width: 22px; margin-right: 5px; }")


class RunsOverlay(pn.viewable.Viewer):
    """The three overlay plots; `show` puts the ticked runs' curves in them."""

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        empty = _lines({}, "frames", "loss")
        self.sources = {name: ColumnDataSource(dict(empty)) for name in PLOTS}
        self.points = ColumnDataSource(_points(empty))
        self.figures = {name: self._figure(name, *spec[2:]) for name, spec in PLOTS.items()}
        self.figures["cv"].scatter("x", "y", source=self.points, color="color", size=6)
        self.legend = pn.pane.HTML("", sizing_mode="stretch_width", margin=(0, 10),
                                   stylesheets=[_LEGEND_CSS])
        self.shown: list[str] = []  # the legend's labels, in order

    def _figure(self, name: str, title: str, ylabel: str):
        # No active wheel zoom: the mouse wheel over a plot scrolls the page.
        figure = bokeh_figure(title=title, x_axis_label=X_LABEL, y_axis_label=ylabel,
                              height=PLOT_HEIGHT, sizing_mode="stretch_width",
                              toolbar_location="above", active_drag="pan", active_scroll=None,
                              tools="pan,box_zoom,wheel_zoom,reset,save",
                              min_width=MIN_PLOT_WIDTH, styles=dict(FLEX_ITEM))
        lines = figure.multi_line("xs", "ys", source=self.sources[name], line_color="color",
                                  line_dash="dash", line_width=2, line_alpha=0.85)
        figure.add_tools(HoverTool(renderers=[lines], tooltips=[("run", "@label")]))
        figure.toolbar.autohide = True  # shown under the mouse: its icons covered the title
        figure.xaxis.formatter = NumeralTickFormatter(format="0.[0]a")
        figure.x_range.start = 0  # frames from 0; y follows the runs' own range (63-67 %)
        return figure

    def __panel__(self) -> pn.Column:
        """The legend, then the three plots side by side (wrapping when the page is narrow)."""
        # The figures themselves are the flex items (a Bokeh pane puts its figure in its place).
        panes = [pn.pane.Bokeh(self.figures[name], sizing_mode="stretch_width") for name in PLOTS]
        return pn.Column(self.legend, pn.FlexBox(*panes, flex_wrap="wrap", sizing_mode="stretch_width"),
                         sizing_mode="stretch_width")

    def show(self, curves: dict[str, dict[str, Any]]) -> None:
        """Draw `curves` (RunTable.overlay's: x and y lists and a label per run), replacing
        what was drawn."""
        for name, (xs, ys, _, _) in PLOTS.items():
            lines = _lines(curves, xs, ys)
            self.sources[name].data = lines
            if name == "cv":
                self.points.data = _points(lines)
        self.shown = [curve["label"] for curve in curves.values()]
        self.legend.object = legend_html(curves)
