"""Open a Kaldi data dir (or rspecifier) with its alignments as an UtteranceSource.

    open_dataset("data/train", ali_dir="exp/tri3_ali")   # run from the recipe dir

Features stay on disk and are read one utterance at a time (labavg.data.archives);
alignments are read whole into int32 arrays. Everything is checked up front so
that a bad corpus fails at open time with one readable DataError.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from labavg.data.alignment import as_int_vector, read_ali_dir, read_int_vectors
from labavg.data.archives import MatrixTable
from labavg.data.cmvn import CmvnTable, apply_cmvn
from labavg.data.rxfilenames import is_rspecifier
from labavg.data.text_tables import read_text_lines
from labavg.data.textgrid import (build_phone_table, count_frames, read_phone_intervals,
                                  read_phone_table, textgrid_labels)
from labavg.base.errors import DataError

PathLike = str | os.PathLike
MAX_LISTED = 5
# A TextGrid whose own frame count is further than this from the features' belongs to
# another recording (the snip-edges difference alone is 2 frames).
TEXTGRID_FRAME_TOLERANCE = 3


def list_first(keys: list[str], limit: int = MAX_LISTED) -> str:
    """`'a', 'b', ... (N in all)` for messages."""
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


@dataclass
class KaldiUtterances:
    """Kaldi features + pdf alignments, implementing labavg.data.base.UtteranceSource.

    `dropped_keys`: feature keys left out for having no alignment (skip_mismatched);
    `unused_alignment_keys`: alignments without features; `num_pdfs_source` says where
    `num_pdfs` came from; `cmvn_applied` whether CMVN stats were found and applied.
    """

    keys: list[str]
    num_frames: dict[str, int]
    feat_dim: int
    num_pdfs: int
    features: MatrixTable
    pdfs: dict[str, np.ndarray]
    cmvn: CmvnTable | None = None
    norm_vars: bool = False
    num_pdfs_source: str = ""
    dropped_keys: list[str] = field(default_factory=list)
    unused_alignment_keys: list[str] = field(default_factory=list)
    frames_from: dict[str, str] = field(default_factory=dict)

    @property
    def cmvn_applied(self) -> bool:
        """True when CMVN stats were found and are applied by `load`."""
        return self.cmvn is not None

    def load(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """Features after CMVN (float32 [T, D]) and pdf ids (int64 [T]) of one utterance."""
        if key not in self.num_frames:
            raise DataError(f"utterance {key!r} is not in this data set")
        feats = load_checked(self.features, key, self.feat_dim)
        if feats.shape[0] != self.num_frames[key]:
            said = self.frames_from.get(key, "the features when the data set was opened")
            raise DataError(f"{self.features.where(key)}: {feats.shape[0]} frames, but "
                            f"{said} says {self.num_frames[key]} (stale utt2num_frames, or "
                            "features rewritten since?)")
        if self.cmvn is not None:
            spk = self.cmvn.speaker_of(key)
            where = self.cmvn.where.get(spk, self.cmvn.source)
            feats = apply_cmvn(feats, self.cmvn.stats_for(key), self.norm_vars, where)
            if not np.all(np.isfinite(feats)):
                raise DataError(f"{where}: the CMVN stats for {spk!r} turn utterance {key!r} "
                                "into NaN or Inf")
        return feats, self.pdfs[key].astype(np.int64)


def load_checked(features: MatrixTable, key: str, feat_dim: int | None) -> np.ndarray:
    """Load one feature matrix; DataError on NaN/Inf or a dimension other than feat_dim."""
    feats = features.load(key)
    if feat_dim is not None and feats.shape[1] != feat_dim:
        raise DataError(f"{features.where(key)}: feature dimension {feats.shape[1]} differs "
                        f"from {feat_dim} (the first utterance's)")
    if not np.all(np.isfinite(feats)):
        bad = np.argwhere(~np.isfinite(feats))[0]
        raise DataError(f"{features.where(key)}: NaN or Inf in the features "
                        f"(frame {bad[0]}, dim {bad[1]}: {feats[bad[0], bad[1]]})")
    return feats


def _feature_source(data: PathLike) -> tuple[str, Path | None]:
    """(rspecifier of the features, data dir or None), or DataError saying what `data` lacks."""
    text = str(data)
    if Path(text).is_dir():
        data_dir = Path(text)
        feats = data_dir / "feats.scp"
        if not feats.is_file():
            # A few names are enough to recognise the wrong folder; a long list would bury
            # the message (a home directory holds hundreds).
            present = sorted(p.name for p in data_dir.iterdir())
            there = f"files there: {list_first(present, 2)}" if present else "it is empty"
            raise DataError(f"{data_dir}: no feats.scp ({there}): not a Kaldi data directory "
                            "or built-in corpus; make one with `labavg corpus synth DIR` or "
                            "steps/make_mfcc.sh")
        return f"scp:{feats}", data_dir
    if is_rspecifier(text):
        return text, None
    if Path(text).is_file() and text.endswith((".scp", ".ark")):
        return text, None
    raise DataError(f"data {text!r} not found: give a Kaldi data dir (with feats.scp) or an "
                    f"rspecifier such as scp:data/train/feats.scp (looked in {Path.cwd()})")


def open_features(data: PathLike) -> tuple[MatrixTable, Path | None]:
    """The feature table and the data dir (None when `data` is an rspecifier or a file)."""
    spec, data_dir = _feature_source(data)
    return MatrixTable.open(spec), data_dir


def _label_source(data: PathLike, data_dir: Path | None, ali: str | None,
                  ali_dir: PathLike | None, textgrid: PathLike | dict | None) -> str:
    """Which alignment source open_dataset reads ("ali", "ali_dir", "textgrid", "pdf_ali")."""
    sources = [name for name, value in (("ali", ali), ("ali_dir", ali_dir),
                                        ("textgrid", textgrid)) if value is not None]
    if len(sources) > 1:
        raise DataError(f"give one alignment source, not {' and '.join(sources)}")
    if sources:
        return sources[0]
    if data_dir is not None and (data_dir / "pdf_ali.ark").is_file():
        return "pdf_ali"
    raise DataError(f"no alignments for {data}: pass ali_dir=<exp/x_ali> (ali.*.gz + "
                    "final.mdl), ali=<rspecifier of pdf ids> or textgrid=<TextGrids>")


def check_data_source(data: PathLike, *, ali: str | None = None, ali_dir: PathLike | None = None,
                      textgrid: PathLike | dict | None = None) -> None:
    """DataError when `data` cannot be opened as training data, found without reading it.

    The checks `open_dataset` makes first (features and one alignment source present), with
    its messages: cheap enough to run on every keystroke of a form, and before a run starts.
    """
    _, data_dir = _feature_source(data)
    _label_source(data, data_dir, ali, ali_dir, textgrid)


def open_cmvn(data_dir: Path | None, cmvn: PathLike | None, allow_pipes: bool = False
              ) -> CmvnTable | None:
    """CMVN stats: the explicit `cmvn` source, else the data dir's cmvn.scp (+ utt2spk)."""
    utt2spk = data_dir / "utt2spk" if data_dir is not None else None
    if cmvn is not None:
        return CmvnTable.open(str(cmvn), utt2spk, allow_pipes=allow_pipes)
    if data_dir is not None and (data_dir / "cmvn.scp").is_file():
        return CmvnTable.open(f"scp:{data_dir / 'cmvn.scp'}", utt2spk, allow_pipes=allow_pipes)
    return None


def read_num_pdfs_file(path: Path) -> int:
    """The integer in a data dir's `num_pdfs` file."""
    text = " ".join(line for _, line in read_text_lines(path)).strip()
    try:
        value = int(text)
    except ValueError:
        raise DataError(f"{path}: expected one integer, got {text[:40]!r}") from None
    if value < 1:
        raise DataError(f"{path}: num_pdfs must be positive, got {value}")
    return value


def read_utt2num_frames(path: Path) -> dict[str, tuple[int, int]]:
    """A Kaldi `utt2num_frames` file: {utt: (frames, line number)}."""
    counts: dict[str, tuple[int, int]] = {}
    for number, line in read_text_lines(path):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2 or not parts[1].isdigit():
            raise DataError(f"{path} line {number}: expected '<utt> <num-frames>', got {line!r}")
        counts[parts[0]] = (int(parts[1]), number)
    return counts


def textgrid_paths(textgrid: PathLike | dict, feature_keys: list[str]) -> dict[str, Path]:
    """{key: TextGrid}: from a dict, a dir of `<key>.TextGrid`, or one file for one utterance."""
    if isinstance(textgrid, dict):
        return {str(k): Path(v) for k, v in textgrid.items()}
    path = Path(textgrid)
    if path.is_dir():
        return {p.stem: p for p in sorted(path.glob("*.TextGrid"))}
    if path.is_file():
        if len(feature_keys) != 1:
            raise DataError(f"one TextGrid ({path}) for {len(feature_keys)} utterances; give a "
                            "dir of <utterance-key>.TextGrid files or a {key: path} dict")
        return {feature_keys[0]: path}
    raise DataError(f"TextGrid path not found: {path}")


def count_all_frames(features: MatrixTable, keys: list[str], data_dir: Path | None
                     ) -> tuple[dict[str, int], int, dict[str, str]]:
    """Frame counts, feature dim and where each count came from.

    From utt2num_frames when the data dir has one: each count is compared with the
    matrix header's row count (read for every binary matrix when the table was
    opened), and every header's dimension with the first utterance's, so a stale
    file or a stray matrix fails here. Otherwise one pass loads each utterance once
    and also checks NaN/Inf and dims.
    """
    counts_file = data_dir / "utt2num_frames" if data_dir is not None else None
    if counts_file is not None and counts_file.is_file():
        listed = read_utt2num_frames(counts_file)
        missing = [k for k in keys if k not in listed]
        if missing:
            raise DataError(f"{counts_file}: no frame count for {len(missing)} utterance(s): "
                            f"{list_first(missing)}")
        feat_dim = load_checked(features, keys[0], None).shape[1]
        for key in keys:
            frames, line = listed[key]
            shape = features.shapes.get(key)
            if shape is None:
                continue
            if shape[0] != frames:
                raise DataError(f"{counts_file} line {line}: {key!r} has {frames} frames, but "
                                f"its feature matrix ({features.where(key)}) has {shape[0]} "
                                "rows; the file is stale: regenerate it "
                                "(utils/data/get_utt2num_frames.sh) or delete it")
            if shape[1] != feat_dim:
                raise DataError(f"{features.where(key)}: feature dimension {shape[1]} differs "
                                f"from {feat_dim} (the first utterance's)")
        frames_from = {k: f"{counts_file} line {listed[k][1]}" for k in keys}
        return {k: listed[k][0] for k in keys}, feat_dim, frames_from
    counts: dict[str, int] = {}
    feat_dim: int | None = None
    for key in keys:
        feats = load_checked(features, key, feat_dim)
        feat_dim = feats.shape[1]
        counts[key] = int(feats.shape[0])
    return counts, int(feat_dim), {}


def open_dataset(data: PathLike, *, ali: str | None = None, ali_dir: PathLike | None = None,
                 textgrid: PathLike | dict | None = None, apply_cmvn: bool = True,
                 norm_vars: bool = False, skip_mismatched: bool = False,
                 cmvn: PathLike | None = None, num_pdfs: int | None = None,
                 phone_table: list[str] | PathLike | None = None,
                 snip_edges: bool = True, allow_pipes: bool = False) -> KaldiUtterances:
    """Open Kaldi features with pdf alignments; run from the recipe dir, as Kaldi does.

    data: a data dir (feats.scp; optional cmvn.scp, utt2spk, utt2num_frames,
      pdf_ali.ark, num_pdfs) or a feature rspecifier (`scp:...`, `ark:...`).
    Alignments (one source): `ali`, an rspecifier of pdf-id int vectors; `ali_dir`, a
      Kaldi alignment dir (ali.*.gz + final.mdl, transition ids mapped to pdfs);
      `textgrid`, TextGrid phone tiers (a file, a dir of <key>.TextGrid, or a dict;
      class ids from `phone_table`, else built sorted from the labels; `snip_edges`
      as the features were computed); else the data dir's `pdf_ali.ark`.
    CMVN (apply_cmvn): stats from `cmvn` (rspecifier, or a file with one global
      matrix) or the data dir's cmvn.scp, per speaker via utt2spk; mean normalisation,
      variances too with norm_vars. No stats found: features are used as they are.
    num_pdfs, in order of preference: the alignment dir's model, the `num_pdfs`
      argument, the data dir's `num_pdfs` file, the phone table, and only as a last
      resort max(pdf)+1 over the alignments (which undercounts pdfs never seen).
    Key mismatches between features and alignments raise DataError, or with
      skip_mismatched=True keep the common keys and record the rest in
      `dropped_keys` / `unused_alignment_keys`.
    allow_pipes: run the shell commands of pipe rxfilenames (`ark:gunzip -c ali.gz |`,
      `KEY cmd |` lines) in alignment and CMVN sources; without it any pipe raises
      DataError. Feature pipes are refused either way (features are read lazily).
    Whatever is cheap to check for every utterance is checked here, before training
      starts: each scp target exists, each binary matrix header fits its file (and
      matches utt2num_frames), each utterance's speaker has CMVN stats of the right
      dimension, frame counts and pdf ids match.
    """
    features, data_dir = open_features(data)
    stats = open_cmvn(data_dir, cmvn, allow_pipes) if apply_cmvn else None

    source = _label_source(data, data_dir, ali, ali_dir, textgrid)
    labels = _read_labels(source, features, data_dir, ali, ali_dir, textgrid, phone_table,
                          allow_pipes)
    num_pdfs, pdf_source = _known_num_pdfs(num_pdfs, labels, data_dir)
    ali_name = ({"ali_dir": f"alignment dir {ali_dir}", "ali": f"alignments {ali}",
                 "textgrid": f"TextGrids {textgrid}"}.get(source) if source != "pdf_ali"
                else f"{data_dir / 'pdf_ali.ark'}")
    keys, missing, extra = _common_keys(features, labels, ali_name, data, skip_mismatched)

    num_frames, feat_dim, frames_from = count_all_frames(features, keys, data_dir)
    if stats is not None:
        stats.check_covers(keys, feat_dim)
    pdfs = labels.pdfs
    if labels.textgrids is not None:
        pdfs = _textgrid_pdfs(labels, keys, num_frames, snip_edges)
    num_pdfs, pdf_source = _check_pdfs(pdfs, keys, num_frames, features, ali_name, num_pdfs,
                                       pdf_source)

    return KaldiUtterances(
        keys=keys, num_frames=num_frames, feat_dim=feat_dim, num_pdfs=int(num_pdfs),
        features=features, pdfs={k: pdfs[k] for k in keys}, cmvn=stats, norm_vars=norm_vars,
        num_pdfs_source=pdf_source, dropped_keys=missing if skip_mismatched else [],
        unused_alignment_keys=extra if skip_mismatched else [], frames_from=frames_from)


@dataclass
class _Labels:
    """What an alignment source gave before frame counts are known.

    `pdfs` per key (None for TextGrids, labelled once frame counts are known from
    `textgrids`, {key: path}, with `phone_table`); `num_pdfs` and `num_pdfs_source`
    when the source itself says (an alignment dir's model).
    """

    pdfs: dict[str, np.ndarray] | None = None
    textgrids: dict[str, Path] | None = None
    phone_table: list[str] | None = None
    num_pdfs: int | None = None
    num_pdfs_source: str = ""

    def keys(self) -> set[str]:
        return set(self.pdfs) if self.pdfs is not None else set(self.textgrids or {})


def _read_labels(source: str, features: MatrixTable, data_dir: Path | None, ali: str | None,
                 ali_dir: PathLike | None, textgrid: PathLike | dict | None,
                 phone_table: list[str] | PathLike | None, allow_pipes: bool) -> _Labels:
    """Read the alignment source `_label_source` chose (TextGrids: their paths and labels)."""
    if source == "ali_dir":
        pdfs, model = read_ali_dir(ali_dir)
        return _Labels(pdfs, num_pdfs=model.num_pdfs,
                       num_pdfs_source=f"{Path(ali_dir) / 'final.mdl'}")
    if source == "ali":
        return _Labels(read_int_vectors(str(ali), allow_pipes=allow_pipes))
    if source == "textgrid":
        labels_from = textgrid_paths(textgrid, features.keys)
        if isinstance(phone_table, (str, os.PathLike)):
            table = read_phone_table(phone_table)
        elif phone_table is not None:
            table = list(phone_table)
        else:
            names: set[str] = set()
            for path in labels_from.values():
                names |= {label for _, _, label in read_phone_intervals(path)[0]}
            table = build_phone_table(names)
        return _Labels(textgrids=labels_from, phone_table=table)
    return _Labels(read_int_vectors(f"ark:{data_dir / 'pdf_ali.ark'}"))


def _known_num_pdfs(num_pdfs: int | None, labels: _Labels, data_dir: Path | None
                    ) -> tuple[int | None, str]:
    """num_pdfs and where it came from, in open_dataset's order of preference (None: not known)."""
    if labels.num_pdfs_source:
        return labels.num_pdfs, labels.num_pdfs_source
    if num_pdfs is not None:
        return num_pdfs, "the num_pdfs argument"
    if data_dir is not None and (data_dir / "num_pdfs").is_file():
        return read_num_pdfs_file(data_dir / "num_pdfs"), str(data_dir / "num_pdfs")
    if labels.phone_table is not None:
        table = labels.phone_table
        return len(table), f"the phone table ({len(table)} phones)"
    return None, ""


def _common_keys(features: MatrixTable, labels: _Labels, ali_name: str, data: PathLike,
                 skip_mismatched: bool) -> tuple[list[str], list[str], list[str]]:
    """(keys with features and alignments, feature keys without, alignment keys without)."""
    ali_keys = labels.keys()
    missing = [k for k in features.keys if k not in ali_keys]
    extra = sorted(ali_keys - set(features.keys))
    if (missing or extra) and not skip_mismatched:
        parts = []
        if missing:
            parts.append(f"{len(missing)} of {len(features.keys)} feature utterances have no "
                         f"alignment in {ali_name}: {list_first(missing)}")
        if extra:
            parts.append(f"{len(extra)} aligned utterances have no features: {list_first(extra)}")
        raise DataError("; ".join(parts) + ". Pass skip_mismatched=True (--skip-mismatched) "
                        "to train on the utterances that have both")
    keys = [k for k in features.keys if k in ali_keys]
    if not keys:
        raise DataError(f"empty data set: no utterance of {data} has both features and an "
                        f"alignment in {ali_name}")
    return keys, missing, extra


def _textgrid_pdfs(labels: _Labels, keys: list[str], num_frames: dict[str, int],
                   snip_edges: bool) -> dict[str, np.ndarray]:
    """Each utterance's frame labels from its TextGrid, which must last as long as its features."""
    pdfs = {}
    for key in keys:
        path = labels.textgrids[key]
        _, duration = read_phone_intervals(path)
        natural = count_frames(duration, snip_edges)
        if abs(natural - num_frames[key]) > TEXTGRID_FRAME_TOLERANCE:
            raise DataError(f"{path}: the TextGrid lasts {duration:.3f}s "
                            f"({natural} frames) but utterance {key!r} has "
                            f"{num_frames[key]} feature frames; wrong TextGrid?")
        frame_labels, _ = textgrid_labels(path, phone_table=labels.phone_table,
                                          num_frames=num_frames[key], snip_edges=snip_edges)
        pdfs[key] = frame_labels.astype(np.int32)
    return pdfs


def _check_pdfs(pdfs: dict[str, object], keys: list[str], num_frames: dict[str, int],
                features: MatrixTable, ali_name: str, num_pdfs: int | None, pdf_source: str
                ) -> tuple[int, str]:
    """Make each key's labels an int vector of one pdf per frame, in range; (num_pdfs, source).

    `pdfs` is updated in place. Without a known num_pdfs, max(pdf)+1 is the last resort.
    """
    for key in keys:
        pdfs[key] = as_int_vector(pdfs[key], f"{ali_name} key {key!r}")
        if len(pdfs[key]) != num_frames[key]:
            raise DataError(f"utterance {key!r}: {num_frames[key]} feature frames "
                            f"({features.where(key)}) but {len(pdfs[key])} alignment frames "
                            f"in {ali_name}; Kaldi alignments have exactly one label per "
                            "feature frame (features and alignments from different runs?)")
    if num_pdfs is None:
        num_pdfs = 1 + max(int(pdfs[k].max()) for k in keys if len(pdfs[k]))
        pdf_source = "max(pdf)+1 over the alignments (no model or num_pdfs file)"
    for key in keys:
        bad = (pdfs[key] < 0) | (pdfs[key] >= num_pdfs)
        if bad.any():
            frame = int(np.argmax(bad))
            raise DataError(f"utterance {key!r} in {ali_name}: pdf id {int(pdfs[key][frame])} "
                            f"at frame {frame} is out of range 0..{num_pdfs - 1} "
                            f"(num_pdfs {num_pdfs} from {pdf_source})")
    return num_pdfs, pdf_source
