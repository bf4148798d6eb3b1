"""The runs index: reading run directories back, for `labavg info`, sweeps, the reproduction,
the dashboard and notebooks.

    EventTail / read_events   the one reader of events.jsonl (a growing file, or a finished one)
    list_runs                 the runs under a directory: name, config and summary of each
    run_row                   the one projection of a run into a table row (every table's source)

A row's K is the effective averaging interval (`average_every_frames` turned into minibatches
when it is set), as summary.json records it: every table shows the K the run trained with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labavg.jobs.speedup import speedup_from_summary
from labavg.base.errors import UserError
from labavg.jobs.run_json import load_json, read_config_file, read_summary_file

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
    """All events of a run directory as dicts; a last line still being written is skipped.

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


def read_json(path: Path) -> Any:
    """The JSON in `path`, or None when it is missing or not (yet) valid (binary, too deep,
    unreadable: labavg.jobs.run_json says which)."""
    try:
        return load_json(path)
    except (OSError, UserError):
        return None


@dataclass(frozen=True)
class RunRecord:
    """One run directory as found: its config.json and, once it has ended, its summary.json."""

    path: Path
    config: dict[str, Any]
    summary: dict[str, Any] | None
    damaged: str | None = None  # why a summary.json there was not used (file and field)

    @property
    def name(self) -> str:
        return self.path.name


def list_runs(root: Path) -> list[RunRecord]:
    """The runs directly under `root`, by name; a directory without config.json is not a run yet."""
    root = Path(root).expanduser()
    records = []
    for run_dir in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            config = read_config_file(run_dir / CONFIG)
        except (OSError, UserError):
            continue
        try:
            records.append(RunRecord(run_dir, config, read_summary_file(run_dir / SUMMARY)))
        except FileNotFoundError:
            records.append(RunRecord(run_dir, config, None))
        except (OSError, UserError) as exc:
            records.append(RunRecord(run_dir, config, None, damaged=str(exc)))
    return records


def effective_k(config: dict[str, Any]) -> int | None:
    """The minibatches between averaging rounds a config dict trains with (TrainConfig's rule)."""
    frames, minibatch = config.get("average_every_frames"), config.get("minibatch")
    if frames is not None and minibatch:
        return max(1, round(frames / minibatch))
    return config.get("average_every")


def _payload_name(config: dict[str, Any]) -> str:
    """What a run's rounds send, as summary.json names it: fp32, bf16, fp16, int4/8/16."""
    payload = config.get("payload", "fp32")
    return f"int{config.get('payload_bits', 8)}" if payload == "int" else payload


def run_row(name: str, config: dict[str, Any], summary: dict[str, Any] | None) -> dict[str, Any]:
    """The row every table of runs is cut from: settings from the config, results from the summary.

    Results are None until the run has a summary; `status` is finished, stopped or
    running/incomplete.
    """
    s = summary or {}
    model = config.get("model", {})
    low, high = s.get("wer_ci") or (None, None)
    status = "running/incomplete" if summary is None else ("stopped" if s.get("stopped") else "finished")
    return {
        "run": name, "status": status, "backend": config.get("backend"),
        "ranks": s.get("ranks", config.get("ranks")),
        "average_every": s.get("average_every", effective_k(config)),
        "averaging": s.get("averaging", config.get("averaging", "model")),
        "reduce": s.get("reduce", config.get("reduce", "allreduce")),
        "payload": s.get("payload") or _payload_name(config),
        "optimizer": config.get("optimizer"), "lr": config.get("lr"),
        "schedule": config.get("schedule"), "pretrain": config.get("pretrain"),
        "minibatch": config.get("minibatch"), "epochs": config.get("epochs"),
        "seed": config.get("seed"),
        "model": f"{model.get('hidden_layers')}x{model.get('hidden_dim')}",
        "wer": s.get("wer"), "wer_ci_low": low, "wer_ci_high": high, "per": s.get("per"),
        "cv_frame_accuracy": s.get("cv_frame_accuracy"), "cv_loss": s.get("cv_loss"),
        "wall_seconds": s.get("wall_seconds"), "compute_seconds": s.get("compute_seconds"),
        "comm_seconds": s.get("comm_seconds"), "comm_fraction": s.get("comm_fraction"),
        "bytes_sent": s.get("bytes_sent"),
        **_speedup_columns(summary),
    }


def _speedup_columns(summary: dict[str, Any] | None) -> dict[str, Any]:
    """A row's speedup, as labavg.jobs.speedup reads it from the summary (None before the run
    ends, and for a summary from before paired measurements)."""
    speedup = speedup_from_summary(summary) if summary is not None else None
    if speedup is None:
        return {"speedup": None, "speedup_low": None, "speedup_high": None,
                "parallel_efficiency": None, "speedup_flag": None, "cores": None}
    return {"speedup": speedup.value, "speedup_low": speedup.low, "speedup_high": speedup.high,
            "parallel_efficiency": speedup.efficiency, "speedup_flag": speedup.flag,
            "cores": speedup.cores or None}


def summary_row(name: str, summary: dict[str, Any]) -> dict[str, Any]:
    """`run_row` of a finished run from its summary.json alone (which holds its config)."""
    return run_row(name, summary.get("config", {}), summary)


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


def differing_labels(configs: dict[str, dict[str, Any]]) -> dict[str, str]:
    """A label per run made of the settings that differ between the runs ("n2 K=50 lr 0.016").

    Ranks, K and learning rate first (what a comparison of averaging varies), then the rest
    in the config's order; the model shape as one setting ("4x512"), K as trained
    (`effective_k`). Runs whose settings are all equal are told apart by their names.
    """
    skip = {"out", "average_every", "average_every_frames", "model.hidden_layers",
            "model.hidden_dim"}
    flat = {}
    for name, config in configs.items():
        values = {k: v for k, v in flatten_config(config).items() if k not in skip}
        model = config.get("model", {})
        values.update(K=effective_k(config),
                      model=f"{model.get('hidden_layers')}x{model.get('hidden_dim')}")
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
