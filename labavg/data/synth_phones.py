"""The synthetic corpus' phone inventory and lexicon.

Each phone has three HMM-like states (begin / middle / end), so pdf = 3 * phone + state, as a
Kaldi monophone system with one pdf per state (``num_pdfs = 3 * num_phones``). For stops and
affricates the states are closure / burst / release, for diphthongs onset / glide / offset target.
Each state is described by one row of acoustic targets (the columns below), which
labavg.data.synth_signal turns into sound.
"""

from __future__ import annotations

import dataclasses

import numpy as np

STATES_PER_PHONE = 3

# Per-state acoustic description columns (see _row).
F1, F2, F3, VOICE, ASP, FRIC, FRIC_FC, FRIC_OCT, NASAL, ZERO_F = range(10)
NUM_COLS = 10
FORMANT_COLS = slice(F1, F3 + 1)
_SILENT_DB = -80.0
SCHWA = (500.0, 1500.0, 2500.0)


@dataclasses.dataclass(frozen=True)
class Phone:
    """One phone class: its name, broad kind, and a [3, NUM_COLS] per-state description."""

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


def phone_table() -> tuple[Phone, ...]:
    """The 40 phone classes (CMU/ARPAbet set + silence), male reference formants in Hz.

    Vowel targets follow Peterson & Barney (1952) / Hillenbrand et al. (1995) male means; stop and
    fricative formant loci follow the classic locus-equation values (labial F2 ~ 800-1000 Hz,
    alveolar ~ 1700-1800, velar ~ 2000-2300 with F2/F3 pinch).
    """
    labial, dental, alveolar = (300.0, 900.0, 2200.0), (300.0, 1400.0, 2600.0), (300.0, 1750.0, 2650.0)
    postalveolar, velar = (300.0, 1900.0, 2500.0), (300.0, 2100.0, 2400.0)
    sil_row = _row(SCHWA)
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
        Phone("hh", "aspirate", (_row(SCHWA, asp=-14.0),) * 3, (25.0, 25.0, 25.0)),
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
    return [p.name for p in phone_table()]


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


def make_lexicon(rng: np.random.Generator, table: tuple[Phone, ...], num_words: int
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
