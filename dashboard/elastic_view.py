"""The Live tab's row for an elastic run: "Lose a worker" (with the rank it kills) and "Add a
worker", each with one line beside it: why it is off, what the last press did, or the error.

Bound to `dashboard.elastic.WorkerControls` (`pn.bind`); the row is there only while the run on
screen is elastic."""

from __future__ import annotations

from typing import Any

import panel as pn

from dashboard.elastic import WorkerControls

_LINE = {"font-size": "0.85em", "line-height": "1.25"}
_SHEET = ["p { margin: 0; }"]


def _line(text: str, why: str) -> str:
    """What the last press did, else why the button is off ('' when there is nothing to say)."""
    said = text or (f"_{why}_" if why else "")
    return said.replace("*", "\\*")


class WorkerButtons(pn.viewable.Viewer):
    """Lose a worker / Add a worker, for the elastic run on screen."""

    def __init__(self, controls: WorkerControls, **params: Any) -> None:
        super().__init__(**params)
        self.controls = c = controls
        self.lose_button = pn.widgets.Button(
            label="Lose a worker", color="warning", width=120, margin=(4, 5),
            disabled=pn.bind(lambda why, rank: bool(why) or rank is None,
                             c.param.lose_reason, c.param.rank))
        self.rank_select = pn.widgets.Select(
            label="", width=85, margin=(4, 5),
            options=pn.bind(lambda ranks: {f"rank {r}": r for r in ranks[1:]} or {"-": None},
                            c.param.workers),
            value=pn.bind(lambda rank: rank, c.param.rank),
            disabled=pn.bind(lambda why: bool(why), c.param.lose_reason))
        pn.bind(self._choose, self.rank_select.param.value, watch=True)
        self.add_button = pn.widgets.Button(
            label="Add a worker", color="success", width=120, margin=(4, 5),
            disabled=pn.bind(bool, c.param.add_reason))
        self.lose_button.on_click(lambda _: c.lose())
        self.add_button.on_click(lambda _: c.add())
        self.lose_line = pn.pane.Markdown(
            pn.bind(_line, c.param.lose_message, c.param.lose_reason),
            sizing_mode="stretch_width", min_width=150, margin=(8, 5), styles=_LINE,
            stylesheets=_SHEET, name="lose-line")
        self.add_line = pn.pane.Markdown(
            pn.bind(_line, c.param.add_message, c.param.add_reason),
            sizing_mode="stretch_width", min_width=150, margin=(8, 5), styles=_LINE,
            stylesheets=_SHEET, name="add-line")

    def _choose(self, rank: int | None) -> None:
        if rank is not None and rank in self.controls.workers:
            self.controls.rank = rank

    def __panel__(self) -> pn.Row:
        return pn.Row(self.lose_button, self.rank_select, self.lose_line, self.add_button,
                      self.add_line, visible=self.controls.param.elastic,
                      sizing_mode="stretch_width", margin=(0, 5))
