"""The one definition of a run table's columns (labavg.jobs.columns): every table picks from it,
and a value reads the same in a table and in a CSV."""

from __future__ import annotations

import csv
import io

import pytest

from labavg.jobs.columns import COLUMNS, csv_row, markdown_table
from labavg.jobs.summary import run_row, summary_row
from labavg.jobs.run_json import RunSummary

SUMMARY = {"ranks": 4, "average_every": 10, "cv_frame_accuracy": 0.6512345678901234,
           "cv_loss": 1.23456789, "wall_seconds": 123.456789012, "comm_fraction": 0.1234567,
           "bytes_sent": 30108960, "speedup_pairs": [[1.0, 1.2], [1.0, 1.25], [1.0, 1.3]],
           "cores": 8, "backend": "mpi", "wer": 12.3456, "wer_ci": [11.5, 13.25],
           "config": {"ranks": 4, "lr": 0.008, "model": {"hidden_layers": 4, "hidden_dim": 512}}}


def _row() -> dict:
    return summary_row("r", SUMMARY)


def test_every_table_picks_its_columns_from_the_one_definition():
    from dashboard.runs_table import TABLE_COLUMNS, TABLE_TITLES
    from labavg.jobs.summary import INFO_COLUMNS
    from labavg.studies.sweep import COLUMNS as SWEEP_COLUMNS

    for keys in (TABLE_COLUMNS, INFO_COLUMNS, SWEEP_COLUMNS):
        assert set(keys) <= set(COLUMNS), set(keys) - set(COLUMNS)
    assert TABLE_TITLES == {k: COLUMNS[k].title for k in TABLE_COLUMNS}
    # Each column reads a field the run row has (or joins several of them).
    row = _row()
    assert all(c.join is not None or c.field in row or c.key == "speedup_note"
               for c in COLUMNS.values())


def test_a_percentage_reads_the_same_in_the_table_and_the_csv():
    row = _row()
    values = csv_row(["cv_acc_pct", "efficiency_pct", "comm_pct", "mb_sent", "wall_seconds"], row)
    table = markdown_table(["cv_acc_pct", "efficiency_pct", "comm_pct", "mb_sent"], [row])
    cells = [c.strip() for c in table.splitlines()[2].strip("|").split("|")]
    assert cells == ["65.12", f"{values['efficiency_pct']:.0f}%", "12.3", "30.1"]
    assert values["cv_acc_pct"] == 65.1235  # six significant digits, not float noise
    assert values["efficiency_pct"] == pytest.approx(100 * row["parallel_efficiency"], rel=1e-5)
    assert 50 < values["efficiency_pct"] <= 100  # a percentage, as the table shows it
    assert values["wall_seconds"] == 123.457 and values["mb_sent"] == 30.109


def test_cells_join_fields_and_say_dash_for_what_is_missing():
    row = _row()
    assert COLUMNS["wer_with_ci"].cell(row) == "12.35 (11.50-13.25)"
    # A 1-worker run's WER has its interval too (the quick start's first row).
    assert COLUMNS["wer_with_ci"].cell({**row, "ranks": 1}) == "12.35 (11.50-13.25)"
    assert COLUMNS["speedup_with_range"].cell(row).endswith(")")
    running = run_row("r", RunSummary.from_dict(SUMMARY).config, None)
    assert [COLUMNS[k].cell(running) for k in ("wer_with_ci", "cv_acc_pct", "speedup_range")] \
        == ["-", "-", "-"]
    assert COLUMNS["cv_loss"].cell({"cv_loss": float("nan")}) == "-"
    assert csv_row(["cv_loss"], {"cv_loss": float("nan")}) == {"cv_loss": None}
    assert COLUMNS["lr"].cell(row) == "0.008" and COLUMNS["stopped"].cell(row) == "no"


def test_a_sweeps_csv_holds_the_columns_values(tmp_path):
    from labavg.studies.sweep import COLUMNS as SWEEP_COLUMNS, write_results

    write_results([{"name": "r", **_row()}], tmp_path)
    [line] = csv.DictReader(io.StringIO((tmp_path / "results.csv").read_text()))
    assert list(line) == list(SWEEP_COLUMNS)
    assert line["cv_acc_pct"] == "65.1235" and line["bytes_sent"] == "30108960"
    md = (tmp_path / "results.md").read_text()
    assert "| CV acc % |" in " ".join(md.split()) and "65.12" in md
