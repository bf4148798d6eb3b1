"""The built-in corpus' held-out dev and test sets."""

from __future__ import annotations

import filecmp

from labavg.data import synth
from labavg.data.dataset import open_dataset


def test_dev_and_test_sets_have_other_speakers_and_leave_train_unchanged(corpus, tmp_path):
    out = tmp_path / "c"
    synth.synthesize(out, hours=0.02, seed=3, dev_hours=0.005, test_hours=0.01)
    # The training files are those of the same corpus made without held-out sets.
    for name in ("text", "utt2spk", "pdf_ali.ark", "feats.ark", "lexicon.txt", "cmvn.ark"):
        assert filecmp.cmp(out / name, corpus / name, shallow=False), name
    speakers = {}
    for part in ("", "dev", "test"):
        data = out / part if part else out
        source = open_dataset(data)
        assert source.num_pdfs == 120 and source.keys
        speakers[part] = {line.split()[1] for line in (data / "utt2spk").read_text().splitlines()}
        assert (data / "lexicon.txt").read_text() == (out / "lexicon.txt").read_text()
        words = {w for line in (data / "text").read_text().splitlines() for w in line.split()[1:]}
        lexicon = {line.split()[0] for line in (out / "lexicon.txt").read_text().splitlines()}
        assert words <= lexicon
    assert not speakers[""] & speakers["dev"] and not speakers[""] & speakers["test"]
    assert not speakers["dev"] & speakers["test"]
    assert all(s.startswith("tst") for s in speakers["test"])
