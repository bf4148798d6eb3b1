"""summary.json: rank 0 makes it as a run ends (make_summary: each field from where RunSummary's
declaration says, labavg.jobs.run_json), every reader reads it back typed (load_summary), and
a run becomes a table row (run_row) and a table (format_runs).

A row's K is the effective averaging interval (`averaging.average_every_frames` turned into
minibatches when it is set, TrainConfig.effective_average_every), as summary.json records it: every
table shows the K the run trained with.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from labavg.training.config import TrainConfig
from labavg.base.errors import UserError
from labavg.base.events import RunFinished, RunStarted
from labavg.base.json_files import check_fields, load_json
from labavg.jobs.columns import COLUMNS, markdown_table, value_at
from labavg.jobs.speedup import THREAD_BACKENDS, Speedup, measured_speedup, speedup_from_summary
from labavg.jobs.run_json import (CONFIG_FIELDS, SUMMARY, SUMMARY_FIELDS, RunSummary, as_summary,
                                  summary_sources)


class NotFinished(UserError):
    """A run directory without summary.json: the run has not ended (or is no run)."""


def load_summary(run_dir: Path) -> RunSummary:
    """The one reader of summary.json: a finished run's, typed, each field checked for the
    type RunSummary declares. NotFinished when it is missing; UserError naming the file (and
    field) when it is damaged or its config is from an older labavg."""
    path = Path(run_dir) / SUMMARY
    try:
        values = load_json(path)
    except FileNotFoundError:
        raise NotFinished(f"{run_dir} is not a finished labavg run: {path} is missing") from None
    check_fields(values, SUMMARY_FIELDS, path, "summary")
    if isinstance(values.get("config"), dict):
        check_fields(values["config"], CONFIG_FIELDS, path, "summary", "config.")
    return RunSummary.from_dict(values, str(path))


@dataclass(frozen=True)
class RunEnd:
    """What a run's summary is made of as rank 0 finishes: each RunSummary field names its
    attribute path here (labavg.jobs.run_json); the derivations are the properties below."""

    config: TrainConfig
    started: RunStarted
    finished: RunFinished
    pairs: list[tuple[float, float]]  # the speedup's (solo, parallel) s per minibatch
    load: dict[str, float]  # the 1-minute load averages at the run's "start" and "end"
    resumed: bool = False
    process_seconds: float | None = None  # measured by the run's end (labavg.jobs.runs)

    @property
    def all_rounds(self) -> int:
        return self.finished.averaging_rounds - self.finished.node_rounds

    @property
    def all_bytes_sent(self) -> int:
        return self.finished.bytes_sent - self.finished.node_bytes_sent

    @property
    def comm_fraction(self) -> float:
        f = self.finished
        return f.comm_seconds / max(f.compute_seconds + f.comm_seconds, 1e-12)

    @property
    def comm_hidden_fraction(self) -> float | None:
        return comm_hidden_fraction(self.finished)

    @property
    def fragment_bytes(self) -> list[int]:
        return list(self.started.fragment_bytes)

    @property
    def speedup_pairs(self) -> list[list[float]]:
        return [list(p) for p in self.pairs]

    @cached_property
    def speedup(self) -> Speedup:
        return measured_speedup(self.pairs, self.started.size, self.started.cores,
                                self.load.get("start"), self.started.backend in THREAD_BACKENDS)

    @property
    def speedup_text(self) -> str:
        return self.speedup.text()

    @property
    def worker_steps(self) -> list[int] | None:
        return list(self.finished.worker_steps) or None

    @property
    def worker_counts(self) -> list[int] | None:
        return list(self.finished.worker_counts) or None

    @property
    def frames_untrained(self) -> int | None:
        """What a lost worker's shard would have trained while it was away (its place empty)."""
        if self.finished.frames_untrained is not None:  # resumed on fewer ranks
            return self.finished.frames_untrained
        if not self.finished.worker_counts:
            return None
        return self.finished.step * self.started.size * self.config.minibatch \
            - self.finished.frames_trained


def make_summary(end: RunEnd) -> RunSummary:
    """The summary.json of a run: each field from where RunSummary says it comes from."""
    return RunSummary(**{name: value_at(end, path.split("."))
                         for name, path in summary_sources().items()})


def with_derived(summary: RunSummary) -> RunSummary:
    """`summary` with the figures it derives measured again from what they derive from: the
    speedup's from its pairs (labavg.jobs.speedup), the rounds, bytes and communication share
    from their parts; what a reader hands on of a summary read back, never its stored figures
    (a damaged summary's speedup of -5 becomes what its pairs give, as the table shows)."""
    s = summary
    speedup = speedup_from_summary(s)
    figures = {"speedup": None, "speedup_low": None, "speedup_high": None, "speedup_bound": None,
               "speedup_flag": None, "parallel_efficiency": None, "speedup_text": None}
    if speedup is not None:
        figures = {"speedup": speedup.value, "speedup_low": speedup.low,
                   "speedup_high": speedup.high, "speedup_bound": speedup.bound,
                   "speedup_flag": speedup.flag, "parallel_efficiency": speedup.efficiency,
                   "speedup_text": speedup.text()}
    numbers = lambda *v: all(isinstance(x, (int, float)) for x in v)  # noqa: E731
    figures["all_rounds"] = (s.averaging_rounds - s.node_rounds
                             if numbers(s.averaging_rounds, s.node_rounds) else None)
    figures["all_bytes_sent"] = (s.bytes_sent - s.node_bytes_sent
                                 if numbers(s.bytes_sent, s.node_bytes_sent) else None)
    figures["comm_fraction"] = (s.comm_seconds / max(s.compute_seconds + s.comm_seconds, 1e-12)
                                if numbers(s.comm_seconds, s.compute_seconds) else None)
    return replace(s, **figures)


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


def _payload_name(config: TrainConfig) -> str:
    """What a run's rounds send, as summary.json names it: fp32, bf16, fp16, int4/8/16."""
    payload = config.averaging.payload
    return f"int{config.averaging.payload_bits}" if payload == "int" else payload


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def run_row(name: str, config: TrainConfig | None, summary: RunSummary | None) -> dict[str, Any]:
    """The row every table of runs is cut from: each column's value at its attribute path
    (labavg.jobs.columns), then what the row derives: `status` (finished, stopped or
    running/incomplete), the settings the summary records first (what the run trained with)
    or else the config's, the model's shape, and the speedup measured from the summary's
    pairs. Results are None until the run has a summary; `config` is None for a summary
    that does not hold one."""
    s = summary if summary is not None else RunSummary()
    cfg = config
    run = {"summary": s, "config": cfg}
    row = {c.field: c.read(run) for c in COLUMNS.values() if c.path is not None}
    status = "running/incomplete" if summary is None else ("stopped" if s.stopped else "finished")
    return {
        "run": name, "status": status, "backend": _first(cfg and cfg.backend, s.backend),
        "ranks": _first(s.ranks, cfg and cfg.ranks),
        "average_every": _first(s.average_every, cfg and cfg.effective_average_every()),
        "averaging": _first(s.averaging, cfg and cfg.averaging.method, "model"),
        "reduce": _first(s.reduce, cfg and cfg.averaging.reduce, "allreduce"),
        "payload": _first(s.payload, cfg and _payload_name(cfg), "fp32"),
        "optimizer": _first(cfg and cfg.optimizer, s.optimizer),
        "lr": _first(cfg and cfg.lr, s.lr), "schedule": _first(cfg and cfg.schedule, s.schedule),
        "pretrain": _first(cfg and cfg.pretrain, s.pretrain),
        "minibatch": _first(cfg and cfg.minibatch, s.minibatch),
        "epochs": _first(cfg and cfg.epochs, s.epochs),
        "model": cfg and f"{cfg.model.hidden_layers}x{cfg.model.hidden_dim}",
        **row, **_speedup_columns(summary),
    }


def _speedup_columns(summary: RunSummary | None) -> dict[str, Any]:
    """A row's speedup, as labavg.jobs.speedup reads it from the summary (None before the run
    ends, and for a summary from before paired measurements)."""
    speedup = speedup_from_summary(summary) if summary is not None else None
    if speedup is None:
        return {"speedup": None, "speedup_low": None, "speedup_high": None,
                "parallel_efficiency": None, "speedup_flag": None, "cores": None}
    return {"speedup": speedup.value, "speedup_low": speedup.low, "speedup_high": speedup.high,
            "parallel_efficiency": speedup.efficiency, "speedup_flag": speedup.flag,
            "cores": speedup.cores or None}


def summary_row(name: str, summary: RunSummary | Mapping[str, Any]) -> dict[str, Any]:
    """`run_row` of a finished run from its summary alone (which holds its config)."""
    summary = as_summary(summary)
    return run_row(name, summary.config, summary)


# `labavg info`'s columns (labavg.jobs.columns); WER and PER only when a run decoded, reduce
# and payload only when a run did not use the default (they would repeat it in every row),
# workers only when an elastic run's changed.
INFO_COLUMNS = ("run", "ranks", "workers", "average_every", "optimizer", "lr", "epochs",
                "averaging", "reduce", "payload", "wer_with_ci", "per", "cv_acc_pct", "cv_loss",
                "wall_seconds", "process_seconds", "comm_pct", "speedup_with_range", "cores", "efficiency_pct",
                "stopped")


def format_table(summaries: Iterable[Mapping[str, Any]]) -> str:
    """A Markdown table of runs (one row each): summary.json's objects, each with the run's
    name under "run"; error rates when a run decoded."""
    return format_runs([(str(item.get("run")), None, as_summary(item)) for item in summaries])


def format_runs(runs: list[tuple[str, TrainConfig | None, RunSummary | None]]) -> str:
    """The table `labavg train` and `labavg info` print, one row per run: its name, its
    settings (None: those its summary holds) and its summary (None: running or cut short)."""
    rows = [summary_row(name, summary) if summary is not None else run_row(name, config, None)
            for name, config, summary in runs]
    named = [(name, summary) for name, _, summary in runs if summary is not None]
    shown = {"wer_with_ci": any(r["wer"] is not None for r in rows),
             "per": any(r["wer"] is not None for r in rows),
             "reduce": any(r["reduce"] not in (None, "allreduce") for r in rows),
             "payload": any(r["payload"] not in (None, "fp32") for r in rows),
             "workers": any(len(r.get("worker_counts") or ()) > 1 for r in rows)}
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
