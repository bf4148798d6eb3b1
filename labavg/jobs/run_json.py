"""The JSON files of a run directory (config.json, summary.json) and RunSummary, a run's
results declared once.

RunSummary is summary.json: each field says once where its value comes from as the run ends
(`source`: the run's TrainConfig, rank 0's RunStarted or RunFinished event, or a derivation
of them; labavg.jobs.summary.make_summary follows it), and its annotation is the type every
reader checks the file's value against (SUMMARY_FIELDS), so that a damaged run is named with
its file and field instead of ending a reader of many. `to_dict` writes the file's object and
`from_dict` reads it back; labavg.jobs.summary.load_summary is the one reader of the file.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labavg.base.json_files import (FLAG, INT, INTS, NUMBER, NUMBERS_BY_NAME, OBJECT, PAIR,
                                     PAIRS, TEXT, check_fields, load_json)
from labavg.base.settings import to_dict
from labavg.training.config import TrainConfig, config_from_dict

CONFIG = "config.json"
SUMMARY = "summary.json"


def _from(path: str | None) -> Any:
    """A field whose value, as the run ends, is at attribute path `path` of what ended it
    (labavg.jobs.summary.RunEnd): "config.lr" (the run's TrainConfig), "started.size" (rank
    0's RunStarted), "finished.step" (its RunFinished), or a derivation ("comm_fraction",
    "speedup.low"). None: filled in after the run (the decode's fields)."""
    return dataclasses.field(default=None, metadata={"source": path})


@dataclass(frozen=True)
class RunSummary:
    """summary.json: what rank 0 writes as a run ends, in the file's order. A field is None in
    a summary written before the field existed, and the decode's fields (wer ... decode_set)
    until the run has decoded."""

    ranks: int | None = _from("started.size")
    backend: str | None = _from("config.backend")
    average_every: int | None = _from("started.average_every")  # K as trained
    averaging: str | None = _from("started.averaging")
    reduce: str | None = _from("started.reduce")
    payload: str | None = _from("started.payload")
    optimizer: str | None = _from("config.optimizer")
    pretrain: str | None = _from("config.pretrain")
    schedule: str | None = _from("config.schedule")
    minibatch: int | None = _from("config.minibatch")
    epochs: int | None = _from("config.epochs")
    lr: float | None = _from("config.lr")
    effective_lr: float | None = _from("started.effective_lr")
    num_params: int | None = _from("started.num_params")
    num_pdfs: int | None = _from("started.num_pdfs")
    frames_trained: int | None = _from("finished.frames_trained")
    steps: int | None = _from("finished.step")
    averaging_rounds: int | None = _from("finished.averaging_rounds")
    cv_frame_accuracy: float | None = _from("finished.cv_frame_accuracy")
    cv_loss: float | None = _from("finished.cv_loss")
    wall_seconds: float | None = _from("finished.wall_seconds")
    compute_seconds: float | None = _from("finished.compute_seconds")
    comm_seconds: float | None = _from("finished.comm_seconds")
    bytes_per_round: int | None = _from("started.bytes_per_round")
    bytes_sent: int | None = _from("finished.bytes_sent")
    hierarchy_every: int | None = _from("started.hierarchy_every")
    node_ranks: int | None = _from("started.node_ranks")
    node_rounds: int | None = _from("finished.node_rounds")
    node_bytes_sent: int | None = _from("finished.node_bytes_sent")
    all_rounds: int | None = _from("all_rounds")
    all_bytes_sent: int | None = _from("all_bytes_sent")
    stopped: bool | None = _from("finished.stopped")
    comm_fraction: float | None = _from("comm_fraction")
    overlap: str | None = _from("started.overlap")
    fragment_bytes: list[int] | None = _from("fragment_bytes")
    overlap_bytes_sent: int | None = _from("finished.overlap_bytes_sent")
    comm_wait_seconds: float | None = _from("finished.wait_seconds")
    comm_hidden_fraction: float | None = _from("comm_hidden_fraction")
    cores: int | None = _from("started.cores")
    load_average: dict[str, float] | None = _from("load")  # "start", "end": 1-minute loads
    speedup_pairs: list[list[float]] | None = _from("speedup_pairs")  # (solo, parallel) s
    config: TrainConfig | None = _from("config")
    speedup: float | None = _from("speedup.value")
    speedup_low: float | None = _from("speedup.low")
    speedup_high: float | None = _from("speedup.high")
    speedup_bound: float | None = _from("speedup.bound")
    speedup_flag: str | None = _from("speedup.flag")
    parallel_efficiency: float | None = _from("speedup.efficiency")
    speedup_text: str | None = _from("speedup_text")
    resumed: bool | None = _from("resumed")
    wer: float | None = _from(None)
    wer_ci: list[float] | None = _from(None)
    per: float | None = _from(None)
    per_ci: list[float] | None = _from(None)
    acwt: float | None = _from(None)
    decode_set: str | None = _from(None)
    # An elastic run (on_rank_loss = "continue"): the workers present from each step on (the
    # start and each change), and the frames the lost workers' shards left untrained.
    worker_steps: list[int] | None = _from("worker_steps")
    worker_counts: list[int] | None = _from("worker_counts")
    frames_untrained: int | None = _from("frames_untrained")
    # The whole time of the command that ran it, from its start (the `labavg train` process's,
    # or start_run's call in a longer-lived process) to final.pt on disk: the training wall
    # plus start-up (imports, checks, data, launch) and the model's export. None for a resumed
    # run (its earlier parts' commands are not known) and for runs on a cluster's engines.
    process_seconds: float | None = _from("process_seconds")

    def to_dict(self) -> dict[str, Any]:
        """summary.json's object (the config as config.json writes it)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "summary") -> RunSummary:
        """A RunSummary from summary.json's object (checked against SUMMARY_FIELDS by its
        reader). Fields it does not know are left out (a newer labavg's); a config that
        TrainConfig cannot read is a UserError naming `source`."""
        known = {f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values}
        if known.get("config") is not None and not isinstance(known["config"], TrainConfig):
            known["config"] = config_from_dict(known["config"], f"{source}: config")
        return cls(**known)

    @property
    def load_at_start(self) -> float | None:
        return (self.load_average or {}).get("start")


def _plain(value: Any) -> Any:
    return to_dict(value) if dataclasses.is_dataclass(value) else value


def summary_sources() -> dict[str, str]:
    """Each field of RunSummary known as the run ends, and the attribute path it comes from."""
    return {f.name: f.metadata["source"] for f in dataclasses.fields(RunSummary)
            if f.metadata["source"] is not None}


# The type of each field of a RunSummary, as a reader checks summary.json's value of it
# (labavg.base.json_files); None is allowed for every one (a run without a decode has no wer).
# In this declaration a list of floats is always a (low, high) pair.
_KINDS = {int: INT, float: NUMBER, str: TEXT, bool: FLAG, TrainConfig: OBJECT, list[int]: INTS,
          list[float]: PAIR, list[list[float]]: PAIRS, dict[str, float]: NUMBERS_BY_NAME}


def _kind(hint: Any) -> str:
    [value] = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return _KINDS[value]


SUMMARY_FIELDS = {name: _kind(hint) for name, hint in typing.get_type_hints(RunSummary).items()}
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


def as_summary(summary: RunSummary | Mapping[str, Any]) -> RunSummary:
    """A RunSummary of either form a summary is handed around in: typed, or summary.json's
    object (what a notebook or a results file holds)."""
    return summary if isinstance(summary, RunSummary) else RunSummary.from_dict(summary)


def read_run_config(path: Path) -> TrainConfig:
    """A run's config.json as its TrainConfig (types checked, not validated: a run directory
    records what ran); FileNotFoundError when missing, UserError naming the file when it is
    damaged or from an older labavg."""
    return config_from_dict(check_fields(load_json(path), CONFIG_FIELDS, path, "configuration"),
                            str(path))
