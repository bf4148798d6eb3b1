"""The report's tables of the paper's comparisons: the first screen (every comparison and its
verdict), workers, each two-way comparison, the explaining experiments and the yesno recipe."""

from __future__ import annotations

import statistics
from typing import Any

from labavg.studies.reproduction.paper import (HEADLINE, PAIRS, PAPER_WORKERS, WORKER_PAIRS, Pair,
                                               Probe, effect)
from labavg.studies.reproduction.prose import pair_sentence, yesno_sentence
from labavg.studies.reproduction.results import Run, paired, select, stat, trace_stat
from labavg.studies.reproduction.tables import (interval, markdown_table, mean_sd, percent,
                                                wer_interval_of)
from labavg.studies.reproduction.verdicts import WER_WORDS, spread, verdict


def _paper_cell(pair: Pair) -> str:
    return "-" if pair.paper is None else f"{pair.paper_effect:+.1f} ({pair.paper[0]} -> {pair.paper[1]})"


def headline_table(runs: list[Run], base: dict[str, Any]) -> list[str]:
    """Every comparison: its measured effect, the paper's, and the verdict of the one rule."""
    rows = []
    for pair in HEADLINE:
        e = effect(runs, base, pair)
        acc = f"{interval(e.accuracy)} ({e.accuracy_verdict})" if e.accuracy else "-"
        rows.append((pair.title, len(e.wer_values), interval(e.wer, 1), e.direction, acc,
                     _paper_cell(pair), f"**{e.verdict}**"))
    return markdown_table(
        ("comparison", "seeds", "WER change, % (100 ln ratio) [95 % CI]",
         "seeds in the paper's direction", "CV frame acc gain, points [95 % CI]",
         "paper's WER change, % (WER %)", "verdict"), rows)


def workers_table(runs: list[Run], base: dict[str, Any]) -> list[str]:
    """1 / 8 / 16 / 32 workers: WER, PER, frame accuracy, and the change against 1 worker."""
    same = {k: v for k, v in base.items() if k != "ranks"}
    effects = {p.worse: effect(runs, base, p) for p in WORKER_PAIRS}
    rows = []
    for n, paper in PAPER_WORKERS.items():
        here = select(runs, ranks=n, **same)
        updates = stat(here, "steps")
        e = effects.get(n)
        rows.append((
            n, len(here), "-" if updates is None else f"{updates.mean:,.0f}",
            mean_sd(stat(here, "wer")), wer_interval_of(here), mean_sd(stat(here, "per")),
            mean_sd(stat(here, "cv_acc_pct")), percent(trace_stat(here, "max_change_limited")),
            "-" if e is None else interval(e.wer, 1),
            f"{paper}" if e is None else f"{paper} ({e.pair.paper_effect:+.1f} %)",
            "-" if e is None else e.verdict))
    return markdown_table(
        ("workers", "seeds", "updates per worker", "WER % (mean ± sd)", "test-set 95 % CI", "PER %",
         "CV frame acc %", "updates cut by max-change",
         "WER change vs 1 worker, % (100 ln ratio) [95 % CI]", "paper WER % (change)", "verdict"),
        rows)


def pair_table(runs: list[Run], base: dict[str, Any], pair: Pair) -> list[str]:
    """One of the paper's two-way comparisons: both sides, the effect and its verdict."""
    e = effect(runs, base, pair)
    rows = []
    for i, (value, here) in enumerate(zip((pair.better, pair.worse), e.sides)):
        rows.append((value, len(here), mean_sd(stat(here, "wer")), wer_interval_of(here),
                     mean_sd(stat(here, "per")), mean_sd(stat(here, "cv_acc_pct")),
                     "-" if pair.paper is None else str(pair.paper[i])))
    table = markdown_table((pair.name, "seeds", "WER % (mean ± sd)", "test-set 95 % CI", "PER %",
                            "CV frame acc %", "paper WER %"), rows)
    return table + ["", pair_sentence(e)]


def comparison_sections(runs: list[Run], base: dict[str, Any]) -> list[str]:
    out = ["### Number of workers", ""] + workers_table(runs, base)
    for pair in PAIRS:
        out += ["", f"### {pair.title}", ""] + pair_table(runs, base, pair)
    return out


def probe_section(runs: dict[str, list[Run]], base: dict[str, Any], probe: Probe) -> list[str]:
    """One explaining experiment: each row's WER and accuracy, and its effect on WER."""
    found: dict[str, dict[int, Run]] = {}
    rows = []
    for label, sweep, want, against in probe.rows:
        fixed = {**{k: v for k, v in base.items() if k not in want}, **want}
        here = select(runs.get(sweep, []), **{k.replace(".", "__"): v for k, v in fixed.items()})
        found[label] = here
        diff, word = "-", "-"
        if against is not None:
            change = spread(paired(found[against], here, "wer", log=True))
            diff, word = f"{interval(change, 1)} vs {against}", verdict(change)
            word = WER_WORDS.get(word, word)
        lrs = [r.trace["epochs"][-1].get("lr") for r in here.values() if r.trace.get("epochs")]
        rows.append((label, len(here), mean_sd(stat(here, "wer")), diff, word,
                     mean_sd(stat(here, "cv_acc_pct")),
                     percent(trace_stat(here, "max_change_limited")),
                     "-" if not lrs else f"{statistics.fmean(lrs):.2g}"))
    return [f"### {probe.title}", "", probe.question, ""] + markdown_table(
        ("setting", "seeds", "WER % (mean ± sd)", "WER change, % (100 ln ratio) [95 % CI]",
         "verdict", "CV frame acc %", "updates cut by max-change", "final effective lr"), rows)


def _trace_cell(epoch: dict[str, Any], key: str, scale: float = 1.0, fmt: str = "{:.3g}") -> str:
    value = epoch.get(key)
    return "-" if value is None else fmt.format(scale * value)


def schedule_trace(runs: list[Run], base: dict[str, Any]) -> list[str]:
    """The learning rate and CV accuracy at each epoch end, exponential vs Newbob (seed 0)."""
    fixed = {k: v for k, v in base.items() if k not in ("ranks", "schedule")}
    exp = select(runs, **fixed, ranks=16, schedule="exponential", final_lr=None).get(0)
    nb = select(runs, **fixed, ranks=16, schedule="newbob").get(0)
    if exp is None or nb is None:
        return ["(seed 0 of both schedules not finished yet)"]
    e_ep = exp.trace.get("epochs", [])
    n_ep = nb.trace.get("epochs", [])
    rows = []
    for i in range(max(len(e_ep), len(n_ep))):
        e = e_ep[i] if i < len(e_ep) else {}
        n = n_ep[i] if i < len(n_ep) else {}
        rows.append((i + 1, _trace_cell(e, "lr"), _trace_cell(e, "cv_frame_accuracy", 100, "{:.2f}"),
                     _trace_cell(n, "lr"), _trace_cell(n, "cv_frame_accuracy", 100, "{:.2f}"),
                     n.get("accepted", "-")))
    return markdown_table(("epoch", "exponential: lr", "CV acc %", "Newbob: lr", "CV acc %",
                           "accepted"), rows)


def yesno_section(runs: list[Run], facts: dict[str, Any], sweep_file: Any) -> list[str]:
    """The real Kaldi recipe's runs: WER, PER and frame accuracy by workers and optimizer."""
    rows = []
    for n, opt in sorted({(r.get("ranks"), r.get("optimizer")) for r in runs}):
        here = select(runs, ranks=n, optimizer=opt)
        rows.append((n, opt, len(here), mean_sd(stat(here, "wer")), wer_interval_of(here),
                     mean_sd(stat(here, "per")), mean_sd(stat(here, "cv_acc_pct"))))
    return ["## Real data: Kaldi's yesno recipe", "", yesno_sentence(runs, facts, sweep_file),
            ""] + markdown_table(("workers", "optimizer", "seeds", "WER % (mean ± sd)",
                                  "test-set 95 % CI", "PER %", "CV frame acc %"), rows)
