"""The runs index: reading run directories back, for `labavg info`, sweeps, the reproduction,
the dashboard and notebooks.

    EventTail / read_events   the one reader of events.jsonl (a growing file, or a finished one);
    read_run_events           its events typed (labavg.base.events)
    read_run / list_runs      a run directory read back once, typed: its TrainConfig and its
                              RunSummary (labavg.jobs.summary.load_summary); the runs under a
                              directory (or, searched, below it: `labavg info`)
    differing_labels          what tells runs apart, for the dashboard's overlays
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labavg.base.errors import UserError
from labavg.base.events import Event, event_from_dict, well_formed
from labavg.base.settings import to_dict
from labavg.jobs.run_json import CONFIG, SUMMARY, RunSummary, read_run_config
from labavg.jobs.summary import NotFinished, load_summary
from labavg.training.config import TrainConfig

EVENTS = "events.jsonl"

class EventTail:
    """Reads the lines appended to an events.jsonl since the last call.

    A last line without its newline is still being written: it is kept and completed by the
    next read, so a reader never parses half a JSON object. A line is checked for its shape
    as it is read: one that is no event (torn by a crashed writer, JSON that is not an
    object, an object without `rank`, a field of the wrong type:
    labavg.base.events.well_formed) is skipped, so that a reader gets only events it can
    index by their fields.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = b""

    def read(self, max_bytes: int = 16 << 20) -> list[dict[str, Any]]:
        """New complete events (at most `max_bytes` read per call, so one call stays short)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read(max_bytes)
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        *lines, self._partial = data.split(b"\n")
        events = []
        for line in lines:
            if line.strip():
                try:
                    event = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                    continue  # a torn line from a crashed writer: skip, keep following
                if well_formed(event):
                    events.append(event)
        return events


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """All events of a run directory as their JSON objects (for a DataFrame; `read_run_events`
    types them); a last line still being written is skipped.

    FileNotFoundError when the run has no events.jsonl.
    """
    path = Path(run_dir) / EVENTS
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    tail, events = EventTail(path), []
    while True:
        chunk = tail.read(1 << 30)
        if not chunk:
            return events
        events += chunk


def read_run_events(run_dir: Path) -> list[Event]:
    """All events of a run directory, typed (labavg.base.events); what this labavg cannot read
    as an event (a type it does not know) is left out. FileNotFoundError without events.jsonl."""
    return [e for e in map(event_from_dict, read_events(run_dir)) if e is not None]


@dataclass(frozen=True)
class RunRecord:
    """One run directory as found: its settings and, once it has ended, its summary.json."""

    path: Path
    config: TrainConfig | None  # None only for a summary.json without config.json that holds none
    summary: RunSummary | None
    damaged: str | None = None  # why a summary.json there was not used (file and field)

    @property
    def name(self) -> str:
        return self.path.name


def read_run(run_dir: Path) -> RunRecord:
    """A run directory read back once: its summary.json as a RunSummary (None until the run
    has ended) and its settings (config.json, or, without one, the settings the summary
    holds). UserError naming the file when the settings cannot be read (the summary's damage
    first, then config.json's: missing, damaged or from an older labavg); a damaged
    summary.json beside readable settings is kept in `damaged`, so that a list of runs still
    shows the run's settings."""
    run_dir = Path(run_dir)
    summary, damaged = None, None
    try:
        summary = load_summary(run_dir)
    except NotFinished:
        pass
    except (OSError, UserError) as exc:
        damaged = str(exc)
    try:
        config = read_run_config(run_dir / CONFIG)
    except (FileNotFoundError, UserError) as exc:
        if damaged is not None:
            raise UserError(damaged) from None  # the summary's damage first, as `labavg info` reads
        if not isinstance(exc, FileNotFoundError):
            raise
        if summary is None:
            raise UserError(f"{run_dir / CONFIG}: missing (not a labavg run directory)") from None
        config = summary.config  # what the run trained with, as its summary records it (if it does)
    return RunRecord(run_dir, config, summary, damaged)


def list_runs(root: Path, problems: list[str] | None = None, *,
              search: bool = False) -> list[RunRecord]:
    """The runs directly under `root`, by name; a directory without config.json is not a run
    (yet). With `search`, `root` itself when it is a run, else every run below it (a run's
    own folders are not searched; a run is a directory with config.json or summary.json).
    Each run that cannot be read in full (its config.json damaged or from an older labavg:
    left out; its summary.json damaged: listed by its settings) adds one line naming the
    file to `problems`, when given."""
    root = Path(root).expanduser()
    records = []
    if search:
        found = _runs_below(root, problems if problems is not None else [])
    else:
        found = [d for d in (sorted(root.iterdir()) if root.is_dir() else [])
                 if (d / CONFIG).is_file()]
    for run_dir in found:
        try:
            records.append(read_run(run_dir))
        except (OSError, UserError) as exc:
            if problems is not None:
                problems.append(str(exc))
            continue
        if problems is not None and records[-1].damaged:
            problems.append(records[-1].damaged)
    return records


def _runs_below(top: Path, problems: list[str]) -> list[Path]:
    """`top` if it is a run, else every run below it, numbers in names compared as numbers
    (a sweep's ranks_1, ranks_2, ..., ranks_16); a folder that cannot be listed is added to
    `problems` and the search goes on. UserError when `top` holds no run."""
    if not top.exists():
        raise UserError(f"{top}: no such run or directory")
    if not top.is_dir():
        raise UserError(f"{top}: not a run directory (a run is a directory with {CONFIG} or "
                        f"{SUMMARY})")
    natural = lambda name: [(0, int(t), "") if t.isdigit() else (1, 0, t)  # noqa: E731
                            for t in re.split(r"(\d+)", name)]
    found, unreadable = [], []
    on_error = lambda exc: unreadable.append(f"cannot read {exc.filename}: {exc.strerror}")  # noqa: E731
    for here, dirs, files in os.walk(top, onerror=on_error):
        if CONFIG in files or SUMMARY in files:
            found.append(Path(here))
            dirs[:] = []
        else:
            dirs.sort(key=natural)
    problems += unreadable
    if not found and not unreadable:
        raise UserError(f"{top}: no labavg run in it or below it (no {CONFIG} or {SUMMARY})")
    return found


def flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict as one level with dotted keys ("model.hidden_dim")."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flatten_config(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _setting_text(key: str, value: Any) -> str:
    number = f"{value:g}" if isinstance(value, float) else str(value)
    named = {"ranks": f"n{value}", "K": f"K={value}", "lr": f"lr {number}",
             "final_lr": f"final lr {number}" if value is not None else "final lr 0.01 x lr",
             "model": str(value), "minibatch": f"minibatch {value}",
             "epochs": f"{value} epoch{'' if value == 1 else 's'}",
             "optimizer": str(value), "schedule": str(value), "pretrain": f"pretrain {value}",
             "backend": str(value), "seed": f"seed {value}",
             "data.data": Path(str(value)).name}
    return named.get(key, f"{key.split('.')[-1]}={number}")


def differing_labels(configs: dict[str, TrainConfig]) -> dict[str, str]:
    """A label per run made of the settings that differ between the runs ("n2 K=50 lr 0.016").

    Ranks, K and learning rate first (what a comparison of averaging varies), then the rest
    in the config's order; the model shape as one setting ("4x512"), K as trained
    (TrainConfig.effective_average_every). Runs whose settings are all equal are told apart by
    their names.
    """
    skip = {"out", "averaging.average_every", "averaging.average_every_frames",
            "model.hidden_layers", "model.hidden_dim"}
    flat = {}
    for name, cfg in configs.items():
        values = {k: v for k, v in flatten_config(to_dict(cfg)).items() if k not in skip}
        values.update(K=cfg.effective_average_every(),
                      model=f"{cfg.model.hidden_layers}x{cfg.model.hidden_dim}")
        flat[name] = values
    keys: list[str] = []
    for values in flat.values():
        keys += [k for k in values if k not in keys]
    differ = [k for k in keys
              if len({repr(values.get(k)) for values in flat.values()}) > 1]
    first = [k for k in ("ranks", "K", "lr") if k in differ]
    differ = first + [k for k in differ if k not in first]
    labels = {name: " ".join(_setting_text(k, values.get(k)) for k in differ) or name
              for name, values in flat.items()}
    seen: dict[str, int] = {}
    for label in labels.values():
        seen[label] = seen.get(label, 0) + 1
    return {name: label if seen[label] == 1 or label == name else f"{label} ({name})"
            for name, label in labels.items()}
