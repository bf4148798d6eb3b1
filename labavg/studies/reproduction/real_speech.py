"""The report's Real speech section: Debian's Asterisk prompts (experiments/asterisk.toml) by
number of workers, each N against 1 worker seed by seed under the one rule, beside the same
comparison on the built-in corpus (paper.toml's runs at that N, where it trains one)."""

from __future__ import annotations

from typing import Any

from labavg.studies.reproduction.results import Run, paired, select, stat
from labavg.studies.reproduction.tables import interval, markdown_table, mean_sd, wer_interval_of
from labavg.studies.reproduction.verdicts import WER_WORDS, Spread, spread, verdict

TITLE = "## Real speech: Debian's Asterisk prompts"


def against_one_worker(runs: list[Run], n: int, **fixed: Any) -> tuple[Spread | None, str]:
    """N workers' WER change against 1 worker (100 ln ratio per seed) and its verdict, read
    against zero: the paper has no figure for this corpus."""
    change = spread(paired(select(runs, ranks=1, **fixed), select(runs, ranks=n, **fixed), "wer",
                           log=True))
    word = verdict(change)
    return change, WER_WORDS.get(word, word)


def rows(runs: list[Run], paper_runs: list[Run], base: dict[str, Any]) -> list[tuple]:
    """One row per number of workers: the real corpus's scores and change, then the built-in
    corpus's change at the same N ("-" where either side has no runs to pair)."""
    synthetic = {k.replace(".", "__"): v for k, v in base.items() if k != "ranks"}
    out = []
    for n in sorted({int(r.get("ranks")) for r in runs}):
        here = select(runs, ranks=n)
        changes: list[str] = []
        for group, fixed in ((runs, {}), (paper_runs, synthetic)):
            change, word = (None, "-") if n == 1 else against_one_worker(group, n, **fixed)
            changes += ["-", "-"] if change is None else [interval(change, 1), word]
        out.append((n, len(here), mean_sd(stat(here, "wer")), wer_interval_of(here),
                    mean_sd(stat(here, "per")), mean_sd(stat(here, "cv_acc_pct")), *changes))
    return out


def _about(runs: list[Run], sweep_file: Any) -> str:
    first = runs[0]
    model = (f"{first.get('model.hidden_layers')} x {first.get('model.hidden_dim')}, "
             f"{first.get('optimizer')}, {first.get('epochs')} epochs")
    seeds = len({r.seed for r in runs})
    return (f"Made by `labavg sweep {sweep_file}` (also run by this command once "
            "`bash scripts/asterisk-corpus.sh data/asterisk` has installed and prepared the "
            "prompts; docs/corpus.md says how they are aligned and split). One speaker's 8 kHz "
            f"recorded prompts, {model}, {seeds} seeds per number of workers; decoded on the test "
            "prompts with a unigram language model of the training prompts. The paper has no "
            "figure for this corpus, so each change against 1 worker is read against zero only "
            "(higher, lower or the same WER, or unresolved). The last two columns are the same "
            "comparison on the built-in corpus (experiments/paper.toml, which trains 1, 8, 16 "
            "and 32 workers; its model and corpus differ, so compare directions, not sizes).")


def section(runs: list[Run], paper_runs: list[Run], base: dict[str, Any], sweep_file: Any) -> list[str]:
    """The Real speech section of REPRODUCTION.md."""
    table = markdown_table(
        ("workers", "seeds", "WER % (mean ± sd)", "test-set 95 % CI", "PER %", "CV frame acc %",
         "WER change vs 1 worker, % (100 ln ratio) [95 % CI]", "verdict",
         "built-in corpus: WER change vs 1 worker [95 % CI]", "built-in corpus: verdict"),
        rows(runs, paper_runs, base))
    return [TITLE, "", _about(runs, sweep_file), ""] + table
