"""The JSON files of a run directory (config.json, summary.json) read back as untrusted
input (labavg.base.json_files): each field a table or a speedup formats is checked for its
type, so a damaged run is named with its file and field instead of ending a reader of many.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from labavg.base.json_files import (FLAG, INT, NUMBER, OBJECT, PAIR, PAIRS, TEXT, check_fields,
                                     load_json)

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
CONFIG_FIELDS = {
    "ranks": INT, "average_every": INT, "average_every_frames": INT, "minibatch": INT,
    "epochs": INT, "seed": INT, "payload_bits": INT, "lr": NUMBER, "final_lr": NUMBER,
    "backend": TEXT, "optimizer": TEXT, "schedule": TEXT, "averaging": TEXT, "reduce": TEXT,
    "payload": TEXT, "out": TEXT, "model": OBJECT, "data": OBJECT,
    "model.hidden_layers": INT, "model.hidden_dim": INT, "model.nonlinearity": TEXT,
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
