"""Kaldi feature tables and CMVN, decoded by kaldiio, opened and checked here.

Every matrix format Kaldi writes (binary FM/DM, compressed CM/CM2/CM3, text
arks) and scp row/column ranges (`file.ark:123[a:b,c:d]`, inclusive as in Kaldi)
are decoded by kaldiio's `read_kaldi`; this module opens the files itself, never
through kaldiio's openers, for two reasons:

- kaldiio runs any rxfilename of the form `command |` (or `| command`) through
  the shell. A data file is not a place to hide commands, so pipes are refused
  unless the caller passes `allow_pipes=True`, and features never come from pipes
  (they are read lazily, which would rerun the command at every load on every rank).
- kaldiio believes the sizes in a matrix header and reads (allocates) that many
  bytes, and it decodes pickles (`PKL`), which runs code. Each object's header is
  checked against the bytes left in its file before kaldiio sees it.

Every failure is a one-line `DataError` naming the file, line or byte offset and key.

Relative paths inside scp files resolve against the current working directory,
as Kaldi does (util/kaldi-io.cc opens rxfilenames as given), so run from the
recipe directory that holds `data/`, `mfcc/` and `exp/`.
"""

from __future__ import annotations

import io
import os
import re
import struct
import subprocess
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import numpy as np
from kaldiio.matio import read_kaldi
from kaldiio.utils import parse_specifier

from labavg.base.errors import DataError

# What kaldiio's decoder (and gzip/zlib) raise on a short read or a bad body.
READ_ERRORS = (ValueError, AssertionError, struct.error, EOFError, RuntimeError, OSError,
               IndexError, TypeError, OverflowError, KeyError, zlib.error)

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

# Objects kaldiio would decode that are not Kaldi matrices or vectors; PKL is a pickle,
# and unpickling runs code.
_FOREIGN_OBJECTS = {b"PKL": "pickle", b"NPY": "numpy .npy", b"AUDIO": "audio",
                    b"RIFF": "wav audio", b"fLaC": "flac audio"}
_ELEMENT_BYTES = {"FM": 4, "DM": 8, "FV": 4, "DV": 8}


def one_line(text: object) -> str:
    """`text` with every run of whitespace (kaldiio's messages hold newlines) made one space."""
    return " ".join(str(text).split())


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


# ---------------------------------------------------------------- text files


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


# ---------------------------------------------------------------- object headers


@dataclass(frozen=True)
class ObjectHeader:
    """What a Kaldi object's header says: its type, shape and size in bytes.

    kind: FM, DM, CM, CM2, CM3, FV, DV, IV (binary int32 vector) or text; rows/cols
    are None where the header does not say (text; cols for vectors); size is the
    whole object's length in bytes (None for text, whose end is found by parsing).
    """

    kind: str
    rows: int | None
    cols: int | None
    size: int | None


def read_header(handle: BinaryIO, end: int, place: str | Callable[[], str]) -> ObjectHeader:
    """Check the header of the object at the handle's position; the position is kept."""
    start = handle.tell()
    head = handle.read(32)
    handle.seek(start)
    return parse_header(head, end - start, place)


def parse_header(head: bytes, left: int, place: str | Callable[[], str]) -> ObjectHeader:
    """Check an object's header: its first 32 bytes (fewer at the end of the file).

    Refuses (DataError) objects that are not Kaldi matrices or vectors, negative
    sizes, and sizes that need more than the `left` bytes from the object's start to
    the end of its file. `place` names the object in messages (a callable is called
    only on failure: this runs once per utterance at open time).
    """
    if head.startswith(b"\0B") and head[2:3] != b"\4":
        # The usual case, a binary matrix: decided without the checks for rarer objects.
        space = head.find(b" ", 2)
        kind = head[2:space].decode("latin-1") if space > 2 else ""
        if kind in ("FM", "DM") and len(head) >= space + 11 and head[space + 1] == 4 \
                and head[space + 6] == 4:
            rows, cols = struct.unpack("<i", head[space + 2:space + 6])[0], struct.unpack(
                "<i", head[space + 7:space + 11])[0]
            size = space + 11 + rows * cols * _ELEMENT_BYTES[kind]
            if rows >= 0 and cols >= 0 and size <= left:
                return ObjectHeader(kind, rows, cols, size)
        elif kind in ("CM", "CM2", "CM3") and len(head) >= space + 17:
            rows, cols = struct.unpack("<ii", head[space + 9:space + 17])
            per_col = 8 * cols if kind == "CM" else 0
            size = space + 17 + per_col + rows * cols * (2 if kind == "CM2" else 1)
            if rows >= 0 and cols >= 0 and size <= left:
                return ObjectHeader(kind, rows, cols, size)
    where = place() if callable(place) else place

    def short() -> DataError:
        return DataError(f"{where}: truncated object header ({len(head)} bytes left in the "
                         "file; truncated or corrupt ark?)")

    for magic, what in _FOREIGN_OBJECTS.items():
        if head.startswith(magic):
            raise DataError(f"{where}: holds a {what} object, not a Kaldi matrix or vector; "
                            "labavg reads only Kaldi objects")
    if not head.startswith(b"\0B"):
        text = head.lstrip()
        if not text:
            raise short()
        # Kaldi's text objects: `[ ... ]` matrices and vectors, or a line of numbers.
        if not (text.startswith(b"[") or text[:1].isdigit() or text[:1] in (b"-", b"+")):
            raise DataError(f"{where}: no Kaldi object starts here (it begins "
                            f"{head[:8]!r}; stale scp offset, or corrupt ark?)")
        return ObjectHeader("text", None, None, None)
    if head[2:3] == b"\4":
        if len(head) < 7:
            raise short()
        (length,) = struct.unpack("<i", head[3:7])
        kind, rows, cols, size = "IV", length, None, 7 + 5 * length
    else:
        space = head.find(b" ", 2)
        kind = head[2:space].decode("latin-1") if space > 2 else ""
        body = space + 1
        if kind in ("FM", "DM"):
            if len(head) < body + 10:
                raise short()
            if head[body] != 4 or head[body + 5] != 4:
                raise DataError(f"{where}: corrupt {kind} header (size bytes are not 4)")
            rows, cols = struct.unpack("<i", head[body + 1:body + 5])[0], struct.unpack(
                "<i", head[body + 6:body + 10])[0]
            size = body + 10 + rows * cols * _ELEMENT_BYTES[kind]
        elif kind in ("FV", "DV"):
            if len(head) < body + 5:
                raise short()
            if head[body] != 4:
                raise DataError(f"{where}: corrupt {kind} header (size byte is not 4)")
            (rows,) = struct.unpack("<i", head[body + 1:body + 5])
            cols = None
            size = body + 5 + rows * _ELEMENT_BYTES[kind]
        elif kind in ("CM", "CM2", "CM3"):
            if len(head) < body + 16:
                raise short()
            rows, cols = struct.unpack("<ii", head[body + 8:body + 16])
            per_col = 8 * cols if kind == "CM" else 0
            size = body + 16 + per_col + rows * cols * (2 if kind == "CM2" else 1)
        else:
            raise DataError(f"{where}: unknown binary object type {kind[:8]!r} (Kaldi writes "
                            "FM, DM, CM, CM2, CM3, FV, DV or int vectors; corrupt ark?)")
    if rows < 0 or (cols is not None and cols < 0):
        shape = f"{rows} x {cols}" if cols is not None else f"{rows}"
        raise DataError(f"{where}: corrupt {kind} header: negative size {shape}")
    if size > left:
        shape = f"{rows} x {cols}" if cols is not None else f"{rows}"
        raise DataError(f"{where}: {kind} header says {shape} ({size} bytes) but only {left} "
                        "bytes are left in the file (truncated or corrupt ark?)")
    return ObjectHeader(kind, rows, cols, size)


def decode_object(handle: BinaryIO, end: int, where: str) -> object:
    """Check the header, then let kaldiio decode the object at the handle's position."""
    read_header(handle, end, where)
    try:
        return read_kaldi(handle)
    except READ_ERRORS as exc:
        said = one_line(exc)[:200] or f"{type(exc).__name__} (a size or marker byte is wrong)"
        raise DataError(f"{where}: cannot read the object (truncated or corrupt?): {said}") from exc


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


def read_value(rxfilename: str, *, where: str = "", allow_pipes: bool = False) -> object:
    """The Kaldi object an rxfilename names (`file`, `file:offset`, ranges, allowed pipes)."""
    label = where or rxfilename
    refuse_pipe(rxfilename, label, allow_pipes)
    if is_pipe(rxfilename):
        path, offset, range_text = rxfilename, None, None
    else:
        path, offset, range_text = split_rxfilename(rxfilename)
    with open_source(path, label, allow_pipes) as (handle, end):
        if offset is not None:
            if offset >= end:
                raise DataError(f"{label}: offset {offset} is past the end of {path} "
                                f"({end} bytes; truncated ark or stale scp?)")
            handle.seek(offset)
        # An scp line names its key; say which file and byte the object is at, too.
        at = label if path in label else f"{label} at {path.strip()} byte {offset or 0}"
        value = decode_object(handle, end, at)
    if range_text is not None:
        if np.ndim(value) != 2:
            raise DataError(f"{label}: a range applies to matrices, this is a "
                            f"{np.ndim(value)}-d object")
        value = value[parse_range(range_text, label)]
    return value


def read_matrix(rxfilename: str, *, where: str = "", allow_pipes: bool = False) -> np.ndarray:
    """Load one matrix (any Kaldi format, ranges included) as a writable float32 array."""
    label = where or rxfilename
    array = read_value(rxfilename, where=label, allow_pipes=allow_pipes)
    if isinstance(array, tuple) or np.ndim(array) != 2:
        raise DataError(f"{label}: {rxfilename!r} holds a {np.ndim(array)}-d object, "
                        "expected a feature matrix")
    return np.array(array, dtype=np.float32)


def read_key(handle: BinaryIO, end: int, source: str) -> tuple[str, int] | None:
    """The next key of an ark and its byte offset, or None at the end.

    As Kaldi's archive reader: leading whitespace is skipped and the key ends at a space.
    """
    while True:
        char = handle.read(1)
        if char == b"":
            return None
        if not char.isspace():
            break
    start = handle.tell() - 1
    raw = bytearray(char)
    while True:
        char = handle.read(1)
        if char == b" ":
            break
        if char == b"" or char.isspace():
            raise DataError(f"{source} byte {start}: expected a space after the key "
                            f"{bytes(raw[:60])!r} (truncated or corrupt ark, or not an ark?)")
        raw += char
    try:
        return raw.decode("utf-8"), start
    except UnicodeDecodeError:
        raise DataError(f"{source} byte {start}: unreadable key {bytes(raw[:60])!r} "
                        "(not UTF-8; corrupt ark, or not an ark?)") from None


def iter_ark(handle: BinaryIO, end: int, source: str
             ) -> Iterator[tuple[str, object, TableEntry]]:
    """(key, object, entry) of each object of an ark, headers checked before decoding."""
    while (found := read_key(handle, end, source)) is not None:
        key, start = found
        offset = handle.tell()
        entry = TableEntry(key, f"{source}:{offset}", source, offset, "byte")
        yield key, decode_object(handle, end, f"{source} byte {offset} (key {key!r})"), entry


def iter_table(rspecifier: str, *, allow_pipes: bool = False
               ) -> Iterator[tuple[str, object, str]]:
    """(key, object, where) of each entry of `ark:...` / `scp:...` in order; pipes checked."""
    kind, target = split_rspecifier(rspecifier)
    if kind == "scp":
        for entry in read_scp(target, allow_pipes=allow_pipes):
            where = entry_where(entry)
            yield entry.key, read_value(entry.rxfilename, where=where,
                                        allow_pipes=allow_pipes), where
        return
    if not is_pipe(target) and target.strip() != "-" and not Path(target).is_file():
        raise DataError(f"ark file not found: {target} (looked in {Path.cwd()})")
    with open_source(target, f"rspecifier {rspecifier!r}", allow_pipes) as (handle, end):
        for key, value, entry in iter_ark(handle, end, target):
            yield key, value, entry_where(entry)


def index_ark(ark_path: str) -> tuple[list[TableEntry], dict[str, tuple[int, int]]]:
    """One pass over a seekable ark: the offset of each key and each matrix's shape.

    Returns entries whose rxfilename is `ark_path:offset`, so later loads seek
    straight to the matrix, and {key: (rows, cols)}. Binary matrices are skipped
    by the size in their (checked) header, text ones parsed.
    """
    if is_pipe(ark_path) or ark_path.strip() == "-":
        raise DataError(f"features from {ark_path!r}: {FEATURE_PIPE_ADVICE}")
    if not Path(ark_path).is_file():
        raise DataError(f"ark file not found: {ark_path} (looked in {Path.cwd()})")
    entries: list[TableEntry] = []
    shapes: dict[str, tuple[int, int]] = {}
    with open_source(ark_path, ark_path) as (handle, end):
        while (found := read_key(handle, end, ark_path)) is not None:
            key, start = found
            offset = handle.tell()
            where = f"{ark_path} byte {offset} (key {key!r})"
            header = read_header(handle, end, where)
            if header.kind in ("FM", "DM", "CM", "CM2", "CM3"):
                handle.seek(offset + header.size)
                shape = (header.rows, header.cols)
            else:
                array = decode_object(handle, end, where)
                if isinstance(array, tuple) or np.ndim(array) != 2:
                    raise DataError(f"{where}: holds a {np.ndim(array)}-d object, "
                                    "expected a feature matrix")
                shape = (int(array.shape[0]), int(array.shape[1]))
            if key in shapes:
                raise DataError(f"{ark_path} byte {start}: key {key!r} appears twice")
            shapes[key] = shape
            entries.append(TableEntry(key, f"{ark_path}:{offset}", ark_path, offset, "byte"))
    return entries, shapes


def scp_header_shapes(entries: list[TableEntry]) -> dict[str, tuple[int, int]]:
    """Each binary matrix's shape from its header alone (ranges applied), checked to fit.

    One open per ark and one 32-byte read per entry: cheap enough to do for every
    utterance at open time, so that a corrupt header or a truncated ark fails then,
    not on whichever rank first loads the utterance. Text matrices are not parsed.
    """
    by_file: dict[str, list[tuple[TableEntry, int, str | None]]] = {}
    for entry in entries:
        path, offset, range_text = split_rxfilename(entry.rxfilename)
        by_file.setdefault(path, []).append((entry, offset or 0, range_text))
    shapes: dict[str, tuple[int, int]] = {}
    for path, group in by_file.items():
        with open_source(path, entry_where(group[0][0])) as (handle, end):
            descriptor = handle.fileno()
            for entry, offset, range_text in group:
                if offset >= end:
                    raise DataError(f"{entry_where(entry)}: offset {offset} is past the end of "
                                    f"{path} ({end} bytes; truncated ark or stale scp?)")
                # pread: 32 bytes, where a seek and a buffered read would fetch 8 kB.
                header = parse_header(os.pread(descriptor, 32, offset), end - offset,
                                      lambda: f"{entry_where(entry)} at {path} byte {offset}")
                if header.kind in ("FV", "DV", "IV"):
                    raise DataError(f"{entry_where(entry)}: holds a vector ({header.kind}), "
                                    "expected a feature matrix")
                if header.kind == "text":
                    continue
                shape = (header.rows, header.cols)
                if range_text is not None:
                    shape = range_shape(parse_range(range_text, entry_where(entry)), shape)
                shapes[entry.key] = shape
    return shapes


class MatrixTable:
    """Random access to a Kaldi matrix table, one matrix in memory at a time.

    Built from an scp file or an rspecifier (`scp:feats.scp`, `ark:feats.ark`,
    `ark,t:feats.txt`). For an ark, opening makes one indexing pass (which also
    yields every shape); for an scp, opening reads the scp, checks that its files
    exist and reads each binary matrix's header (its shape, checked to fit in the
    file). `shapes` holds every shape known without decoding data: all of an ark's,
    and those of an scp's binary matrices. Pipes are refused (see FEATURE_PIPE_ADVICE).
    """

    def __init__(self, entries: list[TableEntry], shapes: dict[str, tuple[int, int]] | None):
        self.entries = {entry.key: entry for entry in entries}
        self.keys = sorted(self.entries)
        self.shapes = shapes if shapes is not None else {}

    @classmethod
    def open(cls, rspecifier: str) -> "MatrixTable":
        """Open `scp:...`/`ark:...` (or a bare path to an .scp/.ark file)."""
        if is_rspecifier(rspecifier):
            kind, target = split_rspecifier(rspecifier)
        else:
            kind = "scp" if str(rspecifier).endswith(".scp") else "ark"
            target = str(rspecifier)
        if kind == "scp":
            if is_pipe(target) or target.strip() == "-":
                refuse_pipe(target, f"scp list {target!r}", False, features=True)
            entries = read_scp(target)
            for entry in entries:
                refuse_pipe(entry.rxfilename, entry_where(entry), False, features=True)
            check_scp_targets(entries)
            return cls(entries, scp_header_shapes(entries))
        entries, shapes = index_ark(target)
        return cls(entries, shapes)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def where(self, key: str) -> str:
        """`file line N key K` (or byte offset for arks) for messages."""
        return entry_where(self.entries[key])

    def load(self, key: str) -> np.ndarray:
        """The float32 matrix of `key`."""
        if key not in self.entries:
            raise DataError(f"key {key!r} is not in the feature table")
        entry = self.entries[key]
        return read_matrix(entry.rxfilename, where=self.where(key))


# ---------------------------------------------------------------- CMVN


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


def check_cmvn_stats(stats: np.ndarray, where: str, norm_vars: bool = False) -> np.ndarray:
    """Validate a Kaldi CMVN stats matrix (1 or 2 rows x D+1, count in row 0's last column)."""
    stats = np.asarray(stats, dtype=np.float64)
    if stats.ndim != 2 or stats.shape[0] not in (1, 2) or stats.shape[1] < 2:
        raise DataError(f"{where}: CMVN stats must be a 2 x (D+1) matrix, got shape {stats.shape}")
    if norm_vars and stats.shape[0] != 2:
        raise DataError(f"{where}: variance normalisation requested but the stats have no "
                        "second (sum of squares) row")
    if not np.all(np.isfinite(stats)) or np.abs(stats).max() > np.finfo(np.float32).max:
        raise DataError(f"{where}: NaN, Inf or out-of-range values in the CMVN stats")
    count = stats[0, -1]
    # Kaldi's threshold (transform/cmvn.cc): balanced-cmvn writes offsets with a count of 1.
    if not count >= 1.0:
        raise DataError(f"{where}: insufficient CMVN stats, count = {count}")
    return stats


def apply_cmvn(feats: np.ndarray, stats: np.ndarray, norm_vars: bool = False,
               where: str = "CMVN stats") -> np.ndarray:
    """Apply CMVN exactly as Kaldi's ApplyCmvn (src/transform/cmvn.cc), in float32.

    Mean only: offset = float(-1/count) * sum (accumulated in double, stored as float,
    as VectorBase<float>::AddVec does), added to every row. With norm_vars:
    scale = 1/sqrt(max(var, 1e-20)) and offset = -mean*scale in double, stored as
    float; x <- x*scale + offset in float. Returns a new float32 array. `where` names
    the stats in messages.
    """
    stats = check_cmvn_stats(stats, where, norm_vars)
    dim = stats.shape[1] - 1
    if feats.shape[1] != dim:
        raise DataError(f"{where}: CMVN stats are for dimension {dim}, features have "
                        f"{feats.shape[1]}")
    count = stats[0, dim]
    feats = np.asarray(feats, dtype=np.float32)
    if not norm_vars:
        alpha = np.float64(np.float32(-1.0 / count))
        offset = (alpha * stats[0, :dim]).astype(np.float32)
        return feats + offset
    mean = stats[0, :dim] / count
    var = np.maximum(stats[1, :dim] / count - mean * mean, 1.0e-20)
    scale = 1.0 / np.sqrt(var)
    if not np.all(np.isfinite(scale)):
        raise DataError(f"{where}: NaN or infinity in cepstral mean/variance computation")
    offset = -(mean * scale)
    return feats * scale.astype(np.float32) + offset.astype(np.float32)


class CmvnTable:
    """CMVN stats per speaker (or one global matrix), looked up by utterance.

    Kaldi's apply-cmvn with `--utt2spk` looks stats up by speaker; without it, by
    utterance. A table whose only key is `global`, or a single stats matrix, applies
    to every utterance. `where[key]` says where each matrix came from.
    """

    def __init__(self, stats: dict[str, np.ndarray], utt2spk: dict[str, str] | None,
                 source: str, where: dict[str, str] | None = None, utt2spk_path: str = "utt2spk"):
        self.stats = stats
        self.utt2spk = utt2spk
        self.utt2spk_path = utt2spk_path
        self.source = source
        self.where = where or {key: source for key in stats}
        self.global_stats = stats["global"] if list(stats) == ["global"] else None

    @classmethod
    def open(cls, cmvn: str, utt2spk: str | os.PathLike | None = None, *,
             allow_pipes: bool = False) -> "CmvnTable":
        """Open `cmvn.scp`, an rspecifier, or an rxfilename holding one global matrix.

        The stats are read whole at open time, so pipes work here when allowed.
        """
        cmvn = str(cmvn)
        where: dict[str, str] = {}
        if is_rspecifier(cmvn) or cmvn.endswith(".scp"):
            spec = cmvn if is_rspecifier(cmvn) else f"scp:{cmvn}"
            stats = {}
            for key, value, place in iter_table(spec, allow_pipes=allow_pipes):
                if key in stats:
                    raise DataError(f"{place}: CMVN stats for {key!r} appear twice")
                stats[key] = check_cmvn_stats(np.array(value, dtype=np.float64), place)
                where[key] = place
        else:
            if not is_pipe(cmvn) and not Path(file_of_rxfilename(cmvn) or cmvn).is_file():
                raise DataError(f"CMVN stats file not found: {cmvn} (looked in {Path.cwd()})")
            stats = {"global": check_cmvn_stats(read_any_matrix(cmvn, allow_pipes=allow_pipes),
                                                cmvn)}
        if not stats:
            raise DataError(f"{cmvn}: no CMVN stats in the table")
        mapping = read_utt2spk(utt2spk) if utt2spk is not None and Path(utt2spk).is_file() else None
        return cls(stats, mapping, cmvn, where, str(utt2spk))

    def speaker_of(self, utt: str) -> str:
        """The key of `utt`'s stats: its speaker in utt2spk, else the utterance itself."""
        if self.global_stats is not None:
            return "global"
        return self.utt2spk.get(utt, utt) if self.utt2spk is not None else utt

    def stats_for(self, utt: str) -> np.ndarray:
        """The stats matrix that Kaldi's apply-cmvn would use for `utt`."""
        spk = self.speaker_of(utt)
        if spk not in self.stats:
            via = f" (speaker of {utt!r} in {self.utt2spk_path})" if spk != utt else ""
            raise DataError(f"{self.source}: no CMVN stats for {spk!r}{via}")
        return self.stats[spk]

    def check_covers(self, utts: list[str], feat_dim: int) -> None:
        """DataError unless every utterance has stats, of the features' dimension.

        Checked at open time: otherwise only the rank that loads such an utterance finds out.
        """
        missing = [u for u in utts if self.speaker_of(u) not in self.stats]
        if missing:
            speakers = sorted({self.speaker_of(u) for u in missing})
            via = f" (their speakers in {self.utt2spk_path})" if self.utt2spk is not None else ""
            shown = ", ".join(repr(s) for s in speakers[:5])
            more = f", ... ({len(speakers)} in all)" if len(speakers) > 5 else ""
            raise DataError(f"{self.source}: no CMVN stats for {shown}{more}{via}, needed by "
                            f"{len(missing)} utterance(s), e.g. {missing[0]!r}")
        for spk in sorted({self.speaker_of(u) for u in utts}):
            dim = self.stats[spk].shape[1] - 1
            if dim != feat_dim:
                raise DataError(f"{self.where[spk]}: CMVN stats for {spk!r} are for dimension "
                                f"{dim}, the features have {feat_dim}")


def read_any_matrix(rxfilename: str, *, allow_pipes: bool = False) -> np.ndarray:
    """A single matrix from a file that is either a bare Kaldi object or a one-entry ark."""
    target = file_of_rxfilename(rxfilename)
    path, offset, range_text = split_rxfilename(rxfilename)
    bare = True
    if target is not None and offset is None:
        with open_source(path, rxfilename) as (handle, _):
            head = handle.read(2).lstrip()
        bare = head.startswith(b"\0B") or head.startswith(b"[")
    if bare:
        return np.array(read_value(rxfilename, where=rxfilename, allow_pipes=allow_pipes),
                        dtype=np.float64)
    if range_text is not None:
        raise DataError(f"{rxfilename}: a range needs an offset into the ark (file.ark:N[...])")
    items = [value for _, value, _ in iter_table(f"ark:{path}")]
    if len(items) != 1:
        raise DataError(f"{rxfilename}: expected one global CMVN stats matrix, found {len(items)}")
    return np.array(items[0], dtype=np.float64)
