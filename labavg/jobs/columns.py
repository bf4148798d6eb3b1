"""The columns of a table of runs, each declared once: its key, title, unit, how a table shows
it to a person and how a CSV writes it for a program.

Every table of runs picks its columns from COLUMNS by key: `labavg info` (labavg.jobs.summary),
a sweep's results.csv and results.md (labavg.studies.sweep), the reproduction's tables
(labavg.studies.reproduction) and the dashboard's Runs table and its CSV (dashboard.runs_table).
A column names where its value comes from: an attribute path on the run's summary or settings
("summary.cv_frame_accuracy", "config.seed", labavg.jobs.run_json.RunSummary and TrainConfig),
which the run row (labavg.jobs.summary.run_row) follows, or a value the run row derives ("status",
"ranks": the summary's, else the config's; "speedup": measured from the summary's pairs). A
joined cell reads several of them (WER with its interval); a fraction is scaled to the
percentage its title names, in the table and in the CSV alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Row = Mapping[str, Any]

# What a column's attribute path starts at: the run's RunSummary, or its TrainConfig.
RUN_PARTS = ("summary", "config")

# A CSV holds what was measured, not float noise: a time or a rate has no more digits than this.
CSV_SIGNIFICANT = 6


def value_at(root: Any, path: Sequence[str]) -> Any:
    """The value at attribute path `path` of `root` (a key of a mapping, a number a list's
    item); None where a part on the way is None or a list is too short."""
    value = root
    for part in path:
        if value is None:
            return None
        if isinstance(value, Mapping):
            value = value.get(part)
        elif part.isdigit():
            value = value[int(part)] if int(part) < len(value) else None
        else:
            value = getattr(value, part)
    return value


@dataclass(frozen=True)
class Column:
    """One column of a table of runs."""

    key: str  # what selects it; a CSV's header and a dashboard row's key
    title: str  # a table's heading
    unit: str = ""  # of the value in `unit`: "%", "s", "MB"; "" for counts and names
    # An attribute path on the run ("summary.wer", "config.seed"; a number picks a list's
    # item), or the key of a value the run row derives (default: `key`).
    source: str | None = None
    scale: float = 1.0  # the field x scale is the value in `unit` (a fraction x 100 is a %)
    digits: int | None = None  # decimals a table shows; None: as it is (counts, names)
    general: bool = False  # shown as %g (a learning rate: 0.008, 1e-05)
    join: Callable[[Row], str | None] | None = None  # a cell made of several fields
    align: str = "right"  # "left" for names and words
    suffix: str = ""  # after each value a table shows: a unit its (narrow) title does not name

    @property
    def field(self) -> str:
        """The run row's key of the value: the source's last attribute (a list's item: `key`)."""
        last = (self.source or self.key).rsplit(".", 1)[-1]
        return self.key if last.isdigit() else last

    @property
    def path(self) -> list[str] | None:
        """The source's attribute path on the run ("summary", "config" first); None for a
        value the run row derives."""
        parts = (self.source or "").split(".")
        return parts if parts[0] in RUN_PARTS and len(parts) > 1 else None

    def read(self, run: Mapping[str, Any]) -> Any:
        """The value at the source's path on `run` (its parts by name); None where a part is."""
        return value_at(run, self.path or ())

    def measure(self, row: Row) -> float | None:
        """The row's number in its unit, unrounded (what means and intervals are taken of)."""
        value = row.get(self.field)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        return self.scale * value

    def value(self, row: Row) -> Any:
        """The value in its unit for a program (CSV, the dashboard's numbers): a float to
        CSV_SIGNIFICANT digits, None where there is none (not run yet, NaN)."""
        if self.join is not None:
            return self.join(row)
        value = row.get(self.field)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return value
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if self.scale == 1.0 and isinstance(value, int):
            return value
        return float(f"{value * self.scale:.{CSV_SIGNIFICANT}g}")

    def text(self, value: Any) -> str:
        """A value already in its unit as a table shows it; "-" for none."""
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            return "-"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return str(value)
        if self.general:
            return f"{value:g}"
        if self.digits is not None:
            text = f"{value:,.{self.digits}f}" if abs(value) >= 1e4 else f"{value:.{self.digits}f}"
            return text + self.suffix
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    def cell(self, row: Row) -> str:
        """The row's cell as a table shows it."""
        return self.text(self.value(row))


def _with_interval(key: str, low: str, high: str, digits: int) -> Callable[[Row], str | None]:
    def join(row: Row) -> str | None:
        value = row.get(key)
        if value is None:
            return None
        if row.get(low) is None or row.get(high) is None:
            return f"{value:.{digits}f}"
        return f"{value:.{digits}f} ({row[low]:.{digits}f}-{row[high]:.{digits}f})"
    return join


def _range(row: Row) -> str | None:
    if row.get("speedup") is None or row.get("ranks") == 1 or row.get("speedup_low") is None:
        return None
    return f"{row['speedup_low']:.2f}-{row['speedup_high']:.2f}"


def _speedup_and_range(row: Row) -> str | None:
    # A flag (oversubscribed, above the bound) is marked here and said in full below the table.
    text = _with_interval("speedup", "speedup_low", "speedup_high", 2)(row)
    return None if text is None else text + (" *" if row.get("speedup_flag") else "")


def _workers(row: Row) -> str | None:
    """An elastic run's workers over time, "4 -> 3 -> 4"; None where they never changed."""
    counts = row.get("worker_counts")
    return None if not counts or len(counts) < 2 else " -> ".join(map(str, counts))


def _stopped(row: Row) -> str:
    return "yes" if row.get("status") == "stopped" else "no"


COLUMNS: dict[str, Column] = {c.key: c for c in (
    Column("run", "run", align="left"),
    Column("status", "status", align="left"),
    Column("stopped", "stopped", join=_stopped, align="left"),
    Column("backend", "backend", align="left"),
    Column("ranks", "ranks"),
    Column("worker_counts", "workers over time", source="summary.worker_counts"),
    Column("workers", "workers", join=_workers, align="left"),
    Column("average_every", "K"),
    Column("averaging", "method", align="left"),
    Column("reduce", "reduce", align="left"),
    Column("payload", "payload", align="left"),
    Column("optimizer", "optimizer", align="left"),
    Column("lr", "lr", general=True),
    Column("schedule", "schedule", align="left"),
    Column("pretrain", "pretrain", align="left"),
    Column("minibatch", "minibatch"),
    Column("epochs", "epochs"),
    Column("seed", "seed", source="config.seed"),
    Column("model", "model", align="left"),
    Column("wer", "WER %", "%", source="summary.wer", digits=2),
    Column("wer_with_ci", "WER % (95% CI)", "%",
           join=_with_interval("wer", "wer_ci_low", "wer_ci_high", 2)),
    Column("wer_ci_low", "WER 95% CI low", "%", source="summary.wer_ci.0", digits=2),
    Column("wer_ci_high", "WER 95% CI high", "%", source="summary.wer_ci.1", digits=2),
    Column("per", "PER %", "%", source="summary.per", digits=2),
    Column("cv_acc_pct", "CV acc %", "%", source="summary.cv_frame_accuracy", scale=100,
           digits=2),
    Column("cv_loss", "CV loss", source="summary.cv_loss", digits=3),
    Column("steps", "updates per worker", source="summary.steps", digits=0),
    Column("averaging_rounds", "averaging rounds", source="summary.averaging_rounds"),
    Column("wall_seconds", "wall s", "s", source="summary.wall_seconds", digits=1),
    # The whole command's time beside the training loop's: the difference is start-up and end.
    Column("process_seconds", "process s", "s", source="summary.process_seconds", digits=1),
    Column("compute_seconds", "compute s", "s", source="summary.compute_seconds", digits=1),
    Column("comm_seconds", "comm s", "s", source="summary.comm_seconds", digits=1),
    Column("comm_pct", "comm %", "%", source="summary.comm_fraction", scale=100, digits=1),
    Column("bytes_sent", "bytes sent", "B", source="summary.bytes_sent"),
    # Per rank, all rounds (what one rank sent; labavg.averaging.mean's bytes_sent).
    Column("mb_sent", "MB sent", "MB", source="summary.bytes_sent", scale=1e-6, digits=1),
    Column("speedup", "speedup", digits=2),
    Column("speedup_with_range", "speedup (range)", join=_speedup_and_range),
    Column("speedup_range", "pairs' range", join=_range),
    Column("speedup_low", "speedup low", digits=2),
    Column("speedup_high", "speedup high", digits=2),
    Column("cores", "cores"),
    # Titled without its unit, which each cell shows ("92%"): the dashboard's table has the
    # width of "efficiency" for it (dashboard.runs_view.TABLE_WIDTHS).
    Column("efficiency_pct", "efficiency", "%", source="parallel_efficiency", scale=100,
           digits=0, suffix="%"),
    Column("speedup_flag", "speedup flag", align="left"),
    # The dashboard's line of the measured speedup (dashboard.speedup.shown_text).
    Column("speedup_note", "speedup as measured (labavg.jobs.speedup)", align="left"),
)}


def columns(keys: Iterable[str]) -> list[Column]:
    """The columns of `keys`, in that order (KeyError names a key that is no column)."""
    return [COLUMNS[key] for key in keys]


def csv_row(keys: Sequence[str], row: Row) -> dict[str, Any]:
    """A run row as a CSV's (or the dashboard's) values, by column key."""
    return {c.key: c.value(row) for c in columns(keys)}


def markdown_table(keys: Sequence[str], rows: Iterable[Row]) -> str:
    """A GitHub pipe table of run rows (tabulate); each cell as its column shows it."""
    # Here, not above: tabulate brings importlib.metadata and wcwidth (0.1-0.25 s), which a
    # job's ranks, writing their run's record but printing no table, never need.
    from tabulate import tabulate

    chosen = columns(keys)
    cells = [[c.cell(row) for c in chosen] for row in rows]
    return tabulate(cells, headers=[c.title for c in chosen], tablefmt="github",
                    disable_numparse=True, colalign=[c.align for c in chosen])
