"""`labavg info` on run directories and on directories of runs (the quick start's layout)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from labavg.cli.main import main


def _run(path: Path, ranks: int, finished: bool = True) -> Path:
    """A run directory as labavg writes one: config.json, and summary.json once it has ended."""
    path.mkdir(parents=True)
    config = {"ranks": ranks, "averaging": {"average_every": 10}, "optimizer": "ngsgd",
              "lr": 0.016, "model": {"hidden_layers": 4, "hidden_dim": 512}}
    (path / "config.json").write_text(json.dumps(config))
    (path / "events.jsonl").write_text("")
    if finished:
        (path / "summary.json").write_text(json.dumps(
            {"ranks": ranks, "average_every": 10, "optimizer": "ngsgd", "wall_seconds": 100.0 / ranks,
             "cv_frame_accuracy": 0.5, "cv_loss": 1.5, "config": config}))
        (path / "decode_test").mkdir()  # a run's own folders hold no runs
        (path / "decode_test" / "result.json").write_text("{}")
    return path


def _info(capsys, *args) -> tuple[int, list[str], str]:
    code = main(["info", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def _cells(line: str) -> list[str]:
    """A Markdown table line's cells, without the padding that aligns the columns."""
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _runs_in_table(lines: list[str]) -> list[str]:
    return [_cells(line)[0] for line in lines[2:]]


@pytest.fixture
def runs(tmp_path, monkeypatch) -> Path:
    """runs/ after the quick start (nested one level) beside a plain run and a sweep."""
    monkeypatch.chdir(tmp_path)
    _run(tmp_path / "runs" / "quickstart-20250101-120000" / "ranks1", 1)
    _run(tmp_path / "runs" / "quickstart-20250101-120000" / "ranks2", 2)
    _run(tmp_path / "runs" / "k10", 4)
    for ranks in (1, 2, 16):
        _run(tmp_path / "runs" / "sweep" / "runs" / f"seed_0-ranks_{ranks}", ranks)
    _run(tmp_path / "runs" / "sweep" / "runs" / "seed_0-ranks_32", 32, finished=False)
    (tmp_path / "runs" / "sweep" / "results.md").write_text("")
    return Path("runs")


def test_info_of_the_quick_starts_glob_lists_its_nested_runs(runs, capsys):
    # what `labavg info runs/*` expands to
    code, lines, err = _info(capsys, *sorted(runs.iterdir()))
    assert code == 0, err
    assert _runs_in_table(lines) == [
        "runs/k10",
        "runs/quickstart-20250101-120000/ranks1",
        "runs/quickstart-20250101-120000/ranks2",
        "runs/sweep/runs/seed_0-ranks_1",
        "runs/sweep/runs/seed_0-ranks_2",
        "runs/sweep/runs/seed_0-ranks_16",
        "runs/sweep/runs/seed_0-ranks_32 (running/incomplete)",
    ]
    assert _cells(lines[0])[:2] == ["run", "ranks"] and len(lines) == 2 + 7  # one table


def test_info_of_a_directory_searches_it_and_a_run_is_listed_once(runs, capsys):
    code, lines, _ = _info(capsys, runs / "sweep", runs / "sweep" / "runs" / "seed_0-ranks_2")
    assert code == 0
    assert _runs_in_table(lines)[:3] == ["runs/sweep/runs/seed_0-ranks_1",
                                         "runs/sweep/runs/seed_0-ranks_2",
                                         "runs/sweep/runs/seed_0-ranks_16"]
    assert len(lines) == 2 + 4
    # the unfinished run shows its settings and no results
    assert _cells(lines[-1])[1:4] == ["32", "10", "ngsgd"] and "-" in _cells(lines[-1])


def test_info_json_is_one_object_for_one_run_and_a_list_for_a_directory(runs, capsys):
    code, lines, _ = _info(capsys, "--json", runs / "k10")
    one = json.loads("\n".join(lines))
    assert code == 0 and one["run"] == "runs/k10" and one["ranks"] == 4
    code, lines, _ = _info(capsys, "--json", runs / "quickstart-20250101-120000")
    many = json.loads("\n".join(lines))
    assert code == 0 and [s["ranks"] for s in many] == [1, 2]
    code, lines, _ = _info(capsys, "--json", runs / "sweep" / "runs" / "seed_0-ranks_32")
    assert json.loads("\n".join(lines))["status"] == "running/incomplete"


@pytest.mark.parametrize("make, says", [
    (lambda root: (root / "empty" / "sub").mkdir(parents=True) or root / "empty", "no labavg run"),
    (lambda root: root / "missing", "no such run or directory"),
    (lambda root: (root / "notes.txt").write_text("x") and root / "notes.txt", "not a run directory"),
])
def test_info_of_a_path_holding_no_run_exits_2_naming_it(runs, capsys, make, says):
    bad = make(runs)
    code, lines, err = _info(capsys, runs / "k10", bad)
    assert code == 2 and lines == []
    assert err.splitlines() == [err.strip()] and str(bad) in err and says in err


def test_info_names_a_broken_summary(runs, capsys):
    (runs / "k10" / "summary.json").write_text("{")
    code, _, err = _info(capsys, runs)
    assert code == 2 and str(runs / "k10" / "summary.json") in err


@pytest.mark.parametrize("file", ["summary.json", "config.json"])
def test_info_names_a_run_written_before_the_averaging_section_and_lists_the_others(
        runs, capsys, file):
    # an earlier labavg wrote K at the config's top level; a finished run's summary.json
    # holds its config too
    old = runs / "quickstart-20250101-120000" / "ranks2"
    if file == "config.json":
        (old / "summary.json").unlink()
    values = json.loads((old / file).read_text())
    config = values["config"] if file == "summary.json" else values
    config.pop("averaging")
    config["average_every"] = 10
    (old / file).write_text(json.dumps(values))
    code, lines, err = _info(capsys, runs / "quickstart-20250101-120000", runs / "k10")
    assert code == 2
    assert _runs_in_table(lines) == ["runs/quickstart-20250101-120000/ranks1", "runs/k10"]
    assert err.splitlines() == [
        f"labavg: error: {old / file}: {'config: ' if file == 'summary.json' else ''}"
        "settings have moved: average_every is now averaging.average_every"]


def test_info_into_a_closed_pipe_exits_quietly(tmp_path):
    # `labavg info runs | head -1`: the reader has gone before labavg writes
    import subprocess
    import sys

    _run(tmp_path / "runs" / "a", 1)
    proc = subprocess.Popen([sys.executable, "-m", "labavg", "info", str(tmp_path / "runs")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141
    assert err == "", err


@pytest.mark.slow  # end to end: out of the fast suite's 10 minutes
def test_info_shows_the_whole_process_time_beside_the_training_wall(corpus, tmp_path, capsys):
    """A real `labavg train` (its own process, 1 rank): summary.json records the command's whole
    time from its process's start, which `labavg info` and `--json` show beside the training
    loop's wall; it holds the loop and start-up, so it is the larger (issue 45)."""
    import subprocess
    import sys

    from test_train import SMALL

    out = tmp_path / "r1"
    proc = subprocess.run([sys.executable, "-m", "labavg", "train", "--data", str(corpus),
                           "--out", str(out), *SMALL], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    code, lines, err = _info(capsys, out)
    assert code == 0, err
    header = _cells(lines[0])
    row = dict(zip(header, _cells(lines[2])))
    assert header.index("process s") == header.index("wall s") + 1
    assert float(row["process s"]) >= float(row["wall s"]) > 0
    summary = json.loads(_json_of(capsys, out))
    assert summary["process_seconds"] >= summary["wall_seconds"] > 0


def _json_of(capsys, path: Path) -> str:
    assert main(["info", "--json", str(path)]) == 0
    return capsys.readouterr().out


def test_a_summary_from_before_the_process_time_reads_and_shows_none(runs, capsys):
    code, lines, err = _info(capsys, runs / "k10")
    assert code == 0 and not err
    row = dict(zip(_cells(lines[0]), _cells(lines[2])))
    assert row["wall s"] == "25.0" and row["process s"] == "-"
    assert main(["info", "--json", str(runs / "k10")]) == 0
    assert json.loads(capsys.readouterr().out)["process_seconds"] is None
