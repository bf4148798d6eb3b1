"""The synthetic corpus' sound: source-filter speech from an utterance plan, then Kaldi fbank.

Speech is made by a formant (source-filter) synthesiser in the short-time Fourier domain: a
jittered glottal pulse train and white noise are cut into overlapping windowed frames, each frame's
spectrum is multiplied by a spectral envelope built from the current formant frequencies and
bandwidths (Klatt-style pole-pair magnitudes), frication bands, nasal antiformants, glottal tilt and
a speaker's channel colour, and the frames are overlap-added back (the time-varying filter of
Allen & Rabiner's weighted overlap-add). Everything is vectorised per utterance: no Python loop runs
per sample or per frame.

Features are Kaldi ``compute-fbank-feats`` log-mel filterbanks (via kaldi-native-fbank) and frame
labels are taken at each feature frame's centre sample.
"""

from __future__ import annotations

import kaldi_native_fbank as knf
import numpy as np

from labavg.data.synth_phones import FORMANT_COLS, VOICE
from labavg.data.synth_plans import Speaker, UtterancePlan

FEAT_DIM = 40
_LN_DB = np.log(10.0) / 20.0  # dB -> natural-log amplitude

# Synthesis STFT: 16 ms Hann analysis frames, 8 ms hop, zero-padded to 32 ms so that the
# (zero-phase) envelope's impulse response fits without circular wrap-around.
_SYN_WIN_S = 0.016
_SYN_HOP_S = 0.008


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


def _pulse_train(rng: np.random.Generator, f0: np.ndarray, sr: int, speaker: Speaker) -> np.ndarray:
    """Glottal excitation: unit-power impulses at the pitch period with jitter and shimmer."""
    phase = np.cumsum(f0) / sr
    idx = np.flatnonzero(np.diff(np.floor(phase)) > 0) + 1
    period = sr / f0[idx]
    idx = np.clip(np.round(idx + rng.normal(0.0, speaker.jitter, len(idx)) * period), 0, len(f0) - 1)
    amp = np.sqrt(period) * rng.lognormal(0.0, speaker.shimmer, len(idx))
    return np.bincount(idx.astype(np.int64), weights=amp, minlength=len(f0))


def _pitch_contour(rng: np.random.Generator, t: np.ndarray, total: float, speaker: Speaker) -> np.ndarray:
    """Declining F0 with a few pitch accents (log-domain Gaussian bumps)."""
    log_f0 = np.log(speaker.f0) + rng.normal(0.0, 0.08) - rng.uniform(0.1, 0.35) * (t / total - 0.5)
    for _ in range(1 + int(total / 1.2)):
        centre, width = rng.uniform(0.0, total), rng.uniform(0.08, 0.2)
        log_f0 = log_f0 + rng.uniform(0.05, 0.25) * np.exp(-0.5 * ((t - centre) / width) ** 2)
    return np.exp(log_f0)


def synthesize_waveform(plan: UtterancePlan, sr: int, snr_db: tuple[float, float],
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
    formants = _tracks(t, plan.starts, plan.ends, rows[:, FORMANT_COLS], tau_formant)
    gains = _tracks(t, plan.starts, plan.ends, rows[:, VOICE:], 0.006)
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
