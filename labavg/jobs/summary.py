"""summary.json: what rank 0 writes at the end of a run, reading it back, and a Markdown table
of summaries."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from labavg.training.config import TrainConfig
from labavg.base.errors import UserError
from labavg.base.events import RunFinished, RunStarted
from labavg.jobs.columns import markdown_table
from labavg.jobs.index import SUMMARY, summary_row
from labavg.jobs.speedup import (THREAD_BACKENDS, measured_speedup, speedup_from_summary,
                                 summary_fields)
from labavg.jobs.run_json import RunSummary, as_summary, read_run_summary, read_summary_file


def read_summary(run_dir: Path) -> dict[str, Any]:
    """summary.json of a finished run; UserError naming the path otherwise."""
    path = Path(run_dir) / SUMMARY
    try:
        return read_summary_file(path)  # each field the tables format checked for its type
    except FileNotFoundError:
        raise UserError(f"{run_dir} is not a finished labavg run: {path} is missing") from None


def load_summary(run_dir: Path) -> RunSummary:
    """summary.json of a finished run as a RunSummary; UserError naming the path otherwise."""
    path = Path(run_dir) / SUMMARY
    try:
        return read_run_summary(path)
    except FileNotFoundError:
        raise UserError(f"{run_dir} is not a finished labavg run: {path} is missing") from None


def make_summary(cfg: TrainConfig, started: RunStarted, finished: RunFinished,
                 pairs: list[tuple[float, float]], load: dict[str, float],
                 resumed: bool = False) -> RunSummary:
    """The summary.json of a run, with its speedup measured in `pairs` (labavg.jobs.speedup)
    and the load averages at its start and end."""
    fields: dict[str, Any] = {
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
        "config": cfg,
        "resumed": resumed,
    }
    fields.update(summary_fields(measured_speedup(
        pairs, started.size, started.cores, load.get("start"), started.backend in THREAD_BACKENDS)))
    return RunSummary(**fields)


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


# `labavg info`'s columns (labavg.jobs.columns); WER and PER only when a run decoded, reduce
# and payload only when a run did not use the default (they would repeat it in every row).
INFO_COLUMNS = ("run", "ranks", "average_every", "optimizer", "lr", "epochs", "averaging",
                "reduce", "payload", "wer_with_ci", "per", "cv_acc_pct", "cv_loss",
                "wall_seconds", "comm_pct", "speedup_with_range", "cores", "efficiency_pct",
                "stopped")


def format_table(summaries: Iterable[Mapping[str, Any]]) -> str:
    """A Markdown table of runs (one row each): summary.json's objects, each with the run's
    name under "run" (as `labavg train` and `labavg info` print them); error rates when a run
    decoded."""
    return format_runs([(str(item.get("run")), as_summary(item)) for item in summaries])


def format_runs(named: list[tuple[str, RunSummary]]) -> str:
    """`format_table` of runs already read back: each run's name and RunSummary."""
    rows = [summary_row(name, summary) for name, summary in named]
    shown = {"wer_with_ci": any(r["wer"] is not None for r in rows),
             "per": any(r["wer"] is not None for r in rows),
             "reduce": any(r["reduce"] not in (None, "allreduce") for r in rows),
             "payload": any(r["payload"] not in (None, "fp32") for r in rows)}
    keys = [k for k in INFO_COLUMNS if shown.get(k, True)]
    return "\n".join([markdown_table(keys, rows)] + _speedup_notes(named))


def _speedup_notes(named: list[tuple[str, RunSummary]]) -> list[str]:
    """Below the table, each multi-rank run's speedup in full: its pairs, cores, load, flag."""
    notes = []
    for name, summary in named:
        speedup = speedup_from_summary(summary)
        if speedup is not None and speedup.ranks > 1:
            notes.append(f"{'*' if speedup.flag else ''}speedup of {name}: {speedup.text()}")
    return [""] + notes if notes else []
