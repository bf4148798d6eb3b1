"""`labavg reproduce`: run every sweep of experiments/, measure 1 vs 2 MPI ranks, then write
REPRODUCTION.md, its figures and the results file the notebooks read.

The sweep files: paper.toml (the paper's comparisons, decoded), regime.toml and
regime-variables.toml (the regime map and what predicts it), explain.toml (the experiments
behind each disagreement), beyond.toml (BMUF and DiLoCo), asterisk.toml (real speech, once
prepared) and yesno.toml (the real Kaldi recipe, when given). Every step is resumable: finished
runs are kept, so running it again only adds what is missing. The sweeps run in this process
(labavg.studies.sweep.run_sweep, several at once on threads), each one's output in its own log.
Every verdict follows labavg.studies.reproduction.verdicts' one rule.
"""

from __future__ import annotations

import contextlib
import contextvars
import queue
import re
import shutil
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from labavg.base.checkpoint import atomic_write_text
from labavg.base.errors import UserError, one_line, user_error_of
from labavg.base.paths import require_writable
from labavg.studies.reproduction import beyond, elastic, regime, schedules
from labavg.studies.reproduction.paper import base_settings
from labavg.studies.reproduction.report import DISCUSSION_MARKER, render_report
from labavg.studies.reproduction.results import (RESULTS_FILE, SWEEPS, Run, collect,
                                                 read_results_file, select, with_recorded,
                                                 write_results_file)
from labavg.studies.reproduction.speedup import MPI_POINTS
from labavg.studies.reproduction.sweep_files import Experiments
from labavg.studies.sweep import Sweep, load_sweep, make_corpora, run_sweep

# (name, sweep file, output directory, working directory or None) of one sweep to run.
Job = tuple[str, Path, Path, Path | None]


def run_sweeps(jobs: list[Job], parallel: int, results: Path | None = None) -> None:
    """Each job's sweep (labavg.studies.sweep.run_sweep), `parallel` at a time on threads of this
    process, what each prints in OUT.log; the runs `results` records are not trained again (as
    `labavg sweep --recorded`). Once all have ended, a UserError names those that failed."""
    recorded = read_results_file(results) if results is not None and results.is_file() else {}
    # Loaded here, one by one: loading one in its recipe directory changes this process's.
    sweeps = [(name, file, load_sweep(file) if cwd is None else _load_in(file, cwd), out, cwd,
               {r.name: {"settings": r.settings, "summary": r.summary}
                for r in recorded.get(file.stem, [])})
              for name, file, out, cwd in jobs]
    ended: queue.SimpleQueue = queue.SimpleQueue()  # (name, why it failed or None)
    pending, running, alone, failed, logs = list(sweeps), 0, False, [], {}
    with _logs_routed(), _sweeps_ended_first(ended, lambda: running):
        while pending or running:
            # A sweep in a recipe directory runs alone: finishing a decode that was cut short,
            # it changes this process's working directory (labavg.studies.sweep), which the
            # other sweeps' relative paths would follow.
            while pending and running < parallel and not alone and (
                    running == 0 or pending[0][4] is None):
                name, file, sweep, out, cwd, known = pending.pop(0)
                alone = cwd is not None
                out.mkdir(parents=True, exist_ok=True)
                log = logs[name] = out.parent / f"{name}.log"
                print(f"labavg reproduce: sweep {name} ({file}) -> {out} (log {log})", flush=True)
                # Daemon threads; an interruption ends their runs and waits for them
                # (_sweeps_ended_first); their runs resume from their checkpoints.
                threading.Thread(target=_one_sweep, args=(name, sweep, out, cwd, known, log, ended),
                                 daemon=True, name=f"labavg-sweep-{name}").start()
                running += 1
            name, why = ended.get()
            running -= 1
            alone = alone and running > 0
            if why is not None:
                failed.append(f"{name} ({why}; see {logs[name]})")
    if failed:
        raise UserError(f"sweeps failed: {', '.join(failed)}")


@contextlib.contextmanager
def _sweeps_ended_first(ended: queue.SimpleQueue, running) -> Iterator[None]:
    """On an interruption (SIGINT, SIGTERM: labavg.cli.signals), end the sweeps' runs and wait
    for the sweeps' threads to return before going on: one still writing its log or its
    results table when this process exits would leave them half-written."""
    from labavg.jobs.launch import end_runs, signal_of

    try:
        yield
    except KeyboardInterrupt as exc:
        end_runs(signal_of(exc))  # no run starts after this: the sweeps' threads return
        for _ in range(running()):
            try:
                ended.get(timeout=60)
            except queue.Empty:
                break
        raise


# The log of the sweep whose thread (or whose run's threads, which start in a copy of their
# starter's context) is writing; None outside the sweeps.
_LOG: contextvars.ContextVar[TextIO | None] = contextvars.ContextVar("labavg_sweep_log",
                                                                     default=None)


def _one_sweep(name: str, sweep: Sweep, out: Path, cwd: Path | None,
               recorded: dict[str, Any], path: Path, ended: queue.SimpleQueue) -> None:
    """On its own thread: one sweep, everything it and its runs print in its log."""
    why = None
    with open(path, "a", encoding="utf-8", buffering=1) as log:
        _LOG.set(log)
        try:
            rows = run_sweep(sweep, out, cwd=cwd, recorded=recorded)
            print((out / "results.md").read_text())
            print(f"{len(rows)} runs in {out}/runs; tables in {out}/results.csv and results.md")
        except KeyboardInterrupt:  # its runs were ended (_sweeps_ended_first): nothing to say
            why = "interrupted"
        except Exception as exc:  # noqa: BLE001 - named in the one error of all the sweeps
            if user_error_of(exc) is None:
                traceback.print_exc(file=log)
            why = one_line(user_error_of(exc) or exc)
            print(f"labavg: error: {why}", file=log)
        finally:
            ended.put((name, why))


class _Routed:
    """sys.stdout or sys.stderr while sweeps run: a sweep's writes go to its log."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        return (_LOG.get() or self.stream).write(text)

    def __getattr__(self, name: str) -> Any:  # flush, isatty, encoding... of where it goes
        return getattr(_LOG.get() or self.stream, name)


@contextlib.contextmanager
def _logs_routed() -> Iterator[None]:
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Routed(out), _Routed(err)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out, err


def _load_in(file: Path, cwd: Path):
    """A sweep file whose paths are relative to `cwd` (the yesno recipe)."""
    file = file.resolve()
    with contextlib.chdir(cwd):
        return load_sweep(file)


def measure_mpi(paper_file: Path, out: Path, *, epochs: int = 1, cwd: Path | None = None) -> None:
    """1 and 2 MPI ranks (K = 10 and 20) with the comparisons' model and data; resumable."""
    from labavg.base.settings import with_overrides
    from labavg.jobs.launch import start_run

    base = load_sweep(paper_file).base
    for name, ranks, k in MPI_POINTS:
        run = out / "runs" / name
        if (run / "summary.json").is_file():
            continue
        if run.exists():
            shutil.rmtree(run)
        cfg = with_overrides(base, {"out": str(run.resolve()), "ranks": ranks, "backend": "mpi",
                                    "averaging.average_every": k, "epochs": epochs, "decode_data": None})
        start_run(cfg, cwd=cwd).result()


def yesno_facts(recipe: Path | None) -> dict[str, Any]:
    """The recipe's test set and its GMM's best WER (exp/mono0a's wer_* files), where given."""
    if recipe is None:
        return {}
    facts: dict[str, Any] = {}
    try:
        facts["train_utterances"] = len((recipe / "data/train_yesno/text").read_text().splitlines())
    except OSError:
        pass
    best = None
    for path in sorted((recipe / "exp").glob("mono*/decode_test_yesno/wer_*")):
        text = path.read_text(errors="replace")
        wer = re.search(r"%WER ([\d.]+) \[ \d+ / (\d+)", text)
        ser = re.search(r"%SER [\d.]+ \[ \d+ / (\d+)", text)
        if wer and (best is None or float(wer.group(1)) < best[0]):
            best = (float(wer.group(1)), int(wer.group(2)), int(ser.group(1)) if ser else None)
    if best is not None:
        facts.update(gmm_wer=best[0], test_words=best[1], test_utterances=best[2])
    return facts


def _jobs(exp: Experiments, out: Path, yesno: Path | None) -> list[Job]:
    """The sweeps to run, each file checked before hours of training start."""
    for path in (exp.paper, exp.regime) + ((exp.yesno,) if yesno is not None else ()):
        if not path.is_file():
            raise UserError(f"{path}: no such sweep file (labavg reproduce --experiments DIR)")
    if yesno is not None and not (yesno / "data").is_dir():
        raise UserError(f"--yesno {yesno}: not a Kaldi yesno recipe directory (no data/)")
    for path in (exp.paper, exp.regime):
        load_sweep(path)
    jobs: list[Job] = [("paper", exp.paper, out / "paper", None),
                       ("regime", exp.regime, out / "regime", None)]
    if yesno is not None:
        jobs.append(("yesno", exp.yesno, out / "yesno", yesno))
    for name in ("regime-variables", "explain", "beyond"):
        path = getattr(exp, name.replace("-", "_"))
        if path.is_file():
            jobs.append((name, path, out / name, None))
    return jobs


def _real_speech_job(exp: Experiments, out: Path) -> list[Job]:
    """asterisk.toml trains on prompts that a Debian package and a script provide; without them
    its recorded runs are reported as they are, and the command says why it trained none."""
    if not exp.asterisk.is_file():
        return []
    data = Path(load_sweep(exp.asterisk).base.data.data)
    if not (data / "feats.scp").is_file():
        print(f"labavg reproduce: {exp.asterisk} not trained: {data} is not prepared "
              f"(bash scripts/asterisk-corpus.sh {data}); its recorded runs are reported",
              file=sys.stderr)
        return []
    return [("asterisk", exp.asterisk, out / "asterisk", None)]


def _draw_figures(runs: dict[str, list[Run]], exp: Experiments, figure: Path,
                  beyond_figure: Path) -> None:
    """The regime map and the Beyond figures, from the runs there are."""
    points = regime.regime_points(runs["regime"])
    if points:
        base = base_settings(runs["paper"], exp.paper)
        found = regime.fits(points)
        regime.regime_figure(points, regime.comparison_points(runs["paper"], base),
                             found[0] if found else None, figure)
    if runs["beyond"]:
        beyond.figure(runs["beyond"], select([r for r in runs["beyond"] if r.get("ranks") == 1]),
                      beyond_figure)
    if runs["schedules"]:
        schedules.figure(runs["schedules"], figure.with_name(schedules.FIGURE))


def reproduce(out: Path, *, experiments: Path = Path("experiments"), yesno: Path | None = None,
              report: Path = Path("REPRODUCTION.md"), figure: Path | None = None,
              parallel: int = 2, mpi: bool = True, results: Path | None = None,
              train: bool = True, command: str = "labavg reproduce",
              only: tuple[str, ...] | None = None) -> Path:
    """Run (or resume) every experiment, then write the report and the figure; return its path.

    With `train` False nothing is trained: the report is remade from the runs there are.
    `only`: the experiments to train (sweep names, "mpi", "elastic", "schedules"); the others
    are reported from their runs or the results file."""
    start = time.perf_counter()
    unknown = sorted(set(only or ()) - set(SWEEPS))
    if unknown:
        raise UserError(f"--only {','.join(only)}: no experiment {unknown[0]!r} (choose from "
                        f"{', '.join(SWEEPS)})")
    exp = Experiments(experiments)
    jobs = _jobs(exp, out, yesno)
    wanted = lambda name: only is None or name in only  # noqa: E731
    results = results if results is not None else exp.directory / RESULTS_FILE
    figure = figure if figure is not None else report.parent / "docs" / "figures" / "regime-map.png"
    # Before hours of training: its runs' directory, and every output the report and its
    # figures go to.
    if train:
        require_writable(out, "--out", "the reproduction's directory")
    for path, key in ((report, "--report"), (figure, "--figure"), (results, "results file")):
        require_writable(path, key, "an output", file=True)
    if train:
        jobs = [job for job in jobs + _real_speech_job(exp, out) if wanted(job[0])]
        for _, file, _, cwd in jobs:  # first, one by one: sweeps running at once may share one
            make_corpora(load_sweep(file) if cwd is None else _load_in(file, cwd), cwd)
        run_sweeps(jobs, parallel, results)
        if mpi and wanted("mpi"):
            measure_mpi(exp.paper, out / "mpi")
        if exp.elastic.is_file() and wanted("elastic"):
            elastic.run_all(exp.elastic, out / "elastic")
        if exp.schedules.is_file() and wanted("schedules"):
            schedules.run_all(exp.schedules, out / "schedules")
    beyond_figure = figure.with_name("beyond-the-paper.png")
    runs = with_recorded(collect(out), results)
    write_results_file(runs, results)
    _draw_figures(runs, exp, figure, beyond_figure)
    text = render_report(runs, exp, command=command, seconds=time.perf_counter() - start,
                         figure=figure, report=report, beyond_figure=beyond_figure,
                         yesno=yesno_facts(yesno))
    # A discussion written by people below the marker survives regeneration.
    kept = report.read_text().partition(DISCUSSION_MARKER)[2] if report.is_file() else ""
    atomic_write_text(report, f"{text}\n{DISCUSSION_MARKER}{kept or chr(10)}")
    return report
