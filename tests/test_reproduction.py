"""The paper-reproduction report: its sweep and the tables built from finished runs."""

from __future__ import annotations

from dataclasses import replace

from labavg.config import to_dict
from labavg.model import ModelConfig
from labavg.reproduction import (
    _agrees,
    comparison_tables,
    load_rows,
    paper_sweep,
    speedup_section,
)
from labavg.sweep import Sweep, run_sweep

from test_train import small_config


def test_paper_sweep_has_each_comparison_once(tmp_path):
    names = [n for n, _ in paper_sweep(tmp_path, epochs=1, seeds=2).points()]
    assert len(names) == len(set(names)) == 9 * 2
    assert "ranks_32-pretrain_rbm-seed_1" in names and "ranks_16-schedule_newbob-seed_0" in names
    # 16 workers, K=10, NG-SGD, exponential, no pretraining is reached by four grids: once.
    assert sum(n.startswith("ranks_16-seed") for n in names) == 2


def test_agreement_follows_the_ordering():
    better, worse = (60.0, 60.0, 60.0, 1), (50.0, 50.0, 50.0, 1)
    assert _agrees(True, [better, worse]) == "yes"
    assert _agrees(True, [worse, better]) == "no"
    assert _agrees(True, [better, None]) == "-"


def test_tables_show_measured_accuracies(corpus, tmp_path):
    base = replace(small_config(corpus, tmp_path / "unused"), optimizer="ngsgd", ranks=1,
                   model=ModelConfig(hidden_layers=1, hidden_dim=32), average_every=10)
    sweep = Sweep(base, [{"optimizer": ["ngsgd", "sgd"]}])
    run_sweep(sweep, tmp_path / "paper")
    rows = load_rows(tmp_path / "paper")
    assert sorted(r.optimizer for r in rows) == ["ngsgd", "sgd"]
    text = comparison_tables(rows, to_dict(base))
    for r in rows:
        assert f"| 1 | {r.optimizer} | " in text and f"{100 * r.cv_frame_accuracy:.2f}" in text
    assert "not run" in text  # 16 and 32 workers were not trained here
    assert "9.33" in speedup_section(None)  # the cost model fitted to the paper's table
