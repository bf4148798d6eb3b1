"""A run's speedup, measured in pairs inside the run (labavg.training.speedup_probe) and read
by one function (labavg.jobs.speedup) wherever it is shown."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from labavg.jobs.index import list_runs, read_events, read_run_events
from labavg.jobs.runs import run_training
from labavg.jobs.speedup import (measured_speedup, shared_bound, speedup_from_events,
                                 speedup_from_summary)
from labavg.jobs.summary import format_runs, load_summary, summary_row
from support import child_env, stopped_then_resumed
from test_train import final_params, small_config


def test_the_median_pair_with_its_range():
    s = measured_speedup([(0.02, 0.02), (0.02, 0.025), (0.03, 0.02)], ranks=2, cores=8)
    assert s.value == pytest.approx(2.0) and s.low == pytest.approx(1.6)
    assert s.high == pytest.approx(3.0) and s.pairs == 3 and s.bound == 2
    # 3.0 is above what 2 ranks allow: the flag says so, and why
    assert "pairs up to 3.00x are above the 2x the cores allow" in s.flag
    assert s.efficiency == pytest.approx(1.0)
    assert s.text().startswith("2.00x (1.60-3.00 over 3 pairs; 2 ranks on 8 cores")


def test_oversubscribed_ranks_say_what_the_cores_allow():
    s = measured_speedup([(0.02, 0.025)], ranks=4, cores=2, load=0.5)
    assert s.bound == 2 and s.value == pytest.approx(3.2)
    assert "4 ranks on 2 cores: at most 2x here" in s.flag and "3.20x is above the 2x" in s.flag
    threads = measured_speedup([(0.02, 0.04)], ranks=2, cores=2, threads=True)
    assert threads.text().startswith("1.00x (1 pair; 2 threads on 2 cores")
    assert measured_speedup([], ranks=1, cores=2).value == 1.0
    # Under load the ranks take more than their idle share of the cores: said, not hidden.
    loaded = measured_speedup([(0.06, 0.08)], ranks=4, cores=2, load=14.0)
    assert shared_bound(4, 2, 0.0) == 2 and shared_bound(4, 2, 14.0) == pytest.approx(10 / 3)
    assert "under load 14.0 the ranks took a larger share" in loaded.flag
    assert measured_speedup([], ranks=2, cores=2).value is None


def _pairs(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir) if e["type"] == "speedup_pair"]


def test_pairs_leave_training_bitwise_unchanged_and_every_reader_agrees(corpus, tmp_path):
    without = small_config(corpus, tmp_path / "off", speedup_pairs=0)
    run_training(without, progress=False)
    with_pairs = small_config(corpus, tmp_path / "on", speedup_pairs=5)
    summary = run_training(with_pairs, progress=False)
    assert torch.equal(final_params(tmp_path / "on"), final_params(tmp_path / "off"))
    assert torch.equal(final_params(tmp_path / "on", 1), final_params(tmp_path / "off", 1))
    pairs = _pairs(tmp_path / "on")
    assert len(pairs) >= 3 and not _pairs(tmp_path / "off")
    assert all(p["parallel_steps"] >= max(3, p["solo_steps"]) for p in pairs)
    ratios = sorted(2 * p["solo_step_seconds"] / p["parallel_step_seconds"] for p in pairs)
    from_events = speedup_from_events(read_run_events(tmp_path / "on"))
    from_summary = speedup_from_summary(load_summary(tmp_path / "on"))
    assert from_events == from_summary
    assert (from_summary.low, from_summary.high) == (ratios[0], ratios[-1])
    assert summary.speedup == from_summary.value and summary.cores >= 1
    row = summary_row("on", summary)
    assert (row["speedup"], row["speedup_low"], row["speedup_high"]) == (
        from_summary.value, ratios[0], ratios[-1])
    table = format_runs([("on", None, summary)])
    assert f"{from_summary.value:.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})" in table
    assert f"speedup of on: {from_summary.text()}" in table


def test_a_one_rank_run_beside_it_is_no_baseline_any_more(corpus, tmp_path):
    """A 1-rank run made under another load (here: 1000 s) or made after the run changes
    nothing: the run carries its own measurement."""
    runs = tmp_path / "runs"
    par = small_config(corpus, runs / "n2")
    first = run_training(par, progress=False)
    one = small_config(corpus, runs / "n1", ranks=1)
    run_training(one, progress=False)
    slow = json.loads((runs / "n1" / "summary.json").read_text())
    slow["wall_seconds"] = slow["compute_seconds"] = 1000.0
    (runs / "n1" / "summary.json").write_text(json.dumps(slow))
    shutil.copytree(runs / "n2", runs / "n2-again", ignore=shutil.ignore_patterns(".lock"))
    again = replace(par, out=str(runs / "n2-again"))
    (runs / "n2-again" / "summary.json").unlink()
    second = run_training(again, resume=True, progress=False)  # a resume at the end: CV only
    rows = {r.name: summary_row(r.name, r.summary) for r in list_runs(runs)}
    assert rows["n2"]["speedup"] == first.speedup == speedup_from_summary(first).value
    assert rows["n2"]["speedup"] < 3  # 1000 s over a run of seconds would be hundreds
    assert rows["n1"]["speedup"] == 1.0
    assert second.speedup_pairs == first.speedup_pairs  # the resume kept its pairs


def test_a_stopped_run_reports_the_frames_it_trained(corpus, tmp_path):
    cfg = small_config(corpus, tmp_path / "run", epochs=3)
    stopped, resumed = stopped_then_resumed(cfg, at_step=60)
    assert stopped.stopped and stopped.steps < resumed.steps
    assert stopped.speedup_pairs, "pairs measured before the stop"
    assert stopped.speedup == speedup_from_summary(stopped).value
    # the resumed run's summary counts the pairs of both parts
    assert resumed.speedup_pairs[:len(stopped.speedup_pairs)] == stopped.speedup_pairs
    assert len(resumed.speedup_pairs) > len(stopped.speedup_pairs)


# Both slow (fast-suite margin): the pairs of a 2-rank run are checked against the cores in the fast
# test of the paired measurement; these start real MPI jobs pinned by taskset.
@pytest.mark.slow
@pytest.mark.parametrize("ranks,cpus", [(2, "0"), (4, "0,1")])
def test_mpi_ranks_pinned_to_fewer_cores_cannot_pass_the_cores(corpus, tmp_path, ranks, cpus):
    """The physical bound: ranks pinned to C cores share them, and the measurement shows at
    most C x (on the old code a 1-rank run beside it gave any figure at all: 4.41x for 4
    ranks on 2 cores)."""
    taskset = shutil.which("taskset")
    assert taskset, "taskset (util-linux) is needed"
    cores = len(cpus.split(","))
    out = tmp_path / "pinned"
    proc = subprocess.run(
        [taskset, "-c", cpus, sys.executable, "-m", "labavg", "train", "--data", str(corpus),
         "--out", str(out), "--backend", "mpi", "--ranks", str(ranks), "--epochs", "3",
         "--average-every", "3", "--minibatch", "64", "--set", "tensorboard=false",
         "--set", "model.hidden_layers=2", "--set", "model.hidden_dim=256"],
        capture_output=True, text=True, timeout=300, env=child_env())
    assert proc.returncode == 0, proc.stderr
    summary = load_summary(out)
    s = speedup_from_summary(summary)
    assert summary.cores == cores and s.bound == cores and s.pairs >= 3
    assert f"{ranks} ranks on {cores} core{'s' if cores > 1 else ''}: at most {cores}x here" in s.flag
    # On idle cores the bound is the cores; under other work the ranks take a larger share of
    # them (fair sharing, labavg.jobs.speedup.shared_bound), and the flag says so.
    assert s.value < 1.3 * max(cores, shared_bound(ranks, cores, s.load)), s.text()
    assert s.text() in proc.stdout  # labavg info's line under the table, as the quick start shows
