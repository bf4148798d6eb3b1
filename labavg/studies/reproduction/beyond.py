"""Beyond the paper: plain model averaging against BMUF and DiLoCo, in REPRODUCTION.md.

experiments/beyond.toml trains every averaging method (labavg.averaging.methods) at 16 and 32 workers,
averaging every K = 10, 50 and 200 minibatches, on the reproduction's corpus, with seeds. This
module turns its finished runs into the report's section: a table per number of workers, the
verdicts of each method against the paper's plain average at the same workers, K and seed, and
a figure of WER against the megabytes each worker sent.

Verdicts follow labavg.studies.reproduction.verdicts' one rule, against zero (there is no paper figure): the per-seed
effect (WER: 100 x ln of the reference's WER over the method's; frame accuracy: the method's
minus the reference's, points) gets a 95 % t-interval; "better" or "worse" when it excludes
zero, "same" when it lies within the margin of zero, "unresolved" (with the seeds that would
decide) otherwise.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from labavg.averaging.registry import MethodTable
from labavg.studies.reproduction.tables import interval as _interval
from labavg.studies.reproduction.tables import markdown_table
from labavg.studies.reproduction.tables import mean_sd as _mean_sd
from labavg.studies.reproduction.tables import num as _num
from labavg.studies.reproduction.tables import words
from labavg.studies.reproduction.figures import save_png
from labavg.studies.reproduction.results import Run, paired, select
from labavg.studies.reproduction.results import stat as _stat
from labavg.studies.reproduction.verdicts import (ACCURACY_MARGIN, NEGATIVE, POSITIVE, WER_MARGIN, ZERO,
                                                Spread, spread, verdict)

METHODS = MethodTable(lambda cls: cls.method)  # the registered methods, by name
# The paper's averaging interval: what every other point is compared against.
PAPER_K = 10
_LABELS = MethodTable(lambda cls: cls.label)
_SHORT = MethodTable(lambda cls: cls.short)


def _payload(run: Run) -> str:
    """A run's payload: fp32, bf16, fp16, or int<bits> (fp32 for runs from before payloads)."""
    kind = run.get("averaging.payload") or "fp32"
    return f"int{run.get('averaging.payload_bits')}" if kind == "int" else kind


def _cell(runs: list[Run], ranks: int, k: int, method: str, payload: str = "fp32") -> dict[int, Run]:
    # The payload first: `select` keeps one run per seed, and the payloads share every setting
    # `select` looks at.
    return select([r for r in runs if _payload(r) == payload], ranks=ranks,
                  averaging__average_every=k, averaging__method=method)


def _points(runs: list[Run]) -> list[tuple[int, int, str, str]]:
    """(ranks, K, method, payload) of every multi-worker cell, in the table's order."""
    keys = {(r.get("ranks"), r.get("averaging.average_every"), r.get("averaging.method") or "model",
             _payload(r))
            for r in runs if (r.get("ranks") or 1) > 1}
    order = {m: i for i, m in enumerate(METHODS)}
    return sorted(keys, key=lambda p: (p[0], p[1], order.get(p[2], len(order)), p[3] != "fp32", p[3]))


def _mb(run: Run) -> float | None:
    sent = run.summary.bytes_sent
    return None if sent is None else sent / 1e6


def _mean_mb(cell: dict[int, Run]) -> float | None:
    values = [v for v in map(_mb, cell.values()) if v is not None]
    return sum(values) / len(values) if values else None


def compare(better: dict[int, Run], worse: dict[int, Run],
            metric: str = "wer") -> tuple[Spread | None, str]:
    """The paired gain of `better` over the reference `worse` per seed (WER: 100 x ln of the
    reference's over its; frame accuracy, where higher is better: it minus the reference, in
    points) and the rule's word for it: "better", "worse", "same" or unresolved."""
    if metric == "cv_acc_pct":
        diff, margin = spread(paired(worse, better, metric)), ACCURACY_MARGIN
    else:
        diff, margin = spread(paired(better, worse, metric, log=True)), WER_MARGIN
    word = verdict(diff, None, margin)
    return diff, {POSITIVE: "better", NEGATIVE: "worse", ZERO: "same"}.get(word, word)


def table(runs: list[Run], one_worker: dict[int, Run]) -> list[str]:
    """One row per (workers, K, method, payload): WER, frame accuracy, bytes, and the paired
    WER difference against plain averaging at the same workers and K."""
    rows = []
    if one_worker:
        rows.append((1, "-", "-", "-", len(one_worker), _mean_sd(_stat(one_worker, "wer")),
                     _mean_sd(_stat(one_worker, "cv_acc_pct")), 0, 0, "-", "reference"))
    for ranks, k, method, payload in _points(runs):
        cell = _cell(runs, ranks, k, method, payload)
        rounds = [r.summary.averaging_rounds for r in cell.values()]
        rounds = [x for x in rounds if x is not None]
        if method == "model" and payload == "fp32":
            gain, word = "-", "reference"
        else:
            diff, word = compare(cell, _cell(runs, ranks, k, "model"))
            gain = _interval(diff, 1)
        rows.append((ranks, k, _LABELS.get(method, method), payload, len(cell),
                     _mean_sd(_stat(cell, "wer")), _mean_sd(_stat(cell, "cv_acc_pct")),
                     _num(_mean_mb(cell), 1), round(sum(rounds) / len(rounds)) if rounds else "-",
                     gain, word))
    return markdown_table(
        ("workers", "K", "method", "payload", "seeds", "WER % (mean ± sd)", "CV frame acc %",
         "MB sent per worker", "rounds", "WER gain over model, % (100 ln ratio) [95 % CI]",
         "verdict"), rows)


def verdicts(runs: list[Run]) -> list[tuple[str, str]]:
    """(question, answer) for each method against plain averaging: at the same K in WER and
    in CV frame accuracy (which the test set's few thousand words often cannot resolve, and
    the CV frames can), and at a longer K against the paper's K = 10 in WER (the same error
    rate for fewer bytes?)."""
    out = []
    points = _points(runs)
    for ranks in sorted({p[0] for p in points}):
        ks = sorted({p[1] for p in points if p[0] == ranks})
        for method in [m for m in METHODS if m != "model"]:
            for k in ks:
                cell = _cell(runs, ranks, k, method)
                if not cell:
                    continue
                diff, word = compare(cell, _cell(runs, ranks, k, "model"))
                out.append((f"{_SHORT[method]} vs model, {ranks} workers, K = {k}",
                            f"{word}: {_interval(diff, 1)} % of WER"))
            for k in ks:
                cell = _cell(runs, ranks, k, method)
                if not cell:
                    continue
                diff, word = compare(cell, _cell(runs, ranks, k, "model"), "cv_acc_pct")
                out.append((f"{_SHORT[method]} vs model, {ranks} workers, K = {k}, CV frame "
                            "accuracy", f"{word}: {_interval(diff)} points"))
        for method in METHODS:
            for k in [k for k in ks if k > PAPER_K]:
                cell, ref = _cell(runs, ranks, k, method), _cell(runs, ranks, PAPER_K, "model")
                if not cell or not ref:
                    continue
                diff, word = compare(cell, ref)
                ratio = (_mean_mb(ref) or math.nan) / (_mean_mb(cell) or math.nan)
                out.append((f"{_SHORT[method]} at K = {k} ({ratio:.0f}x fewer bytes) vs model at "
                            f"K = {PAPER_K}, {ranks} workers",
                            f"{word}: {_interval(diff, 1)} % of WER"))
    return out


_COLORS = {"model": "#d62728", "bmuf": "#2ca02c", "diloco": "#1f77b4"}
_MARKERS = {"fp32": "o", "bf16": "s", "fp16": "D", "int16": "P", "int8": "^", "int4": "v"}


def figure(runs: list[Run], one_worker: dict[int, Run], path: Path) -> Path:
    """WER against MB sent per worker (log scale), one panel per number of workers: a line per
    method through its K values (fp32), a marker per payload; the one-worker WER dashed."""
    import matplotlib

    matplotlib.use("Agg")  # files only, whatever backend a notebook chose
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    points = _points(runs)
    workers = sorted({p[0] for p in points}) or [16]
    one = _stat(one_worker, "wer")
    fig, axes = plt.subplots(1, len(workers), figsize=(5.6 * len(workers), 4.4), squeeze=False,
                             sharey=True)
    for ax, ranks in zip(axes[0], workers):
        for method in METHODS:
            for payload in sorted({p[3] for p in points if p[0] == ranks and p[2] == method},
                                  key=lambda x: (x != "fp32", x)):
                data = []
                for k in sorted({p[1] for p in points if p[0] == ranks and p[2] == method
                                 and p[3] == payload}):
                    cell = _cell(runs, ranks, k, method, payload)
                    wer, mb = _stat(cell, "wer"), _mean_mb(cell)
                    if wer is not None and mb:
                        data.append((mb, wer.mean, k, len(cell)))
                if not data:
                    continue
                label = _LABELS[method] + ("" if payload == "fp32" else f", {payload}")
                xs, ys = [d[0] for d in data], [d[1] for d in data]
                ax.plot(xs, ys, marker=_MARKERS.get(payload, "o"), color=_COLORS[method],
                        linestyle="-" if payload == "fp32" else "none", label=label)
                if payload == "fp32":
                    for mb, wer, k, _ in data:
                        ax.annotate(f"K={k}", (mb, wer), textcoords="offset points",
                                    xytext=(4, 4), fontsize=8, color=_COLORS[method])
        if one is not None:
            ax.axhline(one.mean, color="grey", linestyle="--", linewidth=1, label="1 worker")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda x, _: ""))
        ax.set_xlabel("MB sent per worker, whole run (log scale)")
        ax.set_title(f"{ranks} workers")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best", framealpha=0.8)
    axes[0][0].set_ylabel("WER on the test set (%), mean over seeds")
    return save_png(fig, path)


def section(runs: list[Run], sweep_file: Path, figure_path: Path | None, report: Path) -> list[str]:
    """The report's "Beyond the paper" section (markdown lines) from beyond.toml's runs."""
    one_worker = select([r for r in runs if r.get("ranks") == 1])
    settings: dict[str, Any] = runs[0].settings if runs else {}
    out = [
        "## Beyond the paper: BMUF and DiLoCo", "",
        f"Made by `labavg sweep {sweep_file}` (also run by this command): the paper's plain "
        "average against BMUF (Chen & Huo 2016) and DiLoCo (Douillard et al. 2023) with their "
        "documented defaults (docs/averaging.md), at 16 and 32 workers, averaging every K "
        f"minibatches; the same corpus as the comparisons above, {settings.get('epochs', '-')} "
        f"epochs of minibatch {settings.get('minibatch', '-')}, learning rate "
        f"{settings.get('lr', '-')} x N for every method. Every method sends the same bytes per "
        "round (the fp32 parameters), so the bytes sent fall with K alone. WER on the test set, "
        "lower is better; the gain is 100 x ln of model's WER over the method's, per seed (about "
        "the relative change in %).", "",
    ]
    if figure_path is not None and figure_path.is_file():
        rel = os.path.relpath(figure_path.resolve(), report.resolve().parent)
        out += [f"![WER against bytes sent]({rel})", ""]
    out += table(runs, one_worker) + ["", "Verdicts (the report's rule, against zero):", ""]
    out += [f"- {question}: **{answer}**" for question, answer in verdicts(runs)]
    return out


def fix_sentence(runs: list[Run]) -> str:
    """What the successors do for many workers at the paper's K, in words written from the
    runs: the methods that beat plain averaging in CV frame accuracy at every number of
    workers, and by how much (empty without such a method)."""
    points = _points(runs)
    workers = sorted({p[0] for p in points})
    winners, gains, wer_gains = [], [], []
    for method in [m for m in METHODS if m != "model"]:
        found = []
        for ranks in workers:
            cell, ref = _cell(runs, ranks, PAPER_K, method), _cell(runs, ranks, PAPER_K, "model")
            acc, word = compare(cell, ref, "cv_acc_pct")
            wer, wer_word = compare(cell, ref)
            if not cell or not ref or word != "better":
                break
            found.append((acc, wer, wer_word))
        if workers and len(found) == len(workers):
            winners.append(_SHORT[method])
            gains += [f[0].mean for f in found]
            wer_gains += [(f[1].mean, f[2]) for f in found if f[1] is not None]
    if not winners:
        return ""
    resolved = sum(1 for _, w in wer_gains if w == "better")
    return (f"What fixes the loss to averaging here is in the Beyond section: at the paper's "
            f"K = {PAPER_K}, {words(winners)} beat plain averaging at "
            f"{words([str(w) for w in workers])} workers by {min(gains):+.1f} to "
            f"{max(gains):+.1f} points of CV frame accuracy (every interval above zero) and by "
            f"{min(g for g, _ in wer_gains):+.1f} to {max(g for g, _ in wer_gains):+.1f} % in WER "
            f"({resolved} of {len(wer_gains)} WER intervals above zero).")
