"""Every bad setting is refused before training with one line naming the key and the value."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labavg.averaging.registry import BMUFConfig
from labavg.averaging.settings import HierarchyConfig
from labavg.training.memory import MEMORY_FRACTION
from labavg.training.config import (TrainConfig, check_model_size, config_from_dict,
                                    estimate_memory, load_config, validate)
from labavg.base.settings import to_dict, with_overrides
from labavg.base.errors import UserError
from labavg.training.model import DNN, count_parameters
from labavg.training.settings import ModelConfig
from labavg.training.memory import parameter_count
from labavg.optim.max_change import LayerUpdate, apply_updates, per_sample_scale


REPO = Path(__file__).resolve().parents[1]


def _refused(overrides: dict) -> str:
    with pytest.raises(UserError) as info:
        validate(with_overrides(TrainConfig(), overrides))
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("key, value, shown", [
    # Sections whose dataclasses used to raise a bare ValueError (or worse, later in training).
    ("ngsgd.rank_in", 0, "0"),
    ("ngsgd.epsilon", float("nan"), "nan"),
    ("ngsgd.max_eta", 1.0, "1.0"),
    ("ngsgd.num_initial_updates", -1, "-1"),
    ("newbob.halving_factor", 2.0, "2.0"),
    ("newbob.max_iters", 0, "0"),
    ("newbob.criterion", "wer", "'wer'"),
    ("rbm.momentum", 1.5, "1.5"),
    ("rbm.learn_rate", -0.1, "-0.1"),
    ("rbm.minibatch_size", 0, "0"),
    ("rbm.seed", -3, "-3"),
    ("model.pnorm_group", 0, "0"),
    ("model.pnorm_p", 0.5, "0.5"),
    ("model.hidden_layers", -1, "-1"),
    ("data.context", -2, "-2"),
    ("data.buffer_frames", 0, "0"),
    ("data.data", "", "''"),
    ("seed", 2**40, str(2**40)),
    ("device", "cuda:x", "'cuda:x'"),
])
def test_nested_and_top_level_values_name_key_and_value(key, value, shown):
    message = _refused({key: value})
    assert f"{key} must be" in message and message.endswith(f"got {shown}")


@pytest.mark.parametrize("key", ["lr", "final_lr", "max_param_change", "max_change_per_sample",
                                 "data.cv_fraction", "newbob.start_halving_impr", "rbm.l2_penalty",
                                 "ngsgd.alpha"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_numbers_are_refused(key, value):
    message = _refused({key: value})
    assert key in message and repr(value) in message


def test_cross_field_rules_name_both_keys():
    message = _refused({"rbm.momentum_ramp_frames": 3})
    assert "rbm.momentum_ramp_frames (3)" in message and "rbm.momentum_steps (40)" in message
    message = _refused({"rbm.momentum": 0.8, "rbm.momentum_max": 0.6})
    assert "rbm.momentum_max (0.6)" in message and "rbm.momentum (0.8)" in message
    message = _refused({"model.nonlinearity": "pnorm", "model.hidden_dim": 512})
    assert "model.hidden_dim (512)" in message and "model.pnorm_group (5)" in message
    message = _refused({"data.buffer_frames": 100, "minibatch": 256})
    assert "data.buffer_frames (100)" in message and "(256)" in message


def test_threads_are_bounded_by_the_cpus():
    cpus = os.cpu_count() or 1
    assert validate(with_overrides(TrainConfig(), {"threads": cpus})).threads == cpus
    for bad in (0, 4 * cpus + 1, 100_000):
        message = _refused({"threads": bad})
        assert "threads must be in 1.." in message and message.endswith(f"got {bad}")


def test_zero_turns_the_max_change_limits_off():
    cfg = validate(with_overrides(TrainConfig(), {"max_change_per_sample": 0, "max_param_change": 0}))
    assert cfg.max_change_per_sample == 0.0 and cfg.max_param_change == 0.0
    assert "max_param_change must be finite and >= 0" in _refused({"max_param_change": -1})
    # ...and the optimisers read 0 as "no limit": a huge update is applied unshrunk.
    rows = torch.full((8,), 1e6)
    assert float(per_sample_scale(rows, rows, 1.0, 0.0)) == 1.0
    assert float(per_sample_scale(rows, rows, 1.0, 0.075)) < 1e-3
    param = torch.zeros(4)
    stats = apply_updates([LayerUpdate([param], [torch.full((4,), 1e3)], coef=1.0)], 0.0)
    assert stats.applied and stats.scale == 1.0 and torch.equal(param, torch.full((4,), 1e3))


@pytest.mark.parametrize("model", [ModelConfig(), ModelConfig(hidden_layers=0),
                                   ModelConfig(hidden_layers=3, hidden_dim=40, nonlinearity="pnorm",
                                               pnorm_group=4)])
def test_parameter_count_matches_a_built_model(model):
    assert parameter_count(model, 77, 13) == count_parameters(DNN(77, 13, model))


def test_absurd_model_refused_before_anything_is_allocated():
    message = _refused({"model.hidden_dim": 10**12})
    assert "model.hidden_dim=1000000000000" in message and "does not fit in memory" in message
    message = _refused({"model.hidden_layers": 10**12, "model.hidden_dim": 64})
    assert "model.hidden_layers=1000000000000" in message
    # inproc workers share one process, so each holds its own copy of the model.
    # One worker fits: the message says it is the ranks, not the model (labavg issue 44).
    assert "with ranks = 1000000 in-process workers" in _refused({"ranks": 10**6})
    assert _refused({"ranks": 10**9}).startswith("ranks = 1000000000 is more ranks than")


def test_check_model_size_with_the_real_dimensions():
    cfg = with_overrides(TrainConfig(), {"model.hidden_layers": 6, "model.hidden_dim": 2048})
    need = estimate_memory(cfg, 440, 3000)
    assert need >= 16 * parameter_count(cfg.model, 440, 3000)
    assert check_model_size(cfg, 440, 3000, memory=int(need / MEMORY_FRACTION) + 1) == need
    with pytest.raises(UserError, match=r"model.hidden_dim=2048.* 440 inputs and 3000 pdfs"):
        check_model_size(cfg, 440, 3000, memory=int(need / MEMORY_FRACTION) - 1)


def test_out_must_be_a_directory_path(tmp_path):
    assert "out must be a non-empty path" in _refused({"out": ""})
    assert "out must be a non-empty path" in _refused({"out": "   "})
    existing = tmp_path / "a-file"
    existing.write_text("x")
    assert f"out {str(existing)!r} is an existing file" in _refused({"out": str(existing)})
    assert validate(with_overrides(TrainConfig(), {"out": str(tmp_path)})).out == str(tmp_path)


def test_toml_with_bad_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_bytes(b"lr = 0.01\n# caf\xe9\nepochs = 1\n")
    with pytest.raises(UserError, match=rf"^{path}: line 2: not UTF-8 \(byte 0xe9\)"):
        load_config(path)


@pytest.mark.parametrize("values, expected", [
    ([1, 2], "config.json: expected a table of settings, got [1, 2]"),
    ({"model": 3}, "config.json: model: expected a table of settings, got 3"),
    ({"ngsgd": [20, 80]}, "config.json: ngsgd: expected a table of settings, got [20, 80]"),
    ({"lr": [0.1]}, "config.json: lr: [0.1] is not a valid float"),
    ({"model": {"hidden_dim": "512"}}, "config.json: model.hidden_dim: '512' is not a valid int"),
    ({"final_lr": "x"}, "config.json: final_lr: 'x' is not a valid value (expected float or NoneType)"),
    ({"lr": 10**400}, "config.json: lr: an integer of 1329 bits is too large for a number"),
    ({"rbm": {"momentum_steps": 0}}, "config.json: rbm.momentum_steps must be positive; got 0"),
    ({"model": {"widths": 3}}, "config.json: unknown key model.widths"),
])
def test_config_from_dict_wrong_shapes(values, expected):
    with pytest.raises(UserError) as info:
        config_from_dict(values, "config.json")
    assert str(info.value).startswith(expected)


def _refused_file(path: Path, text: str) -> str:
    path.write_text(text)
    with pytest.raises(UserError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    return message


def test_a_file_of_an_earlier_labavg_is_refused_naming_each_move(tmp_path):
    message = _refused_file(tmp_path / "old.toml", 'average_every = 5\naveraging = "bmuf"\n'
                            '[hierarchy]\nevery = 4\nnode_size = 2\n')
    assert "settings have moved" in message
    for old, new in (("average_every", "averaging.average_every"),
                     ("averaging", "averaging.method"), ("hierarchy", "averaging.hierarchy")):
        assert f"{old} is now {new}" in message
    message = _refused_file(tmp_path / "every.toml", "[averaging.hierarchy]\nevery = 4\n")
    assert "averaging.hierarchy.every is now averaging.hierarchy.across_nodes_every" in message


def test_an_override_of_a_moved_setting_says_where_it_went():
    for old, new in (("average_every", "averaging.average_every"),
                     ("bmuf.momentum", "averaging.bmuf.momentum"),
                     ("hierarchy.every", "averaging.hierarchy.across_nodes_every")):
        with pytest.raises(UserError) as info:
            with_overrides(TrainConfig(), {old: 5})
        assert str(info.value) == f"setting {old!r} has moved: it is now {new!r}"


def test_an_averaging_section_round_trips_through_plain_values(tmp_path):
    path = tmp_path / "new.toml"
    path.write_text(f'out = "{tmp_path / "run"}"\nranks = 4\n[averaging]\nmethod = "bmuf"\n'
                    'average_every = 20\npayload = "int"\npayload_bits = 4\n'
                    'error_feedback = false\n[averaging.bmuf]\nmomentum = 0.5\n'
                    '[averaging.diloco]\nouter_lr = 0.3\n'
                    '[averaging.hierarchy]\nacross_nodes_every = 40\nnode_size = 2\n')
    cfg = validate(load_config(path))
    plan = cfg.averaging
    assert (plan.method, plan.average_every, plan.payload, plan.payload_bits,
            plan.error_feedback) == ("bmuf", 20, "int", 4, False)
    assert plan.table() == BMUFConfig(momentum=0.5) and plan.table("diloco").outer_lr == 0.3
    assert plan.hierarchy == HierarchyConfig(across_nodes_every=40, node_size=2)
    values = to_dict(cfg)
    again = config_from_dict(values, "config.json")
    assert again == cfg and to_dict(again) == values


@pytest.mark.parametrize("setting, named", [
    ("ngsgd.rank_in=0", "ngsgd.rank_in must be positive; got 0"),
    ("average_every=5", "setting 'average_every' has moved: it is now 'averaging.average_every'"),
    ("lr=inf", "lr must be positive and finite; got inf"),
    ("threads=100000", "got 100000"),
    ("model.hidden_dim=1000000000000", "model.hidden_dim=1000000000000"),
    ('out=""', "out must be a non-empty path"),
])
def test_cli_train_set_exits_2_with_one_line_and_writes_nothing(tmp_path, setting, named):
    out = tmp_path / "run"
    args = ["--out", str(out)] if not setting.startswith("out=") else []
    proc = subprocess.run(
        [sys.executable, "-m", "labavg", "train", "--data", str(tmp_path / "nodata"), *args,
         "--set", setting], capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)})  # this checkout's labavg, run from tmp_path
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("labavg: error: ") and named in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == []
