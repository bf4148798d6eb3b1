"""The built-in synthetic speech corpus: source-filter speech made on the spot, as a Kaldi data dir.

Speech is made by a formant (source-filter) synthesiser in the short-time Fourier domain: a
jittered glottal pulse train and white noise are cut into overlapping windowed frames, each frame's
spectrum is multiplied by a spectral envelope built from the current formant frequencies and
bandwidths (Klatt-style pole-pair magnitudes), frication bands, nasal antiformants, glottal tilt and
a speaker's channel colour, and the frames are overlap-added back (the time-varying filter of
Allen & Rabiner's weighted overlap-add). Everything is vectorised per utterance: no Python loop runs
per sample or per frame.

Each phone has three HMM-like states (begin / middle / end), so pdf = 3 * phone + state, as a
Kaldi monophone system with one pdf per state (``num_pdfs = 3 * num_phones``). For stops and
affricates the states are closure / burst / release, for diphthongs onset / glide / offset target.
Formant tracks interpolate linearly between neighbouring targets (coarticulation), short vowels
undershoot towards schwa, and each speaker has a vocal-tract length factor, pitch range, bandwidths,
breathiness, channel colour and a personal "accent" (per-phone formant offsets).

Features are Kaldi ``compute-fbank-feats`` log-mel filterbanks (via kaldi-native-fbank) and frame
labels are taken at each feature frame's centre sample. See docs/corpus.md for the files written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import kaldi_native_fbank as knf
import kaldiio
import numpy as np

from labavg.base.errors import UserError

STATES_PER_PHONE = 3
FEAT_DIM = 40
FORMAT_VERSION = 1

# Per-state acoustic description columns (see _state_table).
_F1, _F2, _F3, _VOICE, _ASP, _FRIC, _FRIC_FC, _FRIC_OCT, _NASAL, _ZERO_F = range(10)
_NUM_COLS = 10
_FORMANT_COLS = slice(_F1, _F3 + 1)
_SILENT_DB = -80.0
_SCHWA = (500.0, 1500.0, 2500.0)
_LN_DB = np.log(10.0) / 20.0  # dB -> natural-log amplitude

# Synthesis STFT: 16 ms Hann analysis frames, 8 ms hop, zero-padded to 32 ms so that the
# (zero-phase) envelope's impulse response fits without circular wrap-around.
# The dev and test sets are noisier than training (15-35 dB): at the training SNRs a 1-worker
# baseline decodes at about 4.5 % WER, too few errors for differences between systems of 0.3-1
# points to show. 13-17 dB brings it to 10-20 % (docs/corpus.md, "Held-out difficulty"); a narrow
# range keeps the utterances about equally hard, so the bootstrap intervals stay narrow.
HELDOUT_SNR_DB = (13.0, 17.0)

_SYN_WIN_S = 0.016
_SYN_HOP_S = 0.008


@dataclasses.dataclass(frozen=True)
class CorpusInfo:
    """What `synthesize` wrote: sizes, and the path of the finished Kaldi data directory."""

    out_dir: Path
    num_utts: int
    num_speakers: int
    num_frames: int
    num_phones: int
    num_pdfs: int
    feat_dim: int
    hours: float
    seed: int
    seconds_taken: float


@dataclasses.dataclass(frozen=True)
class Phone:
    """One phone class: its name, broad kind, and a [3, _NUM_COLS] per-state description."""

    name: str
    kind: str
    states: tuple[tuple[float, ...], ...]
    state_ms: tuple[float, float, float]


def _row(formants, voice=_SILENT_DB, asp=_SILENT_DB, fric=_SILENT_DB, fc=4000.0, octaves=1.0,
         nasal=0.0, zero_f=1000.0) -> tuple[float, ...]:
    return (*map(float, formants), voice, asp, fric, fc, octaves, nasal, zero_f)


def _vowel(name, begin, end=None, ms=100.0) -> Phone:
    end = begin if end is None else end
    mid = tuple((b + e) / 2 for b, e in zip(begin, end))
    states = (_row(begin, voice=-3.0), _row(mid, voice=0.0), _row(end, voice=-4.0))
    return Phone(name, "vowel", states, (0.3 * ms, 0.4 * ms, 0.3 * ms))


def _approximant(name, formants, voice, ms) -> Phone:
    row = _row(formants, voice=voice)
    return Phone(name, "approximant", (row, row, row), (ms / 3, ms / 3, ms / 3))


def _nasal(name, formants, zero_f, ms) -> Phone:
    row = _row(formants, voice=-9.0, nasal=1.0, zero_f=zero_f)
    return Phone(name, "nasal", (row, row, row), (0.3 * ms, 0.4 * ms, 0.3 * ms))


def _fricative(name, locus, fc, octaves, level, voiced, ms) -> Phone:
    row = _row(locus, voice=-10.0 if voiced else _SILENT_DB, fric=level - (5.0 if voiced else 0.0),
               fc=fc, octaves=octaves)
    return Phone(name, "fricative", (row, row, row), (0.3 * ms, 0.4 * ms, 0.3 * ms))


def _stop(name, locus, fc, octaves, level, voiced) -> Phone:
    closure_locus = (200.0, *locus[1:])
    closure = _row(closure_locus, voice=-30.0 if voiced else _SILENT_DB)
    burst = _row(locus, voice=-24.0 if voiced else _SILENT_DB,
                 fric=level - (6.0 if voiced else 0.0), fc=fc, octaves=octaves)
    if voiced:
        release = _row(locus, voice=-6.0, asp=-24.0)
        ms = (45.0, 12.0, 20.0)
    else:
        release = _row(locus, asp=-8.0)
        ms = (55.0, 14.0, 45.0)
    return Phone(name, "stop", (closure, burst, release), ms)


def _affricate(name, voiced) -> Phone:
    locus = (300.0, 1900.0, 2600.0)
    voice = -24.0 if voiced else _SILENT_DB
    closure = _row((200.0, 1900.0, 2600.0), voice=-30.0 if voiced else _SILENT_DB)
    onset = _row(locus, voice=voice, fric=(-20.0 if voiced else -16.0), fc=3000.0, octaves=0.9)
    frication = _row(locus, voice=voice + 10.0 if voiced else voice, fric=(-26.0 if voiced else -22.0),
                     fc=3200.0, octaves=0.9)
    return Phone(name, "affricate", (closure, onset, frication), (45.0, 30.0, 45.0))


def _phone_table() -> tuple[Phone, ...]:
    """The 40 phone classes (CMU/ARPAbet set + silence), male reference formants in Hz.

    Vowel targets follow Peterson & Barney (1952) / Hillenbrand et al. (1995) male means; stop and
    fricative formant loci follow the classic locus-equation values (labial F2 ~ 800-1000 Hz,
    alveolar ~ 1700-1800, velar ~ 2000-2300 with F2/F3 pinch).
    """
    labial, dental, alveolar = (300.0, 900.0, 2200.0), (300.0, 1400.0, 2600.0), (300.0, 1750.0, 2650.0)
    postalveolar, velar = (300.0, 1900.0, 2500.0), (300.0, 2100.0, 2400.0)
    sil_row = _row(_SCHWA)
    return (
        Phone("sil", "silence", (sil_row, sil_row, sil_row), (60.0, 60.0, 60.0)),
        _vowel("aa", (730, 1090, 2440), ms=130),
        _vowel("ae", (660, 1720, 2410), ms=130),
        _vowel("ah", (580, 1220, 2390), ms=80),
        _vowel("ao", (570, 840, 2410), ms=130),
        _vowel("aw", (720, 1250, 2450), (440, 900, 2300), ms=170),
        _vowel("ay", (720, 1250, 2500), (400, 2050, 2650), ms=170),
        _vowel("eh", (530, 1840, 2480), ms=90),
        _vowel("er", (490, 1350, 1690), ms=110),
        _vowel("ey", (480, 1900, 2500), (330, 2250, 2900), ms=150),
        _vowel("ih", (390, 1990, 2550), ms=80),
        _vowel("iy", (270, 2290, 3010), ms=110),
        _vowel("ow", (520, 950, 2400), (370, 780, 2300), ms=150),
        _vowel("oy", (560, 850, 2400), (400, 1950, 2600), ms=180),
        _vowel("uh", (440, 1020, 2240), ms=80),
        _vowel("uw", (300, 870, 2240), ms=110),
        _stop("b", labial, 900.0, 1.8, -24.0, voiced=True),
        _affricate("ch", voiced=False),
        _stop("d", alveolar, 4200.0, 1.2, -22.0, voiced=True),
        _fricative("dh", dental, 5500.0, 2.2, -38.0, voiced=True, ms=55),
        _fricative("f", labial, 6000.0, 2.0, -34.0, voiced=False, ms=100),
        _stop("g", velar, 2200.0, 0.6, -20.0, voiced=True),
        Phone("hh", "aspirate", (_row(_SCHWA, asp=-14.0),) * 3, (25.0, 25.0, 25.0)),
        _affricate("jh", voiced=True),
        _stop("k", velar, 2200.0, 0.6, -16.0, voiced=False),
        _approximant("l", (360.0, 1050.0, 2800.0), voice=-6.0, ms=65),
        _nasal("m", (260.0, 1100.0, 2200.0), zero_f=900.0, ms=75),
        _nasal("n", (260.0, 1550.0, 2550.0), zero_f=1700.0, ms=70),
        _nasal("ng", (260.0, 2100.0, 2700.0), zero_f=3000.0, ms=80),
        _stop("p", labial, 900.0, 1.8, -20.0, voiced=False),
        _approximant("r", (350.0, 1100.0, 1500.0), voice=-5.0, ms=65),
        _fricative("s", alveolar, 5500.0, 0.7, -23.0, voiced=False, ms=110),
        _fricative("sh", postalveolar, 3100.0, 0.8, -22.0, voiced=False, ms=115),
        _stop("t", alveolar, 4200.0, 1.2, -18.0, voiced=False),
        _fricative("th", dental, 5500.0, 2.2, -36.0, voiced=False, ms=95),
        _fricative("v", labial, 6000.0, 2.0, -36.0, voiced=True, ms=60),
        _approximant("w", (300.0, 700.0, 2200.0), voice=-5.0, ms=60),
        _approximant("y", (260.0, 2100.0, 3000.0), voice=-5.0, ms=55),
        _fricative("z", alveolar, 5500.0, 0.7, -23.0, voiced=True, ms=85),
        _fricative("zh", postalveolar, 3100.0, 0.8, -22.0, voiced=True, ms=80),
    )


def phone_names() -> list[str]:
    """The phone classes in phone-id order (0 is silence); pdf = 3 * phone_id + state."""
    return [p.name for p in _phone_table()]


# ----------------------------------------------------------------------------- lexicon


def _syllable_parts(table: tuple[Phone, ...]) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """Onsets, nuclei and codas of a small English-like phonotactic grammar, as phone ids."""
    idx = {p.name: i for i, p in enumerate(table)}
    vowels = [i for i, p in enumerate(table) if p.kind == "vowel"]
    onset_names = ["b", "ch", "d", "dh", "f", "g", "hh", "jh", "k", "l", "m", "n", "p", "r", "s",
                   "sh", "t", "th", "v", "w", "y", "z", "zh"]
    clusters = [("s", "t"), ("s", "p"), ("s", "k"), ("p", "r"), ("t", "r"), ("k", "r"), ("b", "r"),
                ("d", "r"), ("g", "r"), ("f", "r"), ("p", "l"), ("k", "l"), ("b", "l"), ("f", "l"),
                ("s", "l"), ("th", "r"), ("sh", "r")]
    onsets = [[]] + [[idx[n]] for n in onset_names] + [[idx[a], idx[b]] for a, b in clusters]
    coda_names = ["b", "ch", "d", "dh", "f", "g", "jh", "k", "l", "m", "n", "ng", "p", "r", "s",
                  "sh", "t", "th", "v", "z", "zh"]
    coda_clusters = [("n", "t"), ("n", "d"), ("s", "t"), ("m", "p"), ("ng", "k"), ("l", "d"),
                     ("r", "t"), ("k", "s"), ("n", "z"), ("l", "z")]
    codas = [[]] + [[idx[n]] for n in coda_names] + [[idx[a], idx[b]] for a, b in coda_clusters]
    return onsets, vowels, codas


_SPELLING = {
    "aa": "o", "ae": "a", "ah": "u", "ao": "au", "aw": "ow", "ay": "ai", "eh": "e", "er": "ur",
    "ey": "ay", "ih": "i", "iy": "ee", "ow": "oa", "oy": "oy", "uh": "oo", "uw": "ue", "b": "b",
    "ch": "ch", "d": "d", "dh": "dh", "f": "f", "g": "g", "hh": "h", "jh": "j", "k": "k", "l": "l",
    "m": "m", "n": "n", "ng": "ng", "p": "p", "r": "r", "s": "s", "sh": "sh", "t": "t", "th": "th",
    "v": "v", "w": "w", "y": "y", "z": "z", "zh": "zh",
}


def _make_lexicon(rng: np.random.Generator, table: tuple[Phone, ...], num_words: int
                  ) -> list[tuple[str, list[int]]]:
    """Pseudo-words of 1-3 syllables from the phonotactic grammar, distinct in spelling.

    Every non-silence phone occurs in some word (cycling through the inventory as forced onsets,
    nuclei or codas), so that every pdf is reachable in a corpus of any size.
    """
    onsets, vowels, codas = _syllable_parts(table)
    cons_with_slot = [(o, "onset") for o in onsets if len(o) == 1]
    cons_with_slot += [(c, "coda") for c in codas if len(c) == 1 and c not in onsets]
    words: dict[str, list[int]] = {}
    attempt = 0
    while len(words) < num_words:
        phones: list[int] = []
        for syl in range(int(rng.choice([1, 2, 3], p=[0.35, 0.45, 0.2]))):
            onset = onsets[rng.integers(len(onsets))]
            nucleus = vowels[rng.integers(len(vowels))]
            coda = codas[rng.integers(len(codas))] if rng.random() < 0.55 else []
            if syl == 0:  # force rare phones in early words so that every phone is used
                forced, slot = cons_with_slot[attempt % len(cons_with_slot)]
                onset, coda = (forced, coda) if slot == "onset" else (onset, forced)
                nucleus = vowels[attempt % len(vowels)]
            phones += [*onset, nucleus, *coda]
        attempt += 1
        spelling = "".join(_SPELLING[table[p].name] for p in phones)
        words.setdefault(spelling, phones)
    return sorted(words.items())


# ----------------------------------------------------------------------------- speakers


@dataclasses.dataclass(frozen=True)
class _Speaker:
    spk: str
    gender: str
    alpha: float          # vocal-tract length factor: all resonance frequencies scale by it
    f0: float             # median pitch, Hz
    bw_scale: float
    glottal_corner: float  # Hz where the -6 dB/oct source roll-off starts
    breath_db: float
    rate: float           # duration multiplier
    jitter: float
    shimmer: float
    accent: np.ndarray    # [num_phones, 3] multiplicative formant offsets
    eq_db: np.ndarray     # [3] gains of a smooth channel colour at 500, 1500, 4000 Hz


def _make_speaker(rng: np.random.Generator, spk: str, num_phones: int, accent_sigma: float
                  ) -> _Speaker:
    female = rng.random() < 0.5
    return _Speaker(
        spk=spk,
        gender="f" if female else "m",
        alpha=float((1.17 if female else 1.0) * rng.lognormal(0.0, 0.05)),
        f0=float((205.0 if female else 115.0) * rng.lognormal(0.0, 0.15)),
        bw_scale=float(rng.uniform(0.8, 1.5)),
        glottal_corner=float(rng.uniform(120.0, 450.0)),
        breath_db=float(rng.uniform(-30.0, -12.0)),
        rate=float(rng.lognormal(0.0, 0.12)),
        jitter=float(rng.uniform(0.005, 0.025)),
        shimmer=float(rng.uniform(0.05, 0.2)),
        accent=rng.lognormal(0.0, accent_sigma, size=(num_phones, 3)),
        eq_db=rng.normal(0.0, 4.0, size=3),
    )


# ----------------------------------------------------------------------------- utterance plans


@dataclasses.dataclass(frozen=True)
class _Plan:
    """One utterance: its words, and per-state segments (times in s) with their acoustics."""

    utt: str
    speaker: _Speaker
    words: list[str]
    pdfs: np.ndarray      # [J] pdf id of each state segment
    starts: np.ndarray    # [J]
    ends: np.ndarray      # [J]
    rows: np.ndarray      # [J, _NUM_COLS]
    seed: int


def _plan_utterance(rng: np.random.Generator, utt: str, speaker: _Speaker,
                    table: tuple[Phone, ...], lexicon: list[tuple[str, list[int]]],
                    target_s: float) -> _Plan:
    """Random words, pauses and state durations up to about `target_s` seconds."""
    utt_rate = speaker.rate * rng.lognormal(0.0, 0.08)
    phones: list[int] = [0]
    pause: list[float] = [rng.uniform(0.15, 0.4)]
    words: list[str] = []
    spent = pause[0] + 0.25
    while spent < target_s or not words:
        word, word_phones = lexicon[rng.integers(len(lexicon))]
        words.append(word)
        phones += word_phones
        pause += [0.0] * len(word_phones)
        spent += sum(sum(table[p].state_ms) for p in word_phones) * 1e-3 * utt_rate
        if rng.random() < 0.2:
            phones.append(0)
            pause.append(rng.uniform(0.06, 0.3))
            spent += pause[-1]
    if phones[-1] != 0:
        phones.append(0)
        pause.append(0.0)
    pause[-1] = rng.uniform(0.15, 0.4)

    num = len(phones)
    state_ms = np.array([table[p].state_ms for p in phones]) * utt_rate
    state_ms = state_ms * rng.lognormal(0.0, 0.25, size=(num, 1)) * rng.lognormal(0.0, 0.15, size=(num, 3))
    sil = np.array(phones) == 0
    state_ms[sil] = np.array(pause)[sil, None] * 1e3 * rng.dirichlet([4.0, 4.0, 4.0], size=int(sil.sum()))
    dur = np.maximum(state_ms * 1e-3, 0.010).ravel()

    rows = np.array([table[p].states for p in phones], dtype=np.float64)  # [num, 3, cols]
    rows[:, :, _FORMANT_COLS] *= speaker.accent[phones][:, None, :]
    rows[:, :, _FORMANT_COLS] *= rng.lognormal(0.0, 0.04, size=(num, 1, 3))
    # Short vowels do not reach their targets: pull them towards schwa (Lindblom's undershoot).
    vowel = np.array([table[p].kind == "vowel" for p in phones])
    phone_dur = dur.reshape(num, 3).sum(axis=1)
    undershoot = np.where(vowel, np.clip((0.11 - phone_dur) / 0.11, 0.0, 0.5), 0.0)
    rows[:, :, _FORMANT_COLS] += undershoot[:, None, None] * (np.array(_SCHWA) - rows[:, :, _FORMANT_COLS])
    # /h/ is aspiration through the next phone's vocal tract.
    for i in np.flatnonzero([table[p].name == "hh" for p in phones]):
        rows[i, :, _FORMANT_COLS] = rows[i + 1, 0, _FORMANT_COLS]
    # Silence keeps the neighbouring vocal-tract shape, so transitions into pauses are smooth.
    for i in np.flatnonzero(sil):
        nbr = i + 1 if i == 0 else i - 1
        rows[i, :, _FORMANT_COLS] = rows[nbr, 0 if nbr > i else 2, _FORMANT_COLS]

    ends = np.cumsum(dur)
    pdfs = (STATES_PER_PHONE * np.array(phones)[:, None] + np.arange(STATES_PER_PHONE)).ravel()
    return _Plan(utt, speaker, words, pdfs, ends - dur, ends, rows.reshape(num * 3, _NUM_COLS),
                 int(rng.integers(2**63)))


# ----------------------------------------------------------------------------- synthesis


def _tracks(times: np.ndarray, starts: np.ndarray, ends: np.ndarray, values: np.ndarray,
            tau: float | np.ndarray) -> np.ndarray:
    """Piecewise-linear tracks: each segment holds its value, with linear ramps of about 2*tau
    centred on the boundaries (the coarticulation of a target-interpolation synthesiser)."""
    hold = np.minimum(tau, 0.45 * (ends - starts))
    knots_t = np.stack([starts + hold, ends - hold], axis=1).ravel()
    knots_v = np.repeat(values, 2, axis=0)
    return np.stack([np.interp(times, knots_t, knots_v[:, c]) for c in range(values.shape[1])], axis=1)


def _log_resonance(f: np.ndarray, freq: np.ndarray, bw: np.ndarray) -> np.ndarray:
    """Log magnitude of a pole pair at `freq` with bandwidth `bw`, unity at DC (Klatt 1980)."""
    half = (bw / 2.0) ** 2
    return np.log(freq**2 + half) - 0.5 * (np.log((freq - f) ** 2 + half) + np.log((freq + f) ** 2 + half))


def _stft(x: np.ndarray, win: np.ndarray, hop: int, nfft: int) -> np.ndarray:
    """Windowed frames of `x` (padded by one window both sides), centred in `nfft` zeros, FFT'd."""
    n = len(win)
    padded = np.pad(x, (n, n))
    frames = np.lib.stride_tricks.sliding_window_view(padded, n)[::hop] * win
    buf = np.zeros((frames.shape[0], nfft))
    lead = (nfft - n) // 2
    buf[:, lead:lead + n] = frames
    return np.fft.rfft(buf, axis=1)


def _overlap_add(spec: np.ndarray, win: np.ndarray, hop: int, length: int) -> np.ndarray:
    """Inverse of `_stft` after filtering: overlap-add of the (longer) filtered frames."""
    n, nfft = len(win), 2 * (spec.shape[1] - 1)
    frames = np.fft.irfft(spec, n=nfft, axis=1)
    groups = nfft // hop  # frames r, r + groups, ... tile the output without overlapping
    num = frames.shape[0]
    out = np.zeros(num * hop + nfft * 2)
    for r in range(min(groups, num)):
        block = frames[r::groups].ravel()
        out[r * hop:r * hop + len(block)] += block
    lead = (nfft - n) // 2
    return out[lead + n:lead + n + length] / (win.sum() / hop)


def _pulse_train(rng: np.random.Generator, f0: np.ndarray, sr: int, speaker: _Speaker) -> np.ndarray:
    """Glottal excitation: unit-power impulses at the pitch period with jitter and shimmer."""
    phase = np.cumsum(f0) / sr
    idx = np.flatnonzero(np.diff(np.floor(phase)) > 0) + 1
    period = sr / f0[idx]
    idx = np.clip(np.round(idx + rng.normal(0.0, speaker.jitter, len(idx)) * period), 0, len(f0) - 1)
    amp = np.sqrt(period) * rng.lognormal(0.0, speaker.shimmer, len(idx))
    return np.bincount(idx.astype(np.int64), weights=amp, minlength=len(f0))


def _pitch_contour(rng: np.random.Generator, t: np.ndarray, total: float, speaker: _Speaker) -> np.ndarray:
    """Declining F0 with a few pitch accents (log-domain Gaussian bumps)."""
    log_f0 = np.log(speaker.f0) + rng.normal(0.0, 0.08) - rng.uniform(0.1, 0.35) * (t / total - 0.5)
    for _ in range(1 + int(total / 1.2)):
        centre, width = rng.uniform(0.0, total), rng.uniform(0.08, 0.2)
        log_f0 = log_f0 + rng.uniform(0.05, 0.25) * np.exp(-0.5 * ((t - centre) / width) ** 2)
    return np.exp(log_f0)


def _synthesize_waveform(plan: _Plan, sr: int, snr_db: tuple[float, float],
                         coarticulation_s: tuple[float, float]) -> np.ndarray:
    """The utterance's waveform in 16-bit sample units (float32, rounded), with background noise."""
    rng = np.random.default_rng(plan.seed)
    spk = plan.speaker
    hop, win_len = int(round(_SYN_HOP_S * sr)), int(round(_SYN_WIN_S * sr))
    nfft = 2 * win_len
    win = np.hanning(win_len + 1)[:-1]  # periodic Hann: constant overlap-add at hop = len/4
    length = int(round(plan.ends[-1] * sr))
    num_frames = (length + win_len) // hop + 1
    t = np.arange(num_frames) * hop / sr - win_len / (2 * sr)  # frame centres, s

    rows = plan.rows
    tau_formant = rng.uniform(*coarticulation_s)
    formants = _tracks(t, plan.starts, plan.ends, rows[:, _FORMANT_COLS], tau_formant)
    gains = _tracks(t, plan.starts, plan.ends, rows[:, _VOICE:], 0.006)
    voice_db, asp_db, fric_db, fric_fc, fric_oct, nasal, zero_f = (gains[:, i:i + 1] for i in range(7))

    f = np.fft.rfftfreq(nfft, 1.0 / sr)[None, :]
    f_safe = np.maximum(f, 20.0)
    alpha = spk.alpha
    nasal_damp = 1.0 + 2.0 * nasal
    tract = np.zeros((num_frames, f.shape[1]))
    base_bw = (70.0, 100.0, 140.0, 250.0, 300.0)
    for k in range(3):
        bw = base_bw[k] * spk.bw_scale * (nasal_damp if k else 1.0 + 0.5 * nasal)
        tract += _log_resonance(f, alpha * formants[:, k:k + 1], bw)
    for k, fixed in ((3, 3400.0), (4, 4400.0)):
        tract += _log_resonance(f, np.full((1, 1), alpha * fixed), base_bw[k] * spk.bw_scale)
    tract -= nasal * (18.0 * _LN_DB) * np.exp(-0.5 * ((f - alpha * zero_f) / 200.0) ** 2)
    eq_centres = np.array([500.0, 1500.0, 4000.0])[:, None]
    tract += (spk.eq_db[:, None] * _LN_DB * np.exp(-0.5 * (np.log2(f_safe / eq_centres) / 0.8) ** 2)).sum(0)

    tilt = -0.5 * np.log1p((f / spk.glottal_corner) ** 2)
    voiced_env = np.exp(tract + tilt + voice_db * _LN_DB)
    asp_amp = np.exp(asp_db * _LN_DB) + np.exp((voice_db + spk.breath_db) * _LN_DB)
    noise_env = asp_amp * np.exp(tract - 20.0 * _LN_DB)
    fric_shape = -0.5 * (np.log2(f_safe / (alpha * fric_fc)) / fric_oct) ** 2
    noise_env += np.exp(fric_shape + fric_db * _LN_DB)

    sample_t = np.arange(length) / sr
    f0 = np.interp(sample_t, t, _pitch_contour(rng, t, plan.ends[-1], spk))
    voiced = voiced_env * _stft(_pulse_train(rng, f0, sr, spk), win, hop, nfft)
    # Noise is drawn directly as i.i.d. complex Gaussian STFT bins with the variance that windowed
    # unit white noise would have; background noise (a random spectral tilt, at a random SNR over
    # the utterance) shares the draw, since the sum of independent Gaussians is Gaussian.
    noise_var = float(np.sum(win**2))
    background_env = (np.maximum(f, 50.0) / 1000.0) ** (-rng.uniform(0.0, 1.5) / 2)
    speech_power = np.mean(np.abs(voiced) ** 2) + noise_var * np.mean(noise_env**2)
    snr = rng.uniform(*snr_db)
    background_env = background_env * np.sqrt(speech_power / (noise_var * np.mean(background_env**2))
                                               / 10 ** (snr / 10))
    total_noise_env = np.sqrt(noise_env**2 + background_env**2) * np.sqrt(noise_var / 2)
    bins = rng.standard_normal((2, *voiced.shape))
    spec = voiced + total_noise_env * (bins[0] + 1j * bins[1])
    wave = _overlap_add(spec, win, hop, length)
    level = 10 ** (rng.uniform(-6.0, 6.0) / 20) * 2000.0 / np.sqrt(np.mean(wave**2))
    return np.clip(np.round(wave * level), -32768, 32767).astype(np.float32)


def _fbank_options(sr: int) -> knf.FbankOptions:
    """Kaldi compute-fbank-feats defaults with 40 bins, no dither (determinism), snip_edges."""
    opts = knf.FbankOptions()
    opts.frame_opts.samp_freq = float(sr)
    opts.frame_opts.frame_length_ms = 25.0
    opts.frame_opts.frame_shift_ms = 10.0
    opts.frame_opts.dither = 0.0
    opts.frame_opts.snip_edges = True
    opts.mel_opts.num_bins = FEAT_DIM
    return opts


def compute_fbank(wave: np.ndarray, sr: int) -> np.ndarray:
    """40-dim Kaldi log-mel filterbank features [T, 40] (float32) of a waveform in int16 units."""
    fbank = knf.OnlineFbank(_fbank_options(sr))
    fbank.accept_waveform(float(sr), np.asarray(wave, dtype=np.float32))
    fbank.input_finished()
    num = fbank.num_frames_ready
    if num == 0:
        return np.zeros((0, FEAT_DIM), dtype=np.float32)
    return np.stack([fbank.get_frame(i) for i in range(num)]).astype(np.float32)


def frame_labels(plan_ends: np.ndarray, plan_pdfs: np.ndarray, num_frames: int, sr: int) -> np.ndarray:
    """The pdf of the state segment under each feature frame's centre sample (snip_edges frames)."""
    shift, length = int(sr * 0.010), int(sr * 0.025)
    centres = (np.arange(num_frames) * shift + length / 2.0) / sr
    seg = np.minimum(np.searchsorted(plan_ends, centres, side="right"), len(plan_ends) - 1)
    return plan_pdfs[seg].astype(np.int32)


# ----------------------------------------------------------------------------- writing


def _check_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"corpus output {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise UserError(f"corpus output directory {out_dir} exists and is not empty "
                        "(pass overwrite=True / --overwrite to replace it)")


def _write_lines(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def _relocate_scp(scp: Path, built_ark: Path, final_ark: Path) -> None:
    """Point scp entries at the ark's final absolute path (the build dir is renamed afterwards)."""
    lines = []
    for line in scp.read_text(encoding="utf-8").splitlines():
        key, value = line.split(" ", 1)
        path, offset = value.rsplit(":", 1)
        if Path(path) != built_ark:
            raise RuntimeError(f"unexpected ark path {path!r} in {scp}")
        lines.append(f"{key} {final_ark}:{offset}")
    _write_lines(scp, lines)


def _write_corpus(build: Path, final: Path, plans: list[_Plan], table: tuple[Phone, ...],
                  lexicon: list[tuple[str, list[int]]], sr: int, params: dict) -> tuple[int, float]:
    """Synthesise every utterance (sorted by id) and write the whole Kaldi dir into `build`."""
    cmvn: dict[str, np.ndarray] = {}
    num_frames: dict[str, int] = {}
    total_frames = 0
    with kaldiio.WriteHelper(f"ark,scp:{build / 'feats.ark'},{build / 'feats.scp'}") as feats_out, \
            kaldiio.WriteHelper(f"ark:{build / 'pdf_ali.ark'}") as ali_out:
        for plan in plans:
            wave = _synthesize_waveform(plan, sr, params["snr_db"], params["coarticulation_s"])
            feats = compute_fbank(wave, sr)
            labels = frame_labels(plan.ends, plan.pdfs, len(feats), sr)
            feats_out(plan.utt, feats)
            ali_out(plan.utt, labels)
            stats = cmvn.setdefault(plan.speaker.spk, np.zeros((2, FEAT_DIM + 1)))
            f64 = feats.astype(np.float64)
            stats[0, :FEAT_DIM] += f64.sum(axis=0)
            stats[0, FEAT_DIM] += len(feats)
            stats[1, :FEAT_DIM] += (f64**2).sum(axis=0)
            num_frames[plan.utt] = len(feats)
            total_frames += len(feats)
    kaldiio.save_ark(str(build / "cmvn.ark"), dict(sorted(cmvn.items())), scp=str(build / "cmvn.scp"))
    for name in ("feats", "cmvn"):
        _relocate_scp(build / f"{name}.scp", build / f"{name}.ark", final / f"{name}.ark")

    speakers = sorted({p.speaker.spk: p.speaker for p in plans}.values(), key=lambda s: s.spk)
    _write_lines(build / "utt2spk", [f"{p.utt} {p.speaker.spk}" for p in plans])
    _write_lines(build / "spk2utt", [s.spk + " " + " ".join(p.utt for p in plans if p.speaker is s)
                                     for s in speakers])
    _write_lines(build / "spk2gender", [f"{s.spk} {s.gender}" for s in speakers])
    _write_lines(build / "text", [f"{p.utt} {' '.join(p.words)}" for p in plans])
    _write_lines(build / "utt2num_frames", [f"{u} {n}" for u, n in num_frames.items()])
    _write_lines(build / "utt2dur", [f"{p.utt} {p.ends[-1]:.4f}" for p in plans])
    _write_lines(build / "num_pdfs", [str(STATES_PER_PHONE * len(table))])
    _write_lines(build / "pdfs.txt", [f"{STATES_PER_PHONE * i + s} {p.name} {s}"
                                      for i, p in enumerate(table) for s in range(STATES_PER_PHONE)])
    _write_lines(build / "phones.txt", [f"{p.name} {i}" for i, p in enumerate(table)])
    _write_lines(build / "lexicon.txt", [f"{w} {' '.join(table[i].name for i in ph)}" for w, ph in lexicon])
    hours = float(sum(p.ends[-1] for p in plans) / 3600.0)
    meta = {
        "generator": "labavg.data.synth", "format_version": FORMAT_VERSION, **params,
        "hours": round(hours, 6), "num_utts": len(plans), "num_frames": total_frames,
        "num_speakers": len(speakers), "num_phones": len(table),
        "num_pdfs": STATES_PER_PHONE * len(table), "feat_dim": FEAT_DIM,
        "pdf": "3 * phone_id + state (state 0/1/2 = begin/middle/end)",
        "labels": "pdf of the state under each feature frame's centre sample",
        "features": "kaldi-native-fbank log-mel fbank: 40 bins, 25 ms window, 10 ms shift, "
                    "povey window, preemph 0.97, dither 0, snip_edges true",
        "scp_paths": "absolute paths of the directory as written; move it and rewrite the scp files",
    }
    (build / "corpus.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return total_frames, hours


def _plan_set(rng: np.random.Generator, speakers: list[_Speaker], table: tuple[Phone, ...],
              lexicon: list[tuple[str, list[int]]], hours: float) -> list[_Plan]:
    """Utterances of 1.5-5 s dealt to `speakers` in turn until `hours`, sorted by id."""
    plans: list[_Plan] = []
    spent, target = 0.0, hours * 3600.0
    counts = [0] * len(speakers)
    while spent < target:
        spk_index = len(plans) % len(speakers)
        utt = f"{speakers[spk_index].spk}-u{counts[spk_index]:05d}"
        counts[spk_index] += 1
        plans.append(_plan_utterance(rng, utt, speakers[spk_index], table, lexicon,
                                     rng.uniform(1.5, 5.0)))
        spent += float(plans[-1].ends[-1])
    plans.sort(key=lambda p: p.utt)
    return plans


def synthesize(out_dir: str | os.PathLike, *, hours: float = 1.0, seed: int = 0,
               num_speakers: int | None = None, sample_rate: int = 16000,
               snr_db: tuple[float, float] = (15.0, 35.0), accent_sigma: float = 0.12,
               coarticulation_ms: tuple[float, float] = (20.0, 50.0), lexicon_size: int = 400,
               overwrite: bool = False, dev_hours: float = 0.0, test_hours: float = 0.0,
               heldout_snr_db: tuple[float, float] | None = HELDOUT_SNR_DB,
               heldout_accent_sigma: float | None = None) -> CorpusInfo:
    """Write a synthetic Kaldi data directory of about `hours` of speech to `out_dir`.

    The same arguments give byte-identical files (except the absolute paths inside the scp
    files). `num_speakers` defaults to about 40 per hour (at least 2). `snr_db` is the range of
    per-utterance background-noise SNRs, `accent_sigma` the speakers' per-phone formant deviation
    (log-normal sigma), `coarticulation_ms` the range of half-widths of formant transitions.
    The directory is built beside `out_dir` and renamed into place when complete; a non-empty
    `out_dir` is refused with UserError unless `overwrite`.

    `dev_hours` / `test_hours` > 0 add held-out data dirs `out_dir/dev` and `out_dir/test`: the
    same lexicon and conditions, other speakers (`devNNN`, `tstNNN`), drawn from their own
    random streams, so the training files are the same with or without them.
    `heldout_snr_db` (default HELDOUT_SNR_DB, noisier than training) and `heldout_accent_sigma`
    are the dev and test sets' conditions (None: those of training); they change only the noise
    level / the size of the accents of the same utterances and speakers, as every draw is made
    the same way.
    """
    start = time.perf_counter()
    if "," in str(Path(out_dir).resolve()):
        # Kaldi's "ark,scp:A,B" specifiers split at commas: such a path cannot be written or read
        raise UserError(f"corpus directory {str(out_dir)!r}: Kaldi's file specifiers cannot hold "
                        "a comma in a path; choose one without")
    if not (hours > 0 and np.isfinite(hours)):
        raise UserError(f"hours must be a positive number, got {hours!r}")
    for name, value in (("dev_hours", dev_hours), ("test_hours", test_hours)):
        if not (value >= 0 and np.isfinite(value)):
            raise UserError(f"{name} must be a non-negative number, got {value!r}")
    if sample_rate < 8000:
        raise UserError(f"sample_rate must be at least 8000 Hz, got {sample_rate!r}")
    if lexicon_size < 30:  # fewer words could leave some phones out of the lexicon
        raise UserError(f"lexicon_size must be at least 30, got {lexicon_size!r}")
    if num_speakers is not None and num_speakers < 1:
        raise UserError(f"num_speakers must be at least 1, got {num_speakers!r}")
    if snr_db[0] > snr_db[1] or coarticulation_ms[0] > coarticulation_ms[1] or coarticulation_ms[0] <= 0:
        raise UserError(f"bad ranges snr_db={snr_db!r} coarticulation_ms={coarticulation_ms!r}")
    heldout_snr_db = snr_db if heldout_snr_db is None else heldout_snr_db
    heldout_accent_sigma = accent_sigma if heldout_accent_sigma is None else heldout_accent_sigma
    if heldout_snr_db[0] > heldout_snr_db[1]:
        raise UserError(f"bad range heldout_snr_db={heldout_snr_db!r}")
    if not heldout_accent_sigma >= 0:
        raise UserError(f"heldout_accent_sigma must be non-negative, got {heldout_accent_sigma!r}")
    final = Path(out_dir).resolve()
    _check_out_dir(final, overwrite)
    if num_speakers is None:
        num_speakers = max(2, int(round(40 * hours)))

    table = _phone_table()
    root = np.random.default_rng(np.random.SeedSequence(seed))
    lexicon = _make_lexicon(root, table, lexicon_size)
    width = max(3, len(str(num_speakers - 1)))
    speakers = [_make_speaker(root, f"spk{i:0{width}d}", len(table), accent_sigma)
                for i in range(num_speakers)]
    plans = _plan_set(root, speakers, table, lexicon, hours)
    held_out = []
    for index, (name, prefix, set_hours) in enumerate((("dev", "dev", dev_hours),
                                                       ("test", "tst", test_hours)), start=1):
        if set_hours > 0:
            rng = np.random.default_rng(np.random.SeedSequence([seed, index]))
            set_speakers = [_make_speaker(rng, f"{prefix}{i:03d}", len(table), heldout_accent_sigma)
                            for i in range(max(2, int(round(40 * set_hours))))]
            held_out.append((name, _plan_set(rng, set_speakers, table, lexicon, set_hours)))
    params = {"seed": int(seed), "hours_requested": float(hours), "sample_rate": int(sample_rate),
              "snr_db": [float(x) for x in snr_db], "accent_sigma": float(accent_sigma),
              "coarticulation_s": [float(x) / 1000.0 for x in coarticulation_ms],
              "lexicon_size": len(lexicon)}

    build = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    if build.exists():
        shutil.rmtree(build)
    build.mkdir(parents=True)
    try:
        total_frames, actual_hours = _write_corpus(build, final, plans, table, lexicon, sample_rate, params)
        for name, set_plans in held_out:
            (build / name).mkdir()
            _write_corpus(build / name, final / name, set_plans, table, lexicon, sample_rate,
                          {**params, "set": name, "snr_db": [float(x) for x in heldout_snr_db],
                           "accent_sigma": float(heldout_accent_sigma)})
        if final.exists():
            old = final.with_name(f"{final.name}.old-{os.getpid()}")
            final.rename(old)
            build.rename(final)
            shutil.rmtree(old)
        else:
            build.rename(final)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    return CorpusInfo(out_dir=final, num_utts=len(plans), num_speakers=num_speakers,
                      num_frames=total_frames, num_phones=len(table),
                      num_pdfs=STATES_PER_PHONE * len(table), feat_dim=FEAT_DIM,
                      hours=actual_hours, seed=int(seed), seconds_taken=time.perf_counter() - start)
