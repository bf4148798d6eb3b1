"""The past runs: the runs index of a runs directory as the dashboard's table, overlays, CSV."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

import numpy as np
import param

from dashboard.speedup import (PREDICTED_RANKS, prediction, scaling_point, speedup_note,
                               summary_costs)
from labavg.jobs.columns import columns, csv_row
from labavg.base.events import Averaged, EpochDone, MinibatchDone
from labavg.jobs.index import EVENTS, differing_labels, list_runs, read_run_events
from labavg.jobs.summary import run_row
from labavg.jobs.run_json import RunSummary
from labavg.training.config import TrainConfig

# Results come right after what the runs vary (ranks, K, lr), so that they are on screen at
# 1366 px without scrolling sideways; the rest of the settings follow. Titles, units and
# digits are labavg.jobs.columns'; the rows and the CSV hold each value in its column's unit
# (efficiency in %, as the table shows it).
TABLE_COLUMNS = ("run", "ranks", "average_every", "averaging", "lr", "wer", "per", "cv_acc_pct",
                 "speedup", "efficiency_pct", "speedup_note", "status", "cores", "speedup_range",
                 "cv_loss", "mb_sent", "payload", "optimizer", "model", "wall_seconds",
                 "comm_pct", "reduce", "backend", "schedule", "pretrain", "minibatch", "epochs")
TABLE_TITLES = {c.key: c.title for c in columns(TABLE_COLUMNS)}


def table_row(row: dict[str, Any], summary: RunSummary | None) -> dict[str, Any]:
    """The dashboard's columns of a `labavg.jobs.summary.run_row`, with the measured speedup's
    line as every screen writes it (`dashboard.speedup.shown_text`)."""
    return csv_row(TABLE_COLUMNS, {**row, "speedup_note": speedup_note(summary)})


def run_curve(events: Any, scale: int) -> dict[str, list[float]]:
    """A run's overlay curves from its events: mean training loss and mean divergence before
    averaging over the ranks, by frames over all ranks (`scale` = minibatch x ranks), and
    rank 0's CV frame accuracy (%) at each epoch's end."""
    sums: dict[int, list[float]] = {}
    divs: dict[int, list[float]] = {}
    cv_x, cv_y = [], []
    for event in events:
        if isinstance(event, MinibatchDone):
            sums.setdefault(event.step, []).append(event.loss)
        elif isinstance(event, Averaged):
            divs.setdefault(event.step, []).append(event.divergence)
        elif isinstance(event, EpochDone) and event.rank == 0:
            cv_x.append(event.step * scale)
            cv_y.append(100 * event.cv_frame_accuracy)
    steps, rounds = sorted(sums), sorted(divs)
    return {"frames": [s * scale for s in steps],
            "loss": [float(np.mean(sums[s])) for s in steps],
            "div_frames": [s * scale for s in rounds],
            "divergence": [float(np.mean(divs[s])) for s in rounds],
            "cv_frames": cv_x, "cv_acc_pct": cv_y}


class RunTable(param.Parameterized):
    """The runs under `runs_dir`: one row each (config + summary), overlay selection, CSV."""

    runs_dir = param.String(default="runs")
    rows = param.List(default=[], doc="one dict per run, TABLE_COLUMNS keys, oldest first")
    selected = param.List(default=[], doc="names of the runs to overlay")
    problems = param.List(default=[], doc="one line per run directory not read in full, "
                          "naming the file (a run from an older labavg, a damaged file)")

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self._configs: dict[str, TrainConfig] = {}
        self._points: list[dict[str, Any]] = []
        self._predicted: list[tuple[int, float]] = []
        self._curves: dict[str, tuple[tuple[int, int], dict[str, list[float]]]] = {}

    def refresh(self) -> list[dict[str, Any]]:
        """Rescan runs_dir; returns the rows (runs without config.json are not runs yet)."""
        problems: list[str] = []
        records = list_runs(Path(self.runs_dir), problems)
        self.problems = problems
        rows = [table_row(run_row(r.name, r.config, r.summary), r.summary) for r in records]
        self._points, newest = [], None
        for record, row in zip(records, rows):
            point = (scaling_point(record.name, row["average_every"], record.summary)
                     if row["status"] == "finished" else None)
            if point is not None:
                self._points.append(point)
                newest = (record.summary, row["average_every"])
        # The newest measured run's own costs are what the cost model scales up, to every
        # number of ranks measured (an oversubscribed run's N machines among them).
        ranks = (*PREDICTED_RANKS, *(p["ranks"] for p in self._points))
        self._predicted = prediction(summary_costs(newest[0]), newest[1], ranks) if newest else []
        configs = {r.name: r.config for r in records}
        self._configs = configs
        root = Path(self.runs_dir).expanduser()
        kept = {str(root / name) for name in configs}
        self._curves = {key: value for key, value in self._curves.items() if key in kept}
        self.selected = [name for name in self.selected if name in configs]
        self.rows = rows
        return rows

    def config_of(self, name: str) -> TrainConfig:
        """The settings of run `name`."""
        return self._configs[name]

    def to_csv(self) -> str:
        """The table as CSV text (header + one line per run)."""
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=list(TABLE_COLUMNS), lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.rows)
        return out.getvalue()

    def overlay(self) -> dict[str, dict[str, Any]]:
        """For each selected run: its mean training loss, mean divergence before averaging
        and CV accuracy by frames trained, and a label of what sets it apart.

        x is frames over all ranks (step x minibatch x ranks) so runs with different numbers
        of ranks line up; the label names the settings that differ between the selected runs
        ("n2 K=50 lr 0.016", `labavg.jobs.index.differing_labels`).
        """
        root = Path(self.runs_dir).expanduser()
        selected = [name for name in self.selected if name in self._configs]
        labels = differing_labels({name: self._configs[name] for name in selected})
        return {name: {"label": labels[name], **self._curve(root / name, self._configs[name])}
                for name in selected}

    def _curve(self, run_dir: Path, cfg: TrainConfig) -> dict[str, list[float]]:
        # Ticking one more run must not reread every ticked run's log (a long run's is tens
        # of MB): a log is read again only when it has changed since.
        try:
            stat = (run_dir / EVENTS).stat()
        except OSError:
            return run_curve([], cfg.minibatch * cfg.ranks)  # no log yet
        stamp = (stat.st_mtime_ns, stat.st_size)
        cached = self._curves.get(str(run_dir))
        if cached is None or cached[0] != stamp:
            cached = (stamp, run_curve(read_run_events(run_dir), cfg.minibatch * cfg.ranks))
            self._curves[str(run_dir)] = cached
        return cached[1]

    def communication(self) -> list[dict[str, Any]]:
        """(method, ranks, K, MB sent per rank, CV accuracy %, WER %, run) of the finished
        multi-rank runs: what each bought with the bytes it sent."""
        return [{"method": r["averaging"], "payload": r["payload"], "ranks": r["ranks"],
                 "K": r["average_every"], "mb_sent": r["mb_sent"],
                 "cv_acc_pct": r["cv_acc_pct"], "wer_pct": r["wer"], "run": r["run"]}
                for r in self.rows
                if r["status"] == "finished" and r["ranks"] and r["ranks"] > 1 and r["mb_sent"]]

    def scaling(self) -> list[dict[str, Any]]:
        """The Scaling tab's points: each finished run with a measured speedup
        (`dashboard.speedup.scaling_point`: value, pairs' range, efficiency %, conditions)."""
        return list(self._points)

    def predicted(self) -> list[tuple[int, float]]:
        """The cost model's speedup for N machines, from the newest measured run's costs."""
        return list(self._predicted)
