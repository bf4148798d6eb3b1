"""Work refused or sized up front: a sweep grid larger than the limit is refused before its
points are checked (unless --max-points allows it) and a sweep says how many points it trains
and how long they would take; a NaN in a cross-validation utterance is found before training."""

from __future__ import annotations

import shutil
import subprocess
import time

import kaldiio
import numpy as np
import pytest

from labavg.cli.main import main
from labavg.data.frames import split_cv
from labavg.studies.sweep import MAX_POINTS, load_sweep, plan_line
from tests.support import PYTHON, child_env

SWEEP = """
[base]
epochs = 1
[base.data]
data = "{data}"
[grid]
{grid}
"""


def _sweep_file(tmp_path, grid: str):
    path = tmp_path / "big.toml"
    path.write_text(SWEEP.format(data=tmp_path / "nodata", grid=grid))
    return path


def test_a_grid_of_ten_thousand_points_is_refused_at_once(tmp_path, capsys):
    grid = "\n".join(f"{k} = {list(range(1, 11))}" for k in ("seed", "epochs", "minibatch"))
    grid += "\nlr = " + str([0.001 * i for i in range(1, 11)])
    spec = _sweep_file(tmp_path, grid)
    start = time.perf_counter()
    code = main(["sweep", str(spec), "--out", str(tmp_path / "out")])
    took = time.perf_counter() - start
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"its grid makes 10,000 points, more than the {MAX_POINTS}" in err[0]
    assert "--max-points 10000" in err[0]
    assert took < 5, f"{took:.1f} s: the points were checked before they were counted"
    assert not (tmp_path / "out").exists()


def test_pooled_grids_count_together(tmp_path):
    spec = tmp_path / "pooled.toml"
    spec.write_text(SWEEP.format(data=tmp_path, grid="").replace("[grid]\n", "")
                    + "[[grid]]\nseed = " + str(list(range(150))) + "\n"
                    + "[[grid]]\nepochs = " + str(list(range(2, 102))) + "\n")
    from labavg.base.errors import UserError

    with pytest.raises(UserError, match="makes 250 points"):
        load_sweep(spec)
    assert len(load_sweep(spec, max_points=250).points()) == 250


def test_max_points_must_be_positive(tmp_path, capsys):
    spec = _sweep_file(tmp_path, "seed = [0, 1]")
    assert main(["sweep", str(spec), "--out", str(tmp_path / "out"), "--max-points", "0"]) == 2
    assert "--max-points must be >= 1" in capsys.readouterr().err


def test_the_plan_says_how_many_points_and_how_long(tmp_path):
    import json

    points = [(f"p{i}", {}) for i in range(5)]
    assert plan_line(points, tmp_path) == ("labavg sweep: 5 points to train; how long they "
                                           "take is known once the first has finished")
    for name, wall in (("p0", 100.0), ("p1", 140.0)):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "summary.json").write_text(json.dumps({"wall_seconds": wall}))
    assert plan_line(points, tmp_path) == ("labavg sweep: 5 points, 2 finished, 3 to train: "
                                           "about 0.1 h at the 120 s a finished point took")


def _with_nan_in_a_cv_utterance(corpus, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(corpus, data)
    keys = [line.split()[0] for line in (data / "feats.scp").read_text().splitlines()]
    _, cv_keys = split_cv(sorted(keys), 0.1, seed=0)
    key = cv_keys[-1]
    feats = kaldiio.load_scp(str(data / "feats.scp"))[key].copy()
    feats[3, 5] = np.nan
    kaldiio.save_ark(str(data / "bad.ark"), {key: feats}, scp=str(data / "bad.scp"))
    lines = [(open(data / "bad.scp").read().strip() if line.split()[0] == key else line)
             for line in (data / "feats.scp").read_text().splitlines()]
    (data / "feats.scp").write_text("\n".join(lines) + "\n")
    return data, key


def test_a_nan_in_a_cv_utterance_is_found_before_training(corpus, tmp_path):
    data, key = _with_nan_in_a_cv_utterance(corpus, tmp_path)
    proc = subprocess.run(
        [PYTHON, "-m", "labavg", "train", "--data", str(data), "--out", str(tmp_path / "run"),
         "--epochs", "1", "--minibatch", "64", "--no-progress", "--set", "model.hidden_layers=1",
         "--set", "model.hidden_dim=32"],
        capture_output=True, text=True, env=child_env(), cwd=tmp_path, timeout=300)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(err) == 1 and key in err[0] and "NaN or Inf" in err[0], err
    assert not (tmp_path / "run").exists(), "training started before the CV set was checked"
