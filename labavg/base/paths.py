"""Whether a directory can be written where a setting names one (a run's `out`, the
dashboard's runs directory), told before anything is created."""

from __future__ import annotations

import os
from pathlib import Path


def check_directory(path: str | os.PathLike, key: str = "out",
                    what: str = "the run directory") -> str | None:
    """Why no directory can be written at `path`, or None: it must be a directory, or a new
    path under one, that this process may write into. Checked before anything is created,
    so that a run does not fail on its first write with a bare OSError."""
    text = str(path)
    target = Path(text).expanduser()
    try:
        if target.exists():
            if not target.is_dir():
                return f"{key} {text!r} is an existing file; {what} must be a directory or a new path"
            if not os.access(target, os.W_OK | os.X_OK):
                return f"{key} {text!r} is not writable"
            return None
        parent = target.absolute().parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
    except OSError as exc:  # a name too long, a loop of links
        return f"{key} {text!r} cannot be used: {exc.strerror}"
    if not parent.is_dir():
        return f"{key} {text!r} cannot be created: {parent} is a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{key} {text!r} cannot be created: {parent} is not writable"
    return None
