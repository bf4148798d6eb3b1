"""One settings schema: the configuration declares each setting once; flags and controls follow."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from labavg.training.config import (PRESETS, TrainConfig, check_setting, cli_flags, preset_config,
                                    setting_field, validate)
from labavg.base.settings import with_overrides
from labavg.base.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def test_importing_the_configuration_imports_no_torch():
    # The averaging methods are declared without their classes (torch): labavg.averaging.registry.
    code = ("import sys, labavg.training.config, labavg.base.settings; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_every_flag_sets_its_setting_and_shows_its_help():
    from labavg.cli.commands import train_config
    from labavg.cli.parser import build_parser

    parser = build_parser()
    train_help = parser._subparsers._group_actions[0].choices["train"].format_help()
    for flag in cli_flags():
        text = setting_field(flag.key).metadata["help"]
        assert " ".join(text.split()[:3]) in " ".join(train_help.split()), flag.flag
    args = parser.parse_args(["train", "--optimizer", "sgd", "--hidden-dim", "96", "--norm-vars",
                              "--context", "3"])
    cfg = train_config(args)
    assert (cfg.optimizer, cfg.model.hidden_dim, cfg.data.norm_vars, cfg.data.context) == (
        "sgd", 96, True, 3)
    assert cfg.data.skip_mismatched is False  # a switch not given changes nothing


# A choice that needs another setting set with it.
NEEDS = {("averaging.schedule", "post_local"): {"averaging.post_local_frames": 1000}}
# A box the form greys out unless another box has this value.
ACTIVE_WITH = {"post_local_frames": {"average_schedule": "post_local"}}


def test_dashboard_controls_offer_what_validation_accepts(tmp_path):
    from dashboard.settings import CONTROLS, RunSettings

    # A method with a momentum, so that the momentum box is checked (plain averaging has none).
    settings = RunSettings(data=str(tmp_path), averaging="bmuf")
    for name, key in CONTROLS.items():
        field = setting_field(key)
        rule = field.metadata["rule"]
        parameter = settings.param[name]
        assert parameter.doc == field.metadata["help"]
        if key != "data.data":  # the data directory comes from the page's --data
            assert parameter.default == field.default, name  # labavg train's default
        if rule is not None and rule.choices:
            assert list(parameter.objects) == list(rule.choices), name
            for choice in rule.choices:  # each one the form offers, validate takes
                # (post_local with the frames box it needs: 0 frames is refused under that box)
                validate(with_overrides(TrainConfig(), {key: choice, **NEEDS.get((key, choice), {})}))
            with pytest.raises(UserError):
                validate(with_overrides(TrainConfig(), {key: "no-such-" + name}))
        elif rule is not None and rule.low is not None:
            # Below the bound, the form keeps the value and says what validate would say.
            low = rule.low - 1 if isinstance(field.default, int) else rule.low - 0.5
            settings.param.update(ACTIVE_WITH.get(name, {}))  # a greyed-out box says nothing
            setattr(settings, name, low)
            with pytest.raises(UserError) as info:
                validate(with_overrides(TrainConfig(), {key: low}))
            # In the box's words: the CLI's message with the box's label for the key.
            assert check_setting(key, low) == str(info.value), name
            assert settings.errors[name] == settings.in_words(str(info.value)), name
            assert settings.errors[name].startswith(settings.label(name)), name
            setattr(settings, name, field.default)
            settings.param.update({k: settings.param[k].default for k in ACTIVE_WITH.get(name, {})})
            assert name not in settings.errors, name
    settings.hidden_layers = -1
    assert settings.errors["hidden_layers"] == "hidden layers must be >= 0; got -1"
    settings.hidden_layers = 0  # the schema's lower bound (0 hidden layers is allowed)
    assert "hidden_layers" not in settings.errors


def test_check_setting_speaks_for_one_value_as_validate_does():
    assert check_setting("ranks", 0) == "ranks must be positive; got 0"
    assert check_setting("ranks", 4) is None
    assert check_setting("lr", float("nan")) == "lr must be positive and finite; got nan"
    assert check_setting("ranks", "two") == "ranks: 'two' is not a valid int"
    assert check_setting("final_lr", None) is None  # optional: None is its default
    assert check_setting("optimizer", "adam") == "optimizer must be one of sgd, ngsgd; got 'adam'"
    assert check_setting("no.such", 1) == "unknown setting 'no.such'"


def test_presets_are_overrides_of_the_defaults():
    for name, overrides in PRESETS.items():
        cfg = validate(preset_config(name))
        for key, value in overrides.items():
            node = cfg
            for part in key.split("."):
                node = getattr(node, part)
            assert node == value, (name, key)
        # they pair for speedups
        assert "ranks" not in overrides and "averaging.average_every" not in overrides
    with pytest.raises(UserError, match="unknown preset 'x'; known presets: teaching"):
        preset_config("x")
