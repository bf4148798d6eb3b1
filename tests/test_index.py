"""The runs index's rules for baselines and labels, on run directories written as runs write them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from labavg.training.config import TrainConfig
from labavg.base.settings import to_dict, with_overrides
from labavg.jobs.index import (
    differing_labels,
    find_baseline,
    find_throughput_baseline,
    training_throughput,
)


def _run(root: Path, name: str, finished: bool = True, **overrides) -> dict:
    """A run directory with its config.json and (finished) summary.json, as labavg writes them."""
    cfg = to_dict(with_overrides(TrainConfig(), {"out": str(root / name), **overrides}))
    run = root / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(cfg))
    summary = {"ranks": cfg["ranks"], "wall_seconds": 10.0, "compute_seconds": 6.0,
               "comm_seconds": 2.0, "frames_trained": 40000, "stopped": False, "config": cfg}
    if finished:
        (run / "summary.json").write_text(json.dumps(summary))
    return cfg


def test_a_1_rank_run_of_any_k_is_the_baseline(tmp_path):
    _run(tmp_path, "a-n1", ranks=1, average_every=50)
    cfg = _run(tmp_path, "b-n4", finished=False, ranks=4, average_every=10)
    found = find_baseline(tmp_path / "b-n4", cfg)
    assert found is not None and found["config"]["out"].endswith("a-n1")
    # Another learning rate or number of epochs is another configuration for a wall time.
    for key, value in (("lr", 0.016), ("epochs", 3), ("model.hidden_dim", 256)):
        other = _run(tmp_path, f"c-{key}", finished=False, ranks=4, **{key: value})
        assert find_baseline(tmp_path / f"c-{key}", other) is None, key


def test_throughput_compares_across_schedule_but_not_model_or_minibatch(tmp_path):
    _run(tmp_path, "a-n1", ranks=1)
    _run(tmp_path, "b-n1", ranks=1, epochs=5, lr=0.001)
    cfg = _run(tmp_path, "c-n2", finished=False, ranks=2, epochs=3, lr=0.016, average_every=7)
    found = find_throughput_baseline(tmp_path / "c-n2", cfg)
    assert found["config"]["out"].endswith("b-n1")  # the latest of the same model and data
    same = _run(tmp_path, "d-n2", finished=False, ranks=2)
    assert find_throughput_baseline(tmp_path / "d-n2", same)["config"]["out"].endswith("a-n1")
    for key, value in (("model.hidden_dim", 256), ("minibatch", 128), ("optimizer", "sgd"),
                       ("data.context", 3)):
        other = _run(tmp_path, f"e-{key}", finished=False, ranks=2, **{key: value})
        assert find_throughput_baseline(tmp_path / f"e-{key}", other) is None, key


def test_training_throughput_is_frames_over_compute_and_averaging():
    assert training_throughput({"frames_trained": 800, "compute_seconds": 3.0,
                                "comm_seconds": 1.0}) == pytest.approx(200.0)
    assert training_throughput({"frames_trained": 800, "compute_seconds": 0.0,
                                "comm_seconds": 0.0}) is None


def test_labels_name_what_differs_between_runs(tmp_path):
    configs = {
        "20250101-120000-n2-k50": to_dict(with_overrides(TrainConfig(), {"ranks": 2, "average_every": 50, "lr": 0.016, "out": "x"})),
        "20250101-120100-n2-k10": to_dict(with_overrides(TrainConfig(), {"ranks": 2, "average_every": 10, "lr": 0.016, "out": "y"})),
        "20250101-120200-n1-k10": to_dict(with_overrides(TrainConfig(), {"ranks": 1, "average_every": 10, "lr": 0.008, "out": "z"})),
    }
    assert list(differing_labels(configs).values()) == ["n2 K=50 lr 0.016", "n2 K=10 lr 0.016",
                                                        "n1 K=10 lr 0.008"]
    two = dict(list(configs.items())[:2])
    assert list(differing_labels(two).values()) == ["K=50", "K=10"]
    # K as trained: average_every_frames sets it.
    frames = {"a": configs["20250101-120000-n2-k50"],
              "b": to_dict(with_overrides(TrainConfig(), {"ranks": 2, "lr": 0.016, "average_every_frames": 256 * 20}))}
    assert differing_labels(frames) == {"a": "K=50", "b": "K=20"}
    model = {"a": to_dict(TrainConfig()), "b": to_dict(with_overrides(TrainConfig(), {"model.hidden_dim": 256}))}
    assert differing_labels(model) == {"a": "4x512", "b": "4x256"}
    same = {"r1": to_dict(TrainConfig()), "r2": to_dict(TrainConfig())}
    assert differing_labels(same) == {"r1": "r1", "r2": "r2"}
