"""The reproduction: its statistics, its verdicts, and the whole pipeline at a tiny size."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
from pathlib import Path

import pytest

from labavg.reproduction import (
    DISCUSSION_MARKER,
    PAIRS,
    Run,
    paired,
    spread,
    verdict,
)
from labavg.sweep import load_sweep

from test_train import PYTHON

REPO = Path(__file__).resolve().parent.parent


def _cli(*args, env_extra=None, timeout=2400) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "labavg", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env_extra or {})})


def _run(seed: int, wer: float, **settings) -> Run:
    return Run(f"r{seed}", {"seed": seed, **settings}, {"wer": wer, "cv_frame_accuracy": 0.5})


def test_spread_is_a_t_interval_of_the_mean():
    s = spread([1.0, 2.0, 3.0])
    assert s.mean == 2.0 and s.sd == 1.0 and s.n == 3
    # t(0.975, 2 dof) = 4.303: half-width 4.303 / sqrt(3)
    assert s.high - s.mean == pytest.approx(4.303 / math.sqrt(3))
    one = spread([5.0])
    assert one.n == 1 and one.low == -math.inf and spread([]) is None


def test_verdicts_come_from_the_spread_not_the_sign_of_one_difference():
    assert verdict(spread([0.5, 0.6, 0.4]), +1) == "agrees"
    assert verdict(spread([-0.5, -0.6, -0.4]), +1) == "disagrees"
    assert verdict(spread([-0.5, -0.6, -0.4]), -1) == "agrees"
    # every seed has the paper's sign, but the spread is too wide to call it
    assert verdict(spread([0.1, 2.0, 0.05]), +1) == "within noise"
    assert verdict(spread([1.0]), +1) == "needs 2+ seeds"
    assert verdict(None, +1) == "not run"


def test_differences_pair_runs_of_the_same_seed():
    a = {s: _run(s, w) for s, w in [(0, 10.0), (1, 12.0), (2, 11.0)]}
    b = {s: _run(s, w) for s, w in [(0, 11.0), (2, 11.5), (3, 30.0)]}
    assert paired(a, b, "wer") == [1.0, 0.5]  # seeds 0 and 2; seed 3 has no partner
    assert paired(a, b, "wer", relative=True) == [10.0, pytest.approx(100 * 0.5 / 11)]


def test_every_comparison_of_the_paper_has_its_points_in_experiments_paper_toml():
    sweep = load_sweep(REPO / "experiments" / "paper.toml")
    points = {name for name, _ in sweep.points()}
    assert len({n for n in points if n.startswith("seed_0-")}) == 10
    assert all(f"seed_{s}-ranks_32-pretrain_rbm" in points for s in (0, 1, 2))
    base = sweep.base
    for pair in PAIRS:
        for value in (pair.better, pair.worse):
            want = {**pair.fixed, pair.vary: value}
            found = [o for _, o in sweep.points()
                     if all(o.get(k, getattr(base, k)) == v for k, v in want.items())]
            assert len(found) >= 3, (pair.title, value)  # three seeds each
    # inside the paper's regime: >= 1,000 updates per worker at 32 (checked on the real runs
    # by the report; here from the corpus size the file asks for)
    corpus = sweep.corpora[0]
    frames = corpus["hours"] * 3600 * 100 * (1 - base.data.cv_fraction)
    assert frames * base.epochs / (32 * base.minibatch) > 1000


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_the_whole_reproduction_at_a_tiny_size(tmp_path):
    """`labavg reproduce` end to end: sweeps, decoding, MPI timing, report, figure; resumable."""
    out, report, figure = tmp_path / "runs", tmp_path / "R.md", tmp_path / "fig" / "map.png"
    args = ("reproduce", "--tiny", "--out", str(out), "--experiments", str(REPO / "experiments"),
            "--report", str(report), "--figure", str(figure))
    env = {"LABAVG_CACHE": str(tmp_path / "cache")}
    proc = _cli(*args, env_extra=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = report.read_text()
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "![regime map](fig/map.png)" in text

    # The numbers are the runs': 1 worker's WER is the mean of its two seeds' summaries.
    wers = [json.loads((out / "paper/runs" / f"seed_{s}-ranks_1/summary.json").read_text())["wer"]
            for s in (0, 1)]
    row = next(line for line in text.splitlines() if line.startswith("| 1 | 2 | "))
    assert f"{statistics.fmean(wers):.2f} ± {statistics.stdev(wers):.2f}" in row
    for n in (8, 16, 32):
        line = next(line for line in text.splitlines() if line.startswith(f"| {n} | 2 | "))
        assert line.split("|")[-2].strip() in ("consistent (within noise)", "agrees: loses less",
                                               "disagrees: loses more")
    # every comparison has a verdict decided from two seeds
    glance = text.split("## Verdicts at a glance")[1].split("## The regime map")[0]
    for pair in PAIRS:
        line = next(line for line in glance.splitlines() if line.startswith(f"| {pair.title} |"))
        assert line.split("|")[2].strip() in (
            "agrees", "disagrees", "within noise", "128 better", "256 better"), line
    # the regime map: both corpora, 1/2/4 workers, two seeds, losses with intervals
    regime = text.split("## The regime map")[1].split("## The paper's comparisons")[0]
    rows = [line for line in regime.splitlines() if line.startswith(("| 0.03 |", "| 0.06 |"))]
    assert len(rows) == 6 and all("| 2 |" in line for line in rows)
    assert sum("[" in line for line in rows) == 4  # N = 2 and 4 on each corpus
    assert "#### Measured on this machine" in text and "| 2 | 20 |" in text
    # the explaining experiments, each row against the first, seed by seed
    why = text.split("## Why the disagreements: experiments")[1].split("## Speedup")[0]
    assert sum(line.startswith("### ") for line in why.splitlines()) == 3
    assert "| 32 workers, RBM (4 epochs) | 2 |" in why
    assert "| Newbob | 2 |" in why and "| 16 workers, no per-frame max-change | 2 |" in why

    # A second run trains nothing and keeps the discussion written below the marker.
    report.write_text(report.read_text() + "A human's discussion.\n")
    stamp = (out / "paper/runs/seed_1-ranks_32/summary.json").stat().st_mtime_ns
    proc = _cli(*args, env_extra=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "paper/runs/seed_1-ranks_32/summary.json").stat().st_mtime_ns == stamp
    again = report.read_text()
    assert again.endswith("A human's discussion.\n") and again.count(DISCUSSION_MARKER) == 1
    # what the notebooks read where the runs are not: the same runs, the same report
    from labavg.reproduction import Experiments, read_results_file, render_report

    results = read_results_file(out / "experiments" / "reproduction-results.jsonl")
    assert len(results["paper"]) == 20 and len(results["regime"]) == 12
    assert len(results["explain"]) == 8 and len(results["mpi"]) == 3
    remade = render_report(results, Experiments(out / "experiments"), command="x", seconds=0,
                           figure=None, report=report)
    ours = again.split("## The paper's comparisons")[1].split("## Speedup")[0]
    assert ours in remade


def test_a_missing_sweep_file_is_refused_before_anything_runs(tmp_path):
    proc = _cli("reproduce", "--out", str(tmp_path / "o"), "--experiments", str(tmp_path),
                "--report", str(tmp_path / "R.md"))
    assert proc.returncode == 2 and f"{tmp_path / 'paper.toml'}: no such sweep file" in proc.stderr
    assert not (tmp_path / "o").exists() and not (tmp_path / "R.md").exists()
