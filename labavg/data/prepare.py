"""Real recordings and their transcripts as a Kaldi data directory labavg trains and decodes on.

`prepare_corpus(AUDIO, OUT, text=...)` (the CLI's `labavg corpus prepare`) checks every input
first (nothing is written when one is bad), aligns each utterance with pocketsphinx
(labavg.data.forced_align), and writes what the built-in corpus has: wav.scp, text, utt2spk,
spk2utt, 40-dim fbank features and CMVN stats, per-frame pdfs (pdf_ali.ark, 3 states of each of
CMUdict's 39 phones and silence), phones.txt, pdfs.txt, lexicon.txt, a Kaldi phone CTM
(phones.ctm) and corpus.json. Decoding uses the training transcripts' unigram, as for the built-in
corpus (labavg.decode.task). Work in progress sits in OUT.partial/, one file per utterance, so a
rerun after an interruption aligns only what is left; the finished directory is renamed into place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from labavg.base.errors import UserError
from labavg.data.forced_align import (MODEL_RATE, PHONES, STATES_PER_PHONE, AlignmentFailed,
                                      Aligner, ctm_lines, frame_pdfs)
from labavg.data.synth import check_out_dir
from labavg.data.synth_signal import FEAT_DIM, compute_fbank

AUDIO_SUFFIXES = (".wav", ".flac")
# Telephone, wideband and the common studio rates; the features are made at 16 kHz at most.
RATES = (8000, 16000, 22050, 32000, 44100, 48000)
FEATURE_RATE_LIMIT = 16000
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Recording:
    utt: str
    path: Path
    rate: int
    words: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class PreparedCorpus:
    out_dir: Path
    num_utts: int
    num_frames: int
    hours: float
    unknown_words: dict[str, list[str]]  # utterance -> words outside the dictionary (left out)
    failed: dict[str, str]  # utterance -> why its alignment failed (left out)
    seconds_taken: float


def read_transcripts(path: str | os.PathLike) -> dict[str, tuple[str, ...]]:
    """Kaldi `text` lines (`utt word ...`) or `name: word ...` lines, checked line by line."""
    from labavg.data.text_tables import read_text_lines

    out: dict[str, tuple[str, ...]] = {}
    for number, line in read_text_lines(path):
        if not line.strip():
            continue
        head, colon, rest = line.partition(":")
        key, words = (head.strip(), rest.split()) if colon and " " not in head.strip() \
            else (line.split()[0], line.split()[1:])
        if not words:
            raise UserError(f"{path} line {number}: utterance {key!r} has an empty transcript")
        if key in out:
            raise UserError(f"{path} line {number}: utterance {key!r} is transcribed twice")
        out[key] = tuple(words)
    if not out:
        raise UserError(f"{path}: no transcripts")
    return out


def read_lexicon_file(path: str | os.PathLike) -> dict[str, list[str]]:
    """Extra pronunciations, `word PHONE ...` lines in CMUdict's ARPAbet."""
    from labavg.data.forced_align import phone_of
    from labavg.data.text_tables import read_text_lines

    extra: dict[str, list[str]] = {}
    for number, line in read_text_lines(path):
        parts = line.split()
        if not parts:
            continue
        bad = [p for p in parts[1:] if phone_of(p) == "SIL"]
        if len(parts) < 2 or bad:
            raise UserError(f"{path} line {number}: expected `word PHONE ...` in ARPAbet"
                            + (f"; {bad[0]!r} is not one of CMUdict's phones" if bad else ""))
        extra.setdefault(parts[0].lower(), parts[1:])
    return extra


def _first(items, limit: int = 5) -> str:
    items = sorted(items)
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def find_recordings(audio_dir: Path, transcripts: dict[str, tuple[str, ...]], text: Path
                    ) -> list[Recording]:
    """The recordings, one per transcript, each mono at one rate of RATES; UserError otherwise."""
    import soundfile

    if not audio_dir.is_dir():
        raise UserError(f"audio folder {audio_dir} not found")
    files = {p.stem: p for p in sorted(audio_dir.iterdir()) if p.suffix.lower() in AUDIO_SUFFIXES}
    if not files:
        raise UserError(f"{audio_dir}: no recordings (.wav or .flac files)")
    unheard = set(transcripts) - set(files)
    if unheard:
        raise UserError(f"{text}: no recording in {audio_dir} for {_first(unheard)}")
    untold = set(files) - set(transcripts)
    if untold:
        raise UserError(f"{audio_dir}: no transcript in {text} for {_first(untold)}")
    recordings = []
    for utt in sorted(transcripts):
        path = files[utt]
        try:
            info = soundfile.info(str(path))
        except (RuntimeError, soundfile.LibsndfileError) as exc:
            raise UserError(f"{path}: cannot read the audio ({exc})") from None
        if info.channels != 1:
            raise UserError(f"{path}: {info.channels} channels; give mono recordings")
        if info.samplerate not in RATES:
            raise UserError(f"{path}: sample rate {info.samplerate} Hz; expected one of "
                            f"{', '.join(map(str, RATES))}")
        if info.frames < info.samplerate * 0.1:
            raise UserError(f"{path}: {info.frames} samples, under 0.1 s of audio")
        recordings.append(Recording(utt, path.resolve(), int(info.samplerate), transcripts[utt]))
    rates = {r.rate for r in recordings}
    if len(rates) > 1:
        by_rate = {rate: next(r.path.name for r in recordings if r.rate == rate) for rate in rates}
        raise UserError(f"{audio_dir}: recordings at several sample rates "
                        f"({', '.join(f'{n} at {r} Hz' for r, n in sorted(by_rate.items()))}); "
                        "give one rate")
    return recordings


def load_recording(path: str | os.PathLike) -> tuple[np.ndarray, int]:
    """A recording's samples (int16 values, as Kaldi reads wav) and its sample rate."""
    import soundfile

    samples, rate = soundfile.read(str(path), dtype="int16")
    return samples, int(rate)


def _resampled(samples: np.ndarray, rate: int, to: int) -> np.ndarray:
    """int16-valued `samples` at `rate` as int16-valued samples at `to`."""
    import soxr

    if rate == to:
        return samples
    return np.clip(soxr.resample(samples.astype(np.float32), rate, to), -32768, 32767)


def _prepare_one(rec: Recording, aligner: Aligner, feature_rate: int, cache: Path) -> None:
    """Features, pdfs and phone segments of one utterance, saved atomically in the cache."""
    samples, _ = load_recording(rec.path)  # read once, resampled for the features and the model
    feats = compute_fbank(_resampled(samples, rec.rate, feature_rate).astype(np.float32), feature_rate)
    try:
        segments = aligner.align(_resampled(samples, rec.rate, MODEL_RATE), list(rec.words), str(rec.path))
        result = {"feats": feats, "pdfs": frame_pdfs(segments, len(feats)),
                  "ctm": np.array(ctm_lines(rec.utt, segments))}
    except AlignmentFailed as exc:
        result = {"failed": np.array(str(exc))}
    part = cache / f"{rec.utt}.tmp.npz"
    np.savez(part, **result)
    part.rename(cache / f"{rec.utt}.npz")


def _fingerprint(recordings: list[Recording], extra: dict[str, list[str]], speaker: str | None) -> str:
    stat = [(r.utt, str(r.path), r.path.stat().st_size, r.path.stat().st_mtime_ns, r.words)
            for r in recordings]
    return hashlib.sha1(json.dumps([FORMAT_VERSION, stat, extra, speaker]).encode()).hexdigest()


def _write_lines(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def _write_kaldi_dir(build: Path, final: Path, kept: list[Recording], cache: Path,
                     aligner: Aligner, speaker: str | None) -> int:
    """Every Kaldi file of the kept utterances into `build` (scp paths point into `final`)."""
    import kaldiio

    spk = {r.utt: speaker or r.utt for r in kept}
    cmvn: dict[str, np.ndarray] = {}
    frames: dict[str, int] = {}
    ctm: list[str] = []
    with kaldiio.WriteHelper(f"ark,scp:{build / 'feats.ark'},{build / 'feats.scp'}") as feats_out, \
            kaldiio.WriteHelper(f"ark:{build / 'pdf_ali.ark'}") as ali_out:
        for rec in kept:
            with np.load(cache / f"{rec.utt}.npz") as done:
                feats, pdfs = done["feats"], done["pdfs"]
                ctm += [str(line) for line in done["ctm"]]
            feats_out(rec.utt, feats)
            ali_out(rec.utt, pdfs)
            stats = cmvn.setdefault(spk[rec.utt], np.zeros((2, FEAT_DIM + 1)))
            f64 = feats.astype(np.float64)
            stats[0, :FEAT_DIM] += f64.sum(axis=0)
            stats[0, FEAT_DIM] += len(feats)
            stats[1, :FEAT_DIM] += (f64 ** 2).sum(axis=0)
            frames[rec.utt] = len(feats)
    kaldiio.save_ark(str(build / "cmvn.ark"), dict(sorted(cmvn.items())), scp=str(build / "cmvn.scp"))
    for name in ("feats", "cmvn"):
        scp = build / f"{name}.scp"
        _write_lines(scp, [line.replace(str(build / f"{name}.ark"), str(final / f"{name}.ark"))
                           for line in scp.read_text(encoding="utf-8").splitlines()])
    # Kaldi reads wav files itself and other formats from a pipe (LibriSpeech's data prep).
    _write_lines(build / "wav.scp", [f"{r.utt} {r.path}" if r.path.suffix.lower() == ".wav"
                                     else f"{r.utt} flac -c -d -s {r.path} |" for r in kept])
    _write_lines(build / "text", [f"{r.utt} {' '.join(r.words)}" for r in kept])
    _write_lines(build / "utt2spk", [f"{r.utt} {spk[r.utt]}" for r in kept])
    _write_lines(build / "spk2utt", [f"{s} {' '.join(u for u in sorted(spk) if spk[u] == s)}"
                                     for s in sorted(set(spk.values()))])
    _write_lines(build / "utt2num_frames", [f"{u} {n}" for u, n in frames.items()])
    _write_lines(build / "phones.ctm", ctm)
    _write_lines(build / "num_pdfs", [str(STATES_PER_PHONE * len(PHONES))])
    _write_lines(build / "phones.txt", [f"{p} {i}" for i, p in enumerate(PHONES)])
    _write_lines(build / "pdfs.txt", [f"{STATES_PER_PHONE * i + s} {p} {s}" for i, p in
                                      enumerate(PHONES) for s in range(STATES_PER_PHONE)])
    words = sorted({w for r in kept for w in r.words})
    _write_lines(build / "lexicon.txt", [f"{w} {' '.join(aligner.pronunciation(w))}" for w in words])
    return sum(frames.values())


def prepare_corpus(audio_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                   text: str | os.PathLike, lexicon: str | os.PathLike | None = None,
                   speaker: str | None = None, overwrite: bool = False,
                   progress: bool = True) -> PreparedCorpus:
    """Write the Kaldi data directory of the recordings in `audio_dir` to `out_dir`.

    `text`: the transcripts (Kaldi `text` or `name: words` lines; names are the files' stems).
    `lexicon`: extra pronunciations for words CMUdict lacks. `speaker`: one speaker for every
    utterance (default: each its own, Kaldi's fallback for CMVN). Utterances with words outside
    the dictionary, and those pocketsphinx cannot align, are left out and listed in
    OUT/left_out.txt.
    """
    from tqdm import tqdm

    began = time.perf_counter()
    final, audio_dir, text = Path(out_dir).resolve(), Path(audio_dir), Path(text)
    check_out_dir(final, overwrite)
    recordings = find_recordings(audio_dir, read_transcripts(text), text)
    extra = read_lexicon_file(lexicon) if lexicon is not None else {}
    aligner = Aligner(extra)
    unknown = {r.utt: aligner.unknown(list(r.words)) for r in recordings}
    unknown = {u: ws for u, ws in unknown.items() if ws}
    todo = [r for r in recordings if r.utt not in unknown]
    if not todo:
        words = sorted({w for ws in unknown.values() for w in ws})
        raise UserError(f"{text}: every utterance has words outside the dictionary ({_first(words)}); "
                        "give their pronunciations with --lexicon FILE")
    feature_rate = min(recordings[0].rate, FEATURE_RATE_LIMIT)
    partial = final.with_name(final.name + ".partial")
    cache = partial / "utterances"
    stamp = _fingerprint(recordings, extra, speaker)
    marker = partial / "inputs.sha1"
    if partial.exists() and not marker.is_file():
        raise UserError(f"{partial} exists and is not labavg's work in progress: move it away")
    if partial.is_dir() and marker.read_text(errors="replace") != stamp:
        shutil.rmtree(partial)  # the work of other recordings or settings: not to be resumed
    cache.mkdir(parents=True, exist_ok=True)
    marker.write_text(stamp)
    left = [r for r in todo if not (cache / f"{r.utt}.npz").is_file()]
    for rec in tqdm(left, desc="aligning", unit="utt", disable=not progress or not left):
        _prepare_one(rec, aligner, feature_rate, cache)
    failed = {}
    for rec in todo:
        with np.load(cache / f"{rec.utt}.npz") as done:
            if "failed" in done:
                failed[rec.utt] = str(done["failed"])
    kept = [r for r in todo if r.utt not in failed]
    if not kept:
        shutil.rmtree(partial)
        raise UserError(f"{audio_dir}: pocketsphinx aligned none of the {len(todo)} utterances "
                        f"with known words; the first: {next(iter(failed.values()))}")
    build = partial / "build"
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir()
    num_frames = _write_kaldi_dir(build, final, kept, cache, aligner, speaker)
    _write_lines(build / "left_out.txt",
                 [f"{u} unknown words: {' '.join(ws)}" for u, ws in sorted(unknown.items())]
                 + [f"{u} not aligned: {why}" for u, why in sorted(failed.items())])
    hours = num_frames / 100 / 3600
    meta = {"generator": "labavg.data.prepare", "format_version": FORMAT_VERSION,
            "source": str(audio_dir.resolve()), "transcripts": str(text.resolve()),
            "num_utts": len(kept), "num_frames": num_frames, "hours": round(hours, 6),
            "num_phones": len(PHONES), "num_pdfs": STATES_PER_PHONE * len(PHONES),
            "feat_dim": FEAT_DIM, "sample_rate": recordings[0].rate, "feature_rate": feature_rate,
            "pdf": "3 * phone_id + state, phone ids in phones.txt (CMUdict's 39 and SIL)",
            "labels": "pocketsphinx's forced alignment (US-English model, CMUdict), 10 ms frames",
            "features": "kaldi-native-fbank log-mel fbank: 40 bins, 25 ms window, 10 ms shift, "
                        "povey window, preemph 0.97, dither 0, snip_edges true",
            "left_out": {"unknown_words": len(unknown), "not_aligned": len(failed)}}
    (build / "corpus.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    if final.exists():
        shutil.rmtree(final)
    build.rename(final)
    shutil.rmtree(partial)
    return PreparedCorpus(final, len(kept), num_frames, hours, unknown, failed,
                          time.perf_counter() - began)
