"""The JSON files of a run directory (config.json, summary.json) read back as untrusted
input (labavg.base.json_files): each field a table or a speedup formats is checked for its
type, so a damaged run is named with its file and field instead of ending a reader of many.

RunSummary is summary.json's fields, declared once: its writer (labavg.jobs.summary.make_summary)
builds one and writes `to_dict`, and every reader gets one back (`summary_of`), so that the
file's writer and its readers cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labavg.base.json_files import (FLAG, INT, NUMBER, OBJECT, PAIR, PAIRS, TEXT, check_fields,
                                     load_json)
from labavg.base.settings import to_dict
from labavg.training.config import TrainConfig, config_from_dict

# The fields each reader uses, with the type it needs; None is allowed for every one of them
# (a run without a decode has no wer). Fields not named are kept but never formatted.
SUMMARY_FIELDS = {
    "ranks": INT, "average_every": INT, "steps": INT, "epochs": INT, "minibatch": INT,
    "averaging_rounds": INT, "num_params": INT, "cores": INT, "speedup_pairs": PAIRS,
    "load_average.start": NUMBER, "load_average.end": NUMBER,
    "lr": NUMBER, "wall_seconds": NUMBER, "compute_seconds": NUMBER, "comm_seconds": NUMBER,
    "comm_fraction": NUMBER, "cv_frame_accuracy": NUMBER, "cv_loss": NUMBER, "wer": NUMBER,
    "per": NUMBER, "speedup": NUMBER, "parallel_efficiency": NUMBER, "bytes_sent": NUMBER,
    "frames_trained": NUMBER, "baseline_wall_seconds": NUMBER, "acwt": NUMBER,
    "wer_ci": PAIR, "per_ci": PAIR,
    "averaging": TEXT, "reduce": TEXT, "payload": TEXT, "optimizer": TEXT, "backend": TEXT,
    "schedule": TEXT, "stopped": FLAG, "config": OBJECT, "load_average": OBJECT,
}
# No "averaging": OBJECT: an older labavg's config.json has `averaging` as text, and
# TrainConfig's refusal says where its settings went.
CONFIG_FIELDS = {
    "ranks": INT, "minibatch": INT, "epochs": INT, "seed": INT, "lr": NUMBER, "final_lr": NUMBER,
    "backend": TEXT, "optimizer": TEXT, "schedule": TEXT, "out": TEXT, "model": OBJECT,
    "data": OBJECT, "model.hidden_layers": INT, "model.hidden_dim": INT,
    "model.nonlinearity": TEXT, "averaging.average_every": INT,
    "averaging.average_every_frames": INT, "averaging.payload_bits": INT,
    "averaging.method": TEXT, "averaging.reduce": TEXT, "averaging.payload": TEXT,
}


def read_config_file(path: Path) -> dict[str, Any]:
    """A run's config.json, checked (FileNotFoundError when missing)."""
    return check_fields(load_json(path), CONFIG_FIELDS, path, "configuration")


def read_summary_file(path: Path) -> dict[str, Any]:
    """A run's summary.json, checked, its config included (FileNotFoundError when missing)."""
    summary = check_fields(load_json(path), SUMMARY_FIELDS, path, "summary")
    if isinstance(summary.get("config"), dict):
        check_fields(summary, {f"config.{k}": v for k, v in CONFIG_FIELDS.items()}, path,
                     "summary")
    return summary


@dataclass(frozen=True)
class RunSummary:
    """summary.json: what rank 0 writes as a run ends (labavg.jobs.summary.make_summary). A
    field is None in a summary written before the field existed, and the decode's fields
    (wer ... decode_set) until the run has decoded."""

    ranks: int | None = None
    backend: str | None = None
    average_every: int | None = None  # K as trained (average_every_frames turned into minibatches)
    averaging: str | None = None
    reduce: str | None = None
    payload: str | None = None
    optimizer: str | None = None
    pretrain: str | None = None
    schedule: str | None = None
    minibatch: int | None = None
    epochs: int | None = None
    lr: float | None = None
    effective_lr: float | None = None
    num_params: int | None = None
    num_pdfs: int | None = None
    frames_trained: int | None = None
    steps: int | None = None
    averaging_rounds: int | None = None
    cv_frame_accuracy: float | None = None
    cv_loss: float | None = None
    wall_seconds: float | None = None
    compute_seconds: float | None = None
    comm_seconds: float | None = None
    bytes_per_round: int | None = None
    bytes_sent: int | None = None
    hierarchy_every: int | None = None
    node_ranks: int | None = None
    node_rounds: int | None = None
    node_bytes_sent: int | None = None
    all_rounds: int | None = None
    all_bytes_sent: int | None = None
    stopped: bool | None = None
    comm_fraction: float | None = None
    overlap: str | None = None
    fragment_bytes: list[int] | None = None
    overlap_bytes_sent: int | None = None
    comm_wait_seconds: float | None = None
    comm_hidden_fraction: float | None = None
    cores: int | None = None
    load_average: dict[str, float] | None = None  # "start", "end": 1-minute load averages
    speedup_pairs: list[list[float]] | None = None  # (solo, parallel) s per minibatch
    config: TrainConfig | None = None
    speedup: float | None = None
    speedup_low: float | None = None
    speedup_high: float | None = None
    speedup_bound: float | None = None
    speedup_flag: str | None = None
    parallel_efficiency: float | None = None
    speedup_text: str | None = None
    resumed: bool | None = None
    wer: float | None = None
    wer_ci: list[float] | None = None
    per: float | None = None
    per_ci: list[float] | None = None
    acwt: float | None = None
    decode_set: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """summary.json's object (the config as config.json writes it)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["config"] = None if self.config is None else to_dict(self.config)
        return out

    @property
    def load_at_start(self) -> float | None:
        return (self.load_average or {}).get("start")


SUMMARY_KEYS = frozenset(f.name for f in dataclasses.fields(RunSummary))


def summary_of(values: Mapping[str, Any], source: str = "summary") -> RunSummary:
    """A RunSummary from summary.json's object (checked by `read_summary_file`, or a summary
    `run_training` returned). Fields it does not know are left out (a newer labavg's); its
    config that TrainConfig cannot read is a UserError naming `source`."""
    known = {k: v for k, v in values.items() if k in SUMMARY_KEYS and k != "config"}
    config = values.get("config")
    if config is not None:
        known["config"] = (config if isinstance(config, TrainConfig)
                           else config_from_dict(config, f"{source}: config"))
    return RunSummary(**known)


def as_summary(summary: RunSummary | Mapping[str, Any]) -> RunSummary:
    """A RunSummary of either form a summary is handed around in: typed, or summary.json's
    object (what `run_training` returns, what a notebook or a results file holds)."""
    return summary if isinstance(summary, RunSummary) else summary_of(summary)


def read_run_summary(path: Path) -> RunSummary:
    """A run's summary.json as a RunSummary; UserError naming the file when it is damaged
    (FileNotFoundError when missing)."""
    return summary_of(read_summary_file(path), str(path))


def read_run_config(path: Path) -> TrainConfig:
    """A run's config.json as its TrainConfig (types checked, not validated: a run directory
    records what ran); UserError naming the file when it is damaged or from an older labavg."""
    return config_from_dict(read_config_file(path), str(path))
