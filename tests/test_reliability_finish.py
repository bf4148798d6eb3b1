"""Issue 44, families 1, 4, 7 and 10: one way to finish a run (final.pt, then summary.json as
the commit marker), one writable-output check before any work, and refused commands that
leave the run directory byte-identical (its .lock and checkpoints above all).

Mounting (a tmpfs for a full disk, read-only bind mounts) needs root; these tests skip without
it, except under CI (CI=true), where they fail.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from labavg.base.checkpoint import checkpoint_dir, latest_step
from labavg.base.errors import UserError
from labavg.base.events import RunFinished
from labavg.base.settings import with_overrides
from labavg.jobs.run_dir import load_config_of
from labavg.jobs.runs import run_training
from labavg.jobs.summary import load_summary
from labavg.training.config import DataConfig, ModelConfig, TrainConfig, validate
from tests.support import PYTHON, REPO, child_env
from tests.test_sweep import write_sweep


def _config(corpus: Path, out: Path) -> TrainConfig:
    return validate(TrainConfig(
        out=str(out), ranks=2, minibatch=64, epochs=1, lr=0.004, checkpoint_every=2,
        tensorboard=False, model=ModelConfig(hidden_layers=1, hidden_dim=32),
        data=DataConfig(data=str(corpus), context=1, buffer_frames=2048)))


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    """A finished run of _config: its final.pt is what every completed run must hold."""
    out = tmp_path_factory.mktemp("reference") / "run"
    run_training(_config(corpus, out), progress=False)
    return out


@pytest.fixture
def mounts(tmp_path):
    """tmpfs(size) -> a fresh tmpfs; read_only(dir) -> a read-only bind mount of `dir`."""
    made: list[Path] = []

    def mount(*args: str) -> None:
        done = subprocess.run(["mount", *args], capture_output=True, text=True)
        if done.returncode != 0:
            why = f"cannot mount ({done.stderr.strip()}): these tests need root"
            if os.environ.get("CI") == "true":
                pytest.fail(why)
            pytest.skip(why)
        made.append(Path(args[-1]))

    def tmpfs(size: str) -> Path:
        point = tmp_path / f"disk{len(made)}"
        point.mkdir()
        mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point))
        return point

    def read_only(source: Path) -> Path:
        point = tmp_path / f"ro{len(made)}"
        point.mkdir()
        mount("--bind", str(source), str(point))
        mount("-o", "remount,ro,bind", str(point))
        return point

    mounts.tmpfs, mounts.read_only = tmpfs, read_only
    yield mounts
    for point in reversed(made):
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def tree(run_dir: Path) -> dict[str, str]:
    """Every file (by its bytes' hash) and folder of `run_dir`, .lock and checkpoints too."""
    out = {}
    for path in sorted(run_dir.rglob("*")):
        key = str(path.relative_to(run_dir))
        out[key] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "labavg", *args], capture_output=True, text=True,
                          env=child_env(), timeout=timeout)


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("labavg: error: "), lines
    return lines[0]


# -- family 1: the end of a run is atomic ---------------------------------------------------


def _fill(disk: Path) -> Path:
    """Fill `disk` to the last byte; returns the filler."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        for chunk in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError:
                pass
    return filler


BLOCKS = {  # how the model's write is made to fail at the end, and how the user fixes it
    "a directory in its place": (lambda run, disk: ((run / "final.pt").mkdir(),
                                                    (run / "final.pt" / "x").write_text("x")),
                                 lambda run, disk: shutil.rmtree(run / "final.pt")),
    "a full disk": (lambda run, disk: _fill(disk),
                    lambda run, disk: (disk / "filler").unlink()),
    "an immutable file in its place": (lambda run, disk: (
                                           (run / "final.pt").write_bytes(b"x"),
                                           subprocess.run(["chattr", "+i", str(run / "final.pt")],
                                                          check=True)),
                                       lambda run, disk: subprocess.run(
                                           ["chattr", "-i", str(run / "final.pt")], check=True)),
}


@pytest.mark.slow  # a training run and a resume per case
@pytest.mark.parametrize("how", list(BLOCKS))
def test_a_run_whose_model_cannot_be_written_is_unfinished_and_resume_completes_it(
        corpus, reference, mounts, how, tmp_path, request):
    disk = mounts.tmpfs("16m")
    run = (disk if how == "a full disk" else tmp_path) / "run"  # tmpfs ignores chattr +i
    request.addfinalizer(lambda: subprocess.run(["chattr", "-i", str(run / "final.pt")],
                                                capture_output=True))
    block, unblock = BLOCKS[how]

    def at_the_end(event) -> None:
        if isinstance(event, RunFinished) and event.rank == 0:
            block(run, disk)

    with pytest.raises(UserError) as caught:
        run_training(_config(corpus, run), on_event=at_the_end, progress=False)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"cannot write {run / 'final.pt'}: "), message
    assert "labavg train --resume" in message
    assert not (run / "summary.json").exists()  # no commit marker without the model
    assert latest_step(run) is not None  # the checkpoints are kept
    if how == "a directory in its place":  # the resume names what is in the way, touching nothing
        before = tree(run)
        refused = _one_line(_cli("train", "--resume", str(run), "--no-progress"))
        assert f"{run / 'final.pt'} is a directory where labavg writes a file" in refused
        assert tree(run) == before
    unblock(run, disk)
    resumed = _cli("train", "--resume", str(run), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (run / "final.pt").read_bytes() == (reference / "final.pt").read_bytes()
    assert load_summary(run).steps == load_summary(reference).steps


@pytest.mark.slow  # two decodes
def test_a_run_whose_decode_cannot_be_written_keeps_its_model_and_resume_decodes_it(
        corpus, tmp_path, request):
    run = tmp_path / "run"
    blocker = run / f"decode_{corpus.name}.tmp-{os.getpid()}"  # where the decode builds
    request.addfinalizer(lambda: subprocess.run(["chattr", "-i", str(blocker)], capture_output=True))

    def at_the_end(event) -> None:
        if isinstance(event, RunFinished) and event.rank == 0:
            blocker.write_text("x")
            subprocess.run(["chattr", "+i", str(blocker)], check=True)

    cfg = replace(_config(corpus, run), decode_data=str(corpus))
    with pytest.raises(UserError) as caught:
        run_training(cfg, on_event=at_the_end, progress=False)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"cannot write {run / 'decode_synth'}: ")
    assert message.endswith(f"then `labavg train --resume {run}` decodes it"), message
    model = (run / "final.pt").read_bytes()
    assert load_summary(run).wer is None  # committed, its decode missing
    subprocess.run(["chattr", "-i", str(blocker)], check=True)
    blocker.unlink()
    resumed = _cli("train", "--resume", str(run), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert load_summary(run).wer is not None and (run / "final.pt").read_bytes() == model


def test_a_summary_without_its_model_is_an_unfinished_run_that_resume_completes(
        reference, tmp_path):
    run = tmp_path / "run"  # as an end cut short before issue 44 left it: summary, no model
    shutil.copytree(reference, run)
    (run / "final.pt").unlink()
    cfg = load_config_of(run)
    run_training(replace(cfg, out=str(run)), resume=True, progress=False)
    assert (run / "final.pt").read_bytes() == (reference / "final.pt").read_bytes()
    assert load_summary(run).resumed is True


def test_a_run_its_newbob_schedule_ended_early_is_completed_where_it_ended(corpus, tmp_path):
    """Completing a run resumes at its last checkpoint; one Newbob stopped must end there, not
    train on (or fail: 'the Newbob schedule has already stopped')."""
    from labavg.training.settings import NewbobConfig

    cfg = replace(_config(corpus, tmp_path / "whole"), ranks=1, epochs=4, schedule="newbob",
                  newbob=NewbobConfig(max_iters=1))
    whole = run_training(cfg, progress=False)
    run = tmp_path / "cut"
    shutil.copytree(tmp_path / "whole", run)
    for name in ("summary.json", "final.pt"):  # its end cut short
        (run / name).unlink()
    completed = run_training(replace(cfg, out=str(run)), resume=True, progress=False)
    assert completed.steps == whole.steps < latest_step(run)[0] * 4
    assert (run / "final.pt").read_bytes() == (tmp_path / "whole" / "final.pt").read_bytes()


# -- family 4: outputs that cannot be written are found before the work ---------------------


def test_decode_into_a_read_only_run_directory_is_refused_at_once(corpus, reference, mounts):
    run = mounts.read_only(reference)
    began = time.monotonic()
    line = _one_line(_cli("decode", str(run), "--data", str(corpus)))
    assert line == (f"labavg: error: run directory {str(run)!r} cannot be written: it is on a "
                    f"read-only file system")
    assert time.monotonic() - began < 60  # before the decode's minutes, not after


def _unwritable_commands(ro: Path, full: Path, corpus: Path, resumable: Path, sweep: Path,
                         exp: Path) -> dict[str, tuple[list[str], str]]:
    """Each command that writes, pointed at a read-only or a full place: (argv, the path named)."""
    train = ["--data", str(corpus), "--no-progress", "--epochs", "1"]
    return {
        "train --out (read-only)": (["train", "--out", str(ro / "new"), *train], str(ro / "new")),
        "train --out (full disk)": (["train", "--out", str(full / "new"), *train], str(full / "new")),
        "train --resume (read-only)": (["train", "--resume", str(resumable), "--no-progress"],
                                       str(resumable)),
        "sweep --out": (["sweep", str(sweep), "--out", str(ro / "sweep")], str(ro / "sweep")),
        "reproduce --out": (["reproduce", "--out", str(ro / "rep"), "--tiny", "--no-mpi",
                             "--experiments", str(exp)], str(ro / "rep" / "experiments")),
        "reproduce --report": (["reproduce", "--out", str(exp.parent / "runs"), "--report-only",
                                "--report", str(ro / "R.md"), "--experiments", str(exp)],
                               str(ro / "R.md")),
        "corpus synth": (["corpus", "synth", str(ro / "c"), "--hours", "0.01"], str(ro / "c")),
        "corpus synth (full disk)": (["corpus", "synth", str(full / "c"), "--hours", "0.01"],
                                     str(full / "c")),
        "corpus prepare": (["corpus", "prepare", str(corpus), str(ro / "p"), "--text",
                            str(corpus / "text")], str(ro / "p")),
        "decode (full disk)": (["decode", str(full / "run"), "--data", str(corpus)],
                               str(full / "run")),
    }


UNWRITABLE = ["train --out (read-only)", "train --out (full disk)", "train --resume (read-only)",
              "sweep --out", "reproduce --out", "reproduce --report", "corpus synth", "corpus synth (full disk)",
              "corpus prepare", "decode (full disk)"]


@pytest.mark.slow  # a process each
@pytest.mark.parametrize("name", UNWRITABLE)
def test_every_command_that_writes_refuses_an_unwritable_output_before_any_work(
        corpus, reference, mounts, tmp_path, name):
    place = tmp_path / "place"
    unfinished = place / "unfinished"
    shutil.copytree(reference, unfinished)
    for leftover in ("summary.json", "final.pt"):
        (unfinished / leftover).unlink()
    sweep = place / "s.toml"
    write_sweep(sweep, corpus, "ranks = [1]")
    ro = mounts.read_only(place)
    full = mounts.tmpfs("4m")
    shutil.copytree(reference, full / "run")
    _fill(full)
    exp = tmp_path / "experiments"  # a copy: a command not refused would write its results file
    shutil.copytree(REPO / "experiments", exp)
    argv, named = _unwritable_commands(ro, full, corpus, ro / "unfinished", sweep, exp)[name]
    began = time.monotonic()
    line = _one_line(_cli(*argv))
    assert repr(named) in line, line
    assert ("read-only file system" in line) or ("no space left" in line), line
    assert time.monotonic() - began < 60


# -- families 7 and 10: a refused command touches nothing ----------------------------------


def _unfinished_with_orphans(reference: Path, run: Path) -> Path:
    """An interrupted run (no summary, no model) with an orphan checkpoint and a temporary
    file beside the committed checkpoint, as a kill during a save leaves them."""
    shutil.copytree(reference, run)
    for name in ("summary.json", "final.pt"):
        (run / name).unlink()
    root = checkpoint_dir(run)
    step, _ = latest_step(run)
    shutil.copytree(root / f"{step:09d}", root / f"{step - 1:09d}")
    (root / f"{step:09d}" / ".rank0.pt.x.tmp").write_bytes(b"half")
    return run


def _immutable_model(run: Path) -> None:
    (run / "final.pt").write_bytes(b"old")
    subprocess.run(["chattr", "+i", str(run / "final.pt")], check=True)


@pytest.fixture
def thawed(tmp_path):
    """Clears the immutable flag _immutable_model set, so that tmp_path can be removed."""
    yield
    for path in tmp_path.rglob("final.pt"):
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)


def _refusals(reference: Path, tmp_path: Path) -> dict[str, tuple[Path, list[str]]]:
    """Each refused command: (the run it refuses, after setting it up; `labavg train` args)."""
    def finished(name: str) -> Path:
        shutil.copytree(reference, tmp_path / name)
        return tmp_path / name

    def unfinished(name: str, change=None) -> Path:
        run = _unfinished_with_orphans(reference, tmp_path / name)
        if change is not None:
            change(run)
        return run

    def without_lock(run: Path) -> Path:  # as a copy of a run leaves it: no lock file made
        (run / ".lock").unlink()
        return run

    manifest = lambda run: checkpoint_dir(run) / "latest.json"  # noqa: E731
    cases = {
        "--out a finished run": (finished("f1"), ["--out"]),
        "--resume a finished run": (finished("f2"), ["--resume"]),
        "--resume a finished run without .lock": (without_lock(finished("f4")), ["--resume"]),
        "--resume a finished run as an mpi job": (finished("f3"), ["--backend", "mpi", "--resume"]),
        "--resume with other settings": (unfinished("u1"), ["--set", "lr=0.5", "--resume"]),
        "--resume with other ranks": (unfinished("u2"), ["--ranks", "3", "--resume"]),
        "--out an unfinished run": (unfinished("u3"), ["--out"]),
        "latest.json names a missing step": (unfinished("u4", lambda r: manifest(r).write_text(
            '{"step": 999, "size": 2}\n')), ["--resume"]),
        "latest.json missing": (unfinished("u5", lambda r: manifest(r).unlink()), ["--resume"]),
        "latest.json damaged": (unfinished("u6", lambda r: manifest(r).write_text("{")),
                                ["--resume"]),
        "a rank's checkpoint missing": (unfinished("u7", lambda r: next(
            checkpoint_dir(r).glob(f"{latest_step(r)[0]:09d}/rank1.pt")).unlink()), ["--resume"]),
        "final.pt a directory": (unfinished("u8", lambda r: (r / "final.pt").mkdir()),
                                 ["--resume"]),
        "final.pt immutable": (unfinished("u9", _immutable_model), ["--resume"]),
    }
    return cases


def _refuse_in_process(cfg: TrainConfig, run: Path, args: list[str]) -> None:
    resume = args[-1] == "--resume"
    changes = {"lr": 0.5} if "lr=0.5" in args else {"ranks": 3} if "3" in args else {}
    with pytest.raises(UserError):
        run_training(with_overrides(replace(cfg, out=str(run)), changes), resume=resume,
                     progress=False)


def test_refused_runs_are_left_byte_identical(corpus, reference, tmp_path, thawed):
    cfg = _config(corpus, reference)
    for name, (run, args) in _refusals(reference, tmp_path).items():
        before = tree(run)
        _refuse_in_process(cfg, run, args)
        assert tree(run) == before, name


REFUSALS = ["--out a finished run", "--resume a finished run",
            "--resume a finished run without .lock",
            "--resume a finished run as an mpi job", "--resume with other settings",
            "--resume with other ranks", "--out an unfinished run",
            "latest.json names a missing step", "latest.json missing", "latest.json damaged",
            "a rank's checkpoint missing", "final.pt a directory", "final.pt immutable"]


@pytest.mark.slow  # a process each
@pytest.mark.parametrize("name", REFUSALS)
def test_refused_commands_are_one_line_and_leave_the_run_byte_identical(
        corpus, reference, tmp_path, thawed, name):
    run, args = _refusals(reference, tmp_path)[name]
    before = tree(run)
    argv = ["train", *args, str(run), "--no-progress"]
    if args[0] == "--out":
        argv += ["--data", str(corpus)]
    _one_line(_cli(*argv))
    assert tree(run) == before


def test_a_refused_resume_keeps_every_checkpoint_folder(reference, tmp_path):
    """remove_orphans itself deletes nothing unless latest.json names a whole checkpoint."""
    from labavg.base.checkpoint import remove_orphans

    run = _unfinished_with_orphans(reference, tmp_path / "run")
    manifest = checkpoint_dir(run) / "latest.json"
    for text in ('{"step": 999, "size": 2}\n', "{", None):
        if text is None:
            manifest.unlink()
        else:
            manifest.write_text(text)
        before = tree(run)
        assert remove_orphans(run) == [] and tree(run) == before, text
    manifest.write_text(json.dumps({"step": latest_step(reference)[0], "size": 2}) + "\n")
    assert len(remove_orphans(run)) == 2  # the orphan folder and the temporary file
