"""Beyond the paper: what losing a worker costs, in REPRODUCTION.md.

experiments/elastic.toml holds the corpus, the settings and the seeds: a 4-worker elastic run
(backend torch, on_rank_loss = "continue"). For each seed three runs are trained, one at a time
(each is 4 worker processes):

- `kept`: the run as it is, no worker lost;
- `lost`: worker 3 killed (inject_fault "kill@rank3:stepS") at a quarter of the run; the
  others go on without it, its shard untrained from then on (labavg.training.membership);
- `resumed`: the same run with on_rank_loss = "stop", stopped at step S (its checkpoint at the
  round of step S, then worker 3 killed: the job ends) and resumed on 3 ranks
  (labavg.training.resume_layout: the lost shard untrained to the epoch's end, then the data
  split over 3).

`run_all` trains what is missing (resumable: a finished run is kept, an unfinished `resumed`
goes on from its checkpoint, any other unfinished run starts again) and checks every finished
run's membership: the one injected loss, 4 -> 3 at step S, nothing else. `section` writes the
report's section from the finished (or recorded) runs under the report's one verdict rule.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from labavg.base.errors import UserError, one_line
from labavg.studies.reproduction.beyond import compare
from labavg.studies.reproduction.results import Run, stat
from labavg.studies.reproduction.tables import interval, markdown_table, mean_sd, num

VARIANTS = ("kept", "lost", "resumed")
LOST_RANK = 3
_LABELS = {"kept": "4 workers, none lost", "lost": "worker 3 lost, the others go on (elastic)",
           "resumed": "stopped, resumed on 3 ranks"}


def loss_step(steps_per_epoch: int, epochs: int, average_every: int) -> int:
    """Step S: a quarter of the run, on an averaging round (a checkpoint can be taken there)."""
    quarter = steps_per_epoch * epochs / 4
    return max(average_every, round(quarter / average_every) * average_every)


def _steps_per_epoch(cfg) -> int:
    from labavg.data.dataset import open_dataset
    from labavg.data.frames import split_cv, steps_per_epoch

    source = open_dataset(cfg.data.data)
    keys, _ = split_cv(source.keys, cfg.data.cv_fraction, seed=cfg.seed)
    return steps_per_epoch(keys, source.num_frames, cfg.ranks, cfg.minibatch)


def run_all(sweep_file: Path, out: Path) -> None:
    """Train every missing run of `sweep_file` into OUT/runs/VARIANT-sSEED, seed by seed."""
    from labavg.base.settings import with_overrides
    from labavg.studies.sweep import load_sweep, make_corpora

    sweep = load_sweep(sweep_file)
    make_corpora(sweep)
    for _, overrides in sweep.points():
        base = with_overrides(sweep.base, overrides)
        step = loss_step(_steps_per_epoch(base), base.epochs, base.effective_average_every())
        for variant in VARIANTS:
            run = out / "runs" / f"{variant}-s{base.seed}"
            for attempt in range(3):
                if not (run / "summary.json").is_file():
                    _train(variant, base, run.resolve(), step)
                problem = check_run(run, variant, step)
                if problem is None:
                    break
                aside = out / "spurious" / f"{run.name}.{attempt}"
                print(f"labavg reproduce: {run.name}: {problem}; kept aside as {aside.name}, "
                      f"trained again", flush=True)
                shutil.rmtree(aside, ignore_errors=True)
                aside.parent.mkdir(parents=True, exist_ok=True)
                run.rename(aside)
            else:
                raise UserError(f"{run}: {problem} in 3 attempts")


def _train(variant: str, base, run: Path, step: int) -> None:
    from labavg.base.checkpoint import latest_step
    from labavg.base.settings import with_overrides
    from labavg.jobs.job_outcome import JobFailed
    from labavg.jobs.launch import start_run

    found = latest_step(run) if variant == "resumed" and run.is_dir() else None
    if found is None or found[0] < step:
        shutil.rmtree(run, ignore_errors=True)
        found = None
    fault = {"kept": None, "lost": f"kill@rank{LOST_RANK}:step{step}",
             "resumed": f"kill@rank{LOST_RANK}:step{step + 1}"}[variant]
    cfg = with_overrides(base, {"out": str(run), "inject_fault": fault, **(
        {"on_rank_loss": "stop"} if variant == "resumed" else {})})
    if variant != "resumed":
        start_run(cfg).result()
        return
    if found is None:  # the first leg: a checkpoint at every round, so one is at step S
        try:
            start_run(with_overrides(cfg, {"checkpoint_every": 1})).result()
        except JobFailed as exc:  # the job ends at the kill, in one line
            print(f"labavg reproduce: {run.name} stopped as planned: {one_line(exc)}", flush=True)
        found = latest_step(run)
        if found is None or found[0] != step:
            raise UserError(f"{run}: expected a checkpoint at step {step}, found {found}")
    start_run(with_overrides(cfg, {"ranks": base.ranks - 1, "inject_fault": None}),
              resume=True).result()


def check_run(run: Path, variant: str, step: int) -> str | None:
    """What is wrong with a finished run's membership (None: as planned): `kept` lost nobody,
    the others went 4 -> 3 at `step`, and the one worker lost was the one killed."""
    from labavg.base.events import MemberLost
    from labavg.jobs.index import read_run_events
    from labavg.jobs.summary import load_summary

    summary = load_summary(run)
    counts, steps = summary.worker_counts, summary.worker_steps
    ranks = counts[0] if counts else None
    want = ([ranks], [0]) if variant == "kept" else ([ranks, ranks - 1] if ranks else None,
                                                     [0, step])
    if (counts, steps) != want:
        return f"workers {counts} from steps {steps}, not {want[0]} from {want[1]}"
    lost = [e for e in read_run_events(run) if isinstance(e, MemberLost)]
    expected = 0 if variant != "lost" else ranks - 1
    if len(lost) != expected or any(e.lost != (LOST_RANK,) or e.step != step for e in lost):
        return (f"{len(lost)} member_lost events ({[(list(e.lost), e.step) for e in lost]}), "
                f"not {expected} of worker {LOST_RANK} at step {step}")
    return None


def _variant(run: Run) -> str:
    return run.name.rsplit("-s", 1)[0]


def _cells(runs: list[Run]) -> dict[str, dict[int, Run]]:
    return {v: {r.seed: r for r in runs if _variant(r) == v} for v in VARIANTS}


def _untrained(cell: dict[int, Run]) -> tuple[float | None, float | None]:
    """Mean frames left untrained, and their share of the frames the run planned to train."""
    pairs = [(r.summary.frames_untrained or 0, r.summary.frames_trained or 0)
             for r in cell.values() if r.summary.frames_trained]
    if not pairs:
        return None, None
    untrained = sum(u for u, _ in pairs) / len(pairs)
    return untrained, sum(u / (u + t) for u, t in pairs) / len(pairs)


def _workers(cell: dict[int, Run]) -> str:
    found = {(tuple(r.summary.worker_counts or ()), tuple(r.summary.worker_steps or ()))
             for r in cell.values()}
    if len(found) != 1:
        return "differs by seed"
    counts, steps = found.pop()
    if len(counts) < 2:
        return str(counts[0]) if counts else "-"
    return " -> ".join(map(str, counts)) + f" at step {steps[1]}"


def _wall_minutes(runs: list[Run]) -> float:
    return sum(r.summary.wall_seconds or 0.0 for r in runs) / 60


def table(runs: list[Run]) -> list[str]:
    rows = []
    for variant, cell in _cells(runs).items():
        if not cell:
            continue
        frames, share = _untrained(cell)
        steps = stat(cell, "steps")
        rows.append((_LABELS[variant], len(cell), _workers(cell),
                     num(steps.mean if steps else None, 0),
                     "-" if frames is None else f"{frames:,.0f} ({100 * share:.1f} %)",
                     mean_sd(stat(cell, "wer")), mean_sd(stat(cell, "cv_acc_pct"))))
    return markdown_table(("run", "seeds", "workers", "updates per worker",
                           "frames left untrained (share)",
                           "WER % (mean ± sd)", "CV frame acc %"), rows)


def verdicts(runs: list[Run]) -> list[str]:
    """Each way of losing the worker against keeping it, and the two against each other."""
    cells, out = _cells(runs), []
    for a, b in (("lost", "kept"), ("resumed", "kept"), ("lost", "resumed")):
        if not cells[a] or not cells[b]:
            continue
        wer, wer_word = compare(cells[a], cells[b])
        acc, acc_word = compare(cells[a], cells[b], "cv_acc_pct")
        out.append(f"- {_LABELS[a]} vs {_LABELS[b]}: WER **{wer_word}** ({interval(wer, 1)} % "
                   f"gain, 100 ln ratio); CV frame accuracy **{acc_word}** ({interval(acc)} "
                   "points)")
    return out


def section(runs: list[Run], sweep_file: Path) -> list[str]:
    """The report's "losing a worker" section (markdown lines) from elastic.toml's runs."""
    runs = sorted(runs, key=lambda r: r.name)  # as the results file holds them, or the disk
    s: dict[str, Any] = next((r.settings for r in runs if _variant(r) == "kept"),
                             runs[0].settings if runs else {})
    lost = [r for r in runs if _variant(r) == "lost" and r.summary.worker_steps]
    step = lost[0].summary.worker_steps[1] if lost else None
    return [
        "## Beyond the paper: losing a worker", "",
        f"Made by `labavg reproduce` from `{sweep_file}` (labavg.studies.reproduction.elastic): "
        f"a {s.get('ranks', '-')}-worker elastic run (backend torch, on_rank_loss = "
        f"\"continue\") that loses worker {LOST_RANK} (SIGKILL, inject_fault) at step "
        f"{step if step is not None else '-'}, a quarter of the run, against the same run with "
        "no loss, and against the run stopped at that step and resumed on 3 ranks "
        "(`labavg train --resume RUN --ranks 3`, docs/cluster.md). The elastic run leaves the "
        "lost shard untrained to the end (until a worker would join in its place); the resumed "
        "one only to the end of that epoch, then splits the data over 3. Both train at 3 x lr "
        "from then on (lr_scaling linear). "
        f"{num(s.get('corpus_hours'), 1)} h synthetic corpus, model {s.get('model.hidden_layers')}"
        f" x {s.get('model.hidden_dim')}, {s.get('epochs')} epochs of minibatch "
        f"{s.get('minibatch')}, K = {s.get('averaging.average_every')}, NG-SGD, learning rate "
        f"{s.get('lr')} x N. Sized so that the {len(runs)} runs fit about 25 minutes on a 2-core "
        "machine, where the 4 worker processes share 2 cores (oversubscribed), one run at a "
        f"time: their training took {_wall_minutes(runs):.0f} min of wall time in all, starting "
        "the processes and decoding each run's test set most of the rest; a bigger model or "
        "corpus would leave fewer seeds in the time. The resumed run makes more updates per "
        "worker: after the resume its epochs are split over 3. Every run's "
        "membership was checked: no worker lost but the one killed. WER on the test set; "
        "frames left untrained are those of the lost shard, and their share of what the run "
        "planned to train.", "",
        *table(runs), "", "Verdicts (the report's rule, against zero; per seed, the first run "
        "against the second):", "", *verdicts(runs)]
