"""Beyond the paper: the averaging schedules section of REPRODUCTION.md (issue 46), from
recorded runs; the equal-bytes K and the checks of experiments/schedules.toml."""

from __future__ import annotations

from pathlib import Path

import pytest

from labavg.base.errors import UserError
from labavg.studies.reproduction import schedules
from labavg.studies.reproduction.results import (SWEEPS, Run, read_results_file,
                                                 write_results_file)
from labavg.studies.sweep import load_sweep

REPO = Path(__file__).resolve().parent.parent
BYTES_PER_ROUND = 800_000


def _run(arm, seed, acc, rounds, ranks=16, k=10, steps=156):
    settings = {"seed": seed, "ranks": ranks, "averaging.average_every": k, "epochs": 2,
                "minibatch": 256, "lr": 0.008, "model.hidden_layers": 2, "model.hidden_dim": 256,
                "corpus_hours": 1.0}
    name = schedules.run_name(arm, ranks, seed, None if arm != "constant" or k == 10 else k)
    return Run(name, settings, {"steps": steps, "averaging_rounds": rounds,
                                "bytes_sent": rounds * BYTES_PER_ROUND, "cv_frame_accuracy": acc})


def _runs(ranks=16):
    """constant K0 = 10 (16 rounds); post_local (31 rounds: K_eq = 5) clearly above it;
    adacomm (22 rounds: K_eq = 7) at it within noise; their equal-bytes constant runs."""
    runs = []
    for s in (0, 1, 2):
        runs += [_run("constant", s, 0.50 + 0.01 * s, 16, ranks),
                 _run("post_local", s, 0.52 + 0.01 * s + 0.001 * (s - 1), 31, ranks),
                 _run("adacomm", s, 0.50 + 0.01 * s + (0.004, -0.005, 0.002)[s], 22, ranks),
                 _run("constant", s, 0.53 + 0.01 * s, 32, ranks, k=5),
                 _run("constant", s, 0.505 + 0.01 * s, 22, ranks, k=7)]
    return runs


def _cells(rows: list[str]) -> list[list[str]]:
    return [[c.strip() for c in row.strip().strip("|").split("|")] for row in rows[2:]]


def test_k_equal_bytes_is_steps_over_the_schedules_rounds():
    assert schedules.k_equal_bytes(156, 23) == 7  # adacomm at 16 workers, K0 = 10, seed 0
    assert schedules.k_equal_bytes(156, 31) == 5
    assert schedules.k_equal_bytes(78, 200) == 1  # never below one minibatch
    assert schedules.k_equal_bytes(None, 23) is None and schedules.k_equal_bytes(156, 0) is None


def test_k_equal_bytes_from_a_recorded_summary():
    run = _run("adacomm", 0, 0.5, 23)
    assert schedules.k_equal_bytes(run.summary.steps, run.summary.averaging_rounds) == 7


def test_run_names_round_trip_and_others_are_not_parsed():
    assert schedules.parse_name(schedules.run_name("post_local", 32, 2)) == (
        "post_local", None, 32, 2)
    assert schedules.parse_name(schedules.run_name("constant", 16, 1, 7)) == ("constant", 7, 16, 1)
    for other in ("kept-s0", "seed_0-ranks_16", "adacomm-k7-n16-s0", "a-b-c-d-e"):
        assert schedules.parse_name(other) is None


def test_the_equal_bytes_reference_is_the_constant_run_at_each_seeds_k_eq():
    by_name = {r.name: r for r in _runs()}
    ref = schedules.equal_bytes(by_name, "adacomm")
    assert sorted(ref) == [0, 1, 2]
    assert {r.get("averaging.average_every") for r in ref.values()} == {7}
    # a schedule whose rounds are K0's is compared with the constant K0 run itself
    by_name["adacomm-n16-s0"] = _run("adacomm", 0, 0.5, 16)
    assert schedules.equal_bytes(by_name, "adacomm")[0] is by_name["constant-n16-s0"]
    # a reference not trained yet leaves its seed out
    del by_name["constant-k5-n16-s1"]
    assert sorted(schedules.equal_bytes(by_name, "post_local")) == [0, 2]


def test_the_table_shows_k_rounds_bytes_and_accuracy_per_arm():
    rows = _cells(schedules.table({r.name: r for r in _runs()}))
    assert [r[0] for r in rows] == [
        "constant K (reference at equal K0)", "post-local SGD (Lin et al. 2020)",
        "AdaComm (Wang & Joshi 2019)", "constant K at equal bytes to post_local",
        "constant K at equal bytes to adacomm"]
    assert [r[1] for r in rows] == ["10", "1, then K0 = 10", "K0 = 10, then ≤ K0", "5", "7"]
    assert [r[2] for r in rows] == ["3"] * 5
    assert [r[3] for r in rows] == ["16", "31", "22", "32", "22"]
    assert rows[1][4] == f"{31 * BYTES_PER_ROUND / 1e6:.1f}"
    assert rows[0][5] == "51.00 ± 1.00"  # 50, 51, 52 %
    assert len(rows[0]) == 6  # no WER column: nothing was decoded


def test_the_verdicts_pair_each_schedule_with_both_references():
    found = {(arm, what): text for arm, what, text in
             schedules.verdicts({r.name: r for r in _runs()})}
    assert set(found) == {(a, w) for a in ("post_local", "adacomm")
                          for w in ("at equal K0", "at equal bytes")}
    assert found["post_local", "at equal K0"].startswith("**better** (+2.00 [")
    assert found["post_local", "at equal bytes"].startswith("**worse** (-1.00 [")
    assert found["adacomm", "at equal K0"].startswith("**unresolved")
    assert found["adacomm", "at equal K0"].endswith("3 seeds)")


def test_the_section_has_a_table_per_n_and_reads_the_verdicts(tmp_path):
    sweep = tmp_path / "schedules.toml"
    sweep.write_text("[base.averaging]\npost_local_frames = 72000\n")
    lines = schedules.section(_runs(16) + _runs(32), sweep)
    text = "\n".join(lines)
    assert lines[0] == "## Beyond the paper: averaging schedules"
    assert "### 16 workers" in text and "### 32 workers" in text
    # 72,000 of the 78 x 16 x 256 frames of an epoch
    assert "first 72,000 frames trained by all workers together (23 % of the first" in text
    assert "156 updates per worker at N = 16" in text and "the 30 runs" in text
    assert "- post_local vs constant at equal bytes: **worse**" in text
    assert "the 16 or 32 workers are threads of one process" in text and "oversubscribed" in text
    assert text.endswith("the same bytes spent evenly do as well. No schedule did better than "
                         "constant K for the same bytes here.")
    assert ("verdicts against constant K: at equal K0, 2 better, 2 unresolved; at equal bytes, "
            "2 unresolved, 2 worse (no mean difference larger than 2.00 points).") in text


def test_schedule_runs_survive_the_results_file(tmp_path):
    assert "schedules" in SWEEPS  # labavg reproduce --only schedules
    path = write_results_file({"schedules": _runs()}, tmp_path / "r.jsonl")
    back = read_results_file(path)["schedules"]
    assert sorted(r.name for r in back) == sorted(r.name for r in _runs())
    assert schedules.table({r.name: r for r in back}) == schedules.table(
        {r.name: r for r in _runs()})


def test_the_repositorys_schedules_toml_plans_the_three_arms_at_16_and_32():
    path = REPO / "experiments" / "schedules.toml"
    points = schedules.check_sweep(load_sweep(path), path)
    assert {(arm, n) for arm, n, _, _ in points} == {
        (a, n) for a in ("constant", "post_local", "adacomm") for n in (16, 32)}
    assert sorted({seed for _, _, seed, _ in points}) == [0, 1, 2]


_BASE = """
[base]
backend = "inproc"
ranks = 16
[base.averaging]
average_every = 10
post_local_frames = 72000
[base.data]
data = "nowhere"
"""


@pytest.mark.parametrize("grid, says", [
    ('seed = [0, 1]\nranks = [16]\n"averaging.schedule" = ["post_local", "adacomm"]',
     '"constant"'),
    ('seed = [0, 1]\nranks = [16]\n"averaging.schedule" = ["constant"]', "at least one schedule"),
    ('seed = [0, 1]\nranks = [16]', "no 'averaging.schedule'"),
    ('ranks = [16]\n"averaging.schedule" = ["constant", "adacomm"]', "no 'seed'"),
    ('seed = [0]\nranks = [16]\n"averaging.schedule" = ["constant", "adacomm"]', "2 seeds"),
    ('seed = [0, 1]\n"averaging.schedule" = ["constant", "adacomm"]', "no 'ranks'"),
    ('seed = [0, 1]\nranks = [16]\n"averaging.schedule" = ["constant", "adacomm"]\n'
     '"averaging.payload" = ["bf16"]', "fp32"),
])
def test_a_schedules_toml_without_what_it_needs_is_refused_before_training(tmp_path, grid, says):
    path = tmp_path / "schedules.toml"
    path.write_text(_BASE + "[[grid]]\n" + grid + "\n")
    with pytest.raises(UserError, match=says):
        schedules.run_all(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_report_ends_with_the_schedules_section(tmp_path):
    from labavg.studies.reproduction.report import render_report
    from labavg.studies.reproduction.results import RESULTS_FILE
    from labavg.studies.reproduction.sweep_files import Experiments

    runs = read_results_file(REPO / "experiments" / RESULTS_FILE)
    runs["schedules"] = _runs(16)
    text = render_report(runs, Experiments(REPO / "experiments"), command="x", seconds=0,
                         figure=None, report=tmp_path / "R.md")
    assert text.rstrip().endswith(schedules.section(_runs(16), Experiments(
        REPO / "experiments").schedules)[-1])
    assert text.count("## Beyond the paper: averaging schedules") == 1


def test_the_figure_is_written_and_linked_from_the_section(tmp_path):
    path = schedules.figure(_runs(16) + _runs(32), tmp_path / "docs" / schedules.FIGURE)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = schedules.section(_runs(16), tmp_path / "none.toml", path, tmp_path / "R.md")
    assert f"](docs/{schedules.FIGURE})" in "\n".join(lines)
    assert not any("![" in line for line in schedules.section(_runs(16), tmp_path / "none.toml"))


def test_the_reading_names_a_schedule_that_beats_constant_k_for_the_same_bytes():
    runs = [r for r in _runs() if r.name.split("-")[1] != "k7"]
    runs += [_run("constant", s, 0.47 + 0.01 * s, 22, k=7) for s in (0, 1, 2)]
    text = schedules.reading({16: {r.name: r for r in runs}})
    assert text.endswith("Better than constant K for the same bytes: adacomm at 16 workers.")
