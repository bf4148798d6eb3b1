"""Damaged or hostile files of run directories read back (`labavg info`, `labavg compare`,
`labavg reproduce --report-only`): one line per damaged file naming it and the bad field, the
good runs still listed, exit status 2, never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from labavg.cli.main import main
from tests.support import PYTHON, REPO, child_env, cli_refusal

CONFIG = {"ranks": 1, "averaging": {"average_every": 10}, "optimizer": "ngsgd", "lr": 0.016,
          "model": {"hidden_layers": 4, "hidden_dim": 512}}


def _run(path: Path, ranks: int = 1, **fields) -> Path:
    path.mkdir(parents=True)
    config = {**CONFIG, "ranks": ranks}
    (path / "config.json").write_text(json.dumps(config))
    summary = {"ranks": ranks, "average_every": 10, "optimizer": "ngsgd", "wall_seconds": 50.0,
               "cv_frame_accuracy": 0.5, "cv_loss": 1.5, "wer": 12.0, "wer_ci": [11.0, 13.0],
               "config": config, **fields}
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def _info(capsys, *paths) -> tuple[int, str, list[str]]:
    code = main(["info", *map(str, paths)])
    out, err = capsys.readouterr()
    return code, out, err.strip().splitlines()


# Each damage and the words its one line must hold.
DAMAGED_SUMMARIES = {
    "binary": (b"\x00\xff\xfe\x89PNG\r\n", "binary data"),
    "deep_list": (b"[" * 100_000 + b"]" * 100_000, "nested more than"),
    "deep_object": (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "nested more than"),
    "not_an_object": (b"[1, 2, 3]", "expected an object"),
    "cut_short": (b'{"ranks": 1, "wall_sec', "not valid JSON"),
}
WRONG_TYPES = {
    "accuracy_string": ({"cv_frame_accuracy": "high"}, "'cv_frame_accuracy' is a string"),
    "wer_string": ({"wer": "low"}, "'wer' is a string"),
    "config_list": ({"config": [1, 2]}, "'config' is a list"),
    "wer_ci_number": ({"wer_ci": 3.0}, "'wer_ci' is a number"),
    "model_string": ({"config": {**CONFIG, "model": "big"}}, "'config.model' is a string"),
    "ranks_string": ({"ranks": "two"}, "'ranks' is a string"),
    "lr_list": ({"config": {**CONFIG, "lr": [1]}}, "'config.lr' is a list"),
    "wall_object": ({"wall_seconds": {"s": 1}}, "'wall_seconds' is an object"),
    "speedup_bool": ({"speedup": True}, "'speedup' is a boolean"),
    "pairs_numbers": ({"ranks": 2, "speedup_pairs": [1, 2]}, "'speedup_pairs' is a list"),
    "pairs_text": ({"ranks": 2, "speedup_pairs": [["a", "b"]]}, "'speedup_pairs' is a list"),
    "cores_string": ({"cores": "four"}, "'cores' is a string"),
    "load_string": ({"load_average": {"start": "high"}}, "'load_average.start' is a string"),
}


@pytest.mark.parametrize("name", sorted(DAMAGED_SUMMARIES))
def test_info_names_a_damaged_summary_in_one_line(tmp_path, capsys, name):
    data, words = DAMAGED_SUMMARIES[name]
    run = _run(tmp_path / name)
    (run / "summary.json").write_bytes(data)
    code, out, err = _info(capsys, run)
    assert code == 2
    assert len(err) == 1 and err[0].startswith(f"labavg: error: {run / 'summary.json'}: "), err
    assert words in err[0]


@pytest.mark.parametrize("name", sorted(WRONG_TYPES))
def test_info_names_the_field_of_the_wrong_type(tmp_path, capsys, name):
    fields, words = WRONG_TYPES[name]
    run = _run(tmp_path / name, **fields)
    code, out, err = _info(capsys, run)
    assert code == 2
    assert len(err) == 1 and str(run / "summary.json") in err[0] and words in err[0], err


def test_one_damaged_run_in_a_tree_leaves_the_others_listed(tmp_path, capsys):
    runs = tmp_path / "runs"
    _run(runs / "a_good", 1)
    (_run(runs / "b_binary") / "summary.json").write_bytes(b"\xff\xfe\x00")
    _run(runs / "c_wrong", wer="12 %")
    (_run(runs / "d_config") / "summary.json").unlink()
    (runs / "d_config" / "config.json").write_text('{"ranks": "one"}')
    _run(runs / "e_good", 2)
    code, out, err = _info(capsys, runs)
    assert code == 2
    listed = [line.split("|")[1].strip() for line in out.splitlines()[2:]]
    assert listed == [str(runs / "a_good"), str(runs / "e_good")]
    assert [line.split(": ")[2].split("/")[-2] for line in err] == ["b_binary", "c_wrong",
                                                                   "d_config"], err
    assert "'ranks' is a string" in err[2]


def test_a_fifo_in_place_of_a_summary_is_refused_not_waited_on(tmp_path):
    run = _run(tmp_path / "fifo")
    (run / "summary.json").unlink()
    os.mkfifo(run / "summary.json")
    proc = subprocess.run([PYTHON, "-m", "labavg", "info", str(run)], capture_output=True,
                          text=True, env=child_env(), timeout=60)  # a reader that waits fails here
    assert proc.returncode == 2 and "not a regular file" in proc.stderr, proc.stderr


def _without_dac(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`labavg ARGS` as root without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH: file modes bind."""
    drop = "-dac_override,-dac_read_search"
    return subprocess.run(
        ["setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}", PYTHON, "-m", "labavg", *args],
        capture_output=True, text=True, cwd=cwd, env=child_env(), timeout=120)


@pytest.mark.skipif(shutil.which("setpriv") is None and os.environ.get("CI") != "true",
                    reason="setpriv (util-linux) not installed")
@pytest.mark.parametrize("what", ["summary file", "run directory", "folder of runs"])
def test_unreadable_files_are_named_even_for_root(tmp_path, what):
    runs = tmp_path / "runs"
    _run(runs / "a_good")
    bad = _run(runs / "b_bad" / "inner")
    target = {"summary file": bad / "summary.json", "run directory": bad,
              "folder of runs": bad.parent}[what]
    target.chmod(0)
    try:
        proc = _without_dac(["info", "runs"], tmp_path)
    finally:
        target.chmod(0o755)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(err) == 1 and err[0].startswith("labavg: error: ") and str(target.relative_to(tmp_path)) in err[0], err
    assert "Permission denied" in err[0]
    assert "runs/a_good" in proc.stdout


def _decoded(run: Path, result: bytes | None = None) -> Path:
    out = run / "decode_test"
    out.mkdir(parents=True)
    (out / "result.json").write_bytes(result if result is not None else b'{"acwt": 0.1}')
    (out / "ref.txt").write_text("u1 a b\nu2 c\n")
    (out / "hyp_0.1.txt").write_text("u1 a b\nu2 d\n")
    return run


COMPARE_DAMAGE = {
    "binary result": ("result.json", b"\x00\xff\x89", "binary data"),
    "deep result": ("result.json", b"[" * 50_000 + b"]" * 50_000, "nested more than"),
    "acwt a string": ("result.json", b'{"acwt": "0.1"}', "'acwt' is a string"),
    "acwt a list": ("result.json", b'{"acwt": [0.1]}', "'acwt' is a list"),
    "result a list": ("result.json", b"[0.1]", "expected an object"),
    "binary hypotheses": ("hyp_0.1.txt", b"u1 \xff\xfe\n", "binary data"),
}


@pytest.mark.parametrize("name", sorted(COMPARE_DAMAGE))
def test_compare_names_a_damaged_decode_in_one_line(tmp_path, capsys, name):
    file, data, words = COMPARE_DAMAGE[name]
    a = _decoded(tmp_path / "a")
    b = _decoded(tmp_path / "b")
    (b / "decode_test" / file).write_bytes(data)
    code = main(["compare", str(a), str(b)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and str(b / "decode_test" / file) in err[0] and words in err[0], err


@pytest.mark.skipif(shutil.which("setpriv") is None and os.environ.get("CI") != "true",
                    reason="setpriv (util-linux) not installed")
def test_compare_names_an_unreadable_decode_even_for_root(tmp_path):
    a = _decoded(tmp_path / "a")
    b = _decoded(tmp_path / "b")
    (b / "decode_test").chmod(0)
    try:
        proc = _without_dac(["compare", "a", "b"], tmp_path)
    finally:
        (b / "decode_test").chmod(0o755)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert "b/decode_test/result.json" in err[0] and "Permission denied" in err[0]


def _good_results_line() -> str:
    return (REPO / "experiments" / "reproduction-results.jsonl").read_text().splitlines()[0]


RESULTS_DAMAGE = {
    "a list": "[1, 2]",
    "settings a list": lambda good: json.dumps({**json.loads(good), "settings": [1]}),
    "summary a string": lambda good: json.dumps({**json.loads(good), "summary": "fine"}),
    "wer a string": lambda good: json.dumps({**json.loads(good), "summary": {
        **json.loads(good)["summary"], "wer": "x"}}),
    "no name": lambda good: json.dumps({k: v for k, v in json.loads(good).items() if k != "name"}),
    "deep": "[" * 50_000 + "]" * 50_000,
    "binary": b"\xff\xfe\x00 not text",
}


def _refused_report(tmp_path: Path) -> list[str]:
    """`labavg reproduce --report-only` in tmp_path (experiments/, runs/): its stderr lines,
    after checking that it exited 2."""
    proc = subprocess.run(
        [PYTHON, "-m", "labavg", "reproduce", "--report-only", "--out", str(tmp_path / "runs"),
         "--experiments", str(tmp_path / "experiments"), "--report", str(tmp_path / "R.md"),
         "--figure", str(tmp_path / "f.png")],
        capture_output=True, text=True, cwd=tmp_path, env=child_env(), timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    return proc.stderr.strip().splitlines()


@pytest.mark.parametrize("name", sorted(RESULTS_DAMAGE))
def test_report_only_names_a_bad_results_line(tmp_path, name):
    experiments = tmp_path / "experiments"
    shutil.copytree(REPO / "experiments", experiments)
    results = experiments / "reproduction-results.jsonl"
    good = _good_results_line()
    bad = RESULTS_DAMAGE[name]
    bad = bad(good) if callable(bad) else bad
    bad = bad if isinstance(bad, bytes) else bad.encode()
    results.write_bytes(good.encode() + b"\n" + bad + b"\n")
    err = _refused_report(tmp_path)
    assert len(err) == 1 and f"{results}, line 2" in err[0], err
    assert not (tmp_path / "R.md").exists()


def test_report_only_names_a_damaged_run_summary_instead_of_leaving_the_run_out(tmp_path):
    experiments = tmp_path / "experiments"
    shutil.copytree(REPO / "experiments", experiments)
    run = _run(tmp_path / "runs" / "paper" / "runs" / "seed_0")
    (run / "summary.json").write_bytes(b'{"ranks": 1, "wall_sec')
    err = _refused_report(tmp_path)
    assert len(err) == 1 and f"{run / 'summary.json'}: not valid JSON" in err[0], err
    assert f"remove {run} to train it again" in err[0]
    assert not (tmp_path / "R.md").exists()


def test_an_earlier_labavgs_averaging_settings_are_refused_with_where_they_went(tmp_path):
    old = tmp_path / "old.toml"
    old.write_text("average_every = 5\n[bmuf]\nmomentum = 0.5\n")
    work = tmp_path / "work"
    work.mkdir()
    line = cli_refusal(work, [str(old)])
    assert line == (f"labavg: error: {old}: settings have moved: average_every is now "
                    f"averaging.average_every, bmuf is now averaging.bmuf")
    line = cli_refusal(work, ["--set", "average_every=5"])
    assert line == ("labavg: error: --set average_every=5: setting 'average_every' has moved: "
                    "it is now 'averaging.average_every'")


class _RunsCode:
    """Pickles to a call of os.system: what a hostile model file carries."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _hostile_files(tmp_path: Path) -> dict[str, Path]:
    import pickle

    import torch

    marker = tmp_path / "ran"
    files = {"torch archive": tmp_path / "zip.pt", "legacy torch": tmp_path / "legacy.pt",
             "bare pickle": tmp_path / "bare.pt"}
    torch.save({"format": "labavg-final", "x": _RunsCode(marker)}, files["torch archive"])
    torch.save({"x": _RunsCode(marker)}, files["legacy torch"], _use_new_zipfile_serialization=False)
    files["bare pickle"].write_bytes(pickle.dumps({"x": _RunsCode(marker)}, protocol=4))
    return files


@pytest.mark.parametrize("kind", ["torch archive", "legacy torch", "bare pickle"])
def test_a_pickled_final_pt_is_refused_in_labavgs_words(tmp_path, kind):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(_hostile_files(tmp_path)[kind], run / "final.pt")
    proc = subprocess.run([PYTHON, "-m", "labavg", "decode", str(run), "--data", str(tmp_path)],
                          capture_output=True, text=True, env=child_env(), timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2
    assert len(err) == 1, err  # torch's UserWarning about the pickle held back
    assert f"refused model file {run / 'final.pt'}" in err[0]
    assert "labavg loads weights only" in err[0]
    assert "weights_only" not in err[0] and "will likely succeed" not in err[0]
    assert not (tmp_path / "ran").exists()


def test_a_pickled_checkpoint_is_refused_in_labavgs_words(tmp_path):
    from labavg.base.checkpoint import load_rank_state
    from labavg.base.errors import UserError

    path = tmp_path / "checkpoints" / f"{7:09d}" / "rank0.pt"
    path.parent.mkdir(parents=True)
    shutil.copy(_hostile_files(tmp_path)["torch archive"], path)
    with pytest.raises(UserError) as caught:
        load_rank_state(tmp_path, 7, 0)
    assert "naming posix.system" in str(caught.value) or "naming os.system" in str(caught.value)
    assert "will likely succeed" not in str(caught.value)
    assert not (tmp_path / "ran").exists()


def test_a_final_pt_that_is_not_torch_says_what_it_starts_with(tmp_path):
    from labavg.decode.model import load_final_model
    from labavg.base.errors import UserError

    (tmp_path / "final.pt").write_text("hello, not weights")
    with pytest.raises(UserError, match=r"not a torch file labavg wrote .*b'hello, n'"):
        load_final_model(tmp_path)
