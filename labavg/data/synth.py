"""The built-in synthetic speech corpus, written as a complete Kaldi data directory.

`synthesize` draws the lexicon (labavg.data.synth_phones), speakers and utterance plans
(labavg.data.synth_plans), makes each utterance's sound and fbank features
(labavg.data.synth_signal) and writes the Kaldi files here. See docs/corpus.md for the files
written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import kaldiio
import numpy as np

from labavg.base.errors import UserError
from labavg.base.paths import require_writable
from labavg.data.synth_phones import STATES_PER_PHONE, Phone, make_lexicon, phone_table
from labavg.data.synth_plans import UtterancePlan, make_speaker, plan_set
from labavg.data.synth_signal import FEAT_DIM, compute_fbank, frame_labels, synthesize_waveform

FORMAT_VERSION = 1

# The dev and test sets are noisier than training (15-35 dB): at the training SNRs a 1-worker
# baseline decodes at about 4.5 % WER, too few errors for differences between systems of 0.3-1
# points to show. 13-17 dB brings it to 10-20 % (docs/corpus.md, "Held-out difficulty"); a narrow
# range keeps the utterances about equally hard, so the bootstrap intervals stay narrow.
HELDOUT_SNR_DB = (13.0, 17.0)


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


def check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """UserError unless `out_dir` is absent, empty, or to be replaced (`overwrite`), and it
    and the folder it is built beside (then renamed from) can be written now."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"corpus output {out_dir} exists and is not a directory")
    require_writable(out_dir, "corpus output", "the corpus directory")
    require_writable(out_dir.parent, "corpus output's folder", "the folder the corpus is built in")
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


def _write_corpus(build: Path, final: Path, plans: list[UtterancePlan], table: tuple[Phone, ...],
                  lexicon: list[tuple[str, list[int]]], sr: int, params: dict) -> tuple[int, float]:
    """Synthesise every utterance (sorted by id) and write the whole Kaldi dir into `build`."""
    cmvn: dict[str, np.ndarray] = {}
    num_frames: dict[str, int] = {}
    total_frames = 0
    with kaldiio.WriteHelper(f"ark,scp:{build / 'feats.ark'},{build / 'feats.scp'}") as feats_out, \
            kaldiio.WriteHelper(f"ark:{build / 'pdf_ali.ark'}") as ali_out:
        for plan in plans:
            wave = synthesize_waveform(plan, sr, params["snr_db"], params["coarticulation_s"])
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
    _check_arguments(out_dir, hours, dev_hours, test_hours, sample_rate, lexicon_size,
                     num_speakers, snr_db, coarticulation_ms)
    heldout_snr_db = snr_db if heldout_snr_db is None else heldout_snr_db
    heldout_accent_sigma = accent_sigma if heldout_accent_sigma is None else heldout_accent_sigma
    if heldout_snr_db[0] > heldout_snr_db[1]:
        raise UserError(f"bad range heldout_snr_db={heldout_snr_db!r}")
    if not heldout_accent_sigma >= 0:
        raise UserError(f"heldout_accent_sigma must be non-negative, got {heldout_accent_sigma!r}")
    final = Path(out_dir).resolve()
    check_out_dir(final, overwrite)
    if num_speakers is None:
        num_speakers = max(2, int(round(40 * hours)))

    table = phone_table()
    root = np.random.default_rng(np.random.SeedSequence(seed))
    lexicon = make_lexicon(root, table, lexicon_size)
    width = max(3, len(str(num_speakers - 1)))
    speakers = [make_speaker(root, f"spk{i:0{width}d}", len(table), accent_sigma)
                for i in range(num_speakers)]
    plans = plan_set(root, speakers, table, lexicon, hours)
    held_out = _plan_held_out(seed, table, lexicon, dev_hours, test_hours, heldout_accent_sigma)
    params = {"seed": int(seed), "hours_requested": float(hours), "sample_rate": int(sample_rate),
              "snr_db": [float(x) for x in snr_db], "accent_sigma": float(accent_sigma),
              "coarticulation_s": [float(x) / 1000.0 for x in coarticulation_ms],
              "lexicon_size": len(lexicon)}
    heldout_params = {"snr_db": [float(x) for x in heldout_snr_db],
                      "accent_sigma": float(heldout_accent_sigma)}
    total_frames, actual_hours = _write_into_place(final, plans, held_out, table, lexicon,
                                                   sample_rate, params, heldout_params)
    return CorpusInfo(out_dir=final, num_utts=len(plans), num_speakers=num_speakers,
                      num_frames=total_frames, num_phones=len(table),
                      num_pdfs=STATES_PER_PHONE * len(table), feat_dim=FEAT_DIM,
                      hours=actual_hours, seed=int(seed), seconds_taken=time.perf_counter() - start)


def _check_arguments(out_dir: str | os.PathLike, hours: float, dev_hours: float,
                     test_hours: float, sample_rate: int, lexicon_size: int,
                     num_speakers: int | None, snr_db: tuple[float, float],
                     coarticulation_ms: tuple[float, float]) -> None:
    """UserError for the first of `synthesize`'s training-set arguments that is out of range."""
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


def _plan_held_out(seed: int, table: tuple[Phone, ...], lexicon: list[tuple[str, list[int]]],
                   dev_hours: float, test_hours: float, accent_sigma: float
                   ) -> list[tuple[str, list[UtterancePlan]]]:
    """(name, plans) of the dev and test sets asked for, each from its own random stream."""
    held_out = []
    for index, (name, prefix, set_hours) in enumerate((("dev", "dev", dev_hours),
                                                       ("test", "tst", test_hours)), start=1):
        if set_hours > 0:
            rng = np.random.default_rng(np.random.SeedSequence([seed, index]))
            set_speakers = [make_speaker(rng, f"{prefix}{i:03d}", len(table), accent_sigma)
                            for i in range(max(2, int(round(40 * set_hours))))]
            held_out.append((name, plan_set(rng, set_speakers, table, lexicon, set_hours)))
    return held_out


def _write_into_place(final: Path, plans: list[UtterancePlan],
                      held_out: list[tuple[str, list[UtterancePlan]]], table: tuple[Phone, ...],
                      lexicon: list[tuple[str, list[int]]], sample_rate: int, params: dict,
                      heldout_params: dict) -> tuple[int, float]:
    """Build the corpus beside `final`, then rename it into place; nothing is left on failure.

    Returns the training set's (frames, hours).
    """
    build = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    if build.exists():
        shutil.rmtree(build)
    build.mkdir(parents=True)
    try:
        total_frames, actual_hours = _write_corpus(build, final, plans, table, lexicon, sample_rate, params)
        for name, set_plans in held_out:
            (build / name).mkdir()
            _write_corpus(build / name, final / name, set_plans, table, lexicon, sample_rate,
                          {**params, "set": name, **heldout_params})
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
    return total_frames, actual_hours
