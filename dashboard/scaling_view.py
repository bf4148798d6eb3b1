"""The Scaling tab: the measured speedup of the runs in the table, and "Measure speedup".

Every point is `labavg.jobs.speedup`'s reading of a run (the Live tab's and the Runs table's
number, with its pairs' range), beside what the cores here allow (min(N, cores)) and the cost
model's speedup for N machines. "Measure speedup" trains short runs of 2 and 4 ranks of the
current settings (`labavg.studies.speedup_study.measure_speedup`: MPI jobs, never threads of
this server) on a worker thread, and plots what they measured the same way: the thread sets
the view's state (`study_text`, `measuring`) and its plot, and Panel carries each change to
the page's document (never more than one progress line per PROGRESS_S).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import panel as pn
import param

from dashboard.plots import load_backend, scaling_plot
from dashboard.runs_table import RunTable
from dashboard.settings import RunSettings
from dashboard.speedup import (machine_cores, oversubscribed_note, prediction, speedup_point,
                               summary_costs)
from labavg.base.errors import one_line, user_error_of
from labavg.base.events import Event, MinibatchDone, RunStarted, SpeedupPair

STUDY_RANKS = (2, 4)
# A short run per number of ranks: one epoch, the pairs spread over it.
STUDY_EPOCHS = 1
PROGRESS_S = 0.5  # the study's progress line changes at most this often (it has a line a step)
_EXPLAINED = (
    "Speedup is measured inside each run of several ranks, in pairs (labavg.jobs.speedup): at a "
    "few averaging rounds rank 0 trains a few minibatches alone while the others wait, then all "
    "ranks train; each pair gives N × (time alone) / (time together) over the same frames, "
    "under the same load. A point is the median of a run's pairs, its bar their range; the Live "
    "tab and the Runs table show the same number. The dashed line is what the cores here allow, "
    "min(N, cores); the green line is the cost model's speedup for N machines of one rank each. "
    "In-process workers are threads of one process. Hover a point for its conditions.")


class ScalingView(pn.viewable.Viewer):
    """The measured speedups of the table's runs, and the "Measure speedup" study."""

    study_text = param.String(default=(
        f"**Measure speedup** trains {' and '.join(map(str, STUDY_RANKS))} MPI ranks of the "
        f"settings in the sidebar for {STUDY_EPOCHS} epoch each (a few minutes on a small "
        "model) and plots what each measured."), doc="the study's line: what it does, its progress or result")
    measuring = param.Boolean(default=False, doc="the study's runs are training")

    def __init__(self, table: RunTable, settings: RunSettings, **params: Any) -> None:
        super().__init__(**params)
        load_backend()
        self.table, self.settings = table, settings
        self.cores = machine_cores()
        self.plot = pn.pane.HoloViews(None, sizing_mode="stretch_width")  # drawn by refresh
        self.note = pn.pane.Markdown("", margin=(0, 10))
        self.measure_button = pn.widgets.Button(label="Measure speedup", width=170,
                                                disabled=self.param.measuring)
        self.measure_button.on_click(lambda _: self.measure())
        self.study_status = pn.pane.Markdown(self.param.study_text, margin=(0, 10),
                                             sizing_mode="stretch_width")
        self.study_plot = pn.pane.HoloViews(None, sizing_mode="stretch_width", visible=False)
        self._thread: threading.Thread | None = None
        self._drawn = ""
        pn.bind(lambda _: self.refresh(), table.param.rows, watch=True)

    def __panel__(self) -> pn.Column:
        """What the points mean, the runs' points, then the study."""
        return pn.Column(pn.pane.Markdown(_EXPLAINED, margin=(8, 10)), self.note, self.plot,
                         pn.Row(self.measure_button, self.study_status,
                                sizing_mode="stretch_width"),
                         self.study_plot, sizing_mode="stretch_width")

    def refresh(self) -> None:
        """Redraw the runs' points (the table has just been rescanned)."""
        points = self.table.scaling()
        predicted = self.table.predicted()
        drawn = json.dumps([points, predicted], sort_keys=True, default=str)
        if drawn == self._drawn:
            return  # the table was rescanned, its measured runs are the same
        self._drawn = drawn
        self.plot.object = scaling_plot(points, self.cores, predicted)
        notes = [n for p in points if (n := oversubscribed_note(p, dict(predicted)))]
        if not any(p["ranks"] > 1 for p in points):
            notes.insert(0, "No measured speedup yet: finish a run of 2 or more ranks (it "
                            "measures its own), or press Measure speedup below.")
        self.note.object = "  \n".join(f"_{n}_" for n in notes)

    def measure(self) -> bool:
        """Start the study on a worker thread; False (and why) when it cannot start."""
        if self.measuring:
            return False
        problem = self.settings.first_error()
        if problem is not None:
            self.study_text = f"**Cannot measure:** {problem}"
            return False
        runs_dir = Path(self.settings.runs_dir).expanduser()
        out = runs_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-speedup"
        try:
            cfg = self.settings.build(out / "base")  # each run's start_run validates it
        except Exception as exc:  # noqa: BLE001 - the form found nothing; said in the page regardless
            self.study_text = f"**Cannot measure:** {one_line(user_error_of(exc) or exc)}"
            return False
        self.measuring = True
        self.study_text = f"**Measuring in {out}: starting {STUDY_RANKS[0]} MPI ranks…**"
        self._thread = threading.Thread(target=self._study, args=(cfg, out), daemon=True,
                                        name="labavg-dashboard-speedup")
        self._thread.start()
        return True

    def _study(self, cfg: Any, out: Path) -> None:
        from labavg.studies.speedup_study import measure_speedup

        size, said = {"ranks": STUDY_RANKS[0]}, [time.monotonic()]

        def say(text: str) -> None:
            if time.monotonic() - said[0] >= PROGRESS_S:
                said[0] = time.monotonic()
                self.study_text = f"**{text}**"

        def progress(event: Event) -> None:  # typed, as measure_speedup hands them on
            if event.rank != 0:
                return
            if isinstance(event, RunStarted):
                size["ranks"] = event.size
            elif isinstance(event, SpeedupPair):
                say(f"Measuring in {out.name}: {size['ranks']} ranks, pair at step {event.step}…")
            elif isinstance(event, MinibatchDone):
                say(f"Measuring in {out.name}: {size['ranks']} ranks, step {event.step}…")

        try:
            speedups = measure_speedup(cfg, out, STUDY_RANKS, epochs=STUDY_EPOCHS,
                                       on_event=progress)
            self.show_study(out, cfg, speedups)
        except BaseException as exc:  # noqa: BLE001 - shown in the page, not lost on a thread
            self.study_text = f"**Measure speedup failed:** {one_line(user_error_of(exc) or exc)}"
        finally:
            self.measuring = False

    def show_study(self, out: Path, cfg: Any, speedups: list) -> None:
        """Plot what the study's runs measured, with the bound and the cost model's line."""
        from labavg.jobs.summary import load_summary

        k = cfg.effective_average_every()
        points = [p for s in speedups
                  if (p := speedup_point(f"{out.name}/n{s.ranks}", k, s)) is not None]
        largest = out / f"n{max(STUDY_RANKS)}"
        costs = summary_costs(load_summary(largest)) if (largest / "summary.json").is_file() else None
        predicted = prediction(costs, k)
        self.study_plot.object = scaling_plot(points, self.cores, predicted)
        self.study_plot.visible = True
        shown = dict(predicted)
        lines = [f"{p['ranks']} ranks: {p['text']}" + (
            f"; cost model for {p['ranks']} machines {shown[p['ranks']]:.1f}x"
            if p["ranks"] in shown and p["ranks"] > 1 else "") for p in points]
        self.study_text = (f"**Measured in {out.name}** (K={k}, {self.cores} cores "
                                    "here):  \n" + "  \n".join(lines))

