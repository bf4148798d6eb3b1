"""Beyond the paper: the BMUF/DiLoCo section of REPRODUCTION.md, from recorded runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from labavg.studies.reproduction import beyond
from labavg.studies.reproduction.results import Run, read_results_file, with_recorded, write_results_file
from labavg.studies.sweep import load_sweep

REPO = Path(__file__).resolve().parent.parent


def _run(seed, wer, ranks=16, k=10, method="model", payload="fp32", bits=8, acc=0.7):
    name = f"seed_{seed}-ranks_{ranks}-method_{method}-average_every_{k}-{payload}{bits}"
    rounds = 1000 // k
    bytes_per_round = 0 if ranks == 1 else 800_000
    settings = {"seed": seed, "ranks": ranks, "averaging.average_every": k,
                "averaging.method": method, "averaging.payload": payload,
                "averaging.payload_bits": bits, "epochs": 2, "minibatch": 256, "lr": 0.008}
    return Run(name, settings, {"wer": wer, "cv_frame_accuracy": acc, "averaging_rounds": rounds,
                                "bytes_sent": bytes_per_round * rounds})


def _runs():
    runs = [_run(s, 10.0 + 0.1 * s, ranks=1) for s in (0, 1, 2)]
    for s in (0, 1, 2):
        runs += [_run(s, 12.0 + 0.1 * s), _run(s, 11.0 + 0.15 * s, method="bmuf"),
                 _run(s, 12.0 + (0.3, -0.3, 0.1)[s], method="diloco"),
                 _run(s, 14.0 + 0.1 * s, k=200), _run(s, 11.9 + 0.1 * s, k=200, method="bmuf")]
    return runs


def _cells(rows: list[str]) -> list[list[str]]:
    """A markdown table's body rows as stripped cells (the header and its rule left out)."""
    return [[c.strip() for c in row.strip().strip("|").split("|")] for row in rows[2:]]


def _row(rows: list[str], *first: str) -> list[str]:
    return next(c for c in _cells(rows) if c[:len(first)] == list(first))


def test_the_table_pairs_each_method_with_plain_averaging_at_the_same_k():
    runs = _runs()
    one = beyond.select([r for r in runs if r.get("ranks") == 1])
    rows = beyond.table(runs, one)
    assert _cells(rows)[0][:2] == ["1", "-"] and _cells(rows)[0][-1] == "reference"
    bmuf10 = _row(rows, "16", "10", "BMUF")
    # 100 ln(model / bmuf) per seed: 8.70, 8.18, 7.66 -> +8.2 %, excluding zero
    gain = sum(100 * math.log((12.0 + 0.1 * s) / (11.0 + 0.15 * s)) for s in range(3)) / 3
    assert bmuf10[9].startswith(f"{gain:+.1f} [") and bmuf10[-1] == "better"
    assert _row(rows, "16", "10", "DiLoCo")[-1].startswith("unresolved: ")
    k200 = _row(rows, "16", "200", "model (the paper's)")
    assert k200[7:9] == ["4.0", "5"]  # MB sent per worker (5 rounds of 0.8 MB) and the rounds
    # 1 worker, and model at K = 10 and at K = 200
    assert sum(c[-1] == "reference" for c in _cells(rows)) == 3


def test_verdicts_compare_longer_blocks_with_the_papers_k():
    answers = dict(beyond.verdicts(_runs()))
    gain = sum(100 * math.log((14.0 + 0.1 * s) / (11.9 + 0.1 * s)) for s in range(3)) / 3
    assert answers["BMUF vs model, 16 workers, K = 200"].startswith(f"better: {gain:+.1f}")
    # BMUF at K = 200 sends 20x fewer bytes than model at K = 10 and is as good: 0.1 points of
    # 12 % WER on every seed, 0.8 % relative, inside the 1 % margin of "same".
    assert answers["BMUF at K = 200 (20x fewer bytes) vs model at K = 10, 16 workers"].startswith(
        "same: +0.8")
    loss = sum(100 * math.log((12.0 + 0.1 * s) / (14.0 + 0.1 * s)) for s in range(3)) / 3
    assert answers["model at K = 200 (20x fewer bytes) vs model at K = 10, 16 workers"].startswith(
        f"worse: {loss:+.1f}")
    assert "DiLoCo vs model, 16 workers, K = 200" not in answers  # not run: no line


def test_a_single_seed_is_not_a_verdict():
    runs = [_run(0, 12.0), _run(0, 11.0, method="bmuf")]
    assert dict(beyond.verdicts(runs))["BMUF vs model, 16 workers, K = 10"].startswith(
        "needs 2+ seeds")


def test_payloads_are_their_own_rows():
    # Listed after the fp32 runs of the same seeds, as a sweep would find them.
    runs = _runs() + [_run(s, 12.2, payload="int", bits=4) for s in (0, 1)]
    rows = beyond.table(runs, {})
    int4 = [c for c in _cells(rows) if c[3] == "int4"]
    assert len(int4) == 1 and int4[0][:5] == ["16", "10", "model (the paper's)", "int4", "2"]
    # The fp32 reference keeps its three seeds, and int4 is paired with it on seeds 0 and 1.
    fp32 = _row(rows, "16", "10", "model (the paper's)", "fp32")
    assert fp32[4:6] == ["3", "12.10 ± 0.10"]
    gain = (100 * math.log(12.0 / 12.2) + 100 * math.log(12.1 / 12.2)) / 2  # model against int4
    assert int4[0][9].startswith(f"{gain:+.1f} [")


def test_the_figure_is_written(tmp_path):
    runs = _runs()
    path = beyond.figure(runs, beyond.select([r for r in runs if r.get("ranks") == 1]),
                         tmp_path / "fig.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_recorded_runs_fill_in_for_missing_run_directories(tmp_path):
    results = write_results_file({"beyond": _runs()[:4], "paper": []}, tmp_path / "r.jsonl")
    recorded = read_results_file(results)
    assert [r.name for r in recorded["beyond"]] == sorted(r.name for r in _runs()[:4])
    # A run that is there wins over its recorded copy; the others come from the file.
    fresh = _run(0, 99.0, ranks=1)
    merged = with_recorded({"beyond": [fresh], "paper": []}, results)
    by_name = {r.name: r for r in merged["beyond"]}
    assert by_name[fresh.name].metric("wer") == 99.0 and len(by_name) == 4
    assert with_recorded({"beyond": []}, tmp_path / "missing.jsonl") == {"beyond": []}
    line = json.loads(results.read_text().splitlines()[0])
    assert line["settings"]["averaging.method"] in ("model", "bmuf", "diloco")


def test_experiments_beyond_toml_has_every_cell_with_two_seeds():
    sweep = load_sweep(REPO / "experiments" / "beyond.toml")
    points = [o for _, o in sweep.points()]
    for ranks in (16, 32):
        for method in beyond.METHODS:
            for k in (10, 50, 200):
                seeds = {o["seed"] for o in points if o.get("ranks") == ranks
                         and o.get("averaging.method") == method
                         and o.get("averaging.average_every") == k}
                assert seeds >= {0, 1}, (ranks, method, k)
    assert sweep.base.decode_data  # every point is decoded: the section's error rate is WER


@pytest.mark.parametrize("name", ["model", "bmuf", "diloco"])
def test_method_labels_cover_every_averager(name):
    from labavg.averaging.registry import methods

    assert set(methods()) == set(beyond.METHODS) and name in beyond._LABELS


def test_frame_accuracy_decides_where_the_seeds_agree_and_higher_is_better():
    runs = [_run(s, 12.0, acc=0.60 + 0.01 * s) for s in (0, 1, 2)]
    runs += [_run(s, 12.0 + (0.5, -0.5, 0.0)[s], method="bmuf", acc=0.62 + 0.01 * s)
             for s in (0, 1, 2)]
    answers = dict(beyond.verdicts(runs))
    assert answers["BMUF vs model, 16 workers, K = 10"].startswith("unresolved")
    assert answers["BMUF vs model, 16 workers, K = 10, CV frame accuracy"].startswith(
        "better: +2.00")
