"""`labavg corpus prepare`: real recordings aligned with pocketsphinx into a Kaldi data directory.

The real utterance of ../shared/data/real-utterance (26.7 s of read English) has a Montreal
Forced Aligner TextGrid: pocketsphinx's phones must agree with it on most 10 ms frames.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kaldiio
import numpy as np
import pytest
import soundfile
from praatio import textgrid

from labavg.data import forced_align, prepare

REPO = Path(__file__).resolve().parents[1]
REAL = REPO.parent / "shared" / "data" / "real-utterance"
WAV, GRID = REAL / "acoustic_corpus.wav", REAL / "acoustic_corpus.TextGrid"
# The one word of the utterance CMUdict lacks, with the pronunciation a user would give it.
EXTRA = "yknow Y N OW1\n"


def _words() -> list[str]:
    grid = textgrid.openTextgrid(str(GRID), includeEmptyIntervals=False)
    return [e.label for e in grid.getTier("words").entries if e.label.strip()]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "labavg", "corpus", "prepare", *args, "--no-progress"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def real_folder(tmp_path_factory, shared_data) -> Path:
    """The real utterance as `real.flac` and a copy `oov.wav` whose transcript has an unknown word."""
    root = tmp_path_factory.mktemp("real")
    (root / "audio").mkdir()
    samples, rate = soundfile.read(str(WAV), dtype="int16")
    soundfile.write(str(root / "audio" / "real.flac"), samples, rate)
    (root / "audio" / "oov.wav").write_bytes(WAV.read_bytes())
    words = " ".join(_words())
    (root / "text").write_text(f"real: {words}\noov: {words} zzqxv\n")
    (root / "extra.txt").write_text(EXTRA)
    return root


@pytest.mark.usefixtures("shared_data")  # the real utterance is in ../shared
def test_pocketsphinx_agrees_with_the_montreal_aligner_on_most_frames():
    samples, rate = soundfile.read(str(WAV), dtype="int16")
    assert rate == 16000
    segments = forced_align.Aligner({"yknow": ["Y", "N", "OW1"]}).align(samples, _words(), str(WAV))
    frames = 2672  # the TextGrid's 26.72 s at 10 ms
    agreement = forced_align.frame_agreement(forced_align.frame_phones(segments, frames),
                                             forced_align.reference_phones(GRID, frames))
    print(agreement)
    # Measured: 85.9 % of all frames, 81.5 % of the 1,930 speech frames (docs/corpus.md). The
    # aligners differ in dictionaries ("the" as DH IY or DH AH) and in boundaries by a frame or two.
    assert agreement.agreeing > 0.80 and agreement.speech_agreeing > 0.75, agreement
    assert agreement.speech_frames > 1500


def test_prepare_writes_a_data_dir_that_training_reads_and_leaves_unknown_words_out(real_folder,
                                                                                    tmp_path):
    out = tmp_path / "corpus"
    proc = _cli(str(real_folder / "audio"), str(out), "--text", str(real_folder / "text"),
                "--lexicon", str(real_folder / "extra.txt"), "--speaker", "reader")
    assert proc.returncode == 0, proc.stderr
    assert "1 utterances" in proc.stdout and "left out 1 with words outside the dictionary" in proc.stdout
    assert (out / "left_out.txt").read_text() == "oov unknown words: zzqxv\n"
    assert not out.with_name("corpus.partial").exists()
    feats = dict(kaldiio.load_scp(str(out / "feats.scp")))
    pdfs = dict(kaldiio.load_ark(str(out / "pdf_ali.ark")))
    assert list(feats) == ["real"] and feats["real"].shape == (2670, 40)
    assert len(pdfs["real"]) == 2670 and pdfs["real"].max() < 120
    assert (out / "num_pdfs").read_text().strip() == "120"
    assert (out / "utt2spk").read_text() == "real reader\n"
    assert (out / "wav.scp").read_text() == f"real flac -c -d -s {(real_folder / 'audio' / 'real.flac').resolve()} |\n"
    ctm = (out / "phones.ctm").read_text().splitlines()
    assert ctm[1].split()[:2] == ["real", "1"] and ctm[1].split()[4] == "DH"  # "this"
    lexicon = dict(line.split(" ", 1) for line in (out / "lexicon.txt").read_text().splitlines())
    assert lexicon["yknow"] == "Y N OW" and lexicon["corpus"] == "K AO R P AH S"

    from labavg.data.dataset import open_dataset

    source = open_dataset(out)
    assert source.num_pdfs == 120 and source.feat_dim == 40


def test_an_interrupted_prepare_aligns_only_what_is_left(real_folder, tmp_path, monkeypatch):
    out = tmp_path / "corpus"
    audio = tmp_path / "audio"
    audio.mkdir()
    for name in ("a", "b", "c"):
        (audio / f"{name}.wav").write_bytes(WAV.read_bytes())
    words = " ".join(_words())
    (tmp_path / "text").write_text("".join(f"{n} {words}\n" for n in "abc"))
    aligned = []
    real_one = prepare._prepare_one

    def one(rec, *rest):
        if len(aligned) == 2:
            raise KeyboardInterrupt
        aligned.append(rec.utt)
        real_one(rec, *rest)

    monkeypatch.setattr(prepare, "_prepare_one", one)
    kw = dict(text=tmp_path / "text", lexicon=real_folder / "extra.txt", progress=False)
    with pytest.raises(KeyboardInterrupt):
        prepare.prepare_corpus(audio, out, **kw)
    assert not out.exists() and sorted(p.name for p in (tmp_path / "corpus.partial" / "utterances").iterdir()) \
        == ["a.npz", "b.npz"]
    aligned.clear()
    done = prepare.prepare_corpus(audio, out, **kw)
    assert aligned == ["c"] and done.num_utts == 3
    assert not (tmp_path / "corpus.partial").exists()


def _tone(path: Path, rate: int = 16000, channels: int = 1, seconds: float = 1.0) -> None:
    t = np.arange(int(rate * seconds)) / rate
    wave = (3000 * np.sin(2 * np.pi * 220 * t)).astype(np.int16)
    soundfile.write(str(path), np.stack([wave] * channels, axis=1) if channels > 1 else wave, rate)


BAD_INPUTS = {
    "no audio": (lambda d: None, "no recordings"),
    "unreadable audio": (lambda d: (d / "a.wav").write_bytes(b"RIFF not really a wav"), "a.wav: cannot read the audio"),
    "stereo": (lambda d: _tone(d / "a.wav", channels=2), "a.wav: 2 channels"),
    "odd rate": (lambda d: _tone(d / "a.wav", rate=11025), "a.wav: sample rate 11025 Hz"),
    "several rates": (lambda d: (_tone(d / "a.wav"), _tone(d / "b.wav", rate=8000)), "several sample rates"),
    "a recording without a transcript": (lambda d: (_tone(d / "a.wav"), _tone(d / "zz.wav")), "no transcript"),
    "a transcript without a recording": (lambda d: _tone(d / "b.wav"), "no recording in"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_and_nothing_written(case, tmp_path):
    make, message = BAD_INPUTS[case]
    audio = tmp_path / "audio"
    audio.mkdir()
    make(audio)
    (tmp_path / "text").write_text("a: hello world\nb: hello\n" if case == "several rates" else "a: hello world\n")
    out = tmp_path / "out"
    proc = _cli(str(audio), str(out), "--text", str(tmp_path / "text"))
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not out.exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("text, message", [
    ("a:\n", "line 1: utterance 'a' has an empty transcript"),
    ("a: hello\na: world\n", "line 2: utterance 'a' is transcribed twice"),
    ("", "no transcripts"),
])
def test_bad_transcripts_are_named_by_line(text, message, tmp_path):
    audio = tmp_path / "audio"
    audio.mkdir()
    _tone(audio / "a.wav")
    (tmp_path / "text").write_text(text)
    proc = _cli(str(audio), str(tmp_path / "out"), "--text", str(tmp_path / "text"))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
