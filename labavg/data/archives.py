"""Kaldi archives and scp tables: every object decoded by kaldiio, opened and checked here.

Every matrix format Kaldi writes (binary FM/DM, compressed CM/CM2/CM3, text
arks) and scp row/column ranges (`file.ark:123[a:b,c:d]`, inclusive as in Kaldi)
are decoded by kaldiio's `read_kaldi`; files are opened by labavg.data.rxfilenames
(pipes refused unless allowed, never for features) and each object's header is
checked by labavg.data.object_header before kaldiio sees it.

Every failure is a one-line `DataError` naming the file, line or byte offset and key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np

from labavg.base.errors import DataError
from labavg.data.object_header import decode_object, parse_header, read_header
from labavg.data.rxfilenames import (FEATURE_PIPE_ADVICE, is_pipe, is_rspecifier, open_source,
                                     parse_range, range_shape, refuse_pipe, split_rspecifier,
                                     split_rxfilename)
from labavg.data.text_tables import (TableEntry, check_scp_targets, entry_where, read_scp)


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
