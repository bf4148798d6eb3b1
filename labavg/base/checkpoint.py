"""Atomic checkpoints that every rank can resume from.

Layout: RUN_DIR/checkpoints/STEP/rankR.pt (one file per rank: ranks share the averaged
model but each keeps its own optimizer state, e.g. NG-SGD's Fisher estimates) and
RUN_DIR/checkpoints/latest.json, written last by rank 0 once every rank's file is on disk.
A crash at any moment leaves `latest.json` naming a complete set of files.
"""

from __future__ import annotations

import io
import json
import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from labavg.base.errors import UserError

MANIFEST = "latest.json"
FINAL = "final.pt"  # the run's model, written as it ends (labavg.decode.model)


# A disk that is full, over quota or read-only: the user's to fix, and the run resumable.
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


class NoRoom(UserError):
    """A file of a run could not be written because its disk is full (or over quota, or
    read-only); what was written before is whole, so the run resumes once there is room."""


def no_room(path: Path, exc: OSError) -> UserError | OSError:
    """The UserError to raise for `exc`, met writing `path`; `exc` itself if it is another
    kind of OSError."""
    if exc.errno not in _NO_ROOM:
        return exc
    fix = "make it writable again" if exc.errno == errno.EROFS else "free some space"
    return NoRoom(f"cannot write {path}: {exc.strerror}; {fix}, then `labavg train "
                  f"--resume` continues the run from its last checkpoint (or, before its first, "
                  f"start it again)")


class CannotWrite(UserError):
    """A file of a run could not be put in place for another reason than room (a directory
    in its place, a folder that may not be written); nothing was half-written."""


# Why a file cannot be put in place, in words, where strerror alone would puzzle.
_IN_PLACE = {errno.EISDIR: "a directory is in its place", errno.ENOTEMPTY: "a directory is in its place",
             errno.ENOTDIR: "a file is in the place of one of its folders"}


def _cannot_write(path: Path, exc: OSError) -> UserError:
    """The UserError for `exc`, met writing `path` atomically: NoRoom for a full or read-only
    disk (no_room), CannotWrite for anything else, each naming the file and saying why."""
    found = no_room(path, exc)
    if isinstance(found, UserError):
        return found
    return CannotWrite(f"cannot write {path}: {_IN_PLACE.get(exc.errno, exc.strerror or str(exc))}")


def atomic_write_bytes(path: Path, data: bytes, named: Path | None = None) -> None:
    """Write `data` to `path` via a temporary file, fsync and rename: all or nothing.

    A full disk (NoRoom) or any other failure to write (CannotWrite) is a UserError naming
    `named` (default `path`)."""
    named = path if named is None else named
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise _cannot_write(named, exc) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise _cannot_write(named, exc) from None
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Text version of atomic_write_bytes."""
    atomic_write_bytes(path, text.encode())


def checkpoint_dir(run_dir: Path) -> Path:
    """Where a run keeps its checkpoints."""
    return Path(run_dir) / "checkpoints"


def save_rank_state(run_dir: Path, step: int, rank: int, state: dict[str, Any]) -> Path:
    """Save one rank's state for `step` (not yet visible to resume: see commit_checkpoint)."""
    import torch  # here, not above: a job's launcher reads manifests without torch

    buf = io.BytesIO()
    torch.save(state, buf)
    path = checkpoint_dir(run_dir) / f"{step:09d}" / f"rank{rank}.pt"
    # Every rank meets a full disk at once: named by the step, their messages are one.
    atomic_write_bytes(path, buf.getvalue(), named=path.parent)
    return path


def commit_checkpoint(run_dir: Path, step: int, size: int,
                      ranks: list[int] | None = None) -> Path:
    """Point latest.json at `step` (call once all ranks saved) and drop older checkpoints.

    `ranks`: the launch ranks that saved, where an elastic run has lost some (the manifest
    then names them; the first one's parameters are the run's model)."""
    root = checkpoint_dir(run_dir)
    step_dir = root / f"{step:09d}"
    missing = [r for r in (range(size) if ranks is None else ranks)
               if not (step_dir / f"rank{r}.pt").is_file()]
    if missing:
        raise RuntimeError(f"checkpoint {step_dir} lacks ranks {missing}")
    manifest = {"step": step, "size": size, **({} if ranks is None else {"ranks": list(ranks)})}
    atomic_write_text(root / MANIFEST, json.dumps(manifest) + "\n")
    for old in root.iterdir():
        if old.is_dir() and old.name != step_dir.name and old.name.isdigit():
            shutil.rmtree(old, ignore_errors=True)
    return step_dir


def model_rank(run_dir: Path) -> int:
    """The rank whose file of the latest checkpoint holds the run's model: 0, or the first
    of the ranks an elastic run's manifest names."""
    try:
        ranks = json.loads((checkpoint_dir(run_dir) / MANIFEST).read_text()).get("ranks")
    except (OSError, ValueError, AttributeError):
        return 0
    return int(ranks[0]) if isinstance(ranks, list) and ranks and isinstance(ranks[0], int) else 0


def latest_step(run_dir: Path) -> tuple[int, int] | None:
    """(step, size) of the newest complete checkpoint, or None if there is none."""
    manifest = checkpoint_dir(run_dir) / MANIFEST
    if not manifest.is_file():
        return None
    try:
        info = json.loads(manifest.read_text())
        return int(info["step"]), int(info["size"])
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{manifest}: not a labavg checkpoint manifest ({exc})") from None


def load_rank_state(run_dir: Path, step: int, rank: int, map_location: Any = "cpu") -> dict[str, Any]:
    """Load one rank's state. Only tensors and plain values are accepted (weights_only)."""
    path = checkpoint_dir(run_dir) / f"{step:09d}" / f"rank{rank}.pt"
    try:
        return load_weights(path, "checkpoint", map_location)
    except FileNotFoundError:
        raise UserError(f"checkpoint file {path} is missing") from None


def load_weights(path: Path, what: str, map_location: Any = "cpu") -> Any:
    """torch.load with weights_only=True of a file that may be hostile: FileNotFoundError when
    it is missing, else UserError saying what the file is.

    torch's own refusal advises loading again with weights_only=False, which runs whatever
    code a hostile file holds; labavg never does, and its message says so instead. torch's
    warnings about the pickle are held back (the refusal says what matters).
    """
    import pickle
    import re
    import warnings

    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except IsADirectoryError:
        raise UserError(f"cannot read {what} {path}: it is a directory") from None
    except OSError as exc:
        raise UserError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except pickle.UnpicklingError as exc:  # the weights-only unpickler's refusal
        found = re.search(r"GLOBAL (\S+)", str(exc))
        kind = "a torch archive" if _head(path).startswith(b"PK") else "a pickle"
        holds = f" naming {found.group(1)}" if found else ""
        raise UserError(f"refused {what} {path}: {kind} of Python objects{holds}, not only "
                        f"tensors; labavg loads weights only and never runs code from a model "
                        f"file") from None
    except Exception as exc:  # a corrupt or foreign file: torch raises several types
        head = _head(path)
        raise UserError(f"cannot read {what} {path}: not a torch file labavg wrote "
                        f"({type(exc).__name__}; it starts with {head!r})") from None


def _head(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(8)
    except OSError:
        return b""


def remove_orphans(run_dir: Path) -> list[Path]:
    """Remove what killed writes left behind: temporary files and checkpoints never committed.

    Call only while holding the run directory's lock (no live job is writing), and only once
    every check of the resume has passed. Removes nothing unless latest.json names a
    checkpoint whose files are all there: a manifest that is damaged, missing or names a step
    that is gone leaves every folder as it is, as a hand-fixed latest.json may recover the run
    from one of them. Returns what was removed.
    """
    root = checkpoint_dir(run_dir)
    removed: list[Path] = []
    try:
        found = latest_step(run_dir)
    except UserError:
        return removed
    if found is None or not all((root / f"{found[0]:09d}" / f"rank{r}.pt").is_file()
                                for r in range(found[1])):
        return removed
    keep = f"{found[0]:09d}"
    for path in sorted(root.rglob(".*.tmp")):
        path.unlink(missing_ok=True)
        removed.append(path)
    for path in sorted(root.iterdir()):
        if path.is_dir() and path.name.isdigit() and path.name != keep:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    heartbeat = Path(run_dir) / "heartbeat"
    if heartbeat.is_dir():
        shutil.rmtree(heartbeat, ignore_errors=True)
        removed.append(heartbeat)
    return removed
