"""The reproduction's runs: finished run directories and the results file that records them.

A results file (experiments/reproduction-results.jsonl) holds one JSON line per finished run, its
settings and summary, so that the report and the notebooks can be remade where the run
directories are not.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from labavg.base.checkpoint import atomic_write_text
from labavg.base.errors import UserError
from labavg.base.events import EpochDone, MinibatchDone
from labavg.base.json_files import MAX_DEPTH, OBJECT, TEXT, check_fields, nesting_depth
from labavg.jobs.columns import COLUMNS
from labavg.base.settings import to_dict
from labavg.jobs.index import flatten_config, list_runs, read_run_events
from labavg.jobs.run_json import SUMMARY_FIELDS, RunSummary
from labavg.studies.reproduction.verdicts import Spread, log_ratio, spread

RESULTS_FILE = "reproduction-results.jsonl"  # beside the sweep files: what the notebooks read


@dataclass(frozen=True)
class Run:
    """One finished run: its settings (flattened, dotted keys) and its summary as recorded
    (summary.json's object and its event `trace`, as the results file keeps it; read through
    `summary` and `trace`)."""

    name: str
    settings: dict[str, Any]
    recorded: dict[str, Any]

    def get(self, key: str) -> Any:
        return self.settings.get(key)

    @property
    def seed(self) -> int:
        return int(self.settings["seed"])

    @cached_property
    def summary(self) -> RunSummary:
        return RunSummary.from_dict(self.recorded, f"run {self.name}")

    @property
    def trace(self) -> dict[str, Any]:
        """What `run_trace` kept of the run's events ({} for a run recorded without one)."""
        return self.recorded.get("trace") or {}

    def metric(self, key: str) -> float | None:
        """A column's number (labavg.jobs.columns: "wer", "cv_acc_pct", "steps"), in its unit."""
        value = COLUMNS[key].measure(self.recorded)
        if value is None or not math.isfinite(value):
            return None
        return float(value)


def load_runs(sweep_dir: Path) -> list[Run]:
    """Every finished run of a sweep directory (unfinished ones are left out). UserError naming
    the file when a run's summary.json is damaged: a report that left it out would count seeds
    that are not there."""
    runs = []
    if not (sweep_dir / "runs").is_dir():
        return runs
    for record in list_runs(sweep_dir / "runs"):
        if record.damaged:
            raise UserError(f"{record.damaged} (remove {record.path} to train it again)")
        if record.summary is None or record.summary.stopped:
            continue
        settings = flatten_config(to_dict(record.summary.config or record.config))
        settings["corpus_hours"] = corpus_hours(settings.get("data.data") or "")
        recorded = {k: v for k, v in record.summary.to_dict().items() if k != "config"}
        runs.append(Run(record.name, settings, {**recorded, "trace": run_trace(record.path)}))
    return runs


def run_trace(run_dir: Path) -> dict[str, Any]:
    """What the report needs of a run's events (rank 0): the learning rate, CV accuracy and
    Newbob's decision at each epoch end, and how often max-change cut an update."""
    epochs, logged, limited, scales = [], 0, 0, []
    try:
        events = [e for e in read_run_events(run_dir) if e.rank == 0]
    except OSError:
        return {}
    for event in events:
        if isinstance(event, EpochDone):
            epochs.append({"epoch": event.epoch, "lr": event.lr,
                           "cv_frame_accuracy": event.cv_frame_accuracy,
                           "accepted": event.accepted})
        elif isinstance(event, MinibatchDone) and event.applied:
            logged += 1
            if event.max_change_scale < 1.0:
                limited += 1
                scales.append(event.max_change_scale)
    return {"epochs": epochs, "max_change_limited": limited / logged if logged else None,
            "max_change_median_scale": statistics.median(scales) if scales else None}


SWEEPS = ("paper", "regime", "regime-variables", "yesno", "mpi", "explain", "beyond", "asterisk",
          "elastic", "schedules")
# What a results file keeps of each run's settings: enough to select and to describe it.
_KEPT = ("ranks", "averaging.average_every", "optimizer", "pretrain", "schedule", "minibatch",
         "seed", "epochs", "lr", "lr_scaling", "backend", "data.data", "corpus_hours",
         "model.hidden_layers", "model.hidden_dim", "model.nonlinearity", "decode_data", "final_lr",
         "max_change_per_sample", "max_param_change", "rbm.epochs", "averaging.method",
         "averaging.reduce", "averaging.payload", "averaging.payload_bits",
         "averaging.bmuf.momentum", "averaging.bmuf.block_lr", "averaging.diloco.outer_lr",
         "averaging.diloco.momentum")


def collect(out: Path) -> dict[str, list[Run]]:
    """The finished runs of each sweep of a reproduction directory."""
    return {name: load_runs(out / name) for name in SWEEPS}


def write_results_file(runs: dict[str, list[Run]], path: Path) -> Path:
    """One JSON line per finished run (settings and summary, no paths to files), so that the
    notebooks and the report can be remade where the runs themselves are not."""
    lines = []
    for sweep, group in runs.items():
        for r in sorted(group, key=lambda r: r.name):
            summary = {k: v for k, v in r.recorded.items() if k != "config"}
            settings = {k: r.settings.get(k) for k in _KEPT}
            lines.append(json.dumps({"sweep": sweep, "name": r.name, "settings": settings,
                                     "summary": summary}, sort_keys=True))
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


def read_results_file(path: Path) -> dict[str, list[Run]]:
    """The runs of a results file written by `write_results_file`, by sweep."""
    out: dict[str, list[Run]] = {name: [] for name in SWEEPS}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot read results file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        line = text_line_of(Path(path).read_bytes(), exc.start)
        raise UserError(f"{path}, line {line}: binary data, not a results line") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        if nesting_depth(line) > MAX_DEPTH:
            raise UserError(f"{where}: not a results line (nested more than {MAX_DEPTH} levels)")
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise UserError(f"{where}: not a results line ({exc})") from None
        check_fields(item, {"sweep": TEXT, "name": TEXT, "settings": OBJECT, "summary": OBJECT},
                     where, "results line")
        missing = [k for k in ("sweep", "name", "settings", "summary") if item.get(k) is None]
        if missing:
            raise UserError(f"{where}: not a results line (no field {missing[0]!r})")
        check_fields(item["summary"], SUMMARY_FIELDS, f"{where}, summary", "summary")
        out.setdefault(item["sweep"], []).append(Run(item["name"], item["settings"], item["summary"]))
    return out


def text_line_of(data: bytes, offset: int) -> int:
    """The 1-based line of byte `offset`."""
    return data.count(b"\n", 0, offset) + 1


def with_recorded(runs: dict[str, list[Run]], results: Path) -> dict[str, list[Run]]:
    """`runs` plus the runs of the results file whose run directories are not there: a report
    remade where only some sweeps' runs are (another machine, a cleaned runs directory) keeps
    the rest as they were recorded, and a run there is wins over its recorded copy."""
    if not Path(results).is_file():
        return runs
    out = {name: list(group) for name, group in runs.items()}
    for name, recorded in read_results_file(results).items():
        have = {r.name for r in out.get(name, [])}
        out.setdefault(name, []).extend(r for r in recorded if r.name not in have)
    return out


def select(runs: list[Run], **want: Any) -> dict[int, Run]:
    """The runs whose settings equal `want` (dotted keys with "__" for "."), by seed."""
    want = {k.replace("__", "."): v for k, v in want.items()}
    return {r.seed: r for r in runs if all(r.get(k) == v for k, v in want.items())}


def corpus_hours(path: str) -> float | None:
    """Hours of training speech of a built-in corpus (its corpus.json), None for other data."""
    try:
        return float(json.loads((Path(path) / "corpus.json").read_text())["hours"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def paired(a: dict[int, Run], b: dict[int, Run], metric: str, log: bool = False) -> list[float]:
    """b - a per seed both have; with `log`, 100 x ln(b / a) (labavg.studies.reproduction.verdicts.log_ratio)."""
    out = []
    for seed in sorted(set(a) & set(b)):
        va, vb = a[seed].metric(metric), b[seed].metric(metric)
        if va is None or vb is None:
            continue
        value = log_ratio(va, vb) if log else vb - va
        if value is not None:
            out.append(value)
    return out


def stat(runs: dict[int, Run], metric: str) -> Spread | None:
    """The spread over seeds of one metric of `runs`."""
    return spread([v for v in (r.metric(metric) for r in runs.values()) if v is not None])


def trace_stat(runs: dict[int, Run], key: str) -> float | None:
    """The mean over seeds of one value of the runs' event traces (run_trace)."""
    values = [r.trace.get(key) for r in runs.values()]
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None
