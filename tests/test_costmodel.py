"""Cost model (costmodel: alpha-beta allreduce, epoch time, predictions) and its fits (costfit:
a link's allreduce times, Su & Chen's timing table)."""

from __future__ import annotations

import pytest

from labavg.studies.costfit import (
    LinkSample,
    PAPER_SETUP,
    PAPER_SPEEDUPS,
    PAPER_TABLE,
    Setup,
    TableRow,
    fit_paper_table,
    fit_network,
    fit_table,
    fitted_epoch_time,
    fitted_speedup,
)
from labavg.studies.costmodel import (
    INFINIBAND,
    TEN_GBE,
    MeasuredCosts,
    allreduce_coefficients,
    allreduce_seconds,
    dnn_num_params,
    epoch_time,
    from_summary,
    predict,
    speedup,
)
from labavg.base.errors import UserError

ALPHA, BETA = 1e-6, 1e-9


@pytest.mark.parametrize(
    ("p", "n", "algorithm", "expected"),
    [
        (4, 1000, "ring", 2 * 3 * ALPHA + 2 * 3 / 4 * 1000 * BETA),  # 6 us + 1.5 us
        (8, 800, "rabenseifner", 6 * ALPHA + 1400 * BETA),  # 2 lg 8 alpha + 2 (7/8) n beta
        (8, 800, "recursive_doubling", 3 * ALPHA + 2400 * BETA),  # lg 8 alpha + n lg 8 beta
        (6, 800, "rabenseifner", 6 * ALPHA + 2800 * BETA),  # p'=4: 4a + 1.5nb, fold: +2a + 2nb
        (6, 800, "recursive_doubling", 4 * ALPHA + 3200 * BETA),  # p'=4: 2a + 2nb, fold: +2a + 2nb
        (2, 1000, "ring", 2 * ALPHA + 1000 * BETA),
        (1, 10**9, "ring", 0.0),
        (1, 10**9, "rabenseifner", 0.0),
    ],
)
def test_allreduce_alpha_beta_hand_computed(p, n, algorithm, expected):
    got = allreduce_seconds(p, n, ALPHA, BETA, algorithm)
    assert got == pytest.approx(expected, rel=1e-12, abs=0)


def test_ring_and_rabenseifner_move_the_same_bytes_at_powers_of_two():
    for p in (2, 4, 16, 64):
        ring = allreduce_coefficients(p, 1e6, "ring")[1]
        assert ring == pytest.approx(allreduce_coefficients(p, 1e6, "rabenseifner")[1])
    with pytest.raises(UserError, match="tree"):
        allreduce_coefficients(4, 10, "tree")


def test_epoch_time_hand_computed():
    # 10240 frames / (2 ranks * 64) = 80 minibatches, 8 rounds of 0.5 s at K=10
    e = epoch_time(2, 10240, 64, 10, 0.01, 0.5, parallel_slowdown=0.25, fixed_overhead_s=3.0)
    assert (e.compute_s, e.comm_s, e.rounds) == pytest.approx((80 * 0.01 * 1.25 + 3.0, 4.0, 8.0))
    one = epoch_time(1, 10240, 64, 10, 0.01, 0.5, parallel_slowdown=0.25, fixed_overhead_s=3.0)
    assert (one.compute_s, one.comm_s) == pytest.approx((1.6, 0.0))  # 1 rank: plain SGD
    assert speedup(2, 10240, 64, 10, 0.01, 0.5) == pytest.approx(1.6 / (0.8 + 4.0))


def test_paper_model_size():
    assert dnn_num_params(440, 2048, 6, 9000) == 40_325_928
    assert PAPER_SETUP.n_bytes == 4 * 40_325_928


def _synthetic_table(setup, alpha, beta, t_mb, eta, fixed, algorithm):
    rows = []
    # 3, 6, 12 exercise the fold step of the power-of-two algorithms
    for p in (1, 2, 3, 4, 6, 8, 12, 16, 32):
        a_s = allreduce_seconds(p, setup.n_bytes, alpha, beta, algorithm)
        e = epoch_time(p, setup.frames_per_epoch, setup.minibatch, setup.K, t_mb, a_s,
                       parallel_slowdown=eta, fixed_overhead_s=fixed)
        rows.append(TableRow(p, e.total_s / 60.0, e.comm_s / 60.0))
    return rows


@pytest.mark.parametrize("algorithm", ["ring", "rabenseifner", "recursive_doubling"])
def test_fit_recovers_known_parameters(algorithm):
    setup = Setup(frames_per_epoch=5e7, minibatch=512, K=8, n_bytes=4e7)
    table = _synthetic_table(setup, 3e-3, 1 / 2e9, 0.05, 0.15, 42.0, algorithm)
    fit = fit_table(table, setup, algorithm)
    if algorithm == "recursive_doubling":
        # every message carries all n bytes: only the per-message cost alpha + n beta is identifiable
        assert fit.alpha + setup.n_bytes * fit.beta == pytest.approx(3e-3 + 4e7 / 2e9, rel=1e-6)
    else:
        assert fit.alpha == pytest.approx(3e-3, rel=1e-6)
        assert fit.beta == pytest.approx(1 / 2e9, rel=1e-6)
    assert fit.compute_per_minibatch_s == pytest.approx(0.05, rel=1e-9)
    assert fit.parallel_slowdown == pytest.approx(0.15, rel=1e-6)
    assert fit.fixed_overhead_s == pytest.approx(42.0, rel=1e-6)
    assert max(abs(r.train_residual_min) + abs(r.comm_residual_min) for r in fit.rows) < 1e-8


def test_paper_speedup_definition():
    # The paper's "training time" includes communication: train(1)/train(16) is the quoted 9.32;
    # adding the comm column on top (8.05) is not.
    t1, t16 = PAPER_TABLE[0].train_min, PAPER_TABLE[-1]
    assert round(t1 / t16.train_min, 2) == PAPER_SPEEDUPS[(16, 10)]
    assert round(t1 / (t16.train_min + t16.comm_min), 2) == 8.05


def test_fit_to_paper_table_reproduces_its_speedups():
    fit = fit_paper_table()
    # stated tolerances: 1% at 16 GPUs (K=10 and K=20), 3% for the 32-GPU extrapolation
    assert fitted_speedup(fit, 16) == pytest.approx(PAPER_SPEEDUPS[(16, 10)], rel=0.01)
    assert fitted_speedup(fit, 16, K=20) == pytest.approx(PAPER_SPEEDUPS[(16, 20)], rel=0.01)
    assert fitted_speedup(fit, 32) == pytest.approx(PAPER_SPEEDUPS[(32, 10)], rel=0.03)
    # every row within 2 minutes; the fitted bandwidth is a plausible 0.5-1.5 GB/s
    assert all(abs(r.train_residual_min) < 2.0 and abs(r.comm_residual_min) < 2.0 for r in fit.rows)
    assert 5e8 < fit.bandwidth_bytes_per_s < 1.5e9
    assert fit.parallel_slowdown == pytest.approx(0.263, abs=0.005)
    assert fitted_epoch_time(fit, 1).total_s == pytest.approx(254.5 * 60)


def test_bandwidth_optimal_allreduce_fits_the_paper_better_than_recursive_doubling():
    def sse(fit):
        return sum(r.comm_residual_min**2 for r in fit.rows)

    assert sse(fit_paper_table("rabenseifner")) < 0.2 * sse(fit_paper_table("recursive_doubling"))


SUMMARY = {
    "ranks": 2, "backend": "mpi", "average_every": 8, "minibatch": 64, "epochs": 2,
    "num_params": 10392, "steps": 96, "averaging_rounds": 12, "frames_trained": 12288,
    "compute_seconds": 0.48, "comm_seconds": 0.06, "wall_seconds": 0.7,
}


def test_from_summary():
    m = from_summary(SUMMARY)
    assert m.compute_per_minibatch_s == pytest.approx(0.005)
    assert m.allreduce_s == pytest.approx(0.005)
    assert (m.num_params, m.minibatch, m.ranks, m.n_bytes) == (10392, 64, 2, 41568.0)
    assert m.frames_per_epoch == pytest.approx(6144.0)
    with pytest.raises(UserError, match="steps"):
        from_summary({k: v for k, v in SUMMARY.items() if k != "steps"})


@pytest.mark.parametrize("network", [TEN_GBE, INFINIBAND])
def test_predictions_monotone_in_k_and_bounded_by_ideal(network):
    m = MeasuredCosts(compute_per_minibatch_s=0.02, allreduce_s=0.001, num_params=40_000_000,
                      minibatch=1024, ranks=1, frames_per_epoch=1e8)
    ranks = [1, 2, 3, 4, 8, 16, 32, 64]
    preds = {(q.ranks, q.K): q for q in predict(m, ranks, Ks=(10, 20), network=network)}
    assert len(preds) == 16
    for p in ranks:
        k10, k20 = preds[p, 10], preds[p, 20]
        assert k20.comm_s == pytest.approx(k10.comm_s / 2)
        assert 0 < k10.speedup <= k20.speedup <= p + 1e-9
        assert k10.efficiency == pytest.approx(k10.speedup / p)
        if p > 1:
            assert k20.speedup > k10.speedup
    assert preds[1, 10].speedup == 1.0
    # 160 MB per round: the slow network loses more
    if network is TEN_GBE:
        ib = {(q.ranks, q.K): q for q in predict(m, [64], network=INFINIBAND)}
        assert ib[64, 10].speedup > preds[64, 10].speedup


SIZES = [4096 * 4**k for k in range(7)]  # 4 KB .. 16 MB, as benchmarks/bench_network.py


@pytest.mark.parametrize("algorithm", ["ring", "rabenseifner"])
def test_fit_network_recovers_alpha_and_beta(algorithm):
    samples = [LinkSample(p, n, allreduce_seconds(p, n, 40e-6, 1 / 117e6, algorithm))
               for p in (2, 4) for n in SIZES]
    fit = fit_network("1 Gb/s", samples, algorithm)
    assert fit.network.alpha == pytest.approx(40e-6, rel=1e-6)
    assert fit.network.beta == pytest.approx(1 / 117e6, rel=1e-6)
    assert fit.max_error_pct < 1e-6 and fit.network.name == "1 Gb/s"


def test_fit_network_error_is_relative_per_sample():
    exact = [LinkSample(2, n, allreduce_seconds(2, n, 1e-4, 1e-8)) for n in SIZES]
    off = LinkSample(2, 1e6, 1.25 * allreduce_seconds(2, 1e6, 1e-4, 1e-8))  # 25 % slow
    fit = fit_network("noisy", [*exact, off])
    errors = fit.errors_pct
    assert errors[-1] < -15  # the slow sample is measured above the fit
    assert max(abs(e) for e in errors[:-1]) < 5
    assert fit.max_error_pct == pytest.approx(abs(errors[-1]))
    assert 0 < fit.rms_error_pct < fit.max_error_pct


@pytest.mark.parametrize("samples", [
    [LinkSample(2, 4096, 1e-3)],  # one size: alpha and beta not separable
    [LinkSample(1, 4096, 1e-3), LinkSample(1, 8192, 2e-3)],  # one rank moves nothing
    [LinkSample(2, 4096, 0.0), LinkSample(2, 8192, 1e-3)],
])
def test_fit_network_bad_samples(samples):
    with pytest.raises(UserError):
        fit_network("bad", samples)
