"""A full disk under a run directory (a small tmpfs): one line naming the file, exit status 2,
no half-written line in events.jsonl, and a run that `--resume` finishes once there is room.

Mounting needs root; these tests skip without it, except under CI (CI=true), where they fail.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from labavg.base.errors import UserError
from labavg.base.events import MinibatchDone
from labavg.jobs.event_log import EventLog
from tests.support import PYTHON, child_env


@pytest.fixture
def small_disk(tmp_path):
    """mount(size) -> a fresh tmpfs of that size; remount(point, size) resizes one."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        point = tmp_path / f"disk{len(mounted)}"
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            why = f"cannot mount a tmpfs ({done.stderr.strip()}): these tests need root"
            if os.environ.get("CI") == "true":
                pytest.fail(why)
            pytest.skip(why)
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def _remount(point: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(point)], check=True)


def _whole_lines(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n"), f"a half-written last line: {data[-80:]!r}"
    return [json.loads(line) for line in data.splitlines()]


def _event(step: int) -> MinibatchDone:
    return MinibatchDone(rank=0, epoch=0, step=step, loss=1.0 / (step + 1), frame_accuracy=0.5,
                         frames=256, lr=0.008, applied=True, max_change_scale=1.0)


def test_the_event_log_on_a_full_disk_names_it_and_leaves_whole_lines(small_disk):
    disk = small_disk("64k")
    log = EventLog(disk, 0, tensorboard=False)
    with pytest.raises(UserError) as caught:
        for step in range(10_000):  # until the disk is full, mid-line or between lines
            log.write(_event(step))
    log.close()
    assert str(caught.value).startswith(f"cannot write {disk / 'events.jsonl'}: No space left")
    lines = _whole_lines(disk / "events.jsonl")
    assert [e["step"] for e in lines] == list(range(len(lines))) and len(lines) > 100


def test_an_atomic_write_on_a_full_disk_names_the_file_and_leaves_nothing(small_disk):
    from labavg.base.checkpoint import atomic_write_text

    disk = small_disk("16k")
    with pytest.raises(UserError, match=f"cannot write {disk / 'summary.json'}: No space left"):
        atomic_write_text(disk / "summary.json", "x" * 100_000)
    assert list(disk.iterdir()) == []


def _train(out: Path, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-m", "labavg", "train", "--out", str(out), "--no-progress", *extra],
        capture_output=True, text=True, env=child_env(), timeout=timeout)


SMALL = ["--epochs", "3", "--minibatch", "64", "--set", "model.hidden_layers=1", "--set",
         "model.hidden_dim=32", "--set", "tensorboard=false"]


@pytest.mark.parametrize("size, fills", [("20k", "events.jsonl"),  # checkpoints/ slow: fast-suite margin
                                         pytest.param("300k", "checkpoints/", marks=pytest.mark.slow)])
def test_a_run_on_a_full_disk_is_one_line_and_resumes(corpus, small_disk, size, fills):
    disk = small_disk(size)
    run = disk / "run"
    failed = _train(run, "--data", str(corpus), *SMALL,
                    *(["--checkpoint-every", "1000"] if fills == "events.jsonl" else []))
    err = failed.stderr.strip().splitlines()
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert len(err) == 1 and err[0].startswith(f"labavg: error: cannot write {run / fills}"), err
    assert "No space left on device" in err[0]
    _whole_lines(run / "events.jsonl")
    _remount(disk, "8m")
    if (run / "checkpoints" / "latest.json").exists():
        resumed = _train(run, "--resume", str(run))
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert json.loads((run / "summary.json").read_text())["resumed"] is True
        _whole_lines(run / "events.jsonl")
    else:  # filled before its first checkpoint: nothing to resume, and the refusal says so
        resumed = _train(run, "--resume", str(run))
        assert resumed.returncode == 2 and "no checkpoint to resume from" in resumed.stderr


@pytest.mark.slow  # two MPI ranks
def test_an_mpi_job_on_a_full_disk_is_one_line(corpus, small_disk):
    disk = small_disk("40k")
    run = disk / "run"
    failed = _train(run, "--data", str(corpus), "--ranks", "2", "--backend", "mpi", *SMALL,
                    "--checkpoint-every", "1000")
    err = failed.stderr.strip().splitlines()
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert len(err) == 1 and f"cannot write {run / 'events.jsonl'}: No space left" in err[0], err
    assert "terminate called" not in failed.stderr
    _whole_lines(run / "events.jsonl")
