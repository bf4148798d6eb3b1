"""A run directory's own files are never followed through a link: a `.lock`, events.jsonl,
config.json or checkpoints/ planted as a symbolic link is refused in one line naming it, and
the file it points to is left as it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from labavg.cli.main import main
from labavg.jobs.event_log import EventLog
from labavg.jobs.run_dir import run_dir_lock


def _train(capsys, run: Path, *extra: str) -> tuple[int, list[str]]:
    code = main(["train", "--data", str(run.parent / "nodata"), "--out", str(run),
                 "--no-progress", *extra])
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("name", [".lock", "events.jsonl", "config.json", "summary.json",
                                  "checkpoints", "heartbeat", "final.pt"])
@pytest.mark.parametrize("dangling", [False, True])
def test_a_link_among_the_run_directorys_files_is_refused(tmp_path, capsys, name, dangling):
    run = tmp_path / "run"
    run.mkdir()
    target = tmp_path / "precious"
    if not dangling:
        target.write_text("keep me\n")
    (run / name).symlink_to(target)
    code, err = _train(capsys, run)
    assert code == 2
    assert len(err) == 1 and f"{run / name} is a symbolic link" in err[0], err
    assert (target.read_text() == "keep me\n") if not dangling else not target.exists()


def test_a_lock_that_is_a_directory_is_named(tmp_path, capsys):
    run = tmp_path / "run"
    (run / ".lock").mkdir(parents=True)
    code, err = _train(capsys, run)
    assert code == 2
    assert len(err) == 1 and f"the lock file {run / '.lock'} is not a regular file (a directory)" in err[0], err


def test_a_lock_link_planted_after_the_check_is_not_followed(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    import labavg.jobs.run_dir as run_dir

    def plant(path):  # the check passes, then the link appears
        (Path(path) / ".lock").symlink_to(target)
    monkeypatch.setattr(run_dir, "check_own_files", plant)
    with pytest.raises(run_dir.UserError, match="symbolic link, which labavg does not follow"):
        with run_dir_lock(run):
            pass
    assert target.read_text() == "keep me\n"


def test_the_event_log_does_not_write_through_a_link(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    (tmp_path / "events.jsonl").symlink_to(target)
    with pytest.raises(OSError):
        EventLog(tmp_path, 0, tensorboard=False)
    assert target.read_text() == "keep me\n"


def test_heartbeats_do_not_write_through_a_link(tmp_path):
    from types import SimpleNamespace

    from labavg.comm.watchdog import HEARTBEAT_DIR, Watchdog

    target = tmp_path / "precious"
    target.write_text("keep me\n")
    (tmp_path / "run" / HEARTBEAT_DIR).mkdir(parents=True)
    (tmp_path / "run" / HEARTBEAT_DIR / ".rank0.json.tmp").symlink_to(target)
    Watchdog(SimpleNamespace(rank=0), limit=60, run_dir=tmp_path / "run")._write_heartbeat()
    assert target.read_text() == "keep me\n"
