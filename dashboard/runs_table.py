"""The past runs: the runs index of a runs directory as the dashboard's table, overlays, CSV."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

import numpy as np
import param

from dashboard.speedup import (PREDICTED_RANKS, prediction, scaling_point, summary_costs,
                               table_cells)
from labavg.jobs.index import EVENTS, RunRecord, differing_labels, list_runs, read_events, run_row

# Results come right after what the runs vary (ranks, K, lr), so that they are on screen at
# 1366 px without scrolling sideways; the rest of the settings follow.
# efficiency is in % (the CSV's too), shown as "92%".
TABLE_COLUMNS = ("run", "ranks", "K", "method", "lr", "wer_pct", "per_pct", "cv_acc_pct", "speedup",
                 "efficiency", "speedup_note", "status", "cores", "speedup_range", "cv_loss",
                 "mb_sent", "payload",
                 "optimizer", "model", "wall_s", "comm_pct", "reduce", "backend", "schedule", "pretrain", "minibatch", "epochs")
TABLE_TITLES = {"wer_pct": "WER %", "per_pct": "PER %", "cv_acc_pct": "CV acc %", "cv_loss": "CV loss",
                "wall_s": "wall s", "comm_pct": "comm %", "efficiency": "efficiency",
                "mb_sent": "MB sent", "speedup_range": "pairs' range",
                "speedup_note": "speedup as measured (labavg.jobs.speedup)"}


def _table_row(row: dict[str, Any]) -> dict[str, Any]:
    """The dashboard's columns of a `labavg.jobs.index.run_row`: percentages, short names."""

    def pct(value):
        return None if value is None else round(100 * value, 2)

    return {
        "run": row["run"], "status": row["status"], "backend": row["backend"],
        "ranks": row["ranks"], "K": row["average_every"], "method": row["averaging"],
        "reduce": row["reduce"], "payload": row["payload"], "optimizer": row["optimizer"],
        "lr": row["lr"], "schedule": row["schedule"], "pretrain": row["pretrain"],
        "minibatch": row["minibatch"], "epochs": row["epochs"], "model": row["model"],
        "wer_pct": row["wer"], "per_pct": row["per"],
        "cv_acc_pct": pct(row["cv_frame_accuracy"]), "cv_loss": row["cv_loss"],
        "wall_s": row["wall_seconds"], "comm_pct": pct(row["comm_fraction"]),
        # Per rank, all rounds (what one rank sent; labavg.averaging.mean's bytes_sent).
        "mb_sent": None if row["bytes_sent"] is None else row["bytes_sent"] / 1e6,
        "speedup": None, "speedup_range": None, "efficiency": None, "cores": None,
        "speedup_note": None,
    }


def fill_speedups(rows: list[dict[str, Any]], records: list[RunRecord]) -> None:
    """Each ended run's speedup columns, `dashboard.speedup.table_cells`'s: labavg.jobs.speedup
    reads its summary, as the Live tab reads its events (the same number and interval)."""
    for row, record in zip(rows, records):
        row.update(table_cells(record.summary))


def _csv_value(value: Any) -> Any:
    # Six significant digits: a measured time or rate has no more (float repr wrote 17).
    return float(f"{value:.6g}") if isinstance(value, float) else value


class RunTable(param.Parameterized):
    """The runs under `runs_dir`: one row each (config + summary), overlay selection, CSV."""

    runs_dir = param.String(default="runs")
    rows = param.List(default=[], doc="one dict per run, TABLE_COLUMNS keys, oldest first")
    selected = param.List(default=[], doc="names of the runs to overlay")

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self._configs: dict[str, dict[str, Any]] = {}
        self._points: list[dict[str, Any]] = []
        self._predicted: list[tuple[int, float]] = []

    def refresh(self) -> list[dict[str, Any]]:
        """Rescan runs_dir; returns the rows (runs without config.json are not runs yet)."""
        records = list_runs(Path(self.runs_dir))
        rows = [_table_row(run_row(r.name, r.config, r.summary)) for r in records]
        fill_speedups(rows, records)
        self._points, newest = [], None
        for record, row in zip(records, rows):
            point = (scaling_point(record.name, row["K"], record.summary)
                     if row["status"] == "finished" else None)
            if point is not None:
                self._points.append(point)
                newest = (record.summary, row["K"])
        # The newest measured run's own costs are what the cost model scales up, to every
        # number of ranks measured (an oversubscribed run's N machines among them).
        ranks = (*PREDICTED_RANKS, *(p["ranks"] for p in self._points))
        self._predicted = prediction(summary_costs(newest[0]), newest[1], ranks) if newest else []
        configs = {r.name: r.config for r in records}
        self._configs = configs
        self.selected = [name for name in self.selected if name in configs]
        self.rows = rows
        return rows

    def config_of(self, name: str) -> dict[str, Any]:
        """The config dict of run `name`."""
        return self._configs[name]

    def to_csv(self) -> str:
        """The table as CSV text (header + one line per run)."""
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=list(TABLE_COLUMNS), lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: _csv_value(v) for k, v in row.items()} for row in self.rows)
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
        curves = {}
        for name in selected:
            config = self._configs[name]
            scale = config.get("minibatch", 1) * config.get("ranks", 1)
            sums: dict[int, list[float]] = {}
            divs: dict[int, list[float]] = {}
            cv_x, cv_y = [], []
            for event in read_events(root / name) if (root / name / EVENTS).is_file() else []:
                kind = event.get("type")
                if kind == "minibatch":
                    sums.setdefault(event["step"], []).append(event["loss"])
                elif kind == "average":
                    divs.setdefault(event["step"], []).append(event["divergence"])
                elif kind == "epoch" and event.get("rank") == 0:
                    cv_x.append(event["step"] * scale)
                    cv_y.append(100 * event["cv_frame_accuracy"])
            steps, rounds = sorted(sums), sorted(divs)
            curves[name] = {
                "label": labels[name],
                "frames": [s * scale for s in steps],
                "loss": [float(np.mean(sums[s])) for s in steps],
                "div_frames": [s * scale for s in rounds],
                "divergence": [float(np.mean(divs[s])) for s in rounds],
                "cv_frames": cv_x, "cv_acc_pct": cv_y,
            }
        return curves

    def communication(self) -> list[dict[str, Any]]:
        """(method, ranks, K, MB sent per rank, CV accuracy %, WER %, run) of the finished
        multi-rank runs: what each bought with the bytes it sent."""
        return [{"method": r["method"], "payload": r["payload"], "ranks": r["ranks"], "K": r["K"],
                 "mb_sent": r["mb_sent"],
                 "cv_acc_pct": r["cv_acc_pct"], "wer_pct": r["wer_pct"], "run": r["run"]}
                for r in self.rows
                if r["status"] == "finished" and r["ranks"] and r["ranks"] > 1 and r["mb_sent"]]

    def scaling(self) -> list[dict[str, Any]]:
        """The Scaling tab's points: each finished run with a measured speedup
        (`dashboard.speedup.scaling_point`: value, pairs' range, efficiency %, conditions)."""
        return list(self._points)

    def predicted(self) -> list[tuple[int, float]]:
        """The cost model's speedup for N machines, from the newest measured run's costs."""
        return list(self._predicted)
