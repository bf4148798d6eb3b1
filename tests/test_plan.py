"""labavg plan's computation: the accuracy fits against known lines and the recorded runs, the
Pareto front, the recommendation and the inputs it refuses."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from labavg.base.errors import UserError
from labavg.studies.costmodel import TEN_GBE, MeasuredCosts
from labavg.studies.plan import (network_of, pareto, plan, recommend, speed_error)
from labavg.studies.plan_accuracy import MAP_K, accuracy_model, accuracy_model_of, regime_x
from labavg.studies.reproduction.results import Run

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "experiments" / "reproduction-results.jsonl"


def _run(name, seed, ranks, acc, steps, K=MAP_K, data="c1", method=None, **more):
    settings = {"seed": seed, "ranks": ranks, "data.data": data, "corpus_hours": 1.0,
                "averaging.average_every": K, "averaging.method": method, "minibatch": 256,
                "lr": 0.008, "lr_scaling": "linear", **more}
    return Run(name, settings, {"cv_frame_accuracy": acc / 100, "steps": steps,
                                "averaging_rounds": steps // K})


def _known_runs(slope=-20.0, intercept=-0.1, k_slope=-0.3, bmuf=1.5):
    """A map whose loss is exactly intercept + slope x log2 N / sqrt(updates), K's effect
    exactly k_slope per doubling, BMUF exactly `bmuf` points above plain averaging."""
    regime, variables, beyond = [], [], []
    for data, total in (("c1", 8000), ("c2", 32000)):
        for seed in (0, 1):
            base = 60.0 + seed
            regime.append(_run(f"{data}-1-{seed}", seed, 1, base, total, data=data))
            for n in (2, 4, 8, 16):
                loss = intercept + slope * regime_x(n, total / n)
                regime.append(_run(f"{data}-{n}-{seed}", seed, n, base + loss, total // n, data=data))
                if data == "c1" and n == 16:
                    for K in (2, 40):
                        variables.append(_run(f"v{K}-{seed}", seed, n,
                                              base + loss + k_slope * math.log2(K / MAP_K),
                                              total // n, K=K, data=data))
    for seed in (0, 1):
        for K in (10, 50):
            for method, extra in (("model", 0.0), ("bmuf", bmuf)):
                beyond.append(_run(f"b-{method}-{K}-{seed}", seed, 16,
                                   50.0 + seed + k_slope * math.log2(K / MAP_K) + extra, 500, K=K,
                                   method=method, data="c3"))
    return {"regime": regime, "regime-variables": variables, "beyond": beyond}


def test_the_fits_find_known_lines():
    model = accuracy_model_of(_known_runs(), "known")
    assert model.regime.slope == pytest.approx(-20.0, abs=1e-9)
    assert model.regime.intercept == pytest.approx(-0.1, abs=1e-9)
    assert model.regime.residual_sd == pytest.approx(0.0, abs=1e-9)
    assert model.k_term.slope == pytest.approx(-0.3, abs=1e-9)
    assert model.methods["bmuf"].at(0.0) == pytest.approx(1.5, abs=1e-9)
    assert model.method_ranks["bmuf"] == (16,)
    got = model.predict(8, 1000, 10)
    assert got.change == pytest.approx(-0.1 - 20.0 * regime_x(8, 1000))
    assert got.extrapolated == ()
    assert model.predict(1, 1000, 10).change == 0.0


def test_predictions_outside_the_fits_say_so_and_hold_k_terms():
    model = accuracy_model_of(_known_runs(), "known")
    far = model.predict(64, 10, 400, "bmuf")
    text = "; ".join(far.extrapolated)
    assert "N = 64 outside" in text and "updates per worker outside" in text
    assert "K = 400 outside" in text and "bmuf measured at N = 16 only" in text
    # Held at the largest K measured (50, in the Beyond runs), not extended to 400.
    base = -0.1 - 20.0 * regime_x(64, 10)
    assert far.change == pytest.approx(base - 0.3 * math.log2(50 / MAP_K) + 1.5)
    assert "no runs measured" in "; ".join(model.predict(16, 500, 10, "diloco").extrapolated)


def test_the_recorded_runs_give_the_reproductions_regime_line():
    # REPRODUCTION.md, "The regime": -25.1 x log2 N / sqrt(updates per worker) - 0.14 points.
    model = accuracy_model(RESULTS)
    assert model.regime.slope == pytest.approx(-25.06, abs=0.01)
    assert model.regime.intercept == pytest.approx(-0.14, abs=0.01)
    assert model.regime.points == 25
    assert set(model.methods) == {"bmuf", "diloco"}


def test_speed_error_is_the_largest_leave_one_out_error():
    # REPRODUCTION.md, "Speedup": predicting each row from the others, the largest error is
    # +1.6 % (2 GPUs).
    assert speed_error() == pytest.approx(0.016, abs=0.001)


def _rows():
    measured = MeasuredCosts(0.036, 0.004, 209_528, 128, 1, 1.29e6)
    return plan(measured, accuracy_model_of(_known_runs(), "known"), TEN_GBE,
                ranks=[2, 8, 16], Ks=[2, 10, 50], methods=["model", "bmuf"])


def test_pareto_front_and_recommendation():
    rows = _rows()
    assert len(rows) == 3 * 3 * 2
    front = pareto(rows)
    for r in rows:
        beaten = any(o.speedup >= r.speedup and o.acc_change >= r.acc_change and o is not r
                     and (o.speedup > r.speedup or o.acc_change > r.acc_change) for o in rows)
        assert (r in front) != beaten
    last = 0.0
    for budget in (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 50.0):
        best = recommend(rows, budget)
        ok = [r for r in rows if r.acc_change >= -budget and not r.extrapolated]
        if not ok:
            assert best is None
            continue
        assert best.acc_change >= -budget and not best.extrapolated
        assert best.speedup == max(r.speedup for r in ok)
        assert best.speedup >= last  # a larger budget never recommends a slower point
        last = best.speedup
    anything = recommend(rows, 50.0, covered_only=False)
    assert anything.speedup == max(r.speedup for r in rows if r.acc_change >= -50.0)
    bigger_k = [r for r in rows if r.ranks == 16 and r.method == "model"]
    assert [r.bytes_per_epoch for r in sorted(bigger_k, key=lambda r: r.K)] == sorted(
        (r.bytes_per_epoch for r in bigger_k), reverse=True)


@pytest.mark.parametrize("args, words", [
    (("ethernet", None, None), "--network 'ethernet'"),
    ((None, 10.0, None), "--bandwidth and --latency go together"),
    ((None, -1.0, 5.0), "--bandwidth must be > 0"),
    ((None, float("nan"), 5.0), "--bandwidth must be > 0"),
])
def test_bad_networks_are_named(args, words):
    with pytest.raises(UserError, match=words):
        network_of(*args)


def test_bad_budget_and_method_are_named():
    with pytest.raises(UserError, match="--max-loss"):
        recommend(_rows(), -1.0)
    measured = MeasuredCosts(0.036, 0.004, 209_528, 128, 1, 1.29e6)
    with pytest.raises(UserError, match="method 'adam'"):
        plan(measured, accuracy_model_of(_known_runs(), "known"), TEN_GBE, methods=["adam"])


# --------------------------------------------------------------------------- the command

def _labavg(*args, cwd=REPO):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "labavg", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_plan_prints_the_front_and_the_recommendation():
    done = _labavg("plan", "--ranks", "8", "16", "32", "--network", "10gbe", "--max-loss", "3")
    assert done.returncode == 0, done.stderr
    assert "Predicted on 10GbE" in done.stdout
    assert "Recommended for at most 3 points lost: N = " in done.stdout
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")][1:]
    assert table and all(line.split("|")[2].strip() in {"8", "16", "32"} for line in table)
    starred = [line for line in table if line.split("|")[1].strip() == "*"]
    assert len(starred) == 1 and starred[0].split("|")[-2].strip() == ""  # not extrapolated


def test_plan_says_when_only_points_outside_the_fits_are_within_the_budget():
    done = _labavg("plan", "--ranks", "8", "16", "32", "--max-loss", "0")
    assert done.returncode == 0, done.stderr
    assert "No row the fits cover is predicted to lose at most 0 points" in done.stdout


def test_plan_json_agrees_with_the_library():
    import json

    done = _labavg("plan", "--ranks", "4", "16", "--K", "10", "50", "--max-loss", "2", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert {(r["ranks"], r["K"]) for r in out["rows"]} == {(4, 10), (4, 50), (16, 10), (16, 50)}
    best = out["recommended"]
    assert best["acc_change"] >= -2
    assert best in out["pareto"] or best["extrapolated"]


@pytest.mark.parametrize("args, words", [
    (("--network", "eth"), "--network 'eth'"),
    (("--ranks", "0"), "--ranks 0"),
    (("--max-loss", "nan"), "--max-loss"),
    (("--methods", "adam"), "method 'adam'"),
    (("--results", "no-such-file.jsonl"), "no-such-file.jsonl"),
    (("no-such-run",), "no-such-run"),
])
def test_plan_refuses_bad_input_in_one_line(args, words):
    done = _labavg("plan", *args)
    assert done.returncode == 2
    assert words in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_plan_takes_a_finished_runs_costs(corpus, tmp_path):
    run = tmp_path / "n1"
    done = _labavg("train", "--data", str(corpus), "--out", str(run), "--epochs", "1",
                   "--hidden-layers", "1", "--hidden-dim", "32", "--no-progress",
                   "--speedup-pairs", "0")
    assert done.returncode == 0, done.stderr
    done = _labavg("plan", str(run), "--ranks", "2", "--K", "10", "--methods", "model", "--json")
    assert done.returncode == 0, done.stderr
    import json

    from labavg.jobs.summary import load_summary

    out, summary = json.loads(done.stdout), load_summary(run)
    assert out["source"] == str(run)
    (row,) = out["rows"]
    per_minibatch = summary.compute_seconds / summary.steps
    # Two workers each train half the frames: the epoch's compute is half of one worker's.
    frames = summary.frames_trained / summary.epochs
    assert row["epoch_s"] >= frames / (2 * summary.minibatch) * per_minibatch
