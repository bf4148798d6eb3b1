"""Forced alignment of real recordings with PyPI's pocketsphinx (its US-English model and CMUdict).

`Aligner.align(samples, words)` returns the phone segments of one utterance, each with its three
emitting HMM states, at pocketsphinx's 10 ms frame rate: the frame grid of the fbank features
that labavg.data.prepare writes (25 ms windows every 10 ms from the first sample), so segment
frame t labels feature frame t. `frame_agreement` compares a segmentation with another aligner's
TextGrid frame by frame (docs/corpus.md, "Bring your own recordings").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from labavg.base.errors import DataError

# pocketsphinx's en-us model: CMUdict's 39 phones and silence. A filler the model may put
# between words (+NSN+, +SPN+) is silence to a frame classifier.
SILENCE = "SIL"
PHONES = (SILENCE, "AA", "AE", "AH", "AO", "AW", "AY", "B", "CH", "D", "DH", "EH", "ER", "EY",
          "F", "G", "HH", "IH", "IY", "JH", "K", "L", "M", "N", "NG", "OW", "OY", "P", "R", "S",
          "SH", "T", "TH", "UH", "UW", "V", "W", "Y", "Z", "ZH")
STATES_PER_PHONE = 3
MODEL_RATE = 16000
# A TextGrid's silence and noise labels (Montreal Forced Aligner: "", sil, sp, spn).
REFERENCE_SILENCES = {"", "sil", "sp", "spn", "<eps>"}


class AlignmentFailed(DataError):
    """pocketsphinx found no path through the utterance's words."""


@dataclass(frozen=True)
class PhoneSegment:
    phone: str  # one of PHONES
    start: int  # first 10 ms frame
    frames: int
    states: tuple[int, ...]  # frames in each emitting state, summing to `frames`


def phone_of(name: str) -> str:
    """A pocketsphinx or ARPAbet phone label as one of PHONES (stress stripped)."""
    bare = name.rstrip("012").upper()
    return bare if bare in PHONES else SILENCE


class Aligner:
    """pocketsphinx's decoder set up for alignment; `extra` adds words (word -> ARPAbet phones)."""

    def __init__(self, extra: dict[str, list[str]] | None = None) -> None:
        from pocketsphinx import Decoder

        self._decoder = Decoder(samprate=MODEL_RATE, bestpath=False, loglevel="FATAL")
        for word, phones in (extra or {}).items():
            self._decoder.add_word(word, " ".join(phone_of(p) for p in phones), False)

    def pronunciation(self, word: str) -> list[str] | None:
        """The dictionary's first pronunciation of `word` (lower case, as CMUdict), or None."""
        pron = self._decoder.lookup_word(word.lower())
        return None if pron is None else [phone_of(p) for p in pron.split()]

    def unknown(self, words: list[str]) -> list[str]:
        return sorted({w for w in words if self.pronunciation(w) is None})

    def align(self, samples: np.ndarray, words: list[str], where: str) -> list[PhoneSegment]:
        """Phone segments of 16 kHz int16 `samples` read as `words`; AlignmentFailed names `where`."""
        decoder = self._decoder
        audio = np.ascontiguousarray(samples, dtype=np.int16).tobytes()
        try:
            decoder.set_align_text(" ".join(w.lower() for w in words))
            # Two passes, as pocketsphinx's own aligner: words, then phones and states within them.
            for second in (False, True):
                if second:
                    decoder.set_alignment()
                decoder.start_utt()
                decoder.process_raw(audio, full_utt=True)
                decoder.end_utt()
            alignment = decoder.get_alignment()
        except RuntimeError as exc:
            raise AlignmentFailed(f"{where}: pocketsphinx could not align the transcript ({exc})") from None
        if alignment is None:
            raise AlignmentFailed(f"{where}: pocketsphinx found no alignment of the transcript")
        segments = []
        for word in alignment:
            for phone in word:
                states = [s.duration for s in phone]
                states += [0] * (STATES_PER_PHONE - len(states))
                segments.append(PhoneSegment(phone_of(phone.name), phone.start, phone.duration,
                                             tuple(states[:STATES_PER_PHONE])))
        if not segments:
            raise AlignmentFailed(f"{where}: pocketsphinx aligned no phone")
        return segments


def frame_pdfs(segments: list[PhoneSegment], num_frames: int) -> np.ndarray:
    """Per-frame pdf = 3 x phone index + state (the built-in corpus's numbering), `num_frames`
    long: frames past the last segment (the features' last window) take its last pdf."""
    pdfs = np.zeros(num_frames, dtype=np.int32)
    end = 0
    for seg in segments:
        t = seg.start
        for state, length in enumerate(seg.states):
            pdfs[t:t + length] = STATES_PER_PHONE * PHONES.index(seg.phone) + state
            t += length
        end = max(end, t)
    if 0 < end < num_frames:
        pdfs[end:] = pdfs[end - 1]
    return pdfs


def frame_phones(segments: list[PhoneSegment], num_frames: int) -> list[str]:
    phones = [SILENCE] * num_frames
    for seg in segments:
        for t in range(seg.start, min(seg.start + seg.frames, num_frames)):
            phones[t] = seg.phone
    return phones


def reference_phones(path: str | Path, num_frames: int, tier: str = "phones") -> list[str]:
    """Per-10 ms-frame phones of a TextGrid tier (the label under each frame's centre)."""
    from labavg.data.textgrid import FRAME_SHIFT, read_phone_intervals

    intervals, _ = read_phone_intervals(path, tier)
    phones = [SILENCE] * num_frames
    for start, end, label in intervals:
        phone = SILENCE if label.lower() in REFERENCE_SILENCES else phone_of(label)
        first = max(0, int(np.ceil(start / FRAME_SHIFT - 0.5)))
        for t in range(first, min(num_frames, int(np.ceil(end / FRAME_SHIFT - 0.5)))):
            phones[t] = phone
    return phones


@dataclass(frozen=True)
class Agreement:
    frames: int
    agreeing: float  # share of all frames with the same phone (stress stripped, silence as one)
    speech_frames: int
    speech_agreeing: float  # the same over the frames the reference calls speech


def frame_agreement(ours: list[str], reference: list[str]) -> Agreement:
    if len(ours) != len(reference) or not ours:
        raise ValueError(f"{len(ours)} frames against {len(reference)}")
    same = np.array([a == b for a, b in zip(ours, reference)])
    speech = np.array([r != SILENCE for r in reference])
    return Agreement(len(ours), float(same.mean()), int(speech.sum()),
                     float(same[speech].mean()) if speech.any() else float("nan"))


def ctm_lines(utt: str, segments: list[PhoneSegment]) -> list[str]:
    """Kaldi's phone CTM: utterance, channel 1, start and duration in seconds, phone."""
    return [f"{utt} 1 {s.start / 100:.2f} {s.frames / 100:.2f} {s.phone}" for s in segments]
