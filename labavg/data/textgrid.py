"""Per-frame phone labels from a Praat TextGrid phone tier (parsed with praatio).

Frames follow Kaldi's feature framing (feat/feature-window.cc): with snip_edges
frame t covers [t*shift, t*shift + length); without, frames are centred at
t*shift + shift/2. Each frame takes the label of the interval holding its
centre; empty intervals and gaps get `silence_label`.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from praatio import textgrid as praat_textgrid

from labavg.data.rxfilenames import one_line
from labavg.data.text_tables import read_text_lines
from labavg.base.errors import DataError

FRAME_SHIFT = 0.01
FRAME_LENGTH = 0.025
# A day: far longer than any utterance, far shorter than a corrupt exponent.
MAX_DURATION = 86400.0


def read_phone_intervals(path: str | Path, tier: str = "phones"
                         ) -> tuple[list[tuple[float, float, str]], float]:
    """The (start, end, label) intervals of a tier and the TextGrid's end time."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"TextGrid not found: {path}")
    try:
        grid = praat_textgrid.openTextgrid(str(path), includeEmptyIntervals=False)
    except Exception as exc:  # praatio raises many types on malformed files
        raise DataError(f"{path}: cannot parse the TextGrid: {one_line(exc)[:300]}") from exc
    if tier not in grid.tierNames:
        raise DataError(f"{path}: no tier named {tier!r}; tiers are {list(grid.tierNames)}")
    entries = grid.getTier(tier).entries
    intervals = [(float(e.start), float(e.end), str(e.label).strip()) for e in entries
                 if len(e) == 3]
    if len(intervals) != len(entries):
        raise DataError(f"{path}: tier {tier!r} is a point tier, expected an interval tier")
    duration = float(grid.maxTimestamp)
    # Frame counts come from these times; a corrupt number must not become a huge count.
    if not (math.isfinite(duration) and 0 <= duration < MAX_DURATION):
        raise DataError(f"{path}: end time {duration} is not a plausible duration in seconds")
    for start, end, label in intervals:
        if not (math.isfinite(start) and math.isfinite(end) and 0 <= start <= end <= duration):
            raise DataError(f"{path}: tier {tier!r} interval {label!r} has times {start}..{end}, "
                            f"outside 0..{duration}")
    return [iv for iv in intervals if iv[2]], duration


def count_frames(duration: float, snip_edges: bool = True, frame_shift: float = FRAME_SHIFT,
                 frame_length: float = FRAME_LENGTH) -> int:
    """Kaldi's NumFrames for a signal of `duration` seconds (feature-window.cc)."""
    if snip_edges:
        if duration < frame_length:
            return 0
        return 1 + int(math.floor((duration - frame_length) / frame_shift + 1e-9))
    return int(math.floor(duration / frame_shift + 0.5))


def frame_centres(num_frames: int, snip_edges: bool = True, frame_shift: float = FRAME_SHIFT,
                  frame_length: float = FRAME_LENGTH) -> np.ndarray:
    """Centre time of every frame, in seconds."""
    half = frame_length / 2 if snip_edges else frame_shift / 2
    return np.arange(num_frames, dtype=np.float64) * frame_shift + half


def build_phone_table(labels: list[str] | set[str], silence_label: str = "sil") -> list[str]:
    """A deterministic phone table: the sorted set of labels plus the silence label."""
    return sorted(set(labels) | {silence_label})


def textgrid_labels(path: str | Path, *, tier: str = "phones",
                    phone_table: list[str] | None = None, num_frames: int | None = None,
                    snip_edges: bool = True, silence_label: str = "sil",
                    frame_shift: float = FRAME_SHIFT, frame_length: float = FRAME_LENGTH,
                    ) -> tuple[np.ndarray, list[str]]:
    """Per-frame class ids (int64) from a TextGrid phone tier, and the phone table used.

    `phone_table` (list of names; index = class id) is built from this file when not
    given. `num_frames` forces the frame count (e.g. to the feature matrix's rows);
    otherwise Kaldi's frame count for the TextGrid's duration is used.
    """
    intervals, duration = read_phone_intervals(path, tier)
    if phone_table is None:
        phone_table = build_phone_table({label for _, _, label in intervals}, silence_label)
    index = {name: i for i, name in enumerate(phone_table)}
    for start, _end, label in intervals:
        if label not in index:
            raise DataError(f"{path}: tier {tier!r} interval at {start:.3f}s has label "
                            f"{label!r}, which is not in the phone table")
    if silence_label not in index:
        raise DataError(f"silence label {silence_label!r} is not in the phone table used for "
                        f"{path}")
    if num_frames is None:
        num_frames = count_frames(duration, snip_edges, frame_shift, frame_length)
    centres = frame_centres(num_frames, snip_edges, frame_shift, frame_length)
    labels = np.full(num_frames, index[silence_label], dtype=np.int64)
    if intervals:
        starts = np.array([iv[0] for iv in intervals])
        ends = np.array([iv[1] for iv in intervals])
        ids = np.array([index[iv[2]] for iv in intervals], dtype=np.int64)
        which = np.searchsorted(starts, centres, side="right") - 1
        inside = (which >= 0) & (centres < ends[np.maximum(which, 0)])
        labels[inside] = ids[which[inside]]
    return labels, list(phone_table)


def read_phone_table(path: str | Path) -> list[str]:
    """A phone table file: one name per line, or Kaldi `phones.txt` lines `name id`."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"phone table not found: {path}")
    rows = [(number, line.split()) for number, line in read_text_lines(path) if line.split()]
    if all(len(row) == 1 for _, row in rows):
        return [row[0] for _, row in rows]
    table: dict[int, str] = {}
    for number, row in rows:
        if len(row) != 2 or not row[1].lstrip("-").isdigit():
            raise DataError(f"{path} line {number}: expected '<phone>' or '<phone> <id>'")
        table[int(row[1])] = row[0]
    if sorted(table) != list(range(len(table))):
        raise DataError(f"{path}: phone ids must be 0..N-1 without gaps")
    return [table[i] for i in range(len(table))]
