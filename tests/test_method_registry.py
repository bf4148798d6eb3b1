"""An averaging method is one class plus one registration: registered, a toy method is in the
settings schema, the CLI, the dashboard's form, `labavg info` and the Beyond tables."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

from labavg.averaging.factory import make_averager
from labavg.averaging.methods import Averager
from labavg.averaging.registry import methods, register, unregister
from labavg.base.errors import UserError
from labavg.base.schema import real, setting
from labavg.base.settings import to_dict, with_overrides
from labavg.comm.inproc import run_inproc
from labavg.training.config import TrainConfig, load_config, validate


@dataclass(frozen=True)
class HalfConfig:
    share: float = setting(0.5, "the share of the round's change kept", real(0, 1))


class HalfAverager(Averager):
    """A toy method: the next block starts halfway (`share`) from the old global model to the
    average."""

    method: ClassVar[str] = "half"
    settings: ClassVar[type | None] = HalfConfig
    knob: ClassVar[str] = "share"  # the dashboard's method box
    help: ClassVar[str] = "a toy: half of each round's change"
    label: ClassVar[str] = "half (a toy)"
    short: ClassVar[str] = "Half"
    keeps_global: ClassVar[bool] = True

    def __init__(self, flat: torch.Tensor, comm: Any, average_every: int = 1, restore: bool = True,
                 config: HalfConfig | None = None, reduce: str = "allreduce",
                 **payload: Any) -> None:
        super().__init__(flat, comm, average_every, restore, reduce, **payload)
        self.share = (config or HalfConfig()).share

    def update(self, global_model: torch.Tensor, average: torch.Tensor) -> torch.Tensor:
        return global_model + self.share * (average - global_model)


@pytest.fixture
def half():
    register(HalfAverager)
    try:
        yield HalfAverager
    finally:
        unregister("half")


def _half_config(tmp_path, share: float = 0.25) -> TrainConfig:
    path = tmp_path / "half.toml"
    path.write_text(f'out = "{tmp_path / "run"}"\n\n[averaging]\nmethod = "half"\n'
                    f'average_every = 4\n\n[averaging.half]\nshare = {share}\n')
    return load_config(path)


def test_the_schema_reads_a_registered_method_and_its_table(half, tmp_path):
    cfg = validate(_half_config(tmp_path))
    assert cfg.averaging.method == "half"
    assert cfg.averaging.table("half") == HalfConfig(share=0.25)
    assert cfg.averaging.table() == HalfConfig(share=0.25)  # the chosen method's table
    assert to_dict(cfg)["averaging"]["half"] == {"share": 0.25}
    assert with_overrides(cfg, {"averaging.half.share": 0.75}).averaging.table().share == 0.75
    # named with the file the value came from (labavg issue 44)
    with pytest.raises(UserError,
                       match=r"half\.toml: averaging\.half\.share must be in \[0, 1\]; got 2\.0$"):
        validate(_half_config(tmp_path, share=2))


def test_an_unregistered_method_is_refused(tmp_path):
    with pytest.raises(UserError,
                       match="averaging.method must be one of model, bmuf, diloco; got 'half'"):
        validate(with_overrides(TrainConfig(out=str(tmp_path / "run")),
                                {"averaging.method": "half"}))
    with pytest.raises(UserError, match="unknown key averaging.half"):
        _half_config(tmp_path)


def test_a_name_is_registered_once(half):
    class Other(HalfAverager):
        pass

    with pytest.raises(ValueError, match="'half' is already registered"):
        register(Other)
    assert register(HalfAverager) is HalfAverager  # the same class again changes nothing


def test_the_factory_builds_the_registered_class_with_its_section(half, tmp_path):
    cfg = validate(_half_config(tmp_path, share=0.5))  # [averaging.half] from the TOML file

    def work(comm):
        flat = torch.zeros(4)  # every rank starts the block from the same global model
        averager = make_averager(cfg.averaging, cfg.minibatch, flat, comm)
        flat.fill_(float(comm.rank))  # what the block's minibatches made of it
        averager.round(flat)
        return type(averager), (averager.share, averager.average_every), flat.clone()

    (kind, settings, first), (_, _, second) = run_inproc(2, work)
    assert kind is HalfAverager and settings == (0.5, 4)  # the file's share and K
    # Global model 0, average 0.5: halfway is 0.25 on both ranks.
    assert torch.equal(first, second)
    assert torch.allclose(first, torch.full((4,), 0.25))


def test_the_cli_lists_and_takes_it(half, tmp_path, monkeypatch):
    from labavg.cli.commands import train_config
    from labavg.cli.parser import build_parser

    monkeypatch.chdir(tmp_path)
    parser = build_parser()
    train_help = " ".join(
        parser._subparsers._group_actions[0].choices["train"].format_help().split())
    assert "model | bmuf | diloco | half" in train_help
    assert "half (a toy: half of each round's change)" in train_help
    args = parser.parse_args(["train", "--averaging", "half", "--set", "averaging.half.share=0.1"])
    plan = train_config(args).averaging
    assert (plan.method, plan.table().share) == ("half", 0.1)


def test_the_dashboard_form_offers_it(half, tmp_path):
    from dashboard.settings import RunSettings

    settings = RunSettings(data=str(tmp_path))
    assert "half" in settings.param.averaging.objects
    assert settings.key_of("momentum") is None  # plain averaging: the box is greyed out
    settings.averaging = "half"
    assert "averaging" not in settings.errors
    # The method box is its knob, with the declared default, label and rule.
    assert settings.key_of("momentum") == "averaging.half.share"
    assert (settings.momentum, settings.label("momentum")) == (0.5, "method share")
    settings.momentum = 0.25
    assert settings.build(tmp_path / "run").averaging.table("half").share == 0.25
    settings.momentum = 2.0
    assert settings.errors["momentum"] == "method share must be in [0, 1]; got 2.0"


def test_labavg_info_formats_a_run_of_it(half, tmp_path, capsys):
    from labavg.cli.main import main

    cfg = _half_config(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    summary = {"ranks": 2, "backend": "inproc", "averaging": "half", "average_every": 10,
               "config": to_dict(cfg)}
    (run / "summary.json").write_text(json.dumps(summary))
    assert main(["info", str(run)]) == 0
    assert " half " in capsys.readouterr().out


def test_the_beyond_tables_label_it(half):
    from labavg.studies.reproduction import beyond
    from labavg.studies.reproduction.results import Run

    assert list(beyond.METHODS) == list(methods()) and "half" in beyond.METHODS
    runs = [Run(f"seed_{s}-ranks_{n}-{m}", {"seed": s, "ranks": n, "averaging.average_every": 10,
                                             "averaging.method": m, "averaging.payload": "fp32",
                                             "epochs": 2, "minibatch": 256, "lr": 0.008},
                {"wer": 12.0 + s, "cv_frame_accuracy": 0.7, "averaging_rounds": 100,
                 "bytes_sent": 8e7 if n > 1 else 0})
            for s in (0, 1, 2) for n, m in ((1, "model"), (16, "model"), (16, "half"))]
    one = beyond.select([r for r in runs if r.get("ranks") == 1])
    rows = beyond.table(runs, one)
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    assert any(c[:3] == ["16", "10", "half (a toy)"] for c in cells), rows
