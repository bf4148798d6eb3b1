"""Running training into a run directory (labavg.jobs.run_dir): the checks made before any
rank starts, `run_training` and the decode hand-off.

`run_training` is one process's part of a run behind start_run (labavg.jobs.launch, the one
door): it iterates the trainer and writes the run directory's files (the event log,
config.json, summary.json, final.pt). Only labavg.jobs calls it: a ThreadRun's thread, a job's
rank (labavg.jobs.rank_main), an engine (labavg.jobs.engine).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from labavg.base.errors import UserError, one_line, user_error_of
from labavg.base.checkpoint import CannotWrite, atomic_write_text, remove_orphans
from labavg.comm.elastic_launch import JOINING_ENV
from labavg.comm.launchers import launcher_rank
from labavg.training.config import TrainConfig
from labavg.base.settings import to_dict
from labavg.base.events import (Event, MinibatchDone, RunFinished, RunStarted, SpeedupPair,
                                 event_from_dict)
from labavg.jobs.event_log import EventLog
from labavg.jobs.index import EVENTS, EventTail
from labavg.jobs.run_dir import accept_run_dir, check_run_dir, decode_missing, run_dir_lock
from labavg.jobs.run_json import CONFIG, SUMMARY, RunSummary
from labavg.jobs.summary import RunEnd, load_summary, make_summary


def open_source(cfg: TrainConfig, allow_pipes: bool = False):
    """The run's training data, opened and checked (DataError names what is wrong)."""
    from labavg.data.dataset import open_dataset

    return open_dataset(
        cfg.data.data, ali=cfg.data.ali, ali_dir=cfg.data.ali_dir, textgrid=cfg.data.textgrid,
        apply_cmvn=cfg.data.apply_cmvn, norm_vars=cfg.data.norm_vars,
        skip_mismatched=cfg.data.skip_mismatched, allow_pipes=allow_pipes,
    )


def preflight(cfg: TrainConfig, resume: bool = False, allow_pipes: bool = False, *,
              joining: bool = False):
    """Everything that can be checked before any rank starts; returns the opened data.

    The launcher of a multi-process job calls it once, so that a bad setting or data set is
    reported once, before N ranks meet it; run_training calls it on every rank anyway.
    `joining`: a worker added to a running elastic job, whose directory is the job's.
    """
    from labavg.training.runner import check_fits

    run_dir = Path(cfg.out)
    if not joining:
        check_run_dir(run_dir, resume, cfg)
    if cfg.decode_data is not None:
        from labavg.decode.run import check_decode_data

        check_decode_data(cfg.decode_data)
    source = open_source(cfg, allow_pipes)
    check_fits(cfg, source)  # with cfg.ranks; the ranks check again with the size they find
    # Every check has passed: only now is the run directory touched (a refused command
    # leaves it byte-identical, its checkpoints above all).
    if joining:
        return source
    accept_run_dir(run_dir)
    if resume and launcher_rank() == 0:
        remove_orphans(run_dir)
    return source


def run_training(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    on_event: Callable[[Event], None] | None = None,
    progress: bool = True,
    should_stop: Callable[[], bool] | None = None,
    allow_pipes: bool = False,
    since: float | None = None,
) -> RunSummary | None:
    """Train with `cfg`, writing cfg.out as a run directory; return rank 0's summary.

    At the end rank 0 writes RUN_DIR/final.pt (labavg.decode.model); with `cfg.decode_data` it
    also decodes that data (a data dir, or a corpus with dev/ and test/) and the summary gains
    wer, wer_ci, per, per_ci, acwt and decode_set.

    Under mpiexec/torchrun every process calls this; only rank 0 returns the summary (others
    return None). `on_event` sees every event this process sees. `allow_pipes` lets data files
    and rspecifiers run commands (Kaldi's `cmd |`); only the command line's --allow-pipes sets it.
    `since`: the Unix time the command running it started (summary.json's process_seconds
    counts from it; None: unknown, no process_seconds).
    """
    from labavg.training.runner import train

    run_dir = Path(cfg.out)
    with run_dir_lock(run_dir):
        opened: dict[str, Any] = {}

        def open_data():  # opened on every rank (labavg.training.runner.train agrees on the outcome)
            opened["source"] = preflight(cfg, resume, allow_pipes,
                                         joining=os.environ.get(JOINING_ENV) == "1")
            return opened["source"]

        return _consume(cfg, train(cfg, open_data, run_dir, resume, should_stop=should_stop),
                        run_dir, resume, on_event, progress, opened, since)


def _consume(cfg: TrainConfig, events: Iterator[Event], run_dir: Path, resume: bool,
             on_event: Callable[[Event], None] | None, progress: bool,
             opened: dict[str, Any], since: float | None = None) -> RunSummary | None:
    """Write the run directory from the trainer's events; rank 0's summary (and final.pt)."""
    logs: dict[int, EventLog] = {}
    started: dict[int, RunStarted] = {}
    end = None
    bar = None
    # A resumed run's speedup counts the pairs measured before it was interrupted too.
    pairs = _pairs_logged(run_dir, cfg.ranks) if resume else []
    try:
        for event in events:
            if event.rank not in logs:
                if event.rank == 0 and not resume:
                    atomic_write_text(run_dir / CONFIG, json.dumps(to_dict(cfg), indent=2) + "\n")
                logs[event.rank] = EventLog(run_dir, event.rank, cfg.tensorboard)
            logs[event.rank].write(event)
            if on_event is not None:
                on_event(event)
            if isinstance(event, RunStarted):
                started[event.rank] = event
                if event.rank == 0 and progress:
                    bar = _progress_bar(event, cfg)
            elif bar is not None and event.rank == 0 and isinstance(event, MinibatchDone):
                bar.update(event.step - bar.n)
                bar.set_postfix(loss=f"{event.loss:.3f}", acc=f"{event.frame_accuracy:.3f}", refresh=False)
            elif isinstance(event, SpeedupPair):
                pairs.append((event.solo_step_seconds, event.parallel_step_seconds))
            elif isinstance(event, RunFinished) and event.rank == min(event.members or (0,)):
                # The speedup's load is the one its RunStarted event carries, so the live line
                # and the summary read one measurement (two readings seconds apart differed).
                load = {"start": started[event.rank].load, "end": os.getloadavg()[0]}
                end = RunEnd(cfg, started[event.rank], event, pairs, load, resume)
    except Exception as exc:
        _throw_into(events, exc)
        raise
    finally:
        # Ended early (a full disk met writing the log): the trainer's own cleanup (its data
        # threads, its communicator) runs now, not during interpreter shutdown, where it ended
        # the process with "terminate called without an active exception".
        close = getattr(events, "close", None)
        if close is not None:
            close()
        if bar is not None:
            bar.close()
        for log in logs.values():
            log.close()
    if end is None:
        return None
    # After the trainer has ended (its ranks released, its watchdog gone): exporting and
    # decoding take minutes.
    return finish_run(run_dir, cfg, opened["source"], end, None if resume else since)


def finish_run(run_dir: Path, cfg: TrainConfig, source, end: RunEnd,
               since: float | None = None) -> RunSummary:
    """The one way a run ends: its model (final.pt), then summary.json, the commit marker.

    A run without its model is unfinished (labavg.jobs.run_dir.check_run_dir), so when
    final.pt cannot be written nothing says the run finished and `labavg train --resume`
    completes it from the last checkpoint, which is kept. The decode comes after the commit:
    a failed decode does not lose the model, and a later one adds its figures
    (decode_pending, finish_decode). The summary is made once the model is on disk, so that
    its process_seconds (from `since`, the command's start) counts the export too.
    """
    from labavg.decode.model import export_final_model
    from labavg.decode.run import decode_fields

    try:
        export_final_model(run_dir, cfg, source)
    except CannotWrite as exc:  # NoRoom's message says how to resume already
        raise CannotWrite(f"{exc}; fix that, then `labavg train --resume {run_dir}` writes the "
                          f"model from the run's last checkpoint (kept)") from None
    if since is not None:
        end = replace(end, process_seconds=max(time.time() - since, 0.0))
    summary = make_summary(end)
    _write_summary(run_dir, summary)
    if cfg.decode_data is not None:
        try:
            decoded = decode_fields(run_dir, cfg.decode_data)
        except UserError as exc:
            raise UserError(f"{one_line(exc)}; the model and summary.json are kept: fix that, "
                            f"then `labavg train --resume {run_dir}` decodes it") from None
        summary = replace(summary, **decoded)
        _write_summary(run_dir, summary)
    return summary


def _write_summary(run_dir: Path, summary: RunSummary) -> None:
    atomic_write_text(run_dir / SUMMARY, json.dumps(summary.to_dict(), indent=2) + "\n")


def _throw_into(events: Iterator[Event], exc: Exception) -> None:
    """Hand the trainer an error met consuming its events (a full disk writing the log): a rank
    of several then ends the whole job as for an error of its own (MPI_Abort), instead of
    closing quietly while the other ranks wait in their next collective until the watchdog."""
    throw = getattr(events, "throw", None)
    if throw is None:
        return
    try:
        throw(exc)
    except StopIteration:
        pass
    except Exception as again:  # noqa: BLE001 - the trainer re-raised it (one rank, or inproc)
        if again is not exc and user_error_of(again) is None:
            raise


def _pairs_logged(run_dir: Path, size: int) -> list[tuple[float, float]]:
    """The speedup pairs already in the run's event log (of its part before a resume) measured
    on `size` ranks: a resume on fewer ranks (labavg.training.resume_layout) drops those of
    the ranks it had before, which are of another N."""
    tail, pairs, measured_on = EventTail(run_dir / EVENTS), [], None
    while chunk := tail.read():
        for e in map(event_from_dict, chunk):
            if isinstance(e, RunStarted) and e.rank == 0:
                measured_on = e.size
            elif isinstance(e, SpeedupPair) and e.rank == 0 and measured_on == size:
                pairs.append((e.solo_step_seconds, e.parallel_step_seconds))
    return pairs


def decode_pending(run_dir: Path) -> bool:
    """A finished run asked to decode whose decode did not finish (stopped while it ran)."""
    return decode_missing(load_summary(run_dir))


def finish_decode(cfg: TrainConfig, allow_pipes: bool = False) -> RunSummary:
    """Decode a finished run whose decode was cut short; return its new summary."""
    from labavg.decode.run import decode_fields

    run_dir = Path(cfg.out)
    with run_dir_lock(run_dir):
        summary = load_summary(run_dir)
        accept_run_dir(run_dir)
        summary = replace(summary, **decode_fields(run_dir, cfg.decode_data))
        _write_summary(run_dir, summary)
    return summary


def _progress_bar(event: RunStarted, cfg: TrainConfig):
    import sys

    from tqdm import tqdm

    # Off a terminal (a notebook, a log file) every refresh is kept as a line: refresh rarely.
    interval = 0.1 if sys.stderr.isatty() else 5.0
    return tqdm(total=event.steps_per_epoch * cfg.epochs, initial=event.start_step, unit="mb",
                desc=f"train x{event.size}", dynamic_ncols=True, mininterval=interval)
