"""Error rates with kaldialign: insertions, deletions, substitutions, and a bootstrap interval."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import kaldialign

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
