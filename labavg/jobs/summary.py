"""summary.json: what rank 0 writes at the end of a run, reading it back, and a Markdown table
of summaries."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from labavg.training.config import TrainConfig
from labavg.base.settings import to_dict
from labavg.base.errors import UserError
from labavg.base.events import RunFinished, RunStarted
from labavg.jobs.index import SUMMARY, summary_row
from labavg.jobs.speedup import (THREAD_BACKENDS, measured_speedup, speedup_from_summary,
                                 summary_fields)
from labavg.jobs.run_json import read_summary_file


def read_summary(run_dir: Path) -> dict[str, Any]:
    """summary.json of a finished run; UserError naming the path otherwise."""
    path = Path(run_dir) / SUMMARY
    try:
        return read_summary_file(path)  # each field the tables format checked for its type
    except FileNotFoundError:
        raise UserError(f"{run_dir} is not a finished labavg run: {path} is missing") from None


def make_summary(cfg: TrainConfig, started: RunStarted, finished: RunFinished,
                 pairs: list[tuple[float, float]], load: dict[str, float]) -> dict[str, Any]:
    """The summary.json of a run, with its speedup measured in `pairs` (labavg.jobs.speedup)
    and the load averages at its start and end."""
    summary: dict[str, Any] = {
        "ranks": started.size,
        "backend": cfg.backend,
        "average_every": started.average_every,
        "averaging": started.averaging,
        "reduce": started.reduce,
        "payload": started.payload,
        "optimizer": cfg.optimizer,
        "pretrain": cfg.pretrain,
        "schedule": cfg.schedule,
        "minibatch": cfg.minibatch,
        "epochs": cfg.epochs,
        "lr": cfg.lr,
        "effective_lr": started.effective_lr,
        "num_params": started.num_params,
        "num_pdfs": started.num_pdfs,
        "frames_trained": finished.frames_trained,
        "steps": finished.step,
        "averaging_rounds": finished.averaging_rounds,
        "cv_frame_accuracy": finished.cv_frame_accuracy,
        "cv_loss": finished.cv_loss,
        "wall_seconds": finished.wall_seconds,
        "compute_seconds": finished.compute_seconds,
        "comm_seconds": finished.comm_seconds,
        "bytes_per_round": started.bytes_per_round,
        "bytes_sent": finished.bytes_sent,
        "hierarchy_every": started.hierarchy_every,
        "node_ranks": started.node_ranks,
        "node_rounds": finished.node_rounds,
        "node_bytes_sent": finished.node_bytes_sent,
        "all_rounds": finished.averaging_rounds - finished.node_rounds,
        "all_bytes_sent": finished.bytes_sent - finished.node_bytes_sent,
        "stopped": finished.stopped,
        "comm_fraction": finished.comm_seconds / max(finished.compute_seconds + finished.comm_seconds, 1e-12),
        "overlap": started.overlap,
        "fragment_bytes": list(started.fragment_bytes),
        "overlap_bytes_sent": finished.overlap_bytes_sent,
        "comm_wait_seconds": finished.wait_seconds,
        "comm_hidden_fraction": comm_hidden_fraction(finished),
        "cores": started.cores,
        "load_average": load,
        "speedup_pairs": [list(p) for p in pairs],
        "config": to_dict(cfg),
    }
    summary.update(summary_fields(measured_speedup(
        pairs, started.size, started.cores, load.get("start"), started.backend in THREAD_BACKENDS)))
    return summary


def comm_hidden_fraction(finished: RunFinished) -> float | None:
    """The share of the averaging communication that overlap hid (docs/averaging.md, Overlap):
    1 - (seconds per byte the non-blocking means held the rank) / (seconds per byte of the
    same run's blocking rounds), None without both kinds of rounds. Per byte, because a
    streaming round sends one fragment and an epoch end's blocking round the whole model."""
    blocking_seconds = finished.comm_seconds - finished.overlap_seconds
    blocking_bytes = finished.bytes_sent - finished.overlap_bytes_sent
    if finished.overlap_bytes_sent <= 0 or blocking_bytes <= 0 or blocking_seconds <= 0:
        return None
    return 1.0 - ((finished.overlap_seconds / finished.overlap_bytes_sent)
                  / (blocking_seconds / blocking_bytes))


def format_table(summaries: Iterable[dict[str, Any]]) -> str:
    """A Markdown table of run summaries (one row per run); error rates when the run decoded."""
    cols = [("run", "run"), ("ranks", "ranks"), ("K", "average_every"), ("opt", "optimizer"),
            ("lr", "lr"), ("epochs", "epochs"), ("method", "averaging"),
            ("WER % (95% CI)", "wer"), ("PER %", "per"),
            ("cv acc %", "cv_frame_accuracy"), ("cv loss", "cv_loss"), ("wall s", "wall_seconds"),
            ("comm %", "comm_fraction"), ("speedup (range)", "speedup"), ("cores", "cores"),
            ("efficiency %", "parallel_efficiency"), ("stopped", "status")]
    summaries = list(summaries)
    rows = [{**summary_row(s.get("run"), s), "run": s.get("run")} for s in summaries]
    if not any(r["wer"] is not None for r in rows):
        cols = [c for c in cols if c[1] not in ("wer", "per")]
    if any(r["reduce"] not in (None, "allreduce") for r in rows):
        # Only then: the column would repeat the default in every table of plain runs.
        cols.insert(cols.index(("method", "averaging")) + 1, ("reduce", "reduce"))
    if any(r["payload"] not in (None, "fp32") for r in rows):
        cols.insert(cols.index(("method", "averaging")) + 1, ("payload", "payload"))

    def cell(key: str, row: dict[str, Any]) -> str:
        value = row[key]
        if value is None:
            return "-"
        if key == "wer":
            low, high = (row["wer_ci_low"], row["wer_ci_high"]) if row["wer_ci_low"] is not None \
                else (math.nan, math.nan)
            return f"{value:.2f} ({low:.2f}-{high:.2f})"
        if key == "per":
            return f"{value:.2f}"
        if key == "speedup":  # the pairs' range; a flag (oversubscribed, above the bound) below
            spread = f" ({row['speedup_low']:.2f}-{row['speedup_high']:.2f})" \
                if row["ranks"] != 1 else ""
            return f"{value:.2f}{spread}" + (" *" if row["speedup_flag"] else "")
        if key in ("cv_frame_accuracy", "comm_fraction"):
            return f"{100 * value:.2f}"
        if key == "parallel_efficiency":  # a percentage, as the dashboard shows it
            return f"{100 * value:.0f}"
        if key == "status":
            return "yes" if value == "stopped" else "no"
        if key == "lr":
            return f"{value:g}"
        if isinstance(value, float):
            return "nan" if math.isnan(value) else f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
        return str(value)

    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join(cell(k, row) for _, k in cols) + " |")
    return "\n".join(lines + _speedup_notes(summaries))


def _speedup_notes(summaries: list[dict[str, Any]]) -> list[str]:
    """Below the table, each multi-rank run's speedup in full: its pairs, cores, load, flag."""
    notes = []
    for s in summaries:
        speedup = speedup_from_summary(s)
        if speedup is not None and speedup.ranks > 1:
            notes.append(f"{'*' if speedup.flag else ''}speedup of {s.get('run')}: {speedup.text()}")
    return [""] + notes if notes else []
