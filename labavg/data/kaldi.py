"""Kaldi feature tables and CMVN, read through kaldiio.

Every matrix format Kaldi writes (binary FM/DM, compressed CM/CM2/CM3, text
arks) and scp row/column ranges (`file.ark:123[a:b,c:d]`, inclusive as in Kaldi)
are decoded by kaldiio; this module only indexes tables so that one utterance
can be loaded at a time, and turns every failure into a `DataError` that names
the file, line and key.

Relative paths inside scp files resolve against the current working directory,
as Kaldi does (util/kaldi-io.cc opens rxfilenames as given), so run from the
recipe directory that holds `data/`, `mfcc/` and `exp/`.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import kaldiio
import numpy as np
from kaldiio.matio import read_kaldi, read_token
from kaldiio.utils import parse_specifier

from labavg.errors import DataError

# Anything kaldiio raises on a short read or a bad header.
READ_ERRORS = (ValueError, AssertionError, struct.error, EOFError, UnicodeDecodeError,
               RuntimeError, OSError, IndexError, TypeError)

_RANGE_SUFFIX = re.compile(r"\[[0-9:, ]*\]$")
_OFFSET_SUFFIX = re.compile(r":[0-9]+$")

SCP_PATH_ADVICE = (
    "Kaldi resolves paths in scp files against the working directory of the command, "
    "not against the folder of the scp file; run labavg from the recipe directory "
    "(the one that holds data/, mfcc/ and exp/, e.g. egs/<corpus>/s5)")


@dataclass(frozen=True)
class TableEntry:
    """Where one object of a Kaldi table lives: an rxfilename kaldiio can load.

    `source` and `line` name the scp file line (or the ark file and the byte offset
    of its key) for error messages.
    """

    key: str
    rxfilename: str
    source: str
    line: int


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
        raise DataError(f"bad rspecifier {rspecifier!r}: {exc}") from exc
    if spec["scp"] is not None and spec["ark"] is not None:
        raise DataError(f"bad rspecifier {rspecifier!r}: give one of ark: or scp:, not both")
    if spec["scp"] is not None:
        return "scp", spec["scp"]
    return "ark", spec["ark"]


def is_pipe(rxfilename: str) -> bool:
    """True for Kaldi's `command |` (and `| command`) rxfilenames."""
    text = rxfilename.strip()
    return text.endswith("|") or text.startswith("|")


def file_of_rxfilename(rxfilename: str) -> str | None:
    """The file an rxfilename reads (offset and range stripped); None for pipes and stdin."""
    text = rxfilename.strip()
    if is_pipe(text) or text in ("-", ""):
        return None
    text = _RANGE_SUFFIX.sub("", text)
    return _OFFSET_SUFFIX.sub("", text)


def read_scp(scp_path: str | os.PathLike) -> list[TableEntry]:
    """Read the lines of an scp file (key, rxfilename) keeping line numbers.

    Raises DataError for a missing file, a malformed line or a duplicated key.
    """
    path = Path(scp_path)
    if not path.is_file():
        raise DataError(f"scp file not found: {path} (looked in {Path.cwd()})")
    entries: list[TableEntry] = []
    first_line: dict[str, int] = {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            parts = line.strip().split(None, 1)
            if len(parts) != 2:
                raise DataError(f"{path} line {number}: expected '<key> <rxfilename>', "
                                f"got {line.strip()!r}")
            key, rxfilename = parts
            if key in first_line:
                raise DataError(f"{path} line {number}: key {key!r} repeats line "
                                f"{first_line[key]}; keys of a Kaldi table must be unique")
            first_line[key] = number
            entries.append(TableEntry(key, rxfilename, str(path), number))
    return entries


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


def read_matrix(rxfilename: str, *, where: str = "") -> np.ndarray:
    """Load one matrix (any Kaldi format, ranges included) as a writable float32 array."""
    label = where or rxfilename
    try:
        array = kaldiio.load_mat(rxfilename)
    except FileNotFoundError as exc:
        raise DataError(f"{label}: file not found: {exc.filename}. {SCP_PATH_ADVICE}.") from exc
    except READ_ERRORS as exc:
        raise DataError(f"{label}: cannot read a Kaldi matrix from {rxfilename!r} "
                        f"(truncated or corrupt ark?): {exc}") from exc
    if isinstance(array, tuple) or np.ndim(array) != 2:
        raise DataError(f"{label}: {rxfilename!r} holds a {np.ndim(array)}-d object, "
                        "expected a feature matrix")
    return np.array(array, dtype=np.float32)


def index_ark(ark_path: str) -> tuple[list[TableEntry], dict[str, tuple[int, int]]]:
    """One pass over a seekable ark: the offset of each key and each matrix's shape.

    Returns entries whose rxfilename is `ark_path:offset`, so later loads seek
    straight to the matrix, and {key: (rows, cols)}.
    """
    if is_pipe(ark_path) or ark_path.strip() == "-":
        raise DataError(f"features from a pipe ({ark_path!r}) cannot be read lazily; write "
                        "them to disk first (copy-feats ... ark,scp:feats.ark,feats.scp) and "
                        "pass the scp")
    if not Path(ark_path).is_file():
        raise DataError(f"ark file not found: {ark_path} (looked in {Path.cwd()})")
    entries: list[TableEntry] = []
    shapes: dict[str, tuple[int, int]] = {}
    with open(ark_path, "rb") as handle:
        while True:
            start = handle.tell()
            try:
                key = read_token(handle)
            except UnicodeDecodeError as exc:
                raise DataError(f"{ark_path} byte {start}: unreadable key "
                                "(corrupt ark, or not an ark?)") from exc
            if key is None:
                break
            key = key.strip()
            offset = handle.tell()
            try:
                array = read_kaldi(handle)
            except READ_ERRORS as exc:
                raise DataError(f"{ark_path} byte {offset}: cannot read the object for key "
                                f"{key!r} (truncated or corrupt ark?): {exc}") from exc
            if isinstance(array, tuple) or np.ndim(array) != 2:
                raise DataError(f"{ark_path} key {key!r}: holds a {np.ndim(array)}-d object, "
                                "expected a feature matrix")
            if key in shapes:
                raise DataError(f"{ark_path} byte {start}: key {key!r} appears twice")
            shapes[key] = (int(array.shape[0]), int(array.shape[1]))
            entries.append(TableEntry(key, f"{ark_path}:{offset}", ark_path, offset))
    return entries, shapes


class MatrixTable:
    """Random access to a Kaldi matrix table, one matrix in memory at a time.

    Built from an scp file or an rspecifier (`scp:feats.scp`, `ark:feats.ark`,
    `ark,t:feats.txt`). For an ark, opening makes one indexing pass (which also
    yields every shape); for an scp, opening only reads the scp and checks that its
    files exist.
    """

    def __init__(self, entries: list[TableEntry], shapes: dict[str, tuple[int, int]] | None):
        self.entries = {entry.key: entry for entry in entries}
        self.keys = sorted(self.entries)
        self.shapes = shapes

    @classmethod
    def open(cls, rspecifier: str) -> "MatrixTable":
        """Open `scp:...`/`ark:...` (or a bare path to an .scp/.ark file)."""
        if is_rspecifier(rspecifier):
            kind, target = split_rspecifier(rspecifier)
        else:
            kind = "scp" if str(rspecifier).endswith(".scp") else "ark"
            target = str(rspecifier)
        if kind == "scp":
            entries = read_scp(target)
            check_scp_targets(entries)
            return cls(entries, None)
        entries, shapes = index_ark(target)
        return cls(entries, shapes)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def where(self, key: str) -> str:
        """`file line N key K` (or byte offset for arks) for messages."""
        entry = self.entries[key]
        unit = "line" if entry.source.endswith(".scp") else "byte"
        return f"{entry.source} {unit} {entry.line} (key {key!r})"

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
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
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
    count = stats[0, -1]
    # Kaldi's threshold (transform/cmvn.cc): balanced-cmvn writes offsets with a count of 1.
    if not count >= 1.0:
        raise DataError(f"{where}: insufficient CMVN stats, count = {count}")
    return stats


def apply_cmvn(feats: np.ndarray, stats: np.ndarray, norm_vars: bool = False) -> np.ndarray:
    """Apply CMVN exactly as Kaldi's ApplyCmvn (src/transform/cmvn.cc), in float32.

    Mean only: offset = float(-1/count) * sum (accumulated in double, stored as float,
    as VectorBase<float>::AddVec does), added to every row. With norm_vars:
    scale = 1/sqrt(max(var, 1e-20)) and offset = -mean*scale in double, stored as
    float; x <- x*scale + offset in float. Returns a new float32 array.
    """
    stats = check_cmvn_stats(stats, "CMVN stats", norm_vars)
    dim = stats.shape[1] - 1
    if feats.shape[1] != dim:
        raise DataError(f"CMVN stats are for dimension {dim}, features have {feats.shape[1]}")
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
        raise DataError("NaN or infinity in cepstral mean/variance computation")
    offset = -(mean * scale)
    return feats * scale.astype(np.float32) + offset.astype(np.float32)


class CmvnTable:
    """CMVN stats per speaker (or one global matrix), looked up by utterance.

    Kaldi's apply-cmvn with `--utt2spk` looks stats up by speaker; without it, by
    utterance. A table whose only key is `global`, or a single stats matrix, applies
    to every utterance.
    """

    def __init__(self, stats: dict[str, np.ndarray], utt2spk: dict[str, str] | None,
                 source: str):
        self.stats = stats
        self.utt2spk = utt2spk
        self.source = source
        self.global_stats = stats["global"] if list(stats) == ["global"] else None

    @classmethod
    def open(cls, cmvn: str, utt2spk: str | os.PathLike | None = None) -> "CmvnTable":
        """Open `cmvn.scp`, an rspecifier, or an rxfilename holding one global matrix."""
        if is_rspecifier(cmvn) or str(cmvn).endswith(".scp"):
            table = MatrixTable.open(cmvn)
            stats = {key: read_cmvn_matrix(table, key) for key in table.keys}
        else:
            if not Path(file_of_rxfilename(cmvn) or cmvn).is_file():
                raise DataError(f"CMVN stats file not found: {cmvn} (looked in {Path.cwd()})")
            stats = {"global": check_cmvn_stats(read_any_matrix(cmvn), cmvn)}
        if not stats:
            raise DataError(f"{cmvn}: no CMVN stats in the table")
        mapping = read_utt2spk(utt2spk) if utt2spk is not None and Path(utt2spk).is_file() else None
        return cls(stats, mapping, str(cmvn))

    def stats_for(self, utt: str) -> np.ndarray:
        """The stats matrix that Kaldi's apply-cmvn would use for `utt`."""
        if self.global_stats is not None:
            return self.global_stats
        spk = self.utt2spk.get(utt, utt) if self.utt2spk is not None else utt
        if spk not in self.stats:
            via = f" (speaker of {utt!r} in utt2spk)" if spk != utt else ""
            raise DataError(f"{self.source}: no CMVN stats for {spk!r}{via}")
        return self.stats[spk]


def read_cmvn_matrix(table: MatrixTable, key: str) -> np.ndarray:
    """Load stats in double precision (Kaldi writes them as DM) and validate them."""
    entry = table.entries[key]
    try:
        array = kaldiio.load_mat(entry.rxfilename)
    except READ_ERRORS as exc:
        raise DataError(f"{table.where(key)}: cannot read CMVN stats: {exc}") from exc
    return check_cmvn_stats(np.array(array, dtype=np.float64), table.where(key))


def read_any_matrix(rxfilename: str) -> np.ndarray:
    """A single matrix from a file that is either a bare Kaldi object or a one-entry ark."""
    target = file_of_rxfilename(rxfilename)
    bare = True
    if target is not None and _OFFSET_SUFFIX.search(_RANGE_SUFFIX.sub("", rxfilename)) is None:
        with open(target, "rb") as handle:
            head = handle.read(2).lstrip()
        bare = head.startswith(b"\0B") or head.startswith(b"[")
    try:
        if bare:
            return np.array(kaldiio.load_mat(rxfilename), dtype=np.float64)
        items = list(kaldiio.load_ark(target))
    except READ_ERRORS as exc:
        raise DataError(f"{rxfilename}: cannot read a CMVN stats matrix: {exc}") from exc
    if len(items) != 1:
        raise DataError(f"{rxfilename}: expected one global CMVN stats matrix, found {len(items)}")
    return np.array(items[0][1], dtype=np.float64)
