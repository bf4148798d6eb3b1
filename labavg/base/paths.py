"""Whether the outputs of a command can be written (a run's `out`, a decode's run directory,
a sweep's or a corpus's folder, a report file), told before any work: the one check every
command that writes makes first (`require_writable`), so that minutes of work do not end in
a bare OSError at their first write."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from labavg.base.errors import UserError


def check_directory(path: str | os.PathLike, key: str = "out",
                    what: str = "the run directory") -> str | None:
    """Why no directory can be written at `path`, or None: it must be a directory, or a new
    path under one, that this process may write into, on a disk with room left. Checked
    before anything is created."""
    text = str(path)
    target = Path(text).expanduser()
    try:
        if target.exists():
            if not target.is_dir():
                return f"{key} {text!r} is an existing file; {what} must be a directory or a new path"
            why = _unwritable(target)
            return None if why is None else f"{key} {text!r} cannot be written: {why}"
        parent = target.absolute().parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
    except OSError as exc:  # a name too long, a loop of links
        return f"{key} {text!r} cannot be used: {exc.strerror}"
    if not parent.is_dir():
        return f"{key} {text!r} cannot be created: {parent} is a file, not a directory"
    why = _unwritable(parent)
    return None if why is None else f"{key} {text!r} cannot be created: {parent}: {why}"


def check_output_file(path: str | os.PathLike, key: str, what: str = "the file") -> str | None:
    """Why no file can be written at `path`, or None (its folder is checked as above)."""
    text = str(path)
    target = Path(text).expanduser()
    if target.is_dir():
        return f"{key} {text!r} is a directory; {what} must be a file"
    if target.exists() and not target.is_file():
        return f"{key} {text!r} is not a regular file; {what} must be a file"
    problem = check_directory(target.absolute().parent, key, f"the folder of {what}")
    return None if problem is None else f"{problem} (for {what} {text!r})"


def require_writable(path: str | os.PathLike, key: str, what: str, *, file: bool = False) -> None:
    """UserError naming `key` and `path` and saying why, unless the directory (or, with
    `file`, the file) `path` can be written now."""
    problem = (check_output_file if file else check_directory)(path, key, what)
    if problem is not None:
        raise UserError(problem)


def _unwritable(directory: Path) -> str | None:
    """Why nothing can be written into the existing `directory` now, or None."""
    try:
        disk = os.statvfs(directory)
    except OSError as exc:
        return exc.strerror or str(exc)
    if disk.f_flag & os.ST_RDONLY:
        return "it is on a read-only file system"
    if not os.access(directory, os.W_OK | os.X_OK):
        return "it is not writable (permission denied)" if os.access(directory, os.F_OK) \
            else os.strerror(errno.ENOENT)
    # A full disk: no block left, or (where the file system counts them) no inode left.
    if disk.f_bavail == 0 or (disk.f_files > 0 and disk.f_favail == 0):
        return "no space left on its disk; free some space first"
    return None
