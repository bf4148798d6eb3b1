"""Tests of plain SGD and Kaldi's max-change limits (labavg.optim.sgd, .max_change)."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labavg.averaging.mean import flatten_parameters
from labavg.optim.base import StepStats
from labavg.optim.max_change import LayerUpdate, apply_updates
from labavg.optim.sgd import SGD


def _layer_and_batch(scale: float = 1.0):
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    x = torch.randn(32, 6) * scale
    y = torch.randint(0, 4, (32,))
    return model, x, y


def _params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def test_plain_sgd_step_is_minus_lr_times_summed_gradient():
    model, x, y = _layer_and_batch()
    twin = copy.deepcopy(model)
    F.cross_entropy(twin(x), y, reduction="sum").backward()
    expected = [p.detach() - 0.01 * p.grad for p in twin.parameters()]
    opt = SGD(model, max_change_per_sample=0.0, max_param_change=0.0)
    F.cross_entropy(model(x), y, reduction="sum").backward()
    stats = opt.step(0.01)
    assert stats.applied and stats.scale == 1.0
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach(), e)
        assert p.grad is None  # step clears the gradients


def test_huge_gradient_is_limited_by_per_sample_max_change():
    model, x, y = _layer_and_batch(scale=1e3)
    before = _params(model)
    opt = SGD(model, max_change_per_sample=0.075, max_param_change=0.0)
    loss = F.cross_entropy(model(x), y, reduction="sum")
    loss.backward()
    # nnet2's bound by hand: sum_i lr |x_i, 1| |dy_i| <= 0.075 * N
    with torch.no_grad():
        dy = torch.softmax(model(x), 1) - F.one_hot(y, 4)
        x1 = F.pad(x, (0, 1), value=1.0)
        tot = 1.0 * float((x1.norm(dim=1) * dy.norm(dim=1)).sum())
    stats = opt.step(1.0)
    expected_factor = 0.075 * 32 / tot
    assert expected_factor < 1e-3
    assert stats.scale == pytest_approx(expected_factor)
    change = float(torch.linalg.norm(_params(model) - before))
    assert 0.05 * 0.075 * 32 < change <= 0.075 * 32 * 1.0001


def pytest_approx(value: float):
    return pytest.approx(value, rel=1e-4)


def test_whole_model_max_param_change_scales_the_update_to_its_limit():
    model, x, y = _layer_and_batch(scale=10.0)
    before = _params(model)
    opt = SGD(model, max_change_per_sample=0.0, max_param_change=0.5)
    F.cross_entropy(model(x), y, reduction="sum").backward()
    stats = opt.step(1.0)
    assert stats.applied and stats.scale < 0.5
    assert float(torch.linalg.norm(_params(model) - before)) == pytest_approx(0.5)


def test_nan_gradient_leaves_parameters_bitwise_unchanged():
    model, x, y = _layer_and_batch()
    opt = SGD(model, momentum=0.5)
    F.cross_entropy(model(x), y, reduction="sum").backward()
    opt.step(0.01)
    before = [p.detach().clone() for p in model.parameters()]
    momentum_before = {k: v.clone() for k, v in opt.state_dict()["momentum_buffers"].items()}
    x_bad = x.clone()
    x_bad[3, 2] = math.nan
    F.cross_entropy(model(x_bad), y, reduction="sum").backward()
    stats = opt.step(0.01)
    assert not stats.applied
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)
    for k, v in opt.state_dict()["momentum_buffers"].items():
        assert torch.equal(v, momentum_before[k])
    assert all(p.grad is None for p in model.parameters())


def test_flat_buffer_views_are_updated_in_place():
    model, x, y = _layer_and_batch()
    flat = flatten_parameters([model])
    before = flat.clone()
    opt = SGD(model)
    F.cross_entropy(model(x), y, reduction="sum").backward()
    assert opt.step(0.01).applied
    assert not torch.equal(flat, before)
    torch.testing.assert_close(flat, _params(model))
    assert model.weight.data_ptr() == flat.data_ptr()


def test_momentum_state_dict_round_trip_gives_identical_updates():
    model, x, y = _layer_and_batch()
    opt = SGD(model, momentum=0.9)
    for _ in range(3):
        F.cross_entropy(model(x), y, reduction="sum").backward()
        opt.step(0.01)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    twin = copy.deepcopy(model)
    twin_opt = SGD(twin, momentum=0.9)
    twin_opt.load_state_dict(torch.load(buf, weights_only=True))
    fresh = copy.deepcopy(model)
    fresh_opt = SGD(fresh, momentum=0.9)
    for m, o in ((model, opt), (twin, twin_opt), (fresh, fresh_opt)):
        for _ in range(2):
            F.cross_entropy(m(x), y, reduction="sum").backward()
            o.step(0.01)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert not torch.equal(model.weight, fresh.weight)  # the momentum mattered


def test_a_training_run_applies_max_change_to_ngsgd_only_unless_asked():
    from labavg.training.config import TrainConfig, validate
    from labavg.base.settings import with_overrides

    assert TrainConfig(optimizer="sgd").max_change_limits() == (0.0, 0.0)  # nnet1: none
    assert TrainConfig(optimizer="ngsgd").max_change_limits() == (0.075, 2.0)  # nnet2's
    asked = validate(with_overrides(TrainConfig(optimizer="sgd"), {"max_change_per_sample": 0.075}))
    assert asked.max_change_limits() == (0.075, 0.0)
    off = validate(with_overrides(TrainConfig(), {"max_param_change": 0}))
    assert off.max_change_limits() == (0.075, 0.0)


def test_default_sgd_is_plain_even_where_max_change_would_bind():
    model, x, y = _layer_and_batch(scale=1e3)
    twin = copy.deepcopy(model)
    F.cross_entropy(twin(x), y, reduction="sum").backward()
    expected = [p.detach() - 1.0 * p.grad for p in twin.parameters()]
    opt = SGD(model)
    F.cross_entropy(model(x), y, reduction="sum").backward()
    stats = opt.step(1.0)
    assert stats.applied and stats.scale == 1.0
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach(), e)


def _reference_apply(updates, max_param_change):
    """apply_updates as a per-tensor loop (the implementation before the fused one)."""
    sq = [float(torch.stack([torch.linalg.vector_norm(d) for d in u.deltas]).double().square().sum())
          for u in updates]
    coefs = [float(u.coef) for u in updates]
    factors = [float(u.factor) for u in updates]
    if not all(math.isfinite(v) for v in sq + coefs + factors):
        return StepStats(applied=False, scale=0.0)
    delta = math.sqrt(sum(c * c * n for c, n in zip(coefs, sq)))
    scale = max_param_change / delta if 0 < max_param_change < delta else 1.0
    with torch.no_grad():
        for u, c in zip(updates, coefs):
            for p, d in zip(u.params, u.deltas):
                p.add_(d, alpha=c * scale)
    return StepStats(applied=True, scale=min(factors) * scale)


@pytest.mark.parametrize("max_param_change", [0.0, 1e3, 0.05])
def test_fused_apply_updates_is_bitwise_the_per_tensor_loop(max_param_change):
    gen = torch.Generator().manual_seed(3)
    shapes = [[(7, 5), (7,)], [(3, 7), (3,)], [(4,), (2, 2), (6,)]]

    def make():
        g = torch.Generator().manual_seed(4)
        return [[torch.randn(s, generator=g) for s in group] for group in shapes]

    deltas = [[torch.randn(s, generator=gen) for s in group] for group in shapes]
    coefs = [torch.tensor(-0.3), -0.01, torch.tensor(-2.0)]
    factors = [torch.tensor(0.7), 1.0, torch.tensor(1.0)]
    a, b = make(), make()
    got = apply_updates([LayerUpdate(p, d, c, f) for p, d, c, f in zip(a, deltas, coefs, factors)],
                        max_param_change)
    want = _reference_apply([LayerUpdate(p, d, c, f) for p, d, c, f in zip(b, deltas, coefs, factors)],
                            max_param_change)
    assert got == want
    for pa, pb in zip(sum(a, []), sum(b, [])):
        assert torch.equal(pa, pb)


def test_fused_apply_updates_skips_a_non_finite_float_coefficient():
    p = [torch.ones(3)]
    stats = apply_updates([LayerUpdate(p, [torch.ones(3)], float("inf"))], 0.0)
    assert not stats.applied and torch.equal(p[0], torch.ones(3))
