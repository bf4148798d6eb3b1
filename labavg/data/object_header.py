"""The header of a Kaldi object, checked before kaldiio decodes the object.

kaldiio believes the sizes in a matrix header and reads (allocates) that many
bytes, and it decodes pickles (`PKL`), which runs code. Each object's header is
checked here against the bytes left in its file before kaldiio sees it; every
failure is a one-line `DataError` naming the file, byte offset and key.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO, Callable

from kaldiio.matio import read_kaldi

from labavg.base.errors import DataError
from labavg.data.rxfilenames import one_line

# What kaldiio's decoder (and gzip/zlib) raise on a short read or a bad body.
READ_ERRORS = (ValueError, AssertionError, struct.error, EOFError, RuntimeError, OSError,
               IndexError, TypeError, OverflowError, KeyError, zlib.error)

# Objects kaldiio would decode that are not Kaldi matrices or vectors; PKL is a pickle,
# and unpickling runs code.
_FOREIGN_OBJECTS = {b"PKL": "pickle", b"NPY": "numpy .npy", b"AUDIO": "audio",
                    b"RIFF": "wav audio", b"fLaC": "flac audio"}
_ELEMENT_BYTES = {"FM": 4, "DM": 8, "FV": 4, "DV": 8}


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
    header = _sound_binary_matrix(head, left)
    if header is not None:
        return header
    where = place() if callable(place) else place
    for magic, what in _FOREIGN_OBJECTS.items():
        if head.startswith(magic):
            raise DataError(f"{where}: holds a {what} object, not a Kaldi matrix or vector; "
                            "labavg reads only Kaldi objects")
    if not head.startswith(b"\0B"):
        text = head.lstrip()
        if not text:
            raise _truncated(head, where)
        # Kaldi's text objects: `[ ... ]` matrices and vectors, or a line of numbers.
        if not (text.startswith(b"[") or text[:1].isdigit() or text[:1] in (b"-", b"+")):
            raise DataError(f"{where}: no Kaldi object starts here (it begins "
                            f"{head[:8]!r}; stale scp offset, or corrupt ark?)")
        return ObjectHeader("text", None, None, None)
    kind, rows, cols, size = _binary_sizes(head, where)
    if rows < 0 or (cols is not None and cols < 0):
        shape = f"{rows} x {cols}" if cols is not None else f"{rows}"
        raise DataError(f"{where}: corrupt {kind} header: negative size {shape}")
    if size > left:
        shape = f"{rows} x {cols}" if cols is not None else f"{rows}"
        raise DataError(f"{where}: {kind} header says {shape} ({size} bytes) but only {left} "
                        "bytes are left in the file (truncated or corrupt ark?)")
    return ObjectHeader(kind, rows, cols, size)


def _sound_binary_matrix(head: bytes, left: int) -> ObjectHeader | None:
    """The header of a well-formed binary matrix that fits, else None (then checked in full).

    The usual case, decided without the checks for rarer objects.
    """
    if not (head.startswith(b"\0B") and head[2:3] != b"\4"):
        return None
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
    return None


def _truncated(head: bytes, where: str) -> DataError:
    return DataError(f"{where}: truncated object header ({len(head)} bytes left in the "
                     "file; truncated or corrupt ark?)")


def _binary_sizes(head: bytes, where: str) -> tuple[str, int, int | None, int]:
    """(kind, rows, cols or None, size in bytes) that a binary object's header says, unchecked."""
    if head[2:3] == b"\4":
        if len(head) < 7:
            raise _truncated(head, where)
        (length,) = struct.unpack("<i", head[3:7])
        return "IV", length, None, 7 + 5 * length
    space = head.find(b" ", 2)
    kind = head[2:space].decode("latin-1") if space > 2 else ""
    body = space + 1
    if kind in ("FM", "DM"):
        if len(head) < body + 10:
            raise _truncated(head, where)
        if head[body] != 4 or head[body + 5] != 4:
            raise DataError(f"{where}: corrupt {kind} header (size bytes are not 4)")
        rows, cols = struct.unpack("<i", head[body + 1:body + 5])[0], struct.unpack(
            "<i", head[body + 6:body + 10])[0]
        return kind, rows, cols, body + 10 + rows * cols * _ELEMENT_BYTES[kind]
    if kind in ("FV", "DV"):
        if len(head) < body + 5:
            raise _truncated(head, where)
        if head[body] != 4:
            raise DataError(f"{where}: corrupt {kind} header (size byte is not 4)")
        (rows,) = struct.unpack("<i", head[body + 1:body + 5])
        return kind, rows, None, body + 5 + rows * _ELEMENT_BYTES[kind]
    if kind in ("CM", "CM2", "CM3"):
        if len(head) < body + 16:
            raise _truncated(head, where)
        rows, cols = struct.unpack("<ii", head[body + 8:body + 16])
        per_col = 8 * cols if kind == "CM" else 0
        return kind, rows, cols, body + 16 + per_col + rows * cols * (2 if kind == "CM2" else 1)
    raise DataError(f"{where}: unknown binary object type {kind[:8]!r} (Kaldi writes "
                    "FM, DM, CM, CM2, CM3, FV, DV or int vectors; corrupt ark?)")


def decode_object(handle: BinaryIO, end: int, where: str) -> object:
    """Check the header, then let kaldiio decode the object at the handle's position."""
    read_header(handle, end, where)
    try:
        return read_kaldi(handle)
    except READ_ERRORS as exc:
        said = one_line(exc)[:200] or f"{type(exc).__name__} (a size or marker byte is wrong)"
        raise DataError(f"{where}: cannot read the object (truncated or corrupt?): {said}") from exc
