"""The dashboard's controls of the next run, generated from the settings' schema.

Each control names a TrainConfig setting: its type, choices, help text and default come from
its section's module (where the setting is declared), so the dashboard starts with the CLI's run.
The dashboard adds only its label. Values are not bounded here: a bad value is kept, so that
the page can say what is wrong with it (`RunSettings.errors`, in `check_setting`'s words,
the CLI's) instead of quietly putting the old value back.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import param

from dashboard.corpus_fit import fit_problems
from labavg.averaging.registry import method_names, methods
from labavg.base.paths import check_directory
from labavg.base.settings import to_dict, with_overrides
from labavg.training.config import (PRESETS, TrainConfig, check_setting, config_from_dict,
                                    setting_field, setting_type, validate)
from labavg.data.dataset import check_data_source
from labavg.base.errors import UserError
from labavg.base.machine import usable_cores
from labavg.jobs.index import flatten_config

BACKEND_LABELS = {"in-process workers": "inproc", "MPI engines": "mpi"}
# dotted TrainConfig key of each control, by the control's name (the key's last part, unless
# `control` is given another)
CONTROLS: dict[str, str] = {}
DEFAULTS = "defaults"  # the preset of TrainConfig's own defaults
# The key of a problem that no single control owns (settings that contradict each other).
GENERAL = ""
# The schedule stays with K: it is how K goes during the run (post_local's frames with it), so
# a preset chosen after adacomm does not quietly put a constant K back.
_KEPT_BY_PRESETS = ("ranks", "average_every", "average_schedule", "post_local_frames", "data")
# What `_values` sets whatever the boxes say: never an override of a run shown in the boxes.
_SET_BY_THE_PAGE = ("out", "backend", "tensorboard")
# One box for the method chosen: the setting of its table that its declaration names as its
# `knob` (labavg.averaging.registry; BMUF's block momentum, DiLoCo's outer momentum); a method
# without one (plain averaging) leaves the box greyed out. Its label names the knob.
METHOD_BOX = "momentum"
# How labavg.training.config.check_model_size's refusal begins.
MODEL_TOO_BIG = "the model does not fit in memory"
# A per-frame learning rate above this gets a warning beside its box (Kaldi's are below 0.01).
LARGE_LR = 1.0


def _default(key: str) -> Any:
    f = setting_field(key)
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()


def control(key: str, label: str, name: str | None = None) -> param.Parameter:
    """A param Parameter for setting `key`, with the setting's default, choices and help;
    `name` is the control's (the RunSettings attribute), when not the key's last part."""
    f = setting_field(key)
    CONTROLS[name or key.split(".")[-1]] = key
    rule, doc = f.metadata["rule"], f.metadata["help"]
    hint = setting_type(key)
    kind = next(a for a in getattr(hint, "__args__", None) or (hint,) if a is not type(None))
    # allow_None everywhere: an emptied number box is a value to complain about, not a crash.
    common = {"default": _default(key), "label": label, "doc": doc, "allow_None": True}
    if rule is not None and rule.choices:
        return param.Selector(objects=list(rule.choices), **common)
    if kind is str:
        return param.String(**common)
    if kind is int:
        return param.Integer(**common)
    return param.Number(**common)


def method_knob(method: str | None) -> str | None:
    """The dotted setting the method box sets for averaging method `method`, or None."""
    declared = methods().get(method)
    return None if declared is None else declared.knob_key()


def knob_keys() -> list[str]:
    """The dotted setting of every registered method's box, in registration order."""
    return [key for m in methods().values() if (key := m.knob_key()) is not None]


def _backend_label(backend: str) -> str:
    return next(label for label, name in BACKEND_LABELS.items() if name == backend)


class RunSettings(param.Parameterized):
    """The controls of the next run. Changing them never touches the run on screen."""

    preset = param.Selector(default=DEFAULTS, objects=[DEFAULTS, *PRESETS], label="preset",
                            doc="defaults: TrainConfig's (labavg train's); a named preset "
                                "(labavg.training.config.PRESETS) changes what is trained, not ranks or K")
    backend = param.Selector(default=_backend_label(TrainConfig.backend), objects=list(BACKEND_LABELS),
                             label="backend",
                             doc="in-process workers: threads of the dashboard; MPI engines: ipyparallel")
    ranks = control("ranks", "ranks")
    average_every = control("averaging.average_every", "K (average every)")
    # Named as the CLI's flag (--average-schedule): `schedule` is the learning rate's.
    average_schedule = control("averaging.schedule", "K schedule", name="average_schedule")
    post_local_frames = control("averaging.post_local_frames", "post-local frames")
    # Named as the CLI's flag (--averaging): "method" alone says less beside the other boxes.
    averaging = control("averaging.method", "averaging method", name="averaging")
    # Typed by the first method with a knob; checked by the chosen method's rule (`key_of`).
    momentum = control(knob_keys()[0], "method momentum", name=METHOD_BOX)
    reduce = control("averaging.reduce", "reduce algorithm")
    payload = control("averaging.payload", "payload")
    payload_bits = control("averaging.payload_bits", "payload bits (int)")
    lr = control("lr", "learning rate")
    final_lr = control("final_lr", "final lr")
    schedule = control("schedule", "lr schedule")
    optimizer = control("optimizer", "optimizer")
    pretrain = control("pretrain", "pretrain")
    minibatch = control("minibatch", "minibatch")
    epochs = control("epochs", "epochs")
    hidden_layers = control("model.hidden_layers", "hidden layers")
    hidden_dim = control("model.hidden_dim", "hidden units")
    context = control("data.context", "context")
    data = control("data.data", "data directory")
    runs_dir = param.String(default="runs", label="runs directory")
    overrides = param.Dict(default={}, doc="more TrainConfig settings as dotted keys (not shown)")
    errors = param.Dict(default={}, doc="what is wrong, by control name (GENERAL: the settings "
                                        "together); empty when a run can start")
    warnings = param.Dict(default={}, doc="what will run but may surprise, by control name")
    typed = param.Dict(default={}, doc="text typed into a number box that is not a number, by "
                                       "control name (the setting keeps its last number)")

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self._showing_run = False
        self.param.averaging.objects = list(method_names())  # methods registered since import
        self._method = self.averaging  # the method whose knob the box holds (_on_method)
        self._update_errors()

    @param.depends("preset", watch=True)
    def _on_preset(self) -> None:
        if self._showing_run:
            return  # show_run sets every box itself
        values = {} if self.preset == DEFAULTS else PRESETS[self.preset]
        shown = {key: name for name, key in CONTROLS.items()}
        extra = {k: v for k, v in values.items() if k not in shown}
        # Every shown control but the data and the parallel ones goes back to its default,
        # then the preset's values on top: ranks and K stay what the user compares.
        update = {name: _default(key) for name, key in CONTROLS.items()
                  if name not in _KEPT_BY_PRESETS}
        update.update({shown[k]: v for k, v in values.items() if k in shown})
        # A preset's values replace what was typed, refused text included.
        self.param.update(**update, overrides={**self.overrides, **extra}, typed={})

    @param.depends("averaging", watch=True)
    def _on_method(self) -> None:
        # A box still at the last method's default takes the new one's: a method picked
        # without touching its box trains with its declared default.
        last, self._method = self._method, self.averaging
        if self._showing_run or METHOD_BOX in self.typed:
            return
        old, new = method_knob(last), method_knob(self.averaging)
        if new is not None and self.momentum == _default(old or CONTROLS[METHOD_BOX]):
            self.momentum = _default(new)

    def show_run(self, config: dict[str, Any], runs_dir: str | None = None) -> None:
        """Every box as run `config` (a config.json's dict) trained, so that Start trains what
        is on screen: the controls their values, the rest of its settings as overrides, the
        preset whose values it has (else defaults), `runs_dir` where the run was written."""
        flat = flatten_config(config)
        values: dict[str, Any] = {name: flat[key] for name, key in CONTROLS.items() if key in flat}
        knob = method_knob(flat.get(CONTROLS["averaging"]))
        if knob in flat:
            values[METHOD_BOX] = flat[knob]
        if flat.get("backend") in BACKEND_LABELS.values():
            values["backend"] = _backend_label(flat["backend"])
        if runs_dir is not None:
            values["runs_dir"] = runs_dir
        shown = {*CONTROLS.values(), *knob_keys(), *_SET_BY_THE_PAGE}
        if flat.get("backend") not in BACKEND_LABELS.values():
            # A run on a backend the page does not start (an elastic run's torch): Start trains
            # its model on the page's backend, without what only that backend takes (kept,
            # they refused every Start: on_rank_loss = "continue" needs torch).
            shown |= {k for k in flat if k == "on_rank_loss" or k.startswith("elastic.")}
        defaults = flatten_config(to_dict(TrainConfig()))
        overrides = {k: v for k, v in flat.items()
                     if k in defaults and k not in shown and v != defaults[k]}
        preset = next((name for name, preset in PRESETS.items()
                       if all(flat.get(k) == v for k, v in preset.items())), DEFAULTS)
        self._showing_run = True
        try:
            self.param.update(preset=preset, **values, overrides=overrides, typed={})
        finally:
            self._showing_run = False

    def key_of(self, name: str) -> str | None:
        """The dotted setting control `name` sets now (None: the chosen method has no use for it)."""
        if name == METHOD_BOX:
            return method_knob(self.averaging)
        if name == "payload_bits" and self.payload != "int":
            return None  # only integer codes have a number of bits
        if name == "post_local_frames" and self.average_schedule != "post_local":
            return None  # only post_local averages every minibatch for a number of frames
        return CONTROLS[name]

    def _values(self, out: str | Path) -> dict[str, Any]:
        values = {key: getattr(self, name) for name in CONTROLS
                  if (key := self.key_of(name)) is not None}
        values.update({"out": str(out), "backend": BACKEND_LABELS[self.backend],
                       "tensorboard": False, "data.data": str(Path(self.data or "").expanduser()),
                       **self.overrides})
        return values

    def label(self, name: str) -> str:
        """What the page calls control `name` (its box's label); the method box names the
        chosen method's knob."""
        key = self.key_of(name) if name == METHOD_BOX else None
        if key is not None:
            return f"method {key.rsplit('.', 1)[1]}"
        return self.param[name].label

    def type_text(self, name: str, text: str) -> None:
        """Text typed into number box `name`: its number becomes the setting; anything else
        stays in `typed`, refused in the box's words (the setting keeps its last number)."""
        parameter = self.param[name]
        text = (text or "").strip()
        try:
            number = None if text == "" else float(text)
            if number is not None and isinstance(parameter, param.Integer):
                if not number.is_integer():
                    raise ValueError
                number = int(number)
        except ValueError:
            self.typed = {**self.typed, name: text}
            return
        self.typed = {k: v for k, v in self.typed.items() if k != name}
        if number != getattr(self, name) or type(number) is not type(getattr(self, name)):
            setattr(self, name, number)

    def _typed_problem(self, name: str, text: str) -> str:
        whole = isinstance(self.param[name], param.Integer)
        what = "a whole number" if whole else "a number"
        hint = ""
        if re.fullmatch(r"[+-]?\d*,\d+", text):
            hint = f" (with a decimal point: {text.replace(',', '.')})"
        return f"{self.label(name)} must be {what}; got {text!r}{hint}"

    def in_words(self, text: str) -> str:
        """`text` (the CLI's words) with each setting's dotted key as its box's label."""
        names = {**{key: name for name, key in CONTROLS.items()},
                 **{key: METHOD_BOX for key in knob_keys()}}
        # One pass, longest key first: a label put in ("final lr") is never replaced again.
        keys = "|".join(map(re.escape, sorted(names, key=len, reverse=True)))
        return re.sub(rf"(?<![\w.])({keys})(?!\w)", lambda m: self.label(names[m[1]]), text)

    def problems(self) -> dict[str, str]:
        """What is wrong, by control name; GENERAL for what no one control owns."""
        found = {name: self._typed_problem(name, text) for name, text in self.typed.items()}
        for name in CONTROLS:
            key = self.key_of(name)
            if key is None or name in found:
                continue
            problem = check_setting(key, getattr(self, name))
            if problem is not None:
                found[name] = (f"{self.label(name)} needs a value" if getattr(self, name) is None
                               else self.in_words(problem))
        if not {"average_schedule", "post_local_frames"} & found.keys():
            found.update(self._schedule_problem())
        problem = check_directory(self.runs_dir or "", "runs directory", "the runs directory")
        if problem is None and not (self.runs_dir or "").strip():
            problem = "runs directory must be a non-empty path; got ''"
        if problem is not None:
            found["runs_dir"] = problem
        if "data" not in found:
            try:
                data = self._values("x")
                check_data_source(data["data.data"], ali=data.get("data.ali"),
                                  ali_dir=data.get("data.ali_dir"), textgrid=data.get("data.textgrid"))
            except UserError as exc:
                found["data"] = str(exc)
        if not found:
            try:
                self.to_config(Path(self.runs_dir) / "check")
            except UserError as exc:
                # validate's model-size check knows only the smallest corpus ("143 inputs and 2
                # pdfs"): fit_problems below says it with this corpus's sizes, beside the box.
                if not str(exc).startswith(MODEL_TOO_BIG):
                    found[GENERAL] = self.in_words(str(exc))
        if "data" not in found and GENERAL not in found:
            # The boxes that are fine are checked against the corpus too, the bad ones at their
            # defaults: every refusal at once (ranks = 1000 was flagged only after K and the
            # learning rate were fixed).
            keys = {self.key_of(name) for name in found if name in CONTROLS}
            values = {key: value for key, value in self._values("x").items() if key not in keys}
            for name, problem in fit_problems(values).items():
                found.setdefault(name, problem)
        return found

    def _schedule_problem(self) -> dict[str, str]:
        """The averaging schedule's refusal (AveragingConfig.problem) under the box to change:
        post_local without frames under the frames box, a schedule that another setting rules
        out (overlap, hierarchy) under the schedule's. Said by `validate` too, but there under
        Start, away from both boxes."""
        try:
            averaging = self.build("x").averaging
        except (UserError, TypeError, ValueError):
            return {}  # a box's own refusal says it
        problem = averaging.problem()
        if problem is None or problem == dataclasses.replace(averaging, schedule="constant").problem():
            return {}  # none, or not the schedule's
        frames = dataclasses.replace(averaging, post_local_frames=1).problem() != problem
        return {"post_local_frames" if frames else "average_schedule": self.in_words(problem)}

    def warnings_now(self) -> dict[str, str]:
        """What will run but deserves a word beside its box (the run may still start)."""
        found = {}
        lr = self.lr
        if isinstance(lr, (int, float)) and lr > LARGE_LR and "lr" not in self.errors:
            clipped = (self.optimizer == "ngsgd" or (self.overrides.get("max_param_change") or 0) > 0
                       or (self.overrides.get("max_change_per_sample") or 0) > 0)
            found["lr"] = (
                f"learning rate {lr:g} is far above Kaldi's (0.0008 to 0.008): "
                + ("max-change clips every update, so the rate no longer sets the step (such a "
                   "run can even score best)." if clipped else
                   "plain SGD has no max-change: the updates blow up."))
        ranks, cores = self.ranks, usable_cores()
        if isinstance(ranks, int) and ranks > cores and "ranks" not in self.errors:
            found["ranks"] = (f"{ranks} ranks on this machine's {cores} cores take turns: a "
                              f"speedup of at most {cores}x here (the cost model says what N "
                              "machines would give)")
        return found

    @param.depends(*CONTROLS, "backend", "runs_dir", "overrides", "typed", watch=True)
    def _update_errors(self) -> None:
        self.errors = self.problems()
        self.warnings = self.warnings_now()

    def build(self, out: str | Path) -> TrainConfig:
        """The TrainConfig of a run written to `out`, as the boxes say, not validated: what Start
        hands start_run, which validates it (`errors` already says what is wrong)."""
        return with_overrides(TrainConfig(), self._values(out))

    def to_config(self, out: str | Path) -> TrainConfig:
        """The validated TrainConfig of a run written to `out`; UserError names a bad value."""
        cfg = validate(self.build(out))
        data = cfg.data
        check_data_source(data.data, ali=data.ali, ali_dir=data.ali_dir, textgrid=data.textgrid)
        return cfg

    def check(self) -> str | None:
        """What is wrong with the settings as a message, or None when a run could start."""
        problems = self.problems()
        return next(iter(problems.values())) if problems else None

    def first_error(self) -> str | None:
        """`check()` as the form last found it (its boxes' watchers keep `errors` current):
        what Start and Measure read, so that a start validates once, in start_run."""
        return next(iter(self.errors.values()), None)


def describe_config(config: TrainConfig | Mapping[str, Any]) -> str:
    """One line saying what a run (given its settings, or its config.json's object) trains,
    for the page header."""
    cfg = config if isinstance(config, TrainConfig) else config_from_dict(config, "the run's config")
    final = cfg.final_lr
    lr = f"lr {cfg.lr:g}" + (f"→{final:g}" if final is not None else "")
    backend = {"inproc": "in-process", "mpi": "MPI"}.get(cfg.backend, cfg.backend)
    method, payload = cfg.averaging.method, cfg.averaging.payload
    # Said only when not the paper's: plain averaging of fp32 parameters.
    averaging = (f"{method} · " if method != "model" else "") + (
        f"{payload}{cfg.averaging.payload_bits if payload == 'int' else ''} payload · "
        if payload != "fp32" else "")
    epochs = f"{cfg.epochs} epoch{'' if cfg.epochs == 1 else 's'}"
    # K as set; a schedule that changes it during the run is named beside it.
    schedule = cfg.averaging.schedule
    k = f"K={cfg.effective_average_every()}" + (f" ({schedule})" if schedule != "constant" else "")
    return (f"{backend} × {cfg.ranks} ranks · {k} · {averaging}"
            f"{cfg.optimizer} {lr} ({cfg.schedule}) · pretrain {cfg.pretrain} · "
            f"minibatch {cfg.minibatch} · {epochs} · "
            f"{cfg.model.hidden_layers}×{cfg.model.hidden_dim} · data {Path(str(cfg.data.data)).name}")


def new_run_dir(runs_dir: Path, ranks: int, average_every: int) -> Path:
    """A fresh, not yet existing run directory name under `runs_dir` (time, ranks and K)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = f"{stamp}-n{ranks}-k{average_every}"
    for i in range(1000):
        candidate = runs_dir / (base if i == 0 else f"{base}-{i}")
        if not candidate.exists():
            return candidate
    raise UserError(f"cannot find a free run directory name under {runs_dir}")
