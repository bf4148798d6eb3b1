"""Learning-rate schedules: lr scaling, exponential decay, Newbob (train_scheduler.sh)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest

from labavg.training.settings import NewbobConfig
from labavg.training.schedules import (NewbobState, exponential_lr, newbob_start, newbob_step,
                                       scale_lr)


def test_scale_lr_rules():
    assert scale_lr(0.008, 4, "none") == 0.008
    assert scale_lr(0.008, 4, "linear") == pytest.approx(0.032)
    assert scale_lr(0.008, 1, "linear") == 0.008
    assert scale_lr(0.008, 4, "sqrt") == pytest.approx(0.016)
    with pytest.raises(ValueError, match="cube"):
        scale_lr(0.008, 4, "cube")
    with pytest.raises(ValueError, match="num_jobs"):
        scale_lr(0.008, 0, "linear")


def test_exponential_lr_endpoints_and_monotonic():
    assert exponential_lr(0.01, 0.0001, 0.0) == 0.01
    assert exponential_lr(0.01, 0.0001, 1.0) == pytest.approx(0.0001, rel=1e-12)
    # Geometric: halfway is the geometric mean.
    assert exponential_lr(0.01, 0.0001, 0.5) == pytest.approx(0.001, rel=1e-12)
    rates = [exponential_lr(0.08, 0.0008, i / 100) for i in range(101)]
    assert all(a > b for a, b in zip(rates, rates[1:]))
    # Constant ratio between equally spaced points.
    ratios = [b / a for a, b in zip(rates, rates[1:])]
    assert max(ratios) - min(ratios) < 1e-12
    with pytest.raises(ValueError):
        exponential_lr(0.01, 0.001, 1.5)
    with pytest.raises(ValueError):
        exponential_lr(0.0, 0.001, 0.5)


def _run(cfg, initial, values):
    """Feed CV values until the schedule stops; returns the decisions."""
    state = newbob_start(initial, cfg)
    out = []
    for v in values:
        d = newbob_step(state, v, cfg)
        out.append(d)
        state = d.state
        if d.stop:
            break
    return out


def test_newbob_rejects_worse_epoch_and_keeps_previous_loss():
    cfg = NewbobConfig()
    ds = _run(cfg, 2.0, [1.5, 1.4, 1.45, 1.39, 1.3899, 1.0])
    assert [d.accept for d in ds] == [True, True, False, True, True]
    rejected = ds[2]
    assert rejected.state.best == 1.4  # the last accepted loss is kept
    # A rejected epoch is zero improvement: halving starts right there (epoch 3).
    assert [d.state.halving for d in ds] == [False, False, True, True, True]
    assert [d.lr_factor for d in ds] == [1.0, 1.0, 0.5, 0.5, 1.0]
    # Epoch 4 improves by 0.01/1.4 = 0.7% (> 0.1%): go on; epoch 5 by 0.007%: stop.
    assert [d.stop for d in ds] == [False, False, False, False, True]
    assert ds[-1].state.iters == 5
    assert ds[-1].state.lr_scale == 0.25
    assert ds[-1].state.best == 1.3899


def test_newbob_starts_halving_on_small_relative_improvement():
    cfg = NewbobConfig()
    # rel. improvements: 0.5, 0.02, 0.005 (< 1%: halve from here), 0.002, 0.0005 (< 0.1%: stop).
    ds = _run(cfg, 2.0, [1.0, 0.98, 0.9751, 0.973149, 0.97266243])
    assert [d.lr_factor for d in ds] == [1.0, 1.0, 0.5, 0.5, 1.0]
    assert [d.stop for d in ds] == [False] * 4 + [True]
    assert all(d.accept for d in ds)
    # Just at the threshold is not below it: (1 - 0.99) / 1 = 0.01 exactly -> no halving.
    d = newbob_step(newbob_start(1.0, cfg), 0.99, cfg)
    assert d.lr_factor == 1.0 and not d.state.halving


def test_newbob_min_iters_accepts_and_postpones_stop():
    cfg = NewbobConfig(min_iters=6)
    ds = _run(cfg, 2.0, [1.5, 1.4, 1.45, 1.39, 1.3899, 1.3898, 1.3897, 1.0])
    # Epoch 3 is worse but accepted (iter <= min_iters); negative improvement starts halving.
    assert [d.accept for d in ds][:3] == [True, True, True]
    assert ds[2].state.best == 1.45 and ds[2].lr_factor == 0.5
    # Epochs 5, 6 would stop but iter <= min_iters: continue, and the script's `continue`
    # skips their halving too.
    assert [d.lr_factor for d in ds] == [1.0, 1.0, 0.5, 0.5, 1.0, 1.0, 1.0]
    assert [d.stop for d in ds] == [False] * 6 + [True]
    assert ds[-1].state.iters == 7


def test_newbob_max_iters_and_keep_lr_iters():
    ds = _run(NewbobConfig(max_iters=3), 2.0, [1.0, 0.5, 0.25, 0.1])
    assert len(ds) == 3 and ds[-1].stop and not ds[1].stop
    cfg = NewbobConfig(keep_lr_iters=2)
    ds = _run(cfg, 2.0, [2.5, 2.6, 2.7, 2.0])
    # Within keep_lr_iters: accepted although worse, never halved.
    assert [d.accept for d in ds[:2]] == [True, True]
    assert [d.lr_factor for d in ds[:2]] == [1.0, 1.0]
    assert ds[1].state.best == 2.6
    # Epoch 3 worse than 2.6: rejected, zero improvement -> halving starts.
    assert not ds[2].accept and ds[2].lr_factor == 0.5 and ds[2].state.best == 2.6
    # Epoch 4: (2.6 - 2.0) / 2.6 = 23% improvement while halving: keep halving.
    assert ds[3].accept and ds[3].lr_factor == 0.5 and not ds[3].stop


def test_newbob_rejects_non_finite_loss_and_stops_once_halving():
    cfg = NewbobConfig()
    ds = _run(cfg, 2.0, [float("nan"), float("inf")])
    assert [d.accept for d in ds] == [False, False]
    assert ds[0].lr_factor == 0.5 and ds[1].stop
    assert ds[1].state.best == 2.0


def test_newbob_frame_accuracy_variant():
    cfg = NewbobConfig.for_frame_accuracy()
    assert (cfg.start_halving_impr, cfg.end_halving_impr) == (0.5, 0.1)
    # +10, +2, worse (rejected: halving starts), +0.3 (>= 0.1: halve again), +0.05 -> stop.
    ds = _run(cfg, 40.0, [50.0, 52.0, 51.5, 52.3, 52.35, 60.0])
    assert [d.accept for d in ds] == [True, True, False, True, True]
    assert [d.lr_factor for d in ds] == [1.0, 1.0, 0.5, 0.5, 1.0]
    assert [d.stop for d in ds] == [False] * 4 + [True]
    assert ds[2].state.best == 52.0
    # Halving starts on an accepted epoch that gains less than +0.5% absolute.
    ds = _run(cfg, 40.0, [45.0, 45.4, 45.6, 45.65])
    assert [d.lr_factor for d in ds] == [1.0, 0.5, 0.5, 1.0]
    assert [d.stop for d in ds] == [False, False, False, True]
    with pytest.raises(ValueError, match="percentage"):
        newbob_step(newbob_start(40.0, cfg), 140.0, cfg)


def test_newbob_state_is_json_serialisable_and_final():
    cfg = NewbobConfig(max_iters=2)
    d = newbob_step(newbob_start(3.0, cfg), 2.0, cfg)
    restored = NewbobState(**json.loads(json.dumps(asdict(d.state))))
    assert restored == d.state
    d2 = newbob_step(restored, 1.9, cfg)
    assert d2.stop and d2.state.stopped
    with pytest.raises(ValueError, match="stopped"):
        newbob_step(d2.state, 1.8, cfg)


def test_newbob_config_validation():
    with pytest.raises(ValueError, match="criterion"):
        NewbobConfig(criterion="wer")
    with pytest.raises(ValueError, match="halving_factor"):
        NewbobConfig(halving_factor=0.0)
    with pytest.raises(ValueError, match="positive"):
        newbob_start(0.0, NewbobConfig())
    assert math.isfinite(newbob_start(0.5, NewbobConfig()).best)
