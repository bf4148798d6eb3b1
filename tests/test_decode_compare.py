"""Comparing two decoded systems: the paired bootstrap, decode_<set>/ reading, `labavg compare`,
and the held-out sets' difficulty knobs of the built-in corpus."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

import kaldiio
import numpy as np
import pytest

from labavg.data import synth
from labavg.decode.compare import compare_decodes
from labavg.decode.decode_dir import write_decode_dir
from labavg.decode import task as decode_task
from labavg.decode.score import compare_error_rates, error_rate
from labavg.base.errors import DataError, UserError

REPO = Path(__file__).resolve().parents[1]


def _cli(*args):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "labavg", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def _task(num_utts=300, seed=0):
    """References of 3-8 words; system A wrong on a fixed share of hard utterances."""
    rng = np.random.default_rng(seed)
    vocab = [f"w{i}" for i in range(50)]
    refs = [list(rng.choice(vocab, size=rng.integers(3, 9))) for _ in range(num_utts)]
    hyps = []
    for ref in refs:
        hyp = list(ref)
        if rng.random() < 0.3:  # a hard utterance: one substitution and one deletion
            hyp[0] = "zz"
            del hyp[-1]
        hyps.append(hyp)
    return refs, hyps


def test_identical_systems_differ_by_exactly_zero():
    refs, hyps = _task()
    c = compare_error_rates(refs, hyps, [list(h) for h in hyps])
    assert c.a.rate == c.b.rate > 0
    assert c.diff == c.diff_ci_low == c.diff_ci_high == 0.0 and not c.resolved
    # Kaldi counts only strictly fewer errors as an improvement.
    assert c.p_b_better == 0.0


def test_known_extra_errors_give_the_exact_difference_and_a_paired_interval():
    refs, hyps_a = _task()
    words = sum(len(r) for r in refs)
    hyps_b = [list(h) for h in hyps_a]
    correct = [i for i, (r, h) in enumerate(zip(refs, hyps_a)) if r == h]
    for i in correct[:12]:  # 12 extra substitutions where A was right
        hyps_b[i][1] = "zz"
    c = compare_error_rates(refs, hyps_a, hyps_b)
    assert c.diff == pytest.approx(100.0 * 12 / words, abs=1e-9)
    assert c.b.errors - c.a.errors == 12
    assert 0 < c.diff_ci_low < c.diff < c.diff_ci_high and c.resolved
    assert c.p_b_better == 0.0  # B never makes fewer errors than A
    # Pairing: the shared errors of the hard utterances cancel, so the difference's interval is
    # far narrower than the two systems' own intervals combined, which overlap.
    unpaired = np.hypot(c.a.ci_high - c.a.ci_low, c.b.ci_high - c.b.ci_low) / 2
    assert c.diff_ci_high - c.diff_ci_low < 0.5 * unpaired
    assert c.a.ci_high > c.b.ci_low
    # Swapping the systems negates the difference and the interval, and B (now A) is better.
    r = compare_error_rates(refs, hyps_b, hyps_a)
    assert r.diff == pytest.approx(-c.diff) and r.p_b_better == 1.0
    assert (r.diff_ci_low, r.diff_ci_high) == pytest.approx((-c.diff_ci_high, -c.diff_ci_low))


def test_a_small_difference_on_few_words_is_not_resolved():
    refs, hyps_a = _task(num_utts=60)
    hyps_b = [list(h) for h in hyps_a]
    hyps_b[[i for i, (r, h) in enumerate(zip(refs, hyps_a)) if r == h][0]][0] = "zz"
    c = compare_error_rates(refs, hyps_a, hyps_b)
    assert c.diff > 0 and c.diff_ci_low <= 0 < c.diff_ci_high and not c.resolved


def _decode_dir(run: Path, refs, hyps, acwt=0.1, keys=None):
    keys = keys or [f"u{i:04d}" for i in range(len(refs))]
    test = decode_task.TestSet(name="test", keys=keys, loglikes=[], refs=refs, oov=0, seconds=0.0)
    other = [[] for _ in refs]  # another scale, which compare must not read
    result = decode_task.SetResult(test=test, wers={acwt: error_rate(refs, hyps),
                                                    0.05: error_rate(refs, other)},
                                   hyps={acwt: hyps, 0.05: other}, decode_seconds=0.0, frames=0)
    write_decode_dir(run / "decode_test", result, acwt, None, {"set": "test", "acwt": acwt,
                                                               "acwt_from": "dev"})


@pytest.mark.slow  # keeps README's fast command under 10 minutes; CI runs it
def test_compare_decodes_reads_each_run_at_its_reported_scale(tmp_path):
    refs, hyps_a = _task()
    hyps_b = [list(h) for h in hyps_a]
    hyps_b[0] = []  # B deletes a whole utterance: an empty hypothesis line
    _decode_dir(tmp_path / "a", refs, hyps_a, acwt=0.1)
    _decode_dir(tmp_path / "b", refs, hyps_b, acwt=0.125)
    a, b, c = compare_decodes(tmp_path / "a", tmp_path / "b")
    assert (a.acwt, b.acwt) == (0.1, 0.125)
    expected = compare_error_rates(refs, hyps_a, hyps_b)
    assert c.diff == pytest.approx(expected.diff) and c.diff > 0
    assert c.a.rate == error_rate(refs, hyps_a).rate

    proc = _cli("compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["diff"] == pytest.approx(c.diff) and out["acwt_b"] == 0.125
    proc = _cli("compare", str(tmp_path / "a"), str(tmp_path / "b"))
    assert proc.returncode == 0 and f"B - A: {c.diff:+.2f} points" in proc.stdout


def test_compare_refuses_other_test_sets_with_one_line(tmp_path):
    refs, hyps = _task(num_utts=20)
    _decode_dir(tmp_path / "a", refs, hyps)
    other_refs = [list(r) for r in refs]
    other_refs[3] = ["w1"]
    _decode_dir(tmp_path / "b", other_refs, hyps)
    _decode_dir(tmp_path / "c", refs[:-1], hyps[:-1])
    with pytest.raises(DataError, match="ref.txt differ for 1 utterances.*'u0003'"):
        compare_decodes(tmp_path / "a", tmp_path / "b")
    with pytest.raises(DataError, match="different utterances.*'u0019'"):
        compare_decodes(tmp_path / "a", tmp_path / "c")
    with pytest.raises(UserError, match="decode_dev/result.json not found"):
        compare_decodes(tmp_path / "a", tmp_path / "b", "dev")
    proc = _cli("compare", str(tmp_path / "a"), str(tmp_path / "nothing"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("labavg: error: ")
    assert "nothing/decode_test/result.json not found" in proc.stderr


def test_heldout_conditions_change_only_the_noise_of_the_same_test_utterances(corpus, tmp_path):
    same = tmp_path / "same"
    noisy = tmp_path / "noisy"
    synth.synthesize(same, hours=0.02, seed=3, test_hours=0.005, heldout_snr_db=(15.0, 35.0))
    synth.synthesize(noisy, hours=0.02, seed=3, test_hours=0.005, heldout_snr_db=(0.0, 5.0))
    for name in ("feats.ark", "text", "pdf_ali.ark", "lexicon.txt"):  # training: untouched
        assert filecmp.cmp(noisy / name, corpus / name, shallow=False), name
    for name in ("text", "utt2spk", "pdf_ali.ark"):  # the same utterances and speakers
        assert filecmp.cmp(noisy / "test" / name, same / "test" / name, shallow=False), name
    assert json.loads((noisy / "test" / "corpus.json").read_text())["snr_db"] == [0.0, 5.0]

    def silence_floor(data):
        # Log-mel energy (natural log) of the silent frames (pdfs 0-2) over the speech frames':
        # the background noise's level. Measured: 1.8 higher (8 dB) at 0-5 dB than at 15-35 dB.
        feats = dict(kaldiio.load_scp(str(data / "feats.scp")))
        ali = dict(kaldiio.load_ark(str(data / "pdf_ali.ark")))
        return np.mean([feats[k][ali[k] < 3].mean() - feats[k][ali[k] >= 3].mean() for k in feats])

    assert silence_floor(noisy / "test") > silence_floor(same / "test") + 1.0
    with pytest.raises(UserError, match="heldout_snr_db"):
        synth.synthesize(tmp_path / "bad", hours=0.003, test_hours=0.003, heldout_snr_db=(9, 1))
