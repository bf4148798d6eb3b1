"""The runs index: reading run directories back, for `labavg info`, sweeps, the reproduction,
the dashboard and notebooks.

    EventTail / read_events   the one reader of events.jsonl (a growing file, or a finished one);
    read_run_events           its events typed (labavg.base.events)
    read_run / list_runs      a run directory read back once, typed: its TrainConfig and its
                              RunSummary (labavg.jobs.run_json); the runs under a directory
    run_row                   the one projection of a run into a table row (every table's
                              source; its columns are labavg.jobs.columns')

A row's K is the effective averaging interval (`averaging.average_every_frames` turned into
minibatches when it is set, TrainConfig.average_interval), as summary.json records it: every
table shows the K the run trained with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from labavg.jobs.speedup import speedup_from_summary
from labavg.base.errors import UserError
from labavg.base.events import Event, event_from_dict
from labavg.base.settings import to_dict
from labavg.jobs.run_json import RunSummary, as_summary, read_run_config, read_run_summary
from labavg.training.config import TrainConfig

EVENTS = "events.jsonl"
SUMMARY = "summary.json"
CONFIG = "config.json"

class EventTail:
    """Reads the lines appended to an events.jsonl since the last call.

    A last line without its newline is still being written: it is kept and completed by the
    next read, so a reader never parses half a JSON object.
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
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a torn line from a crashed writer: skip, keep following
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
    config: TrainConfig
    summary: RunSummary | None
    damaged: str | None = None  # why a summary.json there was not used (file and field)

    @property
    def name(self) -> str:
        return self.path.name


def read_run(run_dir: Path) -> RunRecord:
    """A run directory read back once: its config.json as a TrainConfig and its summary.json
    as a RunSummary (None until the run has ended). UserError naming the file when its
    config.json is missing, damaged or from an older labavg; a damaged summary.json is kept
    in `damaged`, so that a list of runs still shows the run's settings."""
    run_dir = Path(run_dir)
    try:
        config = read_run_config(run_dir / CONFIG)
    except FileNotFoundError:
        raise UserError(f"{run_dir / CONFIG}: missing (not a labavg run directory)") from None
    try:
        return RunRecord(run_dir, config, read_run_summary(run_dir / SUMMARY))
    except FileNotFoundError:
        return RunRecord(run_dir, config, None)
    except (OSError, UserError) as exc:
        return RunRecord(run_dir, config, None, damaged=str(exc))


def list_runs(root: Path, problems: list[str] | None = None) -> list[RunRecord]:
    """The runs directly under `root`, by name; a directory without config.json is not a run
    (yet). Each run that cannot be read in full (its config.json damaged or from an older
    labavg: left out; its summary.json damaged: listed by its settings) adds one line naming
    the file to `problems`, when given."""
    root = Path(root).expanduser()
    records = []
    for run_dir in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            records.append(read_run(run_dir))
        except (OSError, UserError) as exc:
            if problems is not None and (run_dir / CONFIG).is_file():
                problems.append(str(exc))
            continue
        if problems is not None and records[-1].damaged:
            problems.append(records[-1].damaged)
    return records


def _payload_name(config: TrainConfig) -> str:
    """What a run's rounds send, as summary.json names it: fp32, bf16, fp16, int4/8/16."""
    payload = config.averaging.payload
    return f"int{config.averaging.payload_bits}" if payload == "int" else payload


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def run_row(name: str, config: TrainConfig | None, summary: RunSummary | None) -> dict[str, Any]:
    """The row every table of runs is cut from (labavg.jobs.columns): settings from the
    config, results from the summary (its settings first: what the run trained with).

    Results are None until the run has a summary; `status` is finished, stopped or
    running/incomplete. `config` is None for a summary that does not hold one.
    """
    s = summary if summary is not None else RunSummary()
    cfg = config
    low, high = s.wer_ci or (None, None)
    status = "running/incomplete" if summary is None else ("stopped" if s.stopped else "finished")
    return {
        "run": name, "status": status, "backend": _first(cfg and cfg.backend, s.backend),
        "ranks": _first(s.ranks, cfg and cfg.ranks),
        "average_every": _first(s.average_every, cfg and cfg.average_interval()),
        "averaging": _first(s.averaging, cfg and cfg.averaging.method, "model"),
        "reduce": _first(s.reduce, cfg and cfg.averaging.reduce, "allreduce"),
        "payload": _first(s.payload, cfg and _payload_name(cfg), "fp32"),
        "optimizer": _first(cfg and cfg.optimizer, s.optimizer),
        "lr": _first(cfg and cfg.lr, s.lr), "schedule": _first(cfg and cfg.schedule, s.schedule),
        "pretrain": _first(cfg and cfg.pretrain, s.pretrain),
        "minibatch": _first(cfg and cfg.minibatch, s.minibatch),
        "epochs": _first(cfg and cfg.epochs, s.epochs), "seed": cfg and cfg.seed,
        "model": cfg and f"{cfg.model.hidden_layers}x{cfg.model.hidden_dim}",
        "wer": s.wer, "wer_ci_low": low, "wer_ci_high": high, "per": s.per,
        "cv_frame_accuracy": s.cv_frame_accuracy, "cv_loss": s.cv_loss,
        "wall_seconds": s.wall_seconds, "compute_seconds": s.compute_seconds,
        "comm_seconds": s.comm_seconds, "comm_fraction": s.comm_fraction,
        "bytes_sent": s.bytes_sent, "steps": s.steps, "averaging_rounds": s.averaging_rounds,
        **_speedup_columns(summary),
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
    (TrainConfig.average_interval). Runs whose settings are all equal are told apart by
    their names.
    """
    skip = {"out", "averaging.average_every", "averaging.average_every_frames",
            "model.hidden_layers", "model.hidden_dim"}
    flat = {}
    for name, cfg in configs.items():
        values = {k: v for k, v in flatten_config(to_dict(cfg)).items() if k not in skip}
        values.update(K=cfg.average_interval(),
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
