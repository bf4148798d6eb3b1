"""Two runs' decodes of the same set compared: WER difference with a paired bootstrap."""

from __future__ import annotations

import os

from labavg.base.errors import DataError
from labavg.decode.decode_dir import Decoded, read_decode_dir
from labavg.decode.score import Comparison, ErrorRate, compare_error_rates


def compare_decodes(run_a: str | os.PathLike, run_b: str | os.PathLike, set_name: str = "test",
                    ) -> tuple[Decoded, Decoded, Comparison]:
    """Run B against run A on the same decoded set, each at its own reported scale.

    WER(B) - WER(A) with the paired bootstrap's 95 % interval and the probability that B is
    better. The two runs must have decoded the same utterances with the same references.
    """
    a, b = read_decode_dir(run_a, set_name), read_decode_dir(run_b, set_name)
    if a.refs.keys() != b.refs.keys():
        only = sorted(a.refs.keys() ^ b.refs.keys())
        raise DataError(f"{a.decode_dir} and {b.decode_dir} decoded different utterances "
                        f"({len(only)} not in both, e.g. {only[0]!r}): not the same test set")
    keys = sorted(a.refs)
    differ = [k for k in keys if a.refs[k] != b.refs[k]]
    if differ:
        raise DataError(f"{a.decode_dir}/ref.txt and {b.decode_dir}/ref.txt differ for "
                        f"{len(differ)} utterances (e.g. {differ[0]!r}): not the same references")
    comparison = compare_error_rates([a.refs[k] for k in keys], [a.hyps[k] for k in keys],
                                     [b.hyps[k] for k in keys])
    return a, b, comparison


def format_comparison(a: Decoded, b: Decoded, c: Comparison, set_name: str = "test") -> str:
    """The comparison for the terminal: both WERs with intervals, then B - A."""
    def line(tag: str, d: Decoded, r: ErrorRate) -> str:
        return (f"{tag} {d.run_dir}: WER {r.rate:.2f} % (95% CI {r.ci_low:.2f}-{r.ci_high:.2f}) "
                f"[ {r.errors} / {r.ref_tokens} ] at acwt {d.acwt:g}")

    verdict = ("resolved: the interval excludes 0" if c.resolved
               else "not resolved: the interval contains 0")
    return "\n".join([
        f"{set_name}: {c.a.sentences} utterances, {c.a.ref_tokens} words",
        line("A", a, c.a), line("B", b, c.b),
        f"B - A: {c.diff:+.2f} points (95% CI {c.diff_ci_low:+.2f} to {c.diff_ci_high:+.2f}, "
        f"paired bootstrap over utterances, {c.replications} replications); "
        f"P(B better) = {c.p_b_better:.3f}; {verdict}"])
