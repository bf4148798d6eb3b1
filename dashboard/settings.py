"""The dashboard's controls of the next run, generated from the settings' schema.

Each control names a TrainConfig setting: its type, choices, help text and lower bound come
from `labavg.config` (where the setting is declared); the dashboard adds only its own default
(small runs, for interactive use), its label and the upper end of a number box.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import param

from labavg.config import TrainConfig, _field_types, setting_field, validate, with_overrides
from labavg.errors import UserError
from labavg.index import effective_k

BACKEND_LABELS = {"in-process workers": "inproc", "MPI engines": "mpi"}
# dotted TrainConfig key of each control, by the control's name (the key's last part)
CONTROLS: dict[str, str] = {}


def control(key: str, default: Any, label: str, high: float | None = None) -> param.Parameter:
    """A param Parameter for setting `key`, checked as `labavg.config` checks it."""
    f = setting_field(key)
    CONTROLS[key.split(".")[-1]] = key
    rule, doc = f.metadata["rule"], f.metadata["help"]
    hint = _field_types_of(key)
    kind = next(a for a in getattr(hint, "__args__", None) or (hint,) if a is not type(None))
    optional = kind is not hint
    common = {"default": default, "label": label, "doc": doc, "allow_None": optional}
    if rule is not None and rule.choices:
        return param.Selector(objects=list(rule.choices), **common)
    if kind is str:
        return param.String(**common)
    low = None if rule is None or rule.low is None or math.isinf(rule.low) else rule.low
    if rule is not None and rule.high is not None:
        high = rule.high if high is None else min(high, rule.high)
    if kind is int:
        return param.Integer(bounds=(low, high), **common)
    return param.Number(bounds=(low, high),
                        inclusive_bounds=(not (rule is not None and rule.low_open), True), **common)


def _field_types_of(key: str) -> Any:
    cls: Any = TrainConfig
    *parents, leaf = key.split(".")
    for part in parents:
        cls = _field_types(cls)[part]
    return _field_types(cls)[leaf]


class RunSettings(param.Parameterized):
    """The controls of the next run. Changing them never touches the run on screen."""

    backend = param.Selector(default="in-process workers", objects=list(BACKEND_LABELS), label="backend",
                             doc="in-process workers: threads of the dashboard; MPI engines: ipyparallel")
    ranks = control("ranks", 2, "ranks", high=64)
    average_every = control("average_every", 10, "K (average every)", high=100000)
    lr = control("lr", 0.008, "learning rate", high=10.0)
    final_lr = control("final_lr", None, "final lr", high=10.0)
    schedule = control("schedule", "exponential", "schedule")
    optimizer = control("optimizer", "sgd", "optimizer")
    pretrain = control("pretrain", "none", "pretrain")
    minibatch = control("minibatch", 256, "minibatch", high=65536)
    epochs = control("epochs", 2, "epochs", high=1000)
    hidden_layers = control("model.hidden_layers", 2, "hidden layers", high=16)
    hidden_dim = control("model.hidden_dim", 256, "hidden units", high=8192)
    context = control("data.context", 5, "context", high=50)
    data = control("data.data", "corpus", "data directory")
    runs_dir = param.String(default="runs", label="runs directory")
    overrides = param.Dict(default={}, doc="more TrainConfig settings as dotted keys (not shown)")

    def to_config(self, out: str | Path) -> TrainConfig:
        """The validated TrainConfig of a run written to `out`; UserError names a bad value."""
        data_dir = Path(self.data).expanduser()
        if not data_dir.exists():
            raise UserError(f"data: {data_dir} does not exist (make one with `labavg corpus synth`)")
        values = {key: getattr(self, name) for name, key in CONTROLS.items()}
        values.update({"out": str(out), "backend": BACKEND_LABELS[self.backend],
                       "tensorboard": False, "data.data": str(data_dir), **self.overrides})
        return validate(with_overrides(TrainConfig(), values))

    def check(self) -> str | None:
        """What is wrong with the settings as a message, or None when a run could start."""
        try:
            self.to_config(Path(self.runs_dir) / "check")
        except UserError as exc:
            return str(exc)
        return None


def describe_config(cfg: dict[str, Any]) -> str:
    """One line saying what a run (given its config dict) trains, for the page header."""
    model = cfg.get("model", {})
    data = cfg.get("data", {})
    final = cfg.get("final_lr")
    lr = f"lr {cfg.get('lr'):g}" + (f"→{final:g}" if final is not None else "")
    backend = {"inproc": "in-process", "mpi": "MPI"}.get(cfg.get("backend"), cfg.get("backend"))
    return (f"{backend} × {cfg.get('ranks')} ranks · K={effective_k(cfg)} · "
            f"{cfg.get('optimizer')} {lr} ({cfg.get('schedule')}) · pretrain {cfg.get('pretrain')} · "
            f"minibatch {cfg.get('minibatch')} · {cfg.get('epochs')} epochs · "
            f"{model.get('hidden_layers')}×{model.get('hidden_dim')} · data {Path(str(data.get('data'))).name}")


def new_run_dir(runs_dir: Path, ranks: int, average_every: int) -> Path:
    """A fresh, not yet existing run directory name under `runs_dir` (time, ranks and K)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = f"{stamp}-n{ranks}-k{average_every}"
    for i in range(1000):
        candidate = runs_dir / (base if i == 0 else f"{base}-{i}")
        if not candidate.exists():
            return candidate
    raise UserError(f"cannot find a free run directory name under {runs_dir}")
