"""Beyond the paper: plain model averaging against BMUF and DiLoCo, in REPRODUCTION.md.

experiments/beyond.toml trains every averaging method (labavg.averagers) at 16 and 32 workers,
averaging every K = 10, 50 and 200 minibatches, on the reproduction's corpus, with seeds. This
module turns its finished runs into the report's section: a table per number of workers, the
verdicts of each method against the paper's plain average at the same workers, K and seed, and
a figure of WER against the megabytes each worker sent.

Verdicts are made as in labavg.reproduction: the per-seed paired difference of WER gets a 95 %
t-interval of its mean, and one method is better than the other only when the interval
excludes zero ("within noise" otherwise).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from labavg.reproduction import Run, Spread, _interval, _mean_sd, _num, paired, select, spread

METHODS = ("model", "bmuf", "diloco")
# The paper's averaging interval: what every other point is compared against.
PAPER_K = 10
_LABELS = {"model": "model (the paper's)", "bmuf": "BMUF", "diloco": "DiLoCo"}
_SHORT = {"model": "model", "bmuf": "BMUF", "diloco": "DiLoCo"}


def _payload(run: Run) -> str:
    """A run's payload: fp32, bf16, fp16, or int<bits> (fp32 for runs from before payloads)."""
    kind = run.get("payload") or "fp32"
    return f"int{run.get('payload_bits')}" if kind == "int" else kind


def _cell(runs: list[Run], ranks: int, k: int, method: str, payload: str = "fp32") -> dict[int, Run]:
    # The payload first: `select` keeps one run per seed, and the payloads share every setting
    # `select` looks at.
    return select([r for r in runs if _payload(r) == payload], ranks=ranks, average_every=k,
                  averaging=method)


def _points(runs: list[Run]) -> list[tuple[int, int, str, str]]:
    """(ranks, K, method, payload) of every multi-worker cell, in the table's order."""
    keys = {(r.get("ranks"), r.get("average_every"), r.get("averaging") or "model", _payload(r))
            for r in runs if (r.get("ranks") or 1) > 1}
    order = {m: i for i, m in enumerate(METHODS)}
    return sorted(keys, key=lambda p: (p[0], p[1], order.get(p[2], len(order)), p[3] != "fp32", p[3]))


def _mb(run: Run) -> float | None:
    sent = run.summary.get("bytes_sent")
    return None if sent is None else sent / 1e6


def _stat(cell: dict[int, Run], metric: str) -> Spread | None:
    return spread([v for v in (r.metric(metric) for r in cell.values()) if v is not None])


def _mean_mb(cell: dict[int, Run]) -> float | None:
    values = [v for v in map(_mb, cell.values()) if v is not None]
    return sum(values) / len(values) if values else None


def compare(better: dict[int, Run], worse: dict[int, Run],
            metric: str = "wer") -> tuple[Spread | None, str]:
    """The paired gain of `better` over the reference `worse` per seed (WER: reference minus
    it; frame accuracy, where higher is better: it minus the reference) and what it says:
    "better", "worse" (than the reference) or "within noise"."""
    gains = paired(better, worse, metric)
    diff = spread([-g for g in gains] if metric == "cv_frame_accuracy" else gains)
    if diff is None:
        return None, "not run"
    if diff.n < 2:
        return diff, "needs 2+ seeds"
    if diff.low > 0:
        return diff, "better"
    if diff.high < 0:
        return diff, "worse"
    return diff, "within noise"


def table(runs: list[Run], one_worker: dict[int, Run]) -> list[str]:
    """One row per (workers, K, method, payload): WER, frame accuracy, bytes, and the paired
    WER difference against plain averaging at the same workers and K."""
    out = ["| workers | K | method | payload | seeds | WER % (mean ± sd) | CV frame acc % | "
           "MB sent per worker | rounds | WER gain over model, points [95 % CI] | verdict |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    if one_worker:
        out.append(f"| 1 | - | - | - | {len(one_worker)} | {_mean_sd(_stat(one_worker, 'wer'))} | "
                   f"{_mean_sd(_stat(one_worker, 'cv_frame_accuracy'))} | 0 | 0 | - | reference |")
    for ranks, k, method, payload in _points(runs):
        cell = _cell(runs, ranks, k, method, payload)
        rounds = [r.summary.get("averaging_rounds") for r in cell.values()]
        rounds = [x for x in rounds if x is not None]
        if method == "model" and payload == "fp32":
            gain, word = "-", "reference"
        else:
            diff, word = compare(cell, _cell(runs, ranks, k, "model"))
            gain = _interval(diff)
        out.append(
            f"| {ranks} | {k} | {_LABELS.get(method, method)} | {payload} | {len(cell)} | "
            f"{_mean_sd(_stat(cell, 'wer'))} | {_mean_sd(_stat(cell, 'cv_frame_accuracy'))} | "
            f"{_num(_mean_mb(cell), 1)} | {round(sum(rounds) / len(rounds)) if rounds else '-'} | "
            f"{gain} | {word} |")
    return out


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
                            f"{word}: {_interval(diff)} points of WER"))
            for k in ks:
                cell = _cell(runs, ranks, k, method)
                if not cell:
                    continue
                diff, word = compare(cell, _cell(runs, ranks, k, "model"), "cv_frame_accuracy")
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
                            f"K = {PAPER_K}, {ranks} workers", f"{word}: {_interval(diff)} points"))
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
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return path


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
        "lower is better; the gain is model's WER minus the method's, per seed.", "",
    ]
    if figure_path is not None and figure_path.is_file():
        rel = os.path.relpath(figure_path.resolve(), report.resolve().parent)
        out += [f"![WER against bytes sent]({rel})", ""]
    out += table(runs, one_worker) + ["", "Verdicts (paired over seeds, 95 % t-intervals):", ""]
    out += [f"- {question}: **{answer}**" for question, answer in verdicts(runs)]
    return out
