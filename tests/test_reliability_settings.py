"""labavg issue 44, families 3, 5, 6 and 12: every source of settings goes through one
validation whose refusal names the file or flag; derived figures read back are measured again
and printed as strict JSON; a rank checks its launch file; every events.jsonl line is checked
for its shape as it is read back."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from labavg.base.settings import to_dict
from labavg.cli.main import main
from labavg.training.config import TrainConfig

from support import REPO, child_env

# --- family 3: settings paths -------------------------------------------------------------

# (TOML text, the setting its one line must name); each with the file's name before it.
BAD_FILES = [
    ("lr = inf", "lr"), ("lr = nan", "lr"), ("lr = -inf", "lr"), ("epochs = -1", "epochs"),
    ("ranks = 0", "ranks"), ("ranks = 100000000", "ranks"), ("seed = -1", "seed"),
    ("minibatch = 0", "minibatch"), ("watchdog_seconds = -1.0", "watchdog_seconds"),
    ("threads = 100000", "threads"), ("[model]\nhidden_dim = -1", "model.hidden_dim"),
    ("[averaging]\naverage_every = 0", "averaging.average_every"),
    ("[data]\ncv_fraction = 2.0", "data.cv_fraction"),
    ("[averaging.bmuf]\nmomentum = 1.0", "averaging.bmuf.momentum"),
    ("[model]\nhidden_dim = 'x'", "model.hidden_dim"),
]

# (flags, the source and the setting its one line must name)
BAD_FLAGS = [
    (["--lr", "inf"], "--lr", "lr"), (["--lr", "nan"], "--lr", "lr"),
    (["--epochs", "-1"], "--epochs", "epochs"), (["--ranks", "0"], "--ranks", "ranks"),
    (["--ranks", "100000000"], "--ranks", "ranks"),
    (["--ranks", "100000000", "--backend", "mpi"], "--ranks", "ranks"),  # was 10^8 mpiexec ranks
    (["--set", "lr=nan"], "--set lr=nan", "lr"), (["--set", "lr=inf"], "--set lr=inf", "lr"),
    (["--set", "lr.x=1"], "--set lr.x=1", "lr.x"),
    (["--set", "ranks.y.z=1"], "--set ranks.y.z=1", "ranks.y.z"),
    (["--set", "model.hidden_dim.x=2"], "--set model.hidden_dim.x=2", "model.hidden_dim.x"),
    (["--set", "model=1"], "--set model=1", "model"),
    (["--set", "model={hidden_dim=-3}"], "--set model={hidden_dim=-3}", "model.hidden_dim"),
    (["--set", "epochs=1e400"], "--set epochs=1e400", "epochs"),
    (["--set", "epochs=true"], "--set epochs=true", "epochs"),
    (["--set", "averaging.average_every=-2"], "--set averaging.average_every=-2",
     "averaging.average_every"),
    # a wait past the platform's time_t failed inside the collectives, mid-run
    (["--set", "watchdog_seconds=1e308"], "--set watchdog_seconds=1e308", "watchdog_seconds"),
    (["--set", "inject_fault='garbage'"], "--set inject_fault='garbage'", "inject_fault"),
]


def _refusal(capsys, tmp_path: Path, args: list[str]) -> str:
    """`labavg train ARGS` in this process: status 2, one line, nothing written."""
    work = tmp_path / f"work{len(list(tmp_path.glob('work*')))}"
    work.mkdir()
    code = main(["train", "--out", str(work / "run"), "--data", str(work / "none"), *args])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("labavg: error: "), err
    assert list(work.iterdir()) == []
    return lines[0].removeprefix("labavg: error: ")


@pytest.mark.parametrize("text, key", BAD_FILES)
def test_a_bad_value_in_a_settings_file_names_the_file_and_the_setting(capsys, tmp_path, text,
                                                                       key):
    path = tmp_path / "bad.toml"
    path.write_text(text + "\n")
    line = _refusal(capsys, tmp_path, [str(path)])
    assert line.startswith(f"{path}: ") and key in line, line
    # validation knows no data yet: no placeholder dimensions stand for the data's
    assert "inputs and" not in line and "pdfs give" not in line, line


@pytest.mark.parametrize("args, source, key", BAD_FLAGS)
def test_a_bad_value_on_the_command_line_names_the_flag_and_the_setting(capsys, tmp_path, args,
                                                                        source, key):
    line = _refusal(capsys, tmp_path, args)
    assert line.startswith(f"{source}: ") and key in line, line
    assert "inputs and" not in line, line


def test_a_later_flag_replaces_a_files_bad_value_and_names_the_flag_it_came_from(capsys, tmp_path):
    from labavg.base.settings import sources_of, with_overrides
    from labavg.training.config import check_values, load_config

    path = tmp_path / "run.toml"
    path.write_text("lr = inf\nepochs = 3\n")
    cfg = with_overrides(load_config(path), {"lr": 0.01}, {"lr": "--lr"})
    assert check_values(cfg) is cfg  # the flag's good value wins over the file's
    assert sources_of(cfg) == {"lr": "--lr", "epochs": str(path)}
    line = _refusal(capsys, tmp_path, [str(path), "--lr", "0.01", "--epochs", "0"])
    assert line.startswith("--epochs: epochs must be positive"), line


@pytest.mark.parametrize("key, value", [("lr", float("nan")), ("epochs", -1), ("ranks", 0),
                                        ("minibatch", 10**30)])
def test_resume_names_the_run_directorys_config_json_for_its_bad_value(capsys, tmp_path, key,
                                                                       value):
    run = tmp_path / "run"
    run.mkdir()
    config = to_dict(TrainConfig(out=str(run)))
    config[key] = value
    (run / "config.json").write_text(json.dumps(config))
    before = sorted((p.name, p.stat().st_mtime_ns) for p in run.iterdir())
    assert main(["train", "--resume", str(run), "--no-progress"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"labavg: error: {run / 'config.json'}: ") and key in line, line
    assert sorted((p.name, p.stat().st_mtime_ns) for p in run.iterdir()) == before


def test_too_many_inproc_ranks_are_named_as_ranks_not_as_the_models_size():
    from labavg.base.errors import UserError
    from labavg.training.config import check_model_size

    cfg = TrainConfig(ranks=100_000_000)
    with pytest.raises(UserError) as info:
        check_model_size(cfg, 65, 2, memory=8 << 30, smallest=True)
    assert "ranks = 100000000" in str(info.value) and "65 inputs" not in str(info.value)
    with pytest.raises(UserError, match="on 440 inputs and 3000 pdfs"):  # the data's own sizes
        check_model_size(TrainConfig(), 440, 3000, memory=1 << 20)


def test_the_dashboards_settings_go_through_the_same_validation(corpus, tmp_path):
    from dashboard.settings import GENERAL, RunSettings

    cases = {"watchdog_seconds": (1e308, "watchdog_seconds must be"),
             "lr.x": (1, "learning rate is a value, not a table"),
             "model": (5, "model: expected a table"), "seed": (-1, "seed must be"),
             "averaging.bmuf.momentum": (float("nan"), "method momentum must be")}
    for key, (value, said) in cases.items():
        settings = RunSettings(runs_dir=str(tmp_path / "runs"), data=str(corpus), ranks=2,
                               overrides={key: value})
        assert said in settings.errors[GENERAL] and "command line" not in settings.errors[GENERAL]


# --- family 6: the rank entry checks its launch file --------------------------------------

def _good_launch(tmp_path: Path) -> dict:
    from labavg.data.settings import DataConfig

    cfg = TrainConfig(out=str(tmp_path / "run"), data=DataConfig(data=str(tmp_path / "d")))
    return {"config": to_dict(cfg),
            "resume": False, "stop_file": str(tmp_path / ".stop")}


def _with(tmp_path: Path, **config) -> dict:
    launch = _good_launch(tmp_path)
    launch["config"].update(config)
    return launch


# Each a launch file's bytes (or what json.dumps makes of the object), and a word its line holds.
HOSTILE_LAUNCH = {
    "a JSON list": (b"[1, 2]", "a list"),
    "a number": (b"5", "a number"),
    "a string": (b'"config"', "a string"),
    "null": (b"null", "null"),
    "no config": ({"resume": False}, "config"),
    "config a list": ({"config": [1]}, "config"),
    "config a string": ({"config": "lr=1"}, "config"),
    "lr NaN": (lambda t: _with(t, lr=float("nan")), "lr"),
    "lr Infinity": (lambda t: _with(t, lr=float("inf")), "lr"),
    "epochs -1": (lambda t: _with(t, epochs=-1), "epochs"),
    "ranks 0": (lambda t: _with(t, ranks=0), "ranks"),
    "epochs a string": (lambda t: _with(t, epochs="2"), "epochs"),
    "model a number": (lambda t: _with(t, model=5), "model"),
    "an unknown setting": (lambda t: _with(t, no_such=1), "no_such"),
    "an unknown key": (lambda t: {**_good_launch(t), "allow_pipes": True}, "allow_pipes"),
    "resume a string": (lambda t: {**_good_launch(t), "resume": "yes"}, "resume"),
    "stop_file a number": (lambda t: {**_good_launch(t), "stop_file": 5}, "stop_file"),
    "not JSON": (b'{"config": ', "not valid JSON"),
    "not UTF-8": (b'{"config": "\xff"}', "binary"),
    "nested deep": (b"[" * 100_000 + b"]" * 100_000, "nested"),
    "empty": (b"", "not valid JSON"),
}


@pytest.mark.parametrize("case", list(HOSTILE_LAUNCH))
def test_a_hostile_launch_file_is_one_line_status_2_and_nothing_trained(tmp_path, capsys, case):
    from labavg.jobs.rank_main import main as rank_main

    content, word = HOSTILE_LAUNCH[case]
    if callable(content):
        content = content(tmp_path)
    if not isinstance(content, bytes):
        content = json.dumps(content).encode()
    launch = tmp_path / "launch.json"
    launch.write_bytes(content)
    assert rank_main([str(launch), "--no-progress"]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"labavg: error: {launch}"), err
    assert word in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


def test_a_rank_process_refuses_a_launch_file_holding_a_list(tmp_path):
    launch = tmp_path / "launch.json"
    launch.write_text("[]")
    proc = subprocess.run([sys.executable, "-m", "labavg.jobs.rank_main", str(launch)],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=child_env())
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr


# --- family 5: derived figures read back ---------------------------------------------------

def _finished_run(path: Path, **summary) -> Path:
    path.mkdir(parents=True)
    config = to_dict(TrainConfig(out=str(path), ranks=2))
    (path / "config.json").write_text(json.dumps(config))
    values = {"ranks": 2, "backend": "mpi", "average_every": 10, "cv_frame_accuracy": 0.5,
              "cv_loss": 1.5, "wall_seconds": 10.0, "compute_seconds": 8.0, "comm_seconds": 2.0,
              "comm_fraction": 0.2, "cores": 16, "speedup_pairs": [[1.0, 1.1], [1.0, 1.2]],
              "config": config, **summary}
    (path / "summary.json").write_text(json.dumps(values))
    return path


def _strict(text: str):
    def refuse(name):
        raise AssertionError(f"not JSON: a bare {name}")

    return json.loads(text, parse_constant=refuse)


def _info_json(capsys, run: Path) -> dict:
    assert main(["info", "--json", str(run)]) == 0
    return _strict(capsys.readouterr().out)


def test_info_json_measures_the_speedup_again_from_the_pairs(capsys, tmp_path):
    run = _finished_run(tmp_path / "run", speedup=-5.0, speedup_low=-5.0, speedup_high=99.0,
                        parallel_efficiency=-2.5, speedup_text="-5.00x", comm_fraction=7.0,
                        speedup_bound=0.0, speedup_flag="forged")
    shown = _info_json(capsys, run)
    ratios = sorted([2 * 1.0 / 1.1, 2 * 1.0 / 1.2])
    assert shown["speedup"] == pytest.approx(sum(ratios) / 2)
    assert (shown["speedup_low"], shown["speedup_high"]) == pytest.approx(ratios)
    assert shown["parallel_efficiency"] == pytest.approx(shown["speedup"] / 2)
    assert shown["speedup_text"].startswith(f"{shown['speedup']:.2f}x")
    assert shown["speedup_flag"] is None and shown["speedup_bound"] == 2.0
    assert shown["comm_fraction"] == pytest.approx(0.2)
    # the table shows the same figure
    assert main(["info", str(run)]) == 0
    assert f"{shown['speedup']:.2f}" in capsys.readouterr().out


@pytest.mark.parametrize("pairs", [
    [[float("nan"), 0.5], [1.0, 0.5]], [[1.0, float("nan")]], [[float("inf"), 0.5]],
    [[1e308, 1e-308], [1e308, 1e-308]], [[1.0, float("inf")]], [[-1.0, 0.5]],
])
def test_info_prints_strict_json_and_no_infinite_speedup(capsys, tmp_path, pairs):
    run = _finished_run(tmp_path / "run", speedup_pairs=pairs, cv_loss=float("nan"),
                        speedup=float("inf"), load_average={"start": float("nan")})
    shown = _info_json(capsys, run)
    assert shown["cv_loss"] is None
    assert shown["speedup"] is None or math.isfinite(shown["speedup"])
    assert main(["info", str(run)]) == 0
    table = capsys.readouterr().out
    assert not any(word in table for word in ("infx", "inf-", "-inf", "nanx", "nan-")), table


def test_info_json_of_a_run_in_progress_is_strict_json(capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    config = to_dict(TrainConfig(out=str(run)))
    config["lr"] = float("nan")  # a record of what ran is shown, in JSON any parser reads
    (run / "config.json").write_text(json.dumps(config))
    shown = _info_json(capsys, run)
    assert shown["status"] == "running/incomplete" and shown["config"]["lr"] is None


def test_a_summary_with_a_count_no_float_holds_is_listed_without_a_traceback(capsys, tmp_path):
    run = _finished_run(tmp_path / "run")
    text = (run / "summary.json").read_text().replace('"ranks": 2', '"ranks": 1' + "0" * 400)
    (run / "summary.json").write_text(text)
    shown = _info_json(capsys, run)  # was OverflowError in the summary's type check
    assert shown["speedup"] is None and shown["speedup_text"] is None
    assert main(["info", str(run)]) == 0


# --- family 12: lines of the wrong shape in a file labavg wrote ----------------------------

GOOD = {"type": "message", "rank": 0, "step": 1, "text": "hello"}
PAIR = {"type": "speedup_pair", "rank": 0, "step": 3, "round": 1, "solo_step_seconds": 1.0,
        "parallel_step_seconds": 0.5, "solo_steps": 2, "parallel_steps": 2}
# Valid JSON, each line not an event this labavg wrote (or of a type it does not know, with a
# field every reader indexes of the wrong type).
WRONG_SHAPES = [
    "5", "[1, 2]", '"text"', "null", "true", "{}", '{"type": "message"}',
    '{"rank": 0, "step": 1}', '{"type": 5, "rank": 0}', '{"type": "message", "rank": "0", '
    '"step": 1, "text": "x"}', '{"type": "message", "rank": -1, "step": 1, "text": "x"}',
    '{"type": "message", "rank": true, "step": 1, "text": "x"}',
    json.dumps({**PAIR, "solo_step_seconds": "fast"}), json.dumps({**PAIR, "step": 2.5}),
    json.dumps({**PAIR, "rank": [0]}), '{"type": "run_started", "rank": 0}',
    '{"type": "new_kind", "rank": 0, "step": "x"}', '{"type": "new_kind", "rank": null}',
    "[" * 50_000 + "]" * 50_000,
]


def _events_file(run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(GOOD), *WRONG_SHAPES, "\xff", json.dumps(PAIR), '{"type": "mess']
    path = run_dir / "events.jsonl"
    path.write_bytes("\n".join(lines).encode("utf-8", "surrogateescape") + b"\n")
    return path


def test_every_reader_of_events_skips_lines_of_the_wrong_shape(tmp_path):
    from labavg.base.events import Message, SpeedupPair
    from labavg.jobs.followed import FollowedRun
    from labavg.jobs.index import read_events, read_run_events
    from labavg.jobs.job_outcome import last_steps, lost_ranks

    run = tmp_path / "run"
    _events_file(run)
    assert read_events(run) == [GOOD, PAIR]
    assert [type(e) for e in read_run_events(run)] == [Message, SpeedupPair]
    assert last_steps(run) == "rank 0 last event at step 3"
    assert lost_ranks(run, {123}) == ""
    followed = FollowedRun(run)
    (run / "summary.json").write_text("{}")  # ended: its events are read to the end
    assert [type(e) for e in followed.events()] == [Message, SpeedupPair]


@pytest.mark.parametrize("line", WRONG_SHAPES[:12])
def test_event_from_dict_refuses_what_is_not_an_event(line):
    from labavg.base.events import event_from_dict

    assert event_from_dict(json.loads(line)) is None


@pytest.mark.slow  # two short trainings per backend
@pytest.mark.parametrize("backend", ["inproc", "mpi"])
def test_resume_goes_past_event_lines_of_the_wrong_shape(corpus, tmp_path, backend):
    # labavg issue 44: `5`, `[1, 2]` or an object without `rank` in events.jsonl ended
    # `--resume` in a traceback (inproc); on MPI both ranks crashed, then the launcher's report.
    from labavg.jobs.launch import start_run
    from labavg.jobs.run_json import SUMMARY
    from support import stop_at_first_round
    from test_train import small_config

    out = tmp_path / "run"
    cfg = small_config(corpus, out, backend=backend, epochs=2, checkpoint_every=1)
    handle = start_run(cfg)
    stop_at_first_round(handle)
    for _ in handle.events(timeout=120):
        pass
    assert handle.result(120).stopped is True
    with open(out / "events.jsonl", "ab") as f:
        f.write("\n".join(WRONG_SHAPES).encode() + b"\n")
    proc = subprocess.run([sys.executable, "-m", "labavg", "train", "--resume", str(out),
                           "--no-progress"], capture_output=True, text=True, timeout=300,
                          env=child_env(), cwd=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    summary = json.loads((out / SUMMARY).read_text())
    assert summary["resumed"] is True and summary["stopped"] is False
