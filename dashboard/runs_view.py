"""The Runs and Communication tabs: the runs table, its overlay, and what each finished run
sent (the Scaling tab is dashboard.scaling_view, redrawn when the table is)."""

from __future__ import annotations

import io
import json
from typing import Any

import pandas as pd
import panel as pn
from bokeh.models import NumberFormatter

from dashboard.overlay import RunsOverlay
from dashboard.plots import communication_plot, load_backend
from dashboard.runs_table import TABLE_COLUMNS, TABLE_TITLES, RunTable
from labavg.jobs.columns import Column, columns


def _number(format: str) -> NumberFormatter:
    # "-" for a run without the result yet, never "NaN".
    return NumberFormatter(format=format, nan_format="-", null_format="-", text_align="right")


def _format(column: Column) -> str:
    """A column's digits (labavg.jobs.columns) as a Bokeh number format; a percentage whose
    title does not say so is shown as one ("92%": numbro's "%" takes a fraction)."""
    if column.general:
        return "0.[00000]"
    digits = "." + "0" * column.digits if column.digits else ""
    return f"0{digits}%" if column.suffix == "%" else f"0,0{digits}"


TABLE_FORMATS = {c.key: _format(c) for c in columns(TABLE_COLUMNS)
                 if c.digits is not None or c.general}
SHOWN_AS_FRACTION = [c.key for c in columns(TABLE_COLUMNS) if c.suffix == "%"]
COUNT_COLUMNS = ("ranks", "average_every", "minibatch", "epochs", "cores")
NUMERIC_COLUMNS = (*TABLE_FORMATS, *COUNT_COLUMNS)
# Pixels: a title with its sort arrow, so that run ... speedup fit the ~970 px beside the
# sidebar at 1366 px (fit_data_table once sized "status" at 140 px and pushed CV accuracy off).
# Through "efficiency" the columns must fit the 1366 px page beside the sidebar (about 960 px).
# 13 px text (the page's is 15 px) keeps every title and run name whole at these widths.
TABLE_WIDTHS = {"run": 175, "ranks": 78, "average_every": 46, "averaging": 96, "lr": 58, "wer": 88,
                "per": 82, "cv_acc_pct": 100, "cv_loss": 90, "speedup": 100, "speedup_range": 120,
                "efficiency_pct": 106, "status": 90, "cores": 78, "speedup_note": 430}
# The measured speedup's one line (value, range, conditions, flag) wraps in its cell.
WRAPPED = {"speedup_note": {"type": "textarea"}}
_TABLE_CSS = (".tabulator, .tabulator .tabulator-header, .tabulator .tabulator-row, "
              ".tabulator .tabulator-cell, .tabulator .tabulator-col-title { font-size: 13px !important; }")
_TABLE_MAX_HEIGHT = 250


def table_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """The runs table's rows as the Tabulator shows them: numbers as numbers, None as NaN."""
    frame = pd.DataFrame(rows, columns=list(TABLE_COLUMNS))
    for column in NUMERIC_COLUMNS:
        frame[column] = pd.to_numeric(frame[column], errors="coerce").astype(float)
    for column in SHOWN_AS_FRACTION:
        frame[column] = frame[column] / 100  # the rows and the CSV hold the percentage
    return frame


class RunsView(pn.viewable.Viewer):
    """The runs table (Tabulator, checkbox selection to overlay), CSV download, scaling plots."""

    def __init__(self, table: RunTable, **params: Any) -> None:
        super().__init__(**params)
        load_backend()
        self.table = table
        formatters = {c: _number(f) for c, f in TABLE_FORMATS.items()}
        formatters.update({c: _number("0") for c in COUNT_COLUMNS}, **WRAPPED)
        self.tabulator = pn.widgets.Tabulator(
            table_frame([]), selectable="checkbox", disabled=True,
            show_index=False, sizing_mode="stretch_width", height=250, layout="fit_data_table",
            titles=TABLE_TITLES, formatters=formatters, frozen_columns=["run"], widths=TABLE_WIDTHS,
            stylesheets=[_TABLE_CSS],
        )
        pn.bind(self._on_select, self.tabulator.param.selection, watch=True)
        self._drawn = ""
        self.download = pn.widgets.FileDownload(callback=self._csv, filename="labavg-runs.csv",
                                                label="Download CSV", color="default", width=150)
        self.refresh_button = pn.widgets.Button(label="Refresh", width=100)
        self.refresh_button.on_click(lambda _: self.refresh(force=True))
        self.overlay = RunsOverlay()
        # The runs directories the scan could not read, each named, above the table they
        # are missing from (or listed in without results).
        self.problems = pn.pane.Alert("", alert_type="warning", visible=False,
                                      sizing_mode="stretch_width", margin=(0, 10))
        self.communication = pn.pane.HoloViews(communication_plot([]), sizing_mode="stretch_width")

    def __panel__(self) -> pn.Column:
        """The runs table with its buttons, and the overlay of the selected runs."""
        return pn.Column(
            pn.Row(pn.pane.Markdown("Tick runs to overlay them below; the legend names what differs "
                                    "between them.", margin=(8, 10)),
                   pn.layout.HSpacer(), self.refresh_button, self.download),
            self.problems, self.tabulator, self.overlay, sizing_mode="stretch_width",
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

    def _on_select(self, selection: list[int]) -> None:
        frame = self.tabulator.value
        self.table.selected = [frame.iloc[i]["run"] for i in selection if i < len(frame)]
        self.overlay.show(self.table.overlay())

    def _show_problems(self, problems: list[str]) -> None:
        text = "\n".join(f"- Not read: {p}" for p in problems)
        if text != self.problems.object:
            self.problems.object = text
            self.problems.visible = bool(problems)

    def refresh(self, force: bool = False) -> None:
        """Rescan the runs directory and redraw the table and the communication plots."""
        selected = list(self.table.selected)
        rows = self.table.refresh()
        self._show_problems(self.table.problems)
        # json: a NaN (a stopped run's CV) equals itself there.
        drawn = json.dumps(rows, sort_keys=True, default=str)
        if drawn == self._drawn and not force:
            return  # a rescan while a run trains finds the same rows: nothing to redraw
        self._drawn = drawn
        frame = table_frame(rows)
        self.tabulator.value = frame
        # As tall as its rows, so that the overlay below starts on screen.
        self.tabulator.height = min(_TABLE_MAX_HEIGHT, 64 + 32 * len(frame))
        names = frame["run"].tolist()
        self.tabulator.selection = [names.index(n) for n in selected if n in names]
        self.communication.object = communication_plot(self.table.communication())
