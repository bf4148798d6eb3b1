"""One settings schema: the configuration declares each setting once; flags and controls follow."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from labavg.config import TrainConfig, cli_flags, setting_field, validate, with_overrides
from labavg.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def test_importing_the_configuration_imports_no_torch():
    code = "import sys, labavg.config; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_every_flag_sets_its_setting_and_shows_its_help():
    from labavg.cli import build_parser, train_config

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


def test_dashboard_controls_offer_what_validation_accepts(tmp_path):
    from dashboard.settings import CONTROLS, RunSettings

    settings = RunSettings(data=str(tmp_path))
    for name, key in CONTROLS.items():
        rule = setting_field(key).metadata["rule"]
        parameter = settings.param[name]
        assert parameter.doc == setting_field(key).metadata["help"]
        if rule is not None and rule.choices:
            assert list(parameter.objects) == list(rule.choices), name
            for choice in rule.choices:  # each one the form offers, validate takes
                validate(with_overrides(TrainConfig(), {key: choice}))
            with pytest.raises(UserError):
                validate(with_overrides(TrainConfig(), {key: "no-such-" + name}))
        elif rule is not None and rule.low is not None:
            assert parameter.bounds[0] == rule.low, name
    with pytest.raises(ValueError, match="hidden_layers"):
        settings.hidden_layers = -1  # the schema's lower bound (0 hidden layers is allowed)
    settings.hidden_layers = 0
