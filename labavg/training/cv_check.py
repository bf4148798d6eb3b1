"""The held-out CV of one rank's run: the global CV pass (every rank's part of the CV set, one
collective), the checks inside epochs that `cv_every` asks for, and the training clock that
time to accuracy is read on.

A check inside an epoch evaluates the mean of the workers' models, the model a plain averaging
round would make now (right after a blocking round every worker holds it already). The mean is
taken in the parameter buffer itself and the buffer put back bitwise after the pass, which
draws no random numbers, so training goes on as without the check. It is taken after the
steps that are multiples of cv_every, after the round due there. Every rank reaches those
steps together: steps count from the run's start, every rank trains the same number of
minibatches per epoch whatever its shard holds (labavg.data.frames.steps_per_epoch, kept by a
resize: labavg.training.resume_layout), a resume goes on from its checkpoint's step, and an
elastic joiner comes in at the survivors' step.

Every CV pass is off the training clock (`Progress.train_seconds`): the clock stops before it
and runs again after it. A check inside an epoch also moves on the start of the epoch's seconds
(EpochDone.seconds) and of a speedup pair's parallel segment (labavg.training.speedup_probe)
by its own seconds, so neither counts it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from labavg.base.events import CVChecked
from labavg.comm.watchdog import beating, busy
from labavg.data.frames import cv_batches
from labavg.training.step import evaluate

# `run` below is the rank's labavg.training.rank._RankRun.


def global_cv(run: Any) -> tuple[float, float]:
    """CV loss and frame accuracy of the (identical) model over every rank's part of the CV set."""
    comm = run.comm
    if run.membership is None:
        mine = run.cv_keys[comm.rank :: comm.size]
    else:  # split over the workers present; a joiner sitting out its first round takes none
        members = run.membership.members
        mine = (run.cv_keys[members.index(comm.rank) :: len(members)]
                if comm.rank in members else [])
    # Work, not a hang, however long (one batch is 4096 frames, on a big model many seconds):
    # busy for this rank's watchdog, a beat per batch for its in-process group.
    with busy():
        totals = evaluate(run.model, beating(cv_batches(run.source, mine,
                                                        context=run.cfg.data.context)),
                          run.device)
    comm.allreduce_mean(totals)  # float64 on CPU: sums are means times size
    loss_sum, correct, frames = (totals * comm.size).tolist()
    if frames == 0:
        return math.nan, math.nan
    return loss_sum / frames, correct / frames


def start_clock(run: Any) -> None:
    """The training clock runs from now: the loop's start, a joiner's heal."""
    run.clock_mark = time.perf_counter()


def train_seconds(run: Any) -> float:
    """The training clock now (`Progress.train_seconds`, brought up to date)."""
    now = time.perf_counter()
    run.progress.train_seconds += now - run.clock_mark
    run.clock_mark = now
    return run.progress.train_seconds


@contextmanager
def off_the_clock(run: Any) -> Iterator[None]:
    """What runs inside is not training time."""
    train_seconds(run)
    try:
        yield
    finally:
        run.clock_mark = time.perf_counter()


def epoch_cv(run: Any) -> Iterator[CVChecked]:
    """The epoch end's CV of the averaged model, into run.cv_loss / run.cv_acc; with cv_every,
    also as a check, so the checks' curve reaches each epoch's end."""
    t0 = time.perf_counter()
    with off_the_clock(run):
        run.cv_loss, run.cv_acc = global_cv(run)
    run.cv_step = run.progress.step
    if run.cfg.cv_every > 0:
        epoch = run.layout.position(run.progress.step - 1)[0]
        yield _checked(run, epoch, epoch + 1.0, run.cv_loss, run.cv_acc,
                       time.perf_counter() - t0, epoch_end=True)


def check_if_due(run: Any) -> Iterator[CVChecked]:
    """The check after the step just trained (and the round due at it), when cv_every asks for
    one there; an epoch's end has its own CV (`epoch_cv`)."""
    every, step = run.cfg.cv_every, run.progress.step
    if every == 0 or step % every or run.stopped or run.layout.epoch_ends(step):
        return
    t0 = time.perf_counter()
    with off_the_clock(run):
        saved = run.flat.clone()
        run.comm.allreduce_mean(run.flat)  # the mean of the models, evaluated in place
        loss, accuracy = global_cv(run)
        run.flat.copy_(saved)
    seconds = time.perf_counter() - t0
    run.epoch_started += seconds
    if run.probe is not None and run.probe.solo_seconds is not None:
        run.probe.parallel_start += seconds
    epoch, done = run.layout.position(step)
    yield _checked(run, epoch, epoch + done / run.layout.batches(epoch).num_steps, loss,
                   accuracy, seconds)


def _checked(run: Any, epoch: int, epochs: float, loss: float, accuracy: float,
             seconds: float, epoch_end: bool = False) -> CVChecked:
    return CVChecked(rank=run.comm.rank, epoch=epoch, step=run.progress.step, epochs=epochs,
                     cv_loss=loss, cv_frame_accuracy=accuracy,
                     train_seconds=run.progress.train_seconds, cv_seconds=seconds,
                     epoch_end=epoch_end)
