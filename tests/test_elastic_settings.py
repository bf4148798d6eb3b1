"""What on_rank_loss = "continue" refuses, before anything starts (fast: no process started)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from labavg.base.errors import UserError
from labavg.base.settings import with_overrides
from labavg.jobs.elastic_join import join, lose
from labavg.training.config import TrainConfig, check_values
from tests.support import child_env

ELASTIC = {"on_rank_loss": "continue", "backend": "torch", "ranks": 4}


@pytest.mark.parametrize("extra, named", [
    ({"backend": "inproc"}, "backend = 'inproc'"),
    ({"backend": "mpi"}, "backend = 'mpi'"),
    ({"averaging.hierarchy.across_nodes_every": 20, "averaging.hierarchy.node_size": 2},
     "averaging.hierarchy"),
    ({"averaging.reduce": "ring"}, "averaging.reduce = 'ring'"),
    ({"averaging.overlap": "eager"}, "averaging.overlap = 'eager'"),
    ({"elastic.min_workers": 5}, "elastic.min_workers = 5 is more than the 4 ranks"),
])
def test_what_cannot_be_elastic_is_refused_in_one_line(extra, named):
    with pytest.raises(UserError, match="on_rank_loss = \"continue\" cannot run with") as err:
        check_values(with_overrides(TrainConfig(), {**ELASTIC, **extra}))
    assert named in str(err.value) and "\n" not in str(err.value)


def test_elastic_settings_have_ranges():
    with pytest.raises(UserError, match="elastic.heartbeat_ms"):
        check_values(with_overrides(TrainConfig(), {**ELASTIC, "elastic.heartbeat_ms": 5}))
    assert check_values(with_overrides(TrainConfig(), ELASTIC)).elastic.min_workers == 1


def test_a_join_names_why_there_is_nothing_to_join(tmp_path):
    with pytest.raises(UserError, match="is not a labavg run directory"):
        join(tmp_path / "nothing")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    with pytest.raises(UserError, match="is not running as an elastic job"):
        join(run)
    with pytest.raises(UserError, match="is not running as an elastic job"):
        lose(run)
    (run / "summary.json").write_text("{}")
    with pytest.raises(UserError, match="has finished: there is no job to join"):
        join(run)
    (run / ".elastic.json").write_text(json.dumps([1, 2]))
    with pytest.raises(UserError, match="not an elastic job's state file"):
        join(run)


def test_a_join_takes_no_settings_of_its_own(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "labavg", "train", "--join", str(tmp_path),
                           "--lr", "0.1", "--set", "epochs=3"], capture_output=True, text=True,
                          env=child_env(), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == ("labavg: error: --join takes the running job's own settings: drop "
                           "--lr, --set\n")


def test_a_join_to_a_job_whose_launcher_was_killed_names_it(tmp_path):
    """SIGKILL leaves the launcher's state file behind: neither a join nor a loss acts on the
    pids in it, which other processes may hold by now."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / ".elastic.json").write_text(json.dumps(
        {"lighthouse": "http://127.0.0.1:1", "launcher": dead.pid, "size": 2,
         "workers": {"0": dead.pid}, "join_socket": str(tmp_path / "gone.sock")}))
    for act in (join, lose):
        with pytest.raises(UserError) as err:
            act(run)
        assert str(err.value) == (f"{run}: the elastic job's launcher (pid {dead.pid}) has "
                                  f"ended: there is nothing to join")
