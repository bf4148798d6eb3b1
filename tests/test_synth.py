"""The built-in synthetic corpus: a valid, deterministic, learnable Kaldi data directory."""

from __future__ import annotations

from pathlib import Path

import kaldiio
import numpy as np
import pytest

from labavg.data import synth, synth_phones, synth_signal
from labavg.base.errors import UserError

TINY_HOURS = 0.02  # 72 s of speech, well under a second to make


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "tiny"
    synth.synthesize(out, hours=TINY_HOURS, seed=3)
    return out


def _table(path: Path) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in path.read_text().splitlines())


def _load(corpus: Path):
    feats = dict(kaldiio.load_scp(str(corpus / "feats.scp")))
    ali = dict(kaldiio.load_ark(str(corpus / "pdf_ali.ark")))
    return feats, ali


def test_is_a_consistent_kaldi_dir(corpus):
    feats, ali = _load(corpus)
    keys = list(_table(corpus / "utt2spk"))
    assert keys == sorted(keys) == sorted(feats) == list(ali)
    utt2spk = _table(corpus / "utt2spk")
    assert all(utt.startswith(spk + "-") for utt, spk in utt2spk.items())
    spk2utt = {s: u.split() for s, u in _table(corpus / "spk2utt").items()}
    assert list(spk2utt) == sorted(set(utt2spk.values()))
    assert [u for utts in spk2utt.values() for u in utts] == keys
    num_frames = {k: int(v) for k, v in _table(corpus / "utt2num_frames").items()}
    num_pdfs = int((corpus / "num_pdfs").read_text())
    assert num_pdfs == 3 * len(synth_phones.phone_names()) == 120
    for key in keys:
        assert feats[key].dtype == np.float32 and feats[key].shape[1] == 40
        assert np.isfinite(feats[key]).all()
        assert ali[key].dtype == np.int32
        assert len(ali[key]) == len(feats[key]) == num_frames[key]
        assert 0 <= ali[key].min() and ali[key].max() < num_pdfs
        assert ali[key][0] // 3 == 0 and ali[key][-1] // 3 == 0  # utterances start and end in silence
    used_phones = np.unique(np.concatenate(list(ali.values())) // 3)
    assert len(used_phones) >= 40
    total = sum(len(f) for f in feats.values())
    assert total == pytest.approx(TINY_HOURS * 3600 * 100, rel=0.15)
    assert set(_table(corpus / "text")) == set(keys)


def test_tables_agree_with_pdf_formula(corpus):
    phones = [line.split() for line in (corpus / "phones.txt").read_text().splitlines()]
    assert [name for name, _ in phones] == synth_phones.phone_names()
    assert [int(i) for _, i in phones] == list(range(40))
    pdfs = [line.split() for line in (corpus / "pdfs.txt").read_text().splitlines()]
    assert len(pdfs) == 120
    for pdf, phone, state in pdfs:
        assert int(pdf) == 3 * synth_phones.phone_names().index(phone) + int(state)


def test_scp_paths_are_absolute_and_final(corpus):
    for name in ("feats.scp", "cmvn.scp"):
        for value in _table(corpus / name).values():
            path = Path(value.rsplit(":", 1)[0])
            assert path.is_absolute() and path.parent == corpus.resolve()
    assert not list(corpus.parent.glob("tiny.tmp-*"))


def test_cmvn_stats_are_kaldi_format_sums(corpus, shared_data):
    feats, _ = _load(corpus)
    cmvn = dict(kaldiio.load_scp(str(corpus / "cmvn.scp")))
    spk2utt = {s: u.split() for s, u in _table(corpus / "spk2utt").items()}
    real = next(iter(dict(kaldiio.load_ark(str(shared_data / "real-utterance" / "cmvn.ark"))).values()))
    assert sorted(cmvn) == sorted(spk2utt)
    for spk, utts in spk2utt.items():
        stats = cmvn[spk]
        assert stats.dtype == real.dtype == np.float64  # compute-cmvn-stats writes a double matrix
        assert stats.shape == (2, 41) and real.shape[0] == 2 and real[1, -1] == stats[1, -1] == 0
        x = np.concatenate([feats[u] for u in utts]).astype(np.float64)
        assert stats[0, -1] == len(x)
        np.testing.assert_allclose(stats[0, :-1], x.sum(0), rtol=1e-9)
        np.testing.assert_allclose(stats[1, :-1], (x**2).sum(0), rtol=1e-9)
    assert (corpus / "cmvn.ark").read_bytes()[:11] == b"spk000 \x00BDM"


def test_same_seed_same_bytes_other_seed_differs(corpus, tmp_path):
    again = tmp_path / "again"
    synth.synthesize(again, hours=TINY_HOURS, seed=3)
    for name in ("feats.ark", "pdf_ali.ark", "cmvn.ark", "text", "utt2spk", "utt2num_frames",
                 "corpus.json", "lexicon.txt"):
        assert (again / name).read_bytes() == (corpus / name).read_bytes(), name
    other = tmp_path / "other"
    synth.synthesize(other, hours=TINY_HOURS, seed=4)
    assert (other / "feats.ark").read_bytes() != (corpus / "feats.ark").read_bytes()
    assert (other / "text").read_text() != (corpus / "text").read_text()


def test_refuses_to_overwrite_unless_asked(tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(UserError, match=str(out)):
        synth.synthesize(out, hours=0.003)
    assert (out / "keep").exists()
    info = synth.synthesize(out, hours=0.003, overwrite=True)
    assert not (out / "keep").exists() and (out / "feats.scp").exists()
    assert info.num_frames == sum(int(v) for v in _table(out / "utt2num_frames").values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    with pytest.raises(UserError, match="hours"):
        synth.synthesize(tmp_path / "d", hours=0)


def test_interrupted_run_leaves_nothing(tmp_path, monkeypatch):
    calls = []

    def failing(wave, sr):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return np.zeros((10, 40), np.float32)

    monkeypatch.setattr(synth, "compute_fbank", failing)
    with pytest.raises(KeyboardInterrupt):
        synth.synthesize(tmp_path / "c", hours=0.01)
    assert list(tmp_path.iterdir()) == []


def test_frame_labels_use_frame_centres():
    # 25 ms frames every 10 ms: frame i's centre is at 12.5 + 10 i ms.
    ends = np.array([0.030, 0.051, 0.2])
    labels = synth_signal.frame_labels(ends, np.array([7, 8, 9]), 5, 16000)
    np.testing.assert_array_equal(labels, [7, 7, 8, 8, 9])  # centres 12.5, 22.5, 32.5, 42.5, 52.5 ms


def test_fbank_is_kaldi_framed():
    wave = np.sin(np.arange(16000) * 0.3).astype(np.float32) * 1000
    feats = synth_signal.compute_fbank(wave, 16000)
    assert feats.shape == (1 + (16000 - 400) // 160, 40)  # snip_edges=true
    np.testing.assert_array_equal(feats, synth_signal.compute_fbank(wave, 16000))  # no dither
    peak = np.argmax(feats.mean(0))  # 0.3 rad/sample = 764 Hz: a low mel bin
    assert 5 <= peak <= 14


def test_phone_classes_are_acoustically_distinct(corpus):
    """Nearest class mean on speaker-mean-normalised middle-state frames beats chance widely."""
    feats, ali = _load(corpus)
    cmvn = dict(kaldiio.load_scp(str(corpus / "cmvn.scp")))
    utt2spk = _table(corpus / "utt2spk")
    keys = sorted(feats)
    xs, ys, train = [], [], []
    for i, key in enumerate(keys):
        stats = cmvn[utt2spk[key]]
        middle = ali[key] % 3 == 1
        xs.append(feats[key][middle] - stats[0, :-1] / stats[0, -1])
        ys.append(ali[key][middle] // 3)
        train.append(np.full(middle.sum(), i % 2 == 0))
    x, y, train = np.concatenate(xs), np.concatenate(ys), np.concatenate(train)
    x = x / x[train].std(0)
    classes = np.unique(y[train])
    means = np.stack([x[train & (y == c)].mean(0) for c in classes])
    test = ~train & np.isin(y, classes)
    predicted = classes[((x[test, None, :] - means[None]) ** 2).sum(-1).argmin(1)]
    # Balanced accuracy (mean recall per class), so that silence's large share does not count.
    recall = [np.mean(predicted[y[test] == c] == c) for c in np.unique(y[test])]
    chance = 1.0 / len(classes)
    assert len(classes) >= 38 and np.mean(recall) > 3.5 * chance, (np.mean(recall), chance)
