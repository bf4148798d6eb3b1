"""Kaldi's text tables: scp lists (key, rxfilename) and the small per-utterance files.

Every failure is a one-line `DataError` naming the file and line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from labavg.base.errors import DataError
from labavg.data.rxfilenames import (SCP_PATH_ADVICE, file_of_rxfilename, is_pipe, one_line,
                                     refuse_pipe, run_pipe)


@dataclass(frozen=True)
class TableEntry:
    """Where one object of a Kaldi table lives: an rxfilename kaldiio can load.

    `source` and `line` name the scp file line (or, with unit "byte", the ark file
    and the byte offset of its object) for error messages.
    """

    key: str
    rxfilename: str
    source: str
    line: int
    unit: str = "line"


def decode_lines(data: bytes, source: str) -> list[tuple[int, str]]:
    """(line number, text) of each line of a UTF-8 text file; DataError names a bad line."""
    lines = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            lines.append((number, raw.decode("utf-8")))
        except UnicodeDecodeError as exc:
            raise DataError(f"{source} line {number}: not valid UTF-8 ({exc.reason} at "
                            f"byte {exc.start + 1} of the line: {raw[exc.start:exc.start + 1]!r})"
                            ) from None
    return lines


def read_text_lines(path: str | os.PathLike) -> list[tuple[int, str]]:
    """The numbered lines of a small text file (scp, utt2spk, utt2num_frames, ...)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise DataError(f"file not found: {path} (looked in {Path.cwd()})") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {one_line(exc)}") from exc
    return decode_lines(data, str(path))


def read_scp(scp_path: str | os.PathLike, *, allow_pipes: bool = False) -> list[TableEntry]:
    """Read the lines of an scp file (key, rxfilename) keeping line numbers.

    Raises DataError for a missing file, undecodable text, a malformed line or a
    duplicated key. The scp itself may come from a pipe only with allow_pipes; its
    lines are returned as they are (callers decide about pipes in them).
    """
    text = str(scp_path)
    if is_pipe(text) or text.strip() == "-":
        refuse_pipe(text, f"scp list {text!r}", allow_pipes)
        lines = decode_lines(run_pipe(text, f"scp list {text!r}"), f"output of {text.strip()!r}")
    else:
        if not Path(text).is_file():
            raise DataError(f"scp file not found: {text} (looked in {Path.cwd()})")
        lines = read_text_lines(text)
    entries: list[TableEntry] = []
    first_line: dict[str, int] = {}
    for number, line in lines:
        if not line.strip():
            continue
        parts = line.strip().split(None, 1)
        if len(parts) != 2:
            raise DataError(f"{text} line {number}: expected '<key> <rxfilename>', "
                            f"got {line.strip()!r}")
        key, rxfilename = parts
        if key in first_line:
            raise DataError(f"{text} line {number}: key {key!r} repeats line "
                            f"{first_line[key]}; keys of a Kaldi table must be unique")
        first_line[key] = number
        entries.append(TableEntry(key, rxfilename, text, number))
    return entries


def entry_where(entry: TableEntry) -> str:
    """`scp line N (key K)` or `ark byte N (key K)` for messages."""
    return f"{entry.source} {entry.unit} {entry.line} (key {entry.key!r})"


def check_scp_targets(entries: list[TableEntry]) -> None:
    """Raise DataError for the first scp line whose file does not exist (relative to cwd)."""
    checked: set[str] = set()
    for entry in entries:
        target = file_of_rxfilename(entry.rxfilename)
        if target is None or target in checked:
            continue
        if not Path(target).is_file():
            raise DataError(describe_missing_target(entry, target))
        checked.add(target)


def describe_missing_target(entry: TableEntry, target: str) -> str:
    """The message for an scp line whose file is missing, with a hint where it would resolve."""
    tried = Path(target) if Path(target).is_absolute() else Path.cwd() / target
    message = (f"{entry.source} line {entry.line}: {target!r} (for key {entry.key!r}) "
               f"not found; tried {tried}. {SCP_PATH_ADVICE}.")
    if not Path(target).is_absolute():
        for folder in Path(entry.source).resolve().parents:
            if (folder / target).is_file():
                return message + f" The file exists relative to {folder}: run from there."
    return message


def read_utt2spk(path: str | os.PathLike) -> dict[str, str]:
    """Read a Kaldi `utt2spk` file."""
    mapping: dict[str, str] = {}
    for number, line in read_text_lines(path):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2:
            raise DataError(f"{path} line {number}: expected '<utt> <spk>', got {line.strip()!r}")
        mapping[parts[0]] = parts[1]
    return mapping
