"""The command line answers without torch: help, `labavg info` and refused settings read only
the methods' declarations (labavg.averaging.registry), never the classes that import torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from labavg.averaging.registry import METHODS, Method, method_names

REPO = Path(__file__).resolve().parents[1]

# Runs the command line in a fresh interpreter, then says whether torch was imported.
PROBE = """
import sys
from labavg.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
sys.stderr.write("\\nTORCH-LOADED=%s\\n" % ("torch" in sys.modules))
sys.exit(code)
"""


def _labavg(*args: str, cwd: Path = REPO) -> tuple[int, str, str, bool]:
    """(exit status, stdout, stderr without the probe's line, whether torch was imported)."""
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env=_env())
    err, _, flag = proc.stderr.rstrip().rpartition("\nTORCH-LOADED=")
    assert flag in ("True", "False"), proc.stderr
    return proc.returncode, proc.stdout, err.strip(), flag == "True"


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.mark.parametrize("args", [("--help",), ("train", "--help"), ("info", "--help"),
                                  ("corpus", "synth", "--help")])
def test_help_imports_no_torch(args):
    code, out, err, torch_loaded = _labavg(*args)
    assert code == 0, err
    assert out.startswith("usage: labavg") and not torch_loaded
    if args[0] == "train":  # the methods' help lines come from their declarations
        assert "model (plain average, the paper)" in " ".join(out.split())
        # The [averaging] section's flags, declared with its settings.
        for flag in ("--averaging", "--average-every", "--average-every-frames", "--reduce",
                     "--payload", "--payload-bits", "--overlap"):
            assert f"  {flag} " in out, flag


def test_info_of_runs_imports_no_torch(tmp_path):
    from labavg.base.settings import to_dict, with_overrides
    from labavg.training.config import TrainConfig

    run, running = tmp_path / "runs" / "k10", tmp_path / "runs" / "k20"
    run.mkdir(parents=True)
    summary = {"ranks": 2, "backend": "inproc", "averaging": "bmuf", "average_every": 10}
    (run / "summary.json").write_text(json.dumps(summary))
    running.mkdir()  # started, not ended: only its settings are on disk
    config = to_dict(with_overrides(TrainConfig(), {"out": str(running), "ranks": 4,
                                                    "averaging.average_every": 20}))
    (running / "config.json").write_text(json.dumps(config))
    code, out, err, torch_loaded = _labavg("info", str(tmp_path / "runs"))
    assert code == 0, err
    out = " ".join(out.split())  # without the padding that aligns the table's columns
    assert f"| {run} | 2 | 10 |" in out and " bmuf " in out
    assert f"| {running} (running/incomplete) | 4 | 20 |" in out and not torch_loaded


@pytest.mark.parametrize("args, message", [
    # Each names the flag the value came from (labavg issue 44).
    (("--set", "lr=-1"), "labavg: error: --set lr=-1: lr must be positive and finite; got -1.0"),
    (("--set", "no_such_key=1"), "labavg: error: --set no_such_key=1: unknown setting "
                                 "'no_such_key'"),
    (("--averaging", "half"), "labavg: error: --averaging: averaging.method must be one of "
                              "model, bmuf, diloco; got 'half'"),
    (("--set", "averaging.bmuf.momentum=1"),
     "labavg: error: --set averaging.bmuf.momentum=1: averaging.bmuf.momentum must be in "
     "[0, 1); got 1.0"),
    (("missing.toml",), "labavg: error: cannot read config file missing.toml: "
                        "No such file or directory"),
])
def test_a_refused_setting_answers_before_torch(tmp_path, args, message):
    code, out, err, torch_loaded = _labavg("train", "--out", str(tmp_path / "run"), *args,
                                           cwd=tmp_path)
    assert (code, out, err) == (2, "", message)
    assert not torch_loaded and not (tmp_path / "run").exists()


def test_the_probe_sees_torch_when_a_class_is_looked_up():
    # What the tests above rely on: the probe does report torch once a method's class is read.
    code = ("import sys; from labavg.averaging.registry import methods; "
            "assert 'torch' not in sys.modules; methods()['bmuf'].averager_class(); "
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=_env())
    assert (proc.returncode, proc.stdout.strip()) == (0, "True"), proc.stderr


def test_each_built_in_declaration_names_its_class():
    from labavg.averaging.methods import Averager

    assert method_names()[:3] == ("model", "bmuf", "diloco")
    for name in ("model", "bmuf", "diloco"):
        declared = METHODS[name]
        cls = declared.averager_class()
        assert issubclass(cls, Averager) and cls.method == name
        assert declared.names(cls) and declared.label and declared.short and declared.help
        # The declaration carries the section, not the class (a class attribute would be a
        # second place to keep it).
        assert "settings" not in vars(cls) and "help" not in vars(cls)
    assert METHODS["model"].settings is None and METHODS["bmuf"].settings.__name__ == "BMUFConfig"


def test_a_declared_class_registers_as_itself_and_no_other():
    from labavg.averaging.methods import BMUFAverager, DiLoCoAverager
    from labavg.averaging.registry import register

    assert register(BMUFAverager) is BMUFAverager and isinstance(METHODS["bmuf"], Method)
    assert METHODS["bmuf"].where == "labavg.averaging.methods:BMUFAverager"  # unchanged

    class Impostor(DiLoCoAverager):
        method = "bmuf"
        help = "not the declared class"

    with pytest.raises(ValueError, match=r"'bmuf' is already registered "
                                         r"\(labavg.averaging.methods:BMUFAverager\)"):
        register(Impostor)


def test_each_knob_names_a_setting_of_its_table():
    # The dashboard's method box sets the declared knob: a method with one has a table with it.
    import dataclasses

    knobs = {name: m.knob_key() for name, m in METHODS.items()}
    assert knobs["model"] is None and knobs["bmuf"] == "averaging.bmuf.momentum"
    for m in METHODS.values():
        if m.knob is not None:
            assert m.knob in {f.name for f in dataclasses.fields(m.settings)}, m.method


# The launcher of a job, in a fresh interpreter: its ranks list their imports (the environment
# they inherit asks for -X importtime), it does not; then it says whether torch was imported.
JOB_PROBE = """
import os, sys
os.environ["PYTHONPROFILEIMPORTTIME"] = "1"  # for the ranks only: this process has started
from labavg.cli.main import main
code = main(sys.argv[1:])
sys.stderr.write("\\nTORCH-LOADED=%s\\n" % ("torch" in sys.modules))
sys.exit(code)
"""


def test_a_jobs_launcher_imports_no_torch_and_its_ranks_no_table(corpus, tmp_path):
    """A real 2-rank MPI job started by `labavg train`: the launcher checks the settings and
    the data, holds the lock and waits, none of which needs torch (issue 45: its import was a
    second of the job's start-up); the ranks import torch and MPI, but not the command line nor
    tabulate, which only the launcher's table needs."""
    from test_train import SMALL

    out = tmp_path / "mpi"
    proc = subprocess.run([sys.executable, "-c", JOB_PROBE, "train", "--data", str(corpus),
                           "--out", str(out), "--ranks", "2", "--backend", "mpi", *SMALL],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.rstrip().endswith("TORCH-LOADED=False")
    imported = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)$", proc.stderr, re.MULTILINE)
    assert imported.count("torch") == 2 and imported.count("mpi4py.MPI") == 2  # one per rank
    assert imported.count("labavg.jobs.runs") == 2
    unneeded = [name for name in imported
                if name.split(".")[0] in ("tabulate", "wcwidth") or name.startswith("labavg.cli")]
    assert not unneeded
    # Rank 0 wrote the run's end after rank 1 had ended (a rank that ends skips the
    # interpreter's teardown, but not what its launcher must hear: labavg.comm.launchers).
    summary = json.loads((out / "summary.json").read_text())
    assert (out / "final.pt").is_file()
    assert summary["process_seconds"] >= summary["wall_seconds"] > 0
