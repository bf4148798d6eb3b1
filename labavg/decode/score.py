"""Error rates with kaldialign: insertions, deletions, substitutions, bootstrap intervals, and the
paired comparison of two systems on the same references."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import kaldialign
import numpy as np

BOOTSTRAP_REPLICATIONS = 1000
BOOTSTRAP_SEED = 0


@dataclass(frozen=True)
class ErrorRate:
    """An error rate in percent with its 95 % bootstrap interval (over utterances, seeded)."""

    rate: float
    ci_low: float
    ci_high: float
    errors: int
    ref_tokens: int
    ins: int
    dels: int
    subs: int
    sentences: int
    sentence_errors: int

    def kaldi_lines(self, kind: str = "WER") -> str:
        """compute-wer's output lines (plus the interval, as compute-wer-bootci reports it)."""
        ser = 100.0 * self.sentence_errors / max(self.sentences, 1)
        return (f"%{kind} {self.rate:.2f} [ {self.errors} / {self.ref_tokens}, {self.ins} ins, "
                f"{self.dels} del, {self.subs} sub ]\n"
                f"%SER {ser:.2f} [ {self.sentence_errors} / {self.sentences} ]\n"
                f"95% CI [{self.ci_low:.2f}, {self.ci_high:.2f}] (bootstrap over utterances, "
                f"{BOOTSTRAP_REPLICATIONS} replications, seed {BOOTSTRAP_SEED})\n")

    def to_dict(self) -> dict:
        """Plain values for JSON."""
        return asdict(self)


def error_rate(refs: list[list[str]], hyps: list[list[str]]) -> ErrorRate:
    """Token error rate of hyps against refs (utterance by utterance), in percent."""
    if len(refs) != len(hyps):
        raise ValueError(f"{len(refs)} references but {len(hyps)} hypotheses")
    ins = dels = subs = ref_tokens = sentence_errors = 0
    for ref, hyp in zip(refs, hyps):
        d = kaldialign.edit_distance(ref, hyp)
        ins, dels, subs = ins + d["ins"], dels + d["del"], subs + d["sub"]
        ref_tokens += len(ref)
        sentence_errors += d["total"] > 0
    errors = ins + dels + subs
    rate = 100.0 * errors / max(ref_tokens, 1)
    low = high = rate
    if refs and ref_tokens:
        # kaldialign maps tokens to ints; an empty reference would divide by zero there.
        pairs = [(r, h) for r, h in zip(refs, hyps) if r]
        ci = kaldialign.bootstrap_wer_ci([r for r, _ in pairs], [h for _, h in pairs],
                                         replications=BOOTSTRAP_REPLICATIONS, seed=BOOTSTRAP_SEED)
        low, high = 100.0 * max(ci["ci95min"], 0.0), 100.0 * ci["ci95max"]
    return ErrorRate(rate=rate, ci_low=low, ci_high=high, errors=errors, ref_tokens=ref_tokens,
                     ins=ins, dels=dels, subs=subs, sentences=len(refs),
                     sentence_errors=int(sentence_errors))


@dataclass(frozen=True)
class Comparison:
    """System B against system A on the same references: B - A in points, paired interval.

    `p_b_better` is the share of bootstrap replications in which B makes fewer errors than A
    (Kaldi's compute-wer-bootci "probability of improvement"); 0.5 means no evidence either way.
    """

    a: ErrorRate
    b: ErrorRate
    diff: float
    diff_ci_low: float
    diff_ci_high: float
    p_b_better: float
    replications: int

    @property
    def resolved(self) -> bool:
        """True when the paired 95 % interval of the difference excludes 0."""
        return self.diff_ci_low > 0 or self.diff_ci_high < 0

    def to_dict(self) -> dict:
        """Plain values for JSON."""
        return asdict(self) | {"resolved": self.resolved}


def _utterance_errors(refs: list[list[str]], hyps: list[list[str]]) -> np.ndarray:
    return np.array([kaldialign.edit_distance(r, h)["total"] for r, h in zip(refs, hyps)],
                    dtype=np.int64)


def compare_error_rates(refs: list[list[str]], hyps_a: list[list[str]], hyps_b: list[list[str]],
                        replications: int = BOOTSTRAP_REPLICATIONS, seed: int = BOOTSTRAP_SEED
                        ) -> Comparison:
    """Paired bootstrap over utterances (Bisani & Ney 2004) of WER(B) - WER(A), in points.

    Both systems are scored on the same resampled utterances in each replication, so what the
    test set's utterances do to both (hard speakers, long sentences) cancels; the interval is that
    of the difference, much narrower than the two systems' own intervals combined. The interval is
    the 2.5 / 97.5 percentiles of the replicated differences; the point estimate is the observed
    difference on the whole set.
    """
    if not len(refs) == len(hyps_a) == len(hyps_b):
        raise ValueError(f"{len(refs)} references but {len(hyps_a)} and {len(hyps_b)} hypotheses")
    a, b = error_rate(refs, hyps_a), error_rate(refs, hyps_b)
    diff = b.rate - a.rate
    low = high = diff
    p_better = 0.5
    pairs = [i for i, r in enumerate(refs) if r]
    if pairs:
        lengths = np.array([len(r) for r in refs], dtype=np.int64)
        delta = _utterance_errors(refs, hyps_b) - _utterance_errors(refs, hyps_a)
        # Each replication draws len(refs) utterances with replacement, the same for A and B.
        draws = np.random.default_rng(seed).integers(0, len(refs), size=(replications, len(refs)))
        diffs = 100.0 * delta[draws].sum(axis=1) / np.maximum(lengths[draws].sum(axis=1), 1)
        low, high = (float(x) for x in np.percentile(diffs, [2.5, 97.5]))
        # kaldialign divides by the reference length; empty references are left out, as above.
        boot = kaldialign.bootstrap_wer_ci([refs[i] for i in pairs], [hyps_a[i] for i in pairs],
                                           [hyps_b[i] for i in pairs], replications=replications,
                                           seed=seed)
        p_better = float(boot["p_s2_improv_over_s1"])
    return Comparison(a=a, b=b, diff=diff, diff_ci_low=low, diff_ci_high=high,
                      p_b_better=p_better, replications=replications)
