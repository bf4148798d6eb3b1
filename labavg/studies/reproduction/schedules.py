"""Beyond the paper: averaging schedules against constant K, in REPRODUCTION.md.

experiments/schedules.toml holds the corpus, the base settings (K0 = averaging.average_every,
averaging.post_local_frames) and a grid of seeds, numbers of workers and
`averaging.schedule` = constant, post_local, adacomm (labavg.averaging.schedule). `run_all`
trains, one run at a time:

1. every point of the grid, into OUT/runs/ARM-nN-sSEED (ARM: the schedule; constant is the
   reference at equal K0);
2. then, for each (N, seed, schedule), the equal-bytes reference: a constant run at
   K_eq = round(steps / rounds) of that schedule's run (`k_equal_bytes`), into
   OUT/runs/constant-kK-nN-sSEED. Every round sends the same fp32 model, so equal rounds are
   equal bytes. The rounds are the run's `averaging_rounds`, epoch-end rounds included (a
   constant run has them too, so its rounds come out near, not exactly at, the schedule's:
   the table shows both). Two schedules with the same K_eq share one run; a K_eq equal to K0
   is the constant K0 run itself.

Resumable: a run with a summary.json is kept, any other is trained again from the start.
`section` writes the report's section from the finished (or recorded) runs: a table per N
and the verdicts of each schedule against constant at equal K0 and at equal bytes, paired by
seed, under the report's one rule (labavg.studies.reproduction.beyond.compare).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from labavg.base.errors import UserError
from labavg.studies.reproduction.beyond import compare
from labavg.studies.reproduction.figures import save_png
from labavg.studies.reproduction.results import Run, paired, stat
from labavg.studies.reproduction.verdicts import spread
from labavg.studies.reproduction.tables import interval, markdown_table, mean_sd, num, words

CONSTANT = "constant"
FIGURE = "schedules-vs-constant.png"  # beside the report's other figures
SCHEDULE_KEY = "averaging.schedule"
_LABELS = {"constant": "constant K", "post_local": "post-local SGD (Lin et al. 2020)",
           "adacomm": "AdaComm (Wang & Joshi 2019)"}
# A schedule's K in the table, from K0.
_K_OF = {"post_local": "1, then K0 = {k0}", "adacomm": "K0 = {k0}, then ≤ K0"}


def k_equal_bytes(steps: int | None, rounds: int | None) -> int | None:
    """The constant K whose rounds match a schedule run's: round(steps / rounds), at least 1
    (None without both numbers)."""
    if not steps or not rounds:
        return None
    return max(1, round(steps / rounds))


def run_name(arm: str, ranks: int, seed: int, k: int | None = None) -> str:
    """A run's directory name: ARM-nN-sSEED, or constant-kK-nN-sSEED for an equal-bytes run."""
    return f"{arm}{'' if k is None else f'-k{k}'}-n{ranks}-s{seed}"


def parse_name(name: str) -> tuple[str, int | None, int, int] | None:
    """(arm, K of an equal-bytes run or None, N, seed) of a run_name, None for another name."""
    parts = name.split("-")
    try:
        seed, ranks = int(parts[-1].removeprefix("s")), int(parts[-2].removeprefix("n"))
        k = int(parts[-3].removeprefix("k")) if len(parts) == 4 else None
    except (ValueError, IndexError):
        return None
    if len(parts) not in (3, 4) or (k is not None and parts[0] != CONSTANT):
        return None
    return parts[0], k, ranks, seed


def check_sweep(sweep, path: Path) -> list[tuple[str, int, int, dict[str, Any]]]:
    """(arm, N, seed, overrides) of every point of schedules.toml's grid, or a UserError that
    says what the file lacks: seeds, numbers of workers, the constant reference and at least
    one schedule, every point at K0 (no average_every_frames) and fp32 rounds."""
    from labavg.base.settings import with_overrides

    points, seen = [], set()
    for _, overrides in sweep.points():
        cfg = with_overrides(sweep.base, overrides)
        if cfg.averaging.average_every_frames is not None or cfg.averaging.payload != "fp32":
            raise UserError(f"{path}: every run averages every averaging.average_every minibatches "
                            "(K0) and sends fp32 rounds (equal rounds must mean equal bytes)")
        seen.add(cfg.averaging.schedule)
        points.append((cfg.averaging.schedule, cfg.ranks, cfg.seed, overrides))
    for key, what in (("seed", "the seeds"), ("ranks", "the numbers of workers"),
                      (SCHEDULE_KEY, "the schedules")):
        if not any(key in grid for grid in sweep.grids):
            raise UserError(f"{path}: its [[grid]] has no {key!r} ({what} to compare)")
    if CONSTANT not in seen or len(seen) < 2:
        raise UserError(f"{path}: {SCHEDULE_KEY} must list \"constant\" (the reference) and at "
                        f"least one schedule; it lists {sorted(seen)}")
    if len({p[2] for p in points}) < 2:
        raise UserError(f"{path}: the report's verdicts need at least 2 seeds")
    return points


def run_all(sweep_file: Path, out: Path) -> None:
    """Train every missing run of `sweep_file` into OUT/runs: the grid, then the equal-bytes
    constant runs (module docstring)."""
    from labavg.base.settings import with_overrides
    from labavg.jobs.summary import load_summary
    from labavg.studies.sweep import load_sweep, make_corpora

    sweep = load_sweep(sweep_file)
    points = check_sweep(sweep, sweep_file)
    make_corpora(sweep)
    runs = out / "runs"
    for arm, ranks, seed, overrides in points:
        _train(with_overrides(sweep.base, overrides), runs / run_name(arm, ranks, seed))
    k0 = sweep.base.averaging.average_every
    for arm, ranks, seed, overrides in points:
        if arm == CONSTANT:
            continue
        summary = load_summary(runs / run_name(arm, ranks, seed))
        k = k_equal_bytes(summary.steps, summary.averaging_rounds)
        if k is None or k == k0:
            continue
        cfg = with_overrides(sweep.base, {**overrides, SCHEDULE_KEY: CONSTANT,
                                          "averaging.average_every": k})
        _train(cfg, runs / run_name(CONSTANT, ranks, seed, k))


def _train(cfg, run: Path) -> None:
    from labavg.base.settings import with_overrides
    from labavg.jobs.launch import start_run

    if (run / "summary.json").is_file():
        return
    shutil.rmtree(run, ignore_errors=True)
    print(f"labavg reproduce: schedules: training {run.name}", flush=True)
    start_run(with_overrides(cfg, {"out": str(run.resolve())})).result()


def _by_name(runs: list[Run], ranks: int) -> dict[str, Run]:
    return {r.name: r for r in runs if (parse_name(r.name) or (None, None, None))[2] == ranks}


def _arm(runs: dict[str, Run], arm: str) -> dict[int, Run]:
    """The runs of one grid arm (not the equal-bytes ones), by seed."""
    return {p[3]: r for n, r in runs.items()
            if (p := parse_name(n)) is not None and p[0] == arm and p[1] is None}


def _k0(runs: dict[str, Run]) -> int | None:
    return next((r.get("averaging.average_every") for r in _arm(runs, CONSTANT).values()), None)


def equal_bytes(runs: dict[str, Run], arm: str) -> dict[int, Run]:
    """The constant run at K_eq of each seed of a schedule `arm` (the constant K0 run where
    K_eq = K0), by seed; seeds whose reference is not trained yet are left out."""
    k0, constant, out = _k0(runs), _arm(runs, CONSTANT), {}
    for seed, run in _arm(runs, arm).items():
        k = k_equal_bytes(run.summary.steps, run.summary.averaging_rounds)
        ranks = run.get("ranks")
        found = constant.get(seed) if k == k0 else runs.get(run_name(CONSTANT, ranks, seed, k))
        if found is not None:
            out[seed] = found
    return out


def _ks(cell: dict[int, Run]) -> str:
    ks = sorted({r.get("averaging.average_every") for r in cell.values()})
    return "-" if not ks else str(ks[0]) if len(ks) == 1 else f"{ks[0]}-{ks[-1]}"


def _mean(cell: dict[int, Run], value) -> float | None:
    values = [v for v in map(value, cell.values()) if v is not None]
    return sum(values) / len(values) if values else None


def _schedules(runs: dict[str, Run]) -> list[str]:
    arms = {p[0] for n in runs if (p := parse_name(n)) is not None and p[1] is None}
    return [a for a in ("post_local", "adacomm") if a in arms] + sorted(
        arms - {CONSTANT, "post_local", "adacomm"})


def _rows(runs: dict[str, Run]) -> list[tuple[str, str, dict[int, Run]]]:
    """(arm, K column, runs by seed) of one N's table, in its order."""
    k0 = _k0(runs)
    rows = [(f"{_LABELS[CONSTANT]} (reference at equal K0)", f"{k0}", _arm(runs, CONSTANT))]
    for arm in _schedules(runs):
        k = _K_OF.get(arm, "K0 = {k0}").format(k0=k0)
        rows.append((_LABELS.get(arm, arm), k, _arm(runs, arm)))
    for arm in _schedules(runs):
        cell = equal_bytes(runs, arm)
        rows.append((f"{_LABELS[CONSTANT]} at equal bytes to {arm}", _ks(cell), cell))
    return rows


def table(runs: dict[str, Run]) -> list[str]:
    """One N's table: per arm its K, rounds, MB sent per worker, CV frame accuracy (and WER
    where the runs were decoded)."""
    decoded = any(r.metric("wer") is not None for r in runs.values())
    rows = []
    for label, k, cell in _rows(runs):
        if not cell:
            continue
        rows.append((label, k, len(cell), num(_mean(cell, lambda r: r.summary.averaging_rounds), 0),
                     num(_mean(cell, lambda r: (r.summary.bytes_sent or 0) / 1e6 or None), 1),
                     mean_sd(stat(cell, "cv_acc_pct")))
                    + ((mean_sd(stat(cell, "wer")),) if decoded else ()))
    return markdown_table(("arm", "K", "seeds", "rounds", "MB sent per worker",
                           "CV frame acc % (mean ± sd)") + (("WER %",) if decoded else ()), rows)


def verdicts(runs: dict[str, Run]) -> list[tuple[str, str, str]]:
    """(schedule, reference, the rule's word with the paired interval in points) of each
    schedule against constant at equal K0 and at equal bytes."""
    out = []
    for arm in _schedules(runs):
        cell = _arm(runs, arm)
        for what, ref in (("at equal K0", _arm(runs, CONSTANT)),
                          ("at equal bytes", equal_bytes(runs, arm))):
            diff, word = compare(cell, ref, "cv_acc_pct")
            seeds = len(set(cell) & set(ref))
            out.append((arm, what, f"**{word}** ({interval(diff)} points of CV frame accuracy, "
                                   f"{seeds} seed{'' if seeds == 1 else 's'})"))
    return out


def reading(by_ranks: dict[int, dict[str, Run]]) -> str:
    """The honest reading: how many verdicts at each comparison said what."""
    counts: dict[str, dict[str, int]] = {"at equal K0": {}, "at equal bytes": {}}
    winners, largest = [], 0.0  # better than constant K for the same bytes; the largest |mean|
    for ranks, runs in by_ranks.items():
        for arm, what, text in verdicts(runs):
            word = text.split("**")[1].split(":")[0]
            counts[what][word] = counts[what].get(word, 0) + 1
            if what == "at equal bytes" and word == "better":
                winners.append(f"{arm} at {ranks} workers")
        for arm in _schedules(runs):
            for ref in (_arm(runs, CONSTANT), equal_bytes(runs, arm)):
                diff = compare(_arm(runs, arm), ref, "cv_acc_pct")[0]
                largest = max(largest, abs(diff.mean) if diff is not None else 0.0)
    said = [f"{what}, " + ", ".join(f"{n} {w}" for w, n in sorted(c.items()))
            for what, c in counts.items() if c]
    if not said:
        return "No schedule has its references trained yet."
    bytes_ = (f"Better than constant K for the same bytes: {words(winners)}." if winners else
              "No schedule did better than constant K for the same bytes here.")
    return ("Of the schedules' verdicts against constant K: " + "; ".join(said) + " (no mean "
            f"difference larger than {largest:.2f} points). A schedule "
            "sends more rounds than constant K0, so a gain at equal K0 may only be the bytes; "
            "the equal-bytes row asks whether the same bytes spent evenly do as well. " + bytes_)


def section(runs: list[Run], sweep_file: Path, figure_path: Path | None = None,
            report: Path | None = None) -> list[str]:
    """The report's "averaging schedules" section (markdown lines) from schedules.toml's runs;
    `figure_path` (written by `figure`) is shown where it is, linked from `report`."""
    runs = sorted(runs, key=lambda r: r.name)
    parsed = [p for p in map(parse_name, (r.name for r in runs)) if p is not None]
    by_ranks = {n: _by_name(runs, n) for n in sorted({p[2] for p in parsed})}
    s: dict[str, Any] = runs[0].settings if runs else {}
    frames = _post_local_frames(sweep_file)
    share = _epoch_share(frames, next(iter(by_ranks.values()), {}))
    steps = {n: num(_mean(_arm(rs, CONSTANT), lambda r: r.summary.steps), 0)
             for n, rs in by_ranks.items()}
    out = [
        "## Beyond the paper: averaging schedules", "",
        f"Made by `labavg reproduce --only schedules` from `{sweep_file}` "
        "(labavg.studies.reproduction.schedules): plain model averaging whose K changes during "
        "the run (labavg.averaging.schedule) against constant K. post_local (Lin et al. 2020) "
        f"averages after every minibatch for the first {f'{frames:,}' if frames else '-'} "
        f"frames trained by all workers together ({share} of the first epoch), then every "
        "K0; adacomm (Wang & Joshi 2019) re-evaluates K = ceil(K0 sqrt(L / L0)) at each round "
        "from the block's training loss, never above K0. Each schedule is compared, paired by "
        "seed, with constant K at equal K0, and with a constant run at equal bytes: K_eq = "
        "round(steps / rounds) of that seed's schedule run (rounds as the run counts them, "
        "epoch-end rounds included, so the constant run's rounds come out near the schedule's, "
        "not equal: both are in the table). Every round sends the fp32 model, so bytes follow "
        f"rounds. {num(s.get('corpus_hours'), 1)} h synthetic corpus, model "
        f"{s.get('model.hidden_layers')} x {s.get('model.hidden_dim')}, {s.get('epochs')} epochs "
        f"of minibatch {s.get('minibatch')}, NG-SGD, learning rate {s.get('lr')} x N, backend "
        f"inproc: the {' or '.join(map(str, by_ranks))} workers are threads of one process on "
        "a 2-core machine "
        "(oversubscribed), one run at a time; "
        + ", ".join(f"{steps[n]} updates per worker at N = {n}" for n in by_ranks)
        + f". Sized so that the {len(runs)} runs fit under an hour (their training took "
        f"{sum(r.summary.wall_seconds or 0.0 for r in runs) / 60:.0f} min of wall time in all, "
        "on the shared machine): CV frame accuracy only (no decode), a small scale at which a "
        "schedule's effect may not show the way it would in a run of thousands of updates. "
        "Verdicts: the report's rule, against zero (per seed, "
        "the schedule's CV frame accuracy minus the reference's, in points).", ""]
    if figure_path is not None and report is not None and figure_path.is_file():
        rel = os.path.relpath(figure_path.resolve(), report.resolve().parent)
        out += [f"![CV frame accuracy against bytes sent, schedules and constant K]({rel})", "",
                "The figure pairs the seeds as the verdicts do: each arm's CV frame accuracy "
                "minus that of the same seed's constant K0 run, the bars the sd of those "
                "differences over the seeds.", ""]
    for ranks, group in by_ranks.items():
        out += [f"### {ranks} workers", "", *table(group), ""]
        out += [f"- {arm} vs constant {what}: {text}" for arm, what, text in verdicts(group)]
        out.append("")
    return out + [reading(by_ranks)]


def _epoch_share(frames: int | None, runs: dict[str, Run]) -> str:
    """`frames` as a share of an epoch of the constant K0 runs (all workers' frames)."""
    run = next(iter(_arm(runs, CONSTANT).values()), None)
    if not frames or run is None or not run.summary.steps:
        return "a share"
    epoch = run.summary.steps / run.get("epochs") * run.get("ranks") * run.get("minibatch")
    return f"{100 * frames / epoch:.0f} %"


def _post_local_frames(sweep_file: Path) -> int | None:
    """averaging.post_local_frames of the sweep file's base (the results file keeps no such
    setting), None where the file cannot say."""
    import tomllib

    try:
        base = tomllib.loads(Path(sweep_file).read_text(encoding="utf-8")).get("base", {})
        return int(base.get("averaging", {}).get("post_local_frames"))
    except (OSError, ValueError, TypeError, tomllib.TOMLDecodeError):
        return None


_COLORS = {"post_local": "#1f77b4", "adacomm": "#2ca02c"}


def figure(runs: list[Run], path: Path) -> Path:
    """CV frame accuracy against MB sent per worker, a panel per N, paired by seed: each arm's
    accuracy minus the same seed's constant K0 run (mean ± sd of the differences); the constant
    runs (K0 and each K_eq) as a line over their bytes, each schedule as a point. A schedule
    above the line does better than constant K for its bytes."""
    import matplotlib

    matplotlib.use("Agg")  # files only, whatever backend a notebook chose
    import matplotlib.pyplot as plt

    workers = sorted({p[2] for p in map(parse_name, (r.name for r in runs)) if p is not None})
    fig, axes = plt.subplots(1, max(1, len(workers)), figsize=(5.2 * max(1, len(workers)), 4.0),
                             squeeze=False)
    for ax, ranks in zip(axes[0], workers):
        by_name = _by_name(runs, ranks)
        reference = _arm(by_name, CONSTANT)

        def point(cell: dict[int, Run]):
            return (_mean(cell, lambda r: (r.summary.bytes_sent or 0) / 1e6 or None),
                    spread(paired(reference, cell, "cv_acc_pct")))

        constant: dict[int, dict[int, Run]] = {}  # K: runs by seed
        for name, run in by_name.items():
            if parse_name(name)[0] == CONSTANT:
                constant.setdefault(run.get("averaging.average_every"), {})[run.seed] = run
        line = sorted((*point(cell), k) for k, cell in constant.items())
        line = [p for p in line if p[0] is not None and p[1] is not None]
        ax.errorbar([p[0] for p in line], [p[1].mean for p in line],
                    yerr=[p[1].sd for p in line], color="#d62728", marker="o", capsize=3,
                    label="constant K")
        for mb, diff, k in line:
            ax.annotate(f"K={k}", (mb, diff.mean), textcoords="offset points", xytext=(5, -12),
                        fontsize=8, color="#d62728")
        for arm in _schedules(by_name):
            mb, diff = point(_arm(by_name, arm))
            if mb is not None and diff is not None:
                ax.errorbar([mb], [diff.mean], yerr=[diff.sd], marker="s", capsize=3,
                            linestyle="none", color=_COLORS.get(arm, "black"), label=arm)
        ax.axhline(0, color="grey", linewidth=0.8)
        ax.margins(x=0.1)  # room for the last K label
        ax.set_title(f"{ranks} workers")
        ax.set_xlabel("MB sent per worker, whole run")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    axes[0][0].set_ylabel("CV frame accuracy minus constant K0's,\nsame seed (points, mean ± sd)")
    return save_png(fig, path)
