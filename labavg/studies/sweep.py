"""Experiment grids: one run directory per point, a results table, resumable.

A sweep file is TOML with a `[base]` table (a training configuration, as for `labavg train`)
and a `[grid]` table mapping dotted setting names to lists of values:

    [base]
    epochs = 3
    [base.data]
    data = "data/synth"
    [grid]
    ranks = [1, 16]
    optimizer = ["sgd", "ngsgd"]
    seed = [0, 1]

`[grid]` may also be an array of tables (`[[grid]]`), one small grid per comparison; their
points are pooled and a configuration reached by two grids is trained once.

`[[corpus]]` tables name built-in corpora the grids use (`out`, and `labavg corpus synth`'s
`hours`, `dev_hours`, `test_hours`, `seed`); the sweep synthesises those that are missing.

`run_sweep` trains every combination, seed by seed, into SWEEP_DIR/runs/NAME (skipping
finished runs and resuming interrupted ones) and writes SWEEP_DIR/results.csv and results.md.
"""

from __future__ import annotations

import contextlib
import csv
import io
import itertools
import math
import statistics
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tabulate import tabulate

from labavg.base.checkpoint import atomic_write_text, latest_step
from labavg.training.config import TrainConfig, config_from_dict, validate
from labavg.base.settings import to_dict, with_overrides
from labavg.base.errors import UserError
from labavg.base.paths import require_writable
from labavg.jobs.columns import Column, columns, csv_row, markdown_table
from labavg.jobs.index import flatten_config
from labavg.jobs.run_dir import RunDirBusy, lock_held, run_dir_lock
from labavg.jobs.run_json import SUMMARY
from labavg.jobs.runs import decode_pending, finish_decode
from labavg.jobs.summary import load_summary, summary_row

# results.csv's and results.md's columns (labavg.jobs.columns); run_sweep's rows hold each
# run's whole row (labavg.jobs.summary.run_row) and its point's name.
COLUMNS = ("run", "ranks", "average_every", "averaging", "reduce", "payload", "optimizer",
           "pretrain", "schedule", "minibatch", "seed", "wer", "wer_ci_low", "wer_ci_high", "per",
           "cv_acc_pct", "cv_loss", "wall_seconds", "compute_seconds", "comm_seconds",
           "bytes_sent", "speedup", "speedup_low", "speedup_high", "cores", "efficiency_pct",
           "speedup_flag")


# A grid with more points than this is refused unless asked for (`labavg sweep --max-points`):
# a slip in a grid (ten values where two were meant, on each of four keys) would otherwise be
# checked point by point for minutes and then train for weeks. The reproduction's largest has 78.
MAX_POINTS = 200


def grid_size(grids: list[dict[str, list[Any]]]) -> int:
    """How many points the grids make (before points reached twice are merged)."""
    return sum(math.prod(len(options) for options in grid.values()) for grid in grids or [{}])


@dataclass(frozen=True)
class Sweep:
    """A base configuration and the grids of settings to vary."""

    base: TrainConfig
    grids: list[dict[str, list[Any]]]
    # Built-in corpora the grids train on, made when missing: {"out": ..., "hours": ..., ...}.
    corpora: tuple[dict[str, Any], ...] = ()

    def points(self) -> list[tuple[str, dict[str, Any]]]:
        """(name, overrides) for every combination of every grid, each configuration once."""
        out, seen = [], set()
        for grid in self.grids or [{}]:
            keys = list(grid)
            for values in itertools.product(*(grid[k] for k in keys)):
                overrides = dict(zip(keys, values))
                name = "-".join(f"{k.split('.')[-1]}_{_label(v)}" for k, v in overrides.items()) or "base"
                try:
                    cfg = with_overrides(self.base, overrides)
                except UserError as exc:
                    raise UserError(f"grid point {name}: {exc}") from None
                identity = repr(sorted(to_dict(cfg).items()))
                if identity in seen:
                    continue
                seen.add(identity)
                out.append((cfg.seed, name, overrides))
        # Seed by seed: a sweep cut short has every setting once before it has any twice.
        out.sort(key=lambda point: point[0])
        return [(name, overrides) for _, name, overrides in out]


def _label(value: Any) -> str:
    """A grid value as part of a run directory's name (a path by its last part)."""
    return Path(value).name if isinstance(value, str) and "/" in value else str(value)


def load_sweep(path: str | Path, max_points: int = MAX_POINTS) -> Sweep:
    """Parse and check a sweep file; every point must be a valid configuration, and there may
    be at most `max_points` of them (counted before any is checked)."""
    path = Path(path)
    try:
        values = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"cannot read sweep file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 (byte {exc.object[exc.start]:#04x} at offset "
                        f"{exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: not valid TOML: {exc}") from None
    unknown = set(values) - {"base", "grid", "corpus"}
    if unknown:
        raise UserError(f"{path}: unknown tables {sorted(unknown)}; a sweep has [base], [grid] "
                        "and [[corpus]]")
    base = config_from_dict(values.get("base", {}), f"{path} [base]")
    corpora = tuple(_corpus_spec(c, f"{path} [[corpus]] {i + 1}")
                    for i, c in enumerate(_tables(values.get("corpus", []))))
    grids = values.get("grid", {})
    grids = grids if isinstance(grids, list) else [grids]
    for grid in grids:
        for key, options in grid.items():
            if not isinstance(options, list) or not options:
                raise UserError(f"{path} [grid] {key}: expected a non-empty list of values")
    size = grid_size(grids)
    if size > max_points:
        raise UserError(f"{path}: its grid makes {size:,} points, more than the {max_points} a "
                        f"sweep trains unless asked; pass --max-points {size} to train them all")
    sweep = Sweep(base, grids, corpora)
    try:
        points = sweep.points()
    except UserError as exc:
        raise UserError(f"{path}: {exc}") from None
    for name, overrides in points:
        try:
            validate(with_overrides(base, overrides))
        except UserError as exc:
            raise UserError(f"{path}: grid point {name}: {exc}") from None
    return sweep


CORPUS_KEYS = {"out": str, "hours": float, "dev_hours": float, "test_hours": float, "seed": int}


def _tables(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _corpus_spec(spec: Any, where: str) -> dict[str, Any]:
    """One [[corpus]] table: where to write the built-in corpus and `labavg corpus synth`'s sizes."""
    if not isinstance(spec, dict):
        raise UserError(f"{where}: expected a table with {sorted(CORPUS_KEYS)}")
    unknown = set(spec) - set(CORPUS_KEYS)
    if unknown:
        raise UserError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(CORPUS_KEYS)}")
    if not isinstance(spec.get("out"), str) or not spec["out"]:
        raise UserError(f"{where}: out must be the corpus directory to write")
    for key, kind in CORPUS_KEYS.items():
        value = spec.get(key)
        if key == "out" or value is None:
            continue
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not numeric or (kind is int and not isinstance(value, int)) or value < 0 \
                or (key == "hours" and value == 0):
            raise UserError(f"{where}: {key} = {value!r} is not a valid {key}")
    return dict(spec)


def make_corpora(sweep: Sweep, cwd: str | Path | None = None) -> None:
    """Synthesise each [[corpus]] of the sweep that is not there yet (idempotent)."""
    from labavg.data.synth import synthesize

    for spec in sweep.corpora:
        out = Path(cwd or ".") / spec["out"]
        if (out / "corpus.json").is_file():
            continue
        print(f"labavg sweep: synthesising {spec['out']} ({spec.get('hours', 1.0)} h)", flush=True)
        synthesize(out, hours=float(spec.get("hours", 1.0)), seed=int(spec.get("seed", 0)),
                   dev_hours=float(spec.get("dev_hours", 0.1)),
                   test_hours=float(spec.get("test_hours", 0.5)))


def run_sweep(
    sweep: Sweep,
    out: Path,
    *,
    train_point: Callable[[TrainConfig, bool], None] | None = None,
    cwd: str | Path | None = None,
    recorded: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Train every point not yet finished; write results.csv and results.md; return the rows.

    `train_point(cfg, resume)` trains one configuration (default: `labavg.jobs.launch.start_run`,
    which picks threads or a job by backend). `cwd` runs every point in that directory
    (Kaldi recipes' scp paths are relative to it); `out` is taken before it applies.
    `recorded` maps point names to {"settings": dotted settings, "summary": RunSummary} of
    runs finished elsewhere (a results file's, `labavg.studies.reproduction.results`): a point
    recorded with the same settings and without a run directory here is not trained again,
    and its recorded summary is its row.
    """
    if train_point is None:
        def train_point(cfg: TrainConfig, resume: bool) -> None:
            _train_point(cfg, resume, cwd)

    if cwd is not None:
        out = out.resolve()

    require_writable(out, "--out", "the sweep directory")
    make_corpora(sweep, cwd)
    out.mkdir(parents=True, exist_ok=True)
    rows, elsewhere, kept = [], [], 0
    points = sweep.points()
    print(plan_line(points, out), flush=True)
    for name, overrides in points:
        run_dir = out / "runs" / name
        # Validated by load_sweep (every point) and by start_run (the one that starts).
        cfg = with_overrides(sweep.base, {**overrides, "out": str(run_dir)})
        record = (recorded or {}).get(name)
        if record is not None and not (run_dir / SUMMARY).is_file() \
                and _same_settings(record["settings"], cfg):
            rows.append({"name": name, **summary_row(name, record["summary"])})
            kept += 1
            continue
        try:
            # Held for the whole point, so a second sweep of the same directory (another
            # process, another node) passes this point by instead of training it twice.
            with run_dir_lock(run_dir), lock_held(run_dir):
                _run_point(cfg, run_dir, train_point, cwd)
        except RunDirBusy:
            elsewhere.append(name)
            continue
        rows.append({"name": name, **summary_row(name, load_summary(run_dir))})
        write_results(rows, out)
    for name in elsewhere:  # trained by the other sweep meanwhile?
        if (out / "runs" / name / SUMMARY).is_file():
            rows.append({"name": name, **summary_row(name, load_summary(out / "runs" / name))})
    write_results(rows, out)
    if kept:
        print(f"labavg sweep: {kept} point(s) recorded as finished elsewhere were not trained "
              "again", flush=True)
    still = [n for n in elsewhere if not (out / "runs" / n / SUMMARY).is_file()]
    if still:
        print(f"labavg sweep: {len(still)} point(s) are being trained by another job "
              f"({', '.join(still[:3])}{' ...' if len(still) > 3 else ''}); run the sweep again "
              "when it ends to tabulate them", flush=True)
    return rows


def plan_line(points: list[tuple[str, dict[str, Any]]], out: Path) -> str:
    """How many points there are, how many are finished, and how long the rest would take at
    the mean wall time of the finished ones (unknown before one has finished)."""
    walls = []
    for name, _ in points:
        try:
            wall = load_summary(out / "runs" / name).wall_seconds
        except UserError:
            continue
        if isinstance(wall, (int, float)) and wall > 0:
            walls.append(wall)
    left = len(points) - len(walls)
    if not walls:
        return (f"labavg sweep: {len(points)} points to train; how long they take is known "
                f"once the first has finished")
    mean = statistics.fmean(walls)
    return (f"labavg sweep: {len(points)} points, {len(walls)} finished, {left} to train: about "
            f"{left * mean / 3600:.1f} h at the {mean:.0f} s a finished point took")


def _same_settings(settings: Mapping[str, Any], cfg: TrainConfig) -> bool:
    """Whether a recorded run's settings (dotted keys, some of them) are `cfg`'s."""
    flat = flatten_config(to_dict(cfg))
    return all(flat[k] == v for k, v in settings.items() if k in flat and k != "out")


def _run_point(cfg: TrainConfig, run_dir: Path, train_point, cwd) -> None:
    if not (run_dir / SUMMARY).is_file():
        resume = latest_step(run_dir) is not None
        if not resume and run_dir.exists():
            # An attempt that died before its first checkpoint: start it afresh.
            for leftover in ("events.jsonl", "config.json"):
                (run_dir / leftover).unlink(missing_ok=True)
        train_point(cfg, resume)
    elif decode_pending(run_dir):
        # Trained, but stopped while it decoded: decode it now, where its paths resolve.
        with contextlib.chdir(cwd or "."):
            finish_decode(cfg)


def _train_point(cfg: TrainConfig, resume: bool, cwd: str | Path | None) -> None:
    from labavg.jobs.job_outcome import JobFailed
    from labavg.jobs.launch import start_run

    try:
        start_run(cfg, resume=resume, cwd=cwd).result()
    except JobFailed as exc:  # its ranks have said why on stderr
        raise UserError(f"sweep point {cfg.out} failed (exit status {exc.code})") from None


def write_results(rows: list[dict[str, Any]], out: Path) -> None:
    """results.csv (one row per run) and results.md (the same, plus means over seeds)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(csv_row(COLUMNS, row) for row in rows)
    atomic_write_text(out / "results.csv", buf.getvalue())
    atomic_write_text(out / "results.md", format_results(rows))


def format_results(rows: list[dict[str, Any]]) -> str:
    """Markdown: every run, then the mean and spread of CV accuracy over seeds per setting."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        key = "-".join(p for p in r["name"].split("-") if not p.startswith("seed_"))
        groups.setdefault(key, []).append(r)
    acc, wer = columns(("cv_acc_pct", "wer"))
    decoded = any(r.get("wer") is not None for r in rows)
    means = []
    for key, group in groups.items():
        line = [key, len(group), *_mean_and_spread(acc, group)]
        if decoded:
            line += _mean_and_spread(wer, group)
        means.append(line)
    header = ["setting", "seeds", f"{acc.title} (mean)", "spread (min-max)"]
    if decoded:
        header += [f"{wer.title} (mean)", "spread (min-max)"]
    return (markdown_table(COLUMNS, rows) + "\n\n"
            + tabulate(means, headers=header, tablefmt="github", disable_numparse=True,
                       colalign=["left"] + ["right"] * (len(header) - 1)) + "\n")


def _mean_and_spread(column: Column, rows: list[dict[str, Any]]) -> list[str]:
    """The mean of a column over `rows` and its range, as the column shows a value."""
    values = [v for v in (column.value(r) for r in rows) if v is not None]
    if not values:
        return ["-", "-"]
    return [column.text(statistics.mean(values)),
            f"{column.text(min(values))}-{column.text(max(values))}"]
