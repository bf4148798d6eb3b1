"""The runs index's rules for labels, on run directories written as runs write them."""

from __future__ import annotations

from labavg.training.config import TrainConfig
from labavg.base.settings import with_overrides
from labavg.jobs.index import differing_labels


def test_labels_name_what_differs_between_runs(tmp_path):
    configs = {
        "20250101-120000-n2-k50": (with_overrides(TrainConfig(), {"ranks": 2, "averaging.average_every": 50, "lr": 0.016, "out": "x"})),
        "20250101-120100-n2-k10": (with_overrides(TrainConfig(), {"ranks": 2, "averaging.average_every": 10, "lr": 0.016, "out": "y"})),
        "20250101-120200-n1-k10": (with_overrides(TrainConfig(), {"ranks": 1, "averaging.average_every": 10, "lr": 0.008, "out": "z"})),
    }
    assert list(differing_labels(configs).values()) == ["n2 K=50 lr 0.016", "n2 K=10 lr 0.016",
                                                        "n1 K=10 lr 0.008"]
    two = dict(list(configs.items())[:2])
    assert list(differing_labels(two).values()) == ["K=50", "K=10"]
    # K as trained: averaging.average_every_frames sets it.
    frames = {"a": configs["20250101-120000-n2-k50"],
              "b": (with_overrides(TrainConfig(), {"ranks": 2, "lr": 0.016, "averaging.average_every_frames": 256 * 20}))}
    assert differing_labels(frames) == {"a": "K=50", "b": "K=20"}
    model = {"a": TrainConfig(), "b": (with_overrides(TrainConfig(), {"model.hidden_dim": 256}))}
    assert differing_labels(model) == {"a": "4x512", "b": "4x256"}
    same = {"r1": TrainConfig(), "r2": TrainConfig()}
    assert differing_labels(same) == {"r1": "r1", "r2": "r2"}
