"""Who says what in the synthetic corpus: speakers and utterance plans.

Formant tracks interpolate linearly between neighbouring targets (coarticulation), short vowels
undershoot towards schwa, and each speaker has a vocal-tract length factor, pitch range, bandwidths,
breathiness, channel colour and a personal "accent" (per-phone formant offsets). A plan holds every
random choice of an utterance but its sound (drawn later from the plan's own seed).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from labavg.data.synth_phones import FORMANT_COLS, NUM_COLS, SCHWA, STATES_PER_PHONE, Phone


@dataclasses.dataclass(frozen=True)
class Speaker:
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


def make_speaker(rng: np.random.Generator, spk: str, num_phones: int, accent_sigma: float
                  ) -> Speaker:
    female = rng.random() < 0.5
    return Speaker(
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
class UtterancePlan:
    """One utterance: its words, and per-state segments (times in s) with their acoustics."""

    utt: str
    speaker: Speaker
    words: list[str]
    pdfs: np.ndarray      # [J] pdf id of each state segment
    starts: np.ndarray    # [J]
    ends: np.ndarray      # [J]
    rows: np.ndarray      # [J, NUM_COLS]
    seed: int


def _plan_utterance(rng: np.random.Generator, utt: str, speaker: Speaker,
                    table: tuple[Phone, ...], lexicon: list[tuple[str, list[int]]],
                    target_s: float) -> UtterancePlan:
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
    rows[:, :, FORMANT_COLS] *= speaker.accent[phones][:, None, :]
    rows[:, :, FORMANT_COLS] *= rng.lognormal(0.0, 0.04, size=(num, 1, 3))
    # Short vowels do not reach their targets: pull them towards schwa (Lindblom's undershoot).
    vowel = np.array([table[p].kind == "vowel" for p in phones])
    phone_dur = dur.reshape(num, 3).sum(axis=1)
    undershoot = np.where(vowel, np.clip((0.11 - phone_dur) / 0.11, 0.0, 0.5), 0.0)
    rows[:, :, FORMANT_COLS] += undershoot[:, None, None] * (np.array(SCHWA) - rows[:, :, FORMANT_COLS])
    # /h/ is aspiration through the next phone's vocal tract.
    for i in np.flatnonzero([table[p].name == "hh" for p in phones]):
        rows[i, :, FORMANT_COLS] = rows[i + 1, 0, FORMANT_COLS]
    # Silence keeps the neighbouring vocal-tract shape, so transitions into pauses are smooth.
    for i in np.flatnonzero(sil):
        nbr = i + 1 if i == 0 else i - 1
        rows[i, :, FORMANT_COLS] = rows[nbr, 0 if nbr > i else 2, FORMANT_COLS]

    ends = np.cumsum(dur)
    pdfs = (STATES_PER_PHONE * np.array(phones)[:, None] + np.arange(STATES_PER_PHONE)).ravel()
    return UtterancePlan(utt, speaker, words, pdfs, ends - dur, ends, rows.reshape(num * 3, NUM_COLS),
                 int(rng.integers(2**63)))


def plan_set(rng: np.random.Generator, speakers: list[Speaker], table: tuple[Phone, ...],
              lexicon: list[tuple[str, list[int]]], hours: float) -> list[UtterancePlan]:
    """Utterances of 1.5-5 s dealt to `speakers` in turn until `hours`, sorted by id."""
    plans: list[UtterancePlan] = []
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
