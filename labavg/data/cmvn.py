"""Kaldi CMVN: per-speaker (or global) stats tables and apply-cmvn, bit for bit."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from labavg.base.errors import DataError
from labavg.data.archives import iter_table, read_value
from labavg.data.rxfilenames import (file_of_rxfilename, is_pipe, is_rspecifier, open_source,
                                     split_rxfilename)
from labavg.data.text_tables import read_utt2spk


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
