"""Where Kaldi data comes from: rspecifiers, rxfilenames, pipes and row/column ranges.

kaldiio runs any rxfilename of the form `command |` (or `| command`) through the
shell. A data file is not a place to hide commands, so pipes are refused unless
the caller passes `allow_pipes=True`, and features never come from pipes (they
are read lazily, which would rerun the command at every load on every rank).
Files are opened here (`open_source`), never through kaldiio's openers.

Relative paths inside scp files resolve against the current working directory,
as Kaldi does (util/kaldi-io.cc opens rxfilenames as given), so run from the
recipe directory that holds `data/`, `mfcc/` and `exp/`.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
from contextlib import contextmanager
from typing import BinaryIO, Iterator

from kaldiio.utils import parse_specifier

from labavg.base.errors import DataError

_RANGE_SUFFIX = re.compile(r"\[([^\[\]]*)\]$")
_RANGE_PART = re.compile(r"\s*([0-9]+)\s*:\s*([0-9]+)\s*")

SCP_PATH_ADVICE = (
    "Kaldi resolves paths in scp files against the working directory of the command, "
    "not against the folder of the scp file; run labavg from the recipe directory "
    "(the one that holds data/, mfcc/ and exp/, e.g. egs/<corpus>/s5)")
PIPE_ADVICE = (
    "labavg runs no commands named in data files unless told to: if you trust where this "
    "came from, pass allow_pipes=True to open_dataset (labavg train --allow-pipes)")
FEATURE_PIPE_ADVICE = (
    "feature pipes are refused even with allow_pipes, because features are read lazily and "
    "the command would run again at every load on every rank; write the features to disk "
    "first (copy-feats ... ark,scp:feats.ark,feats.scp) and give that scp")


def one_line(text: object) -> str:
    """`text` with every run of whitespace (kaldiio's messages hold newlines) made one space."""
    return " ".join(str(text).split())


def is_rspecifier(text: str) -> bool:
    """True for `ark:...`, `scp:...`, `ark,t:...` and the like."""
    head, sep, _ = str(text).partition(":")
    if not sep:
        return False
    opts = head.split(",")
    return ("ark" in opts or "scp" in opts) and all(
        o in {"ark", "scp", "t", "b", "o", "p", "s", "cs", "f", "nf"} for o in opts)


def split_rspecifier(rspecifier: str) -> tuple[str, str]:
    """Return ('ark' | 'scp', filename-or-pipe) of a Kaldi rspecifier."""
    try:
        spec = parse_specifier(rspecifier)
    except ValueError as exc:
        raise DataError(f"bad rspecifier {rspecifier!r}: {one_line(exc)}") from exc
    if spec["scp"] is not None and spec["ark"] is not None:
        raise DataError(f"bad rspecifier {rspecifier!r}: give one of ark: or scp:, not both")
    if spec["scp"] is not None:
        return "scp", spec["scp"]
    return "ark", spec["ark"]


def is_pipe(rxfilename: str) -> bool:
    """True for the rxfilenames kaldiio would run as commands.

    `command |` (Kaldi's input pipe) and `| command` (which kaldiio also runs), and
    either with an offset or range after it (`cmd |:12`, `cmd |[0:3]`), which
    kaldiio splits off and then runs the rest.
    """
    if "|" not in rxfilename:
        return False
    text = rxfilename.strip()
    if text.endswith("|") or text.startswith("|"):
        return True
    path, _, _ = split_rxfilename(text)
    return path.endswith("|") or path.startswith("|")


def split_rxfilename(rxfilename: str) -> tuple[str, int | None, str | None]:
    """(file, byte offset or None, range text or None) of `file[:offset][[range]]`."""
    text = rxfilename.strip()
    range_text = None
    if text.endswith("]"):
        match = _RANGE_SUFFIX.search(text)
        if match:
            range_text, text = match.group(1), text[:match.start()]
    offset = None
    head, colon, tail = text.rpartition(":")
    if colon and tail.isascii() and tail.isdigit():
        offset, text = int(tail), head
    return text.strip(), offset, range_text


def file_of_rxfilename(rxfilename: str) -> str | None:
    """The file an rxfilename reads (offset and range stripped); None for pipes and stdin."""
    if is_pipe(rxfilename) or rxfilename.strip() in ("-", ""):
        return None
    return split_rxfilename(rxfilename)[0]


def refuse_pipe(rxfilename: str, where: str, allow_pipes: bool, features: bool = False) -> None:
    """DataError for a pipe (or stdin) rxfilename unless pipes are allowed (never for features)."""
    text = rxfilename.strip()
    if text == "-":
        raise DataError(f"{where}: reading from standard input ('-') is not supported; "
                        "give a file")
    if not is_pipe(text):
        return
    if features:
        raise DataError(f"{where}: {text!r} is a pipe (a shell command); {FEATURE_PIPE_ADVICE}")
    if not allow_pipes:
        raise DataError(f"{where}: {text!r} is a pipe, a shell command that would be run; "
                        f"{PIPE_ADVICE}")


def run_pipe(pipe: str, where: str) -> bytes:
    """Run an allowed input pipe through the shell, as Kaldi's popen does; its stdout."""
    text = pipe.strip()
    command = text[:-1] if text.endswith("|") else text[1:]
    try:
        proc = subprocess.run(command, shell=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, check=False)
    except OSError as exc:
        raise DataError(f"{where}: cannot run {command.strip()!r}: {one_line(exc)}") from exc
    if proc.returncode != 0:
        err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        said = f": {one_line(err[-1])}" if err else ""
        raise DataError(f"{where}: the command {command.strip()!r} failed with exit status "
                        f"{proc.returncode}{said}")
    return proc.stdout

@contextmanager
def open_source(path: str, where: str, allow_pipes: bool = False
                ) -> Iterator[tuple[BinaryIO, int]]:
    """(binary handle, size) of a file, or of an allowed pipe's output held in memory."""
    if is_pipe(path) or path.strip() == "-":
        refuse_pipe(path, where, allow_pipes)
        data = run_pipe(path, where)
        yield io.BytesIO(data), len(data)
        return
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        raise DataError(f"{where}: file not found: {path}. {SCP_PATH_ADVICE}.") from None
    except OSError as exc:
        raise DataError(f"{where}: cannot open {path}: {one_line(exc)}") from exc
    with handle:
        yield handle, os.fstat(handle.fileno()).st_size


def parse_range(range_text: str, where: str) -> tuple[slice, ...]:
    """Kaldi's inclusive `[r1:r2]` / `[r1:r2,c1:c2]` (empty part or `:` = all) as slices."""
    parts = range_text.split(",")
    if len(parts) > 2:
        raise DataError(f"{where}: bad range [{range_text}]: at most rows,columns")
    slices = []
    for part in parts:
        if part.strip() in ("", ":"):
            slices.append(slice(None))
            continue
        match = _RANGE_PART.fullmatch(part)
        if not match or int(match.group(2)) < int(match.group(1)):
            raise DataError(f"{where}: bad range [{range_text}]: expected first:last "
                            "(inclusive, first <= last)")
        slices.append(slice(int(match.group(1)), int(match.group(2)) + 1))
    return tuple(slices)


def range_shape(slices: tuple[slice, ...], shape: tuple[int, int]) -> tuple[int, int]:
    """The shape after a range, clipped at the matrix's edge as kaldiio (numpy) slices are."""
    full = slices + (slice(None),) * (2 - len(slices))
    rows, cols = (len(range(*part.indices(size))) for part, size in zip(full, shape))
    return rows, cols
