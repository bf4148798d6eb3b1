"""One rank's training run, `train_rank`: a generator of events that reads top to bottom.

Every consumer (the CLI, the notebooks, the dashboard, ipyparallel engines) iterates it,
directly or through labavg.training.runner.train, which starts the ranks of the chosen backend.
The method: shard the data, broadcast rank 0's model, run SGD locally, and let the averager
(labavg.averaging.interface.RoundAverager) average every K minibatches and at each epoch end.
The loop never asks which averager it has: what a round measured comes back in its stats.
CV, at epoch ends and every `cv_every` minibatches, and the training clock that leaves it out
are labavg.training.cv_check.
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from labavg.averaging.factory import make_averager
from labavg.averaging.interface import RoundAverager
from labavg.averaging.mean import broadcast_parameters, flatten_parameters
from labavg.training.config import TrainConfig
from labavg.base.events import (
    Averaged, CheckpointSaved, EpochDone, Event, Message, MinibatchDone, RunFinished, RunStarted,
)
from labavg.base.faults import apply_fault, parse_fault
from labavg.base.machine import usable_cores
from labavg.comm.base import Communicator
from labavg.comm.watchdog import busy, progress as made_progress
from labavg.data.base import UtteranceSource
from labavg.data.frames import FrameBatches, split_cv
from labavg.optim.base import Optimizer
from labavg.optim.factory import make_optimizer
from labavg.training import rank_state
from labavg.training.cv_check import (check_if_due, epoch_cv, global_cv, start_clock,
                                      train_seconds)
from labavg.training.initial_model import build_model, input_dim, pretrain
from labavg.training.membership import (Membership, admit, elastic_load, elastic_state,
                                        follow_members)
from labavg.training.model import DNN, count_parameters
from labavg.training.rank_state import Progress
from labavg.training.resume_layout import Layout, resized
from labavg.training.schedules import exponential_lr, newbob_start, newbob_step, scale_lr
from labavg.training.speedup_probe import (SpeedupProbe, close_pair, make_probe, remember,
                                           run_cores, start_pair)
from labavg.training.step import train_step


def train_rank(
    comm: Communicator,
    cfg: TrainConfig,
    source: UtteranceSource,
    run_dir: Path | None = None,
    resume: bool = False,
    device: torch.device | None = None,
    should_stop: Callable[[], bool] | None = None,
    *,
    new_averager: Callable[..., RoundAverager] = make_averager,
) -> Iterator[Event]:
    """One rank's training run, as a stream of events (see labavg.base.events).

    All ranks run this in lockstep: the same number of minibatches per epoch, averaging when
    the averager says a round is due (every K-th minibatch and each epoch end). Checkpoints go
    to `run_dir` when given. `should_stop` is polled at every averaging round; when it is true
    on any rank, all ranks stop together after that round (with a checkpoint, so the run can
    be resumed). `new_averager(cfg.averaging, cfg.minibatch, flat, comm, sizes=...)` makes the
    run's averager (labavg.averaging.factory.make_averager; any RoundAverager will do).
    """
    run = yield from _set_up(comm, cfg, source, run_dir, resume, device or torch.device("cpu"),
                             new_averager)
    run.should_stop = should_stop
    yield _run_started(run)
    start_clock(run)
    if run.joining:
        yield from _join(run)
    elif run.progress.step:  # resumed: a stop at a check's step skipped the check there
        yield from check_if_due(run)
    while run.progress.step < run.total_steps and not run.stopped:
        epoch, start = run.layout.position(run.progress.step)
        reached_end = yield from _train_epoch(run, epoch, start)
        if not reached_end:  # stopped on request, mid-epoch or at its end
            break
        yield from _end_epoch(run, epoch)
    yield _run_finished(run)


@dataclass
class _RankRun:
    """What the phases of one rank's run share."""

    comm: Communicator
    cfg: TrainConfig
    source: UtteranceSource
    device: torch.device
    run_dir: Path | None
    train_keys: list[str]
    cv_keys: list[str]
    layout: Layout  # each epoch's split of the data (labavg.training.resume_layout)
    total_steps: int
    model: DNN
    flat: torch.Tensor  # every parameter of `model`, as views into this one buffer
    optimizer: Optimizer
    averager: RoundAverager
    lr0: float
    lr_final: float
    progress: Progress
    wall_start: float
    wall_before: float  # training wall seconds of the runs this one resumes
    fault: Any = None  # an injected fault (labavg.base.faults)
    probe: SpeedupProbe | None = None  # the paired speedup measurement
    cores: int = 0  # CPU cores the ranks may use, over all hosts
    should_stop: Callable[[], bool] | None = None
    resumed_accepted: torch.Tensor | None = None  # Newbob's accepted model, from a checkpoint
    accepted_params: torch.Tensor | None = None  # Newbob's accepted model: this epoch's start
    lr: float = math.nan  # of the last minibatch
    epoch_started: float = 0.0
    round_compute: float = 0.0  # compute seconds since the last round
    round_frames: int = 0  # frames trained since the last round
    stopped: bool = False
    cv_loss: float = math.nan
    cv_acc: float = math.nan
    cv_step: int = -1  # the step the CV figures are of
    clock_mark: float = 0.0  # when the training clock last took its time (cv_check.train_seconds)
    membership: Membership | None = None  # an elastic run's workers (labavg.training.membership)
    joining: bool = False  # started by `labavg train --join`: heals at the next round


# Setup ----------------------------------------------------------------------------------------

def _set_up(comm: Communicator, cfg: TrainConfig, source: UtteranceSource,
            run_dir: Path | None, resume: bool, device: torch.device,
            new_averager: Callable[..., RoundAverager]) -> Iterator[Event]:
    """Data, model, optimizer, the resumed or pretrained start, the averager; returns the
    _RankRun (through `yield from`), yielding pretraining's events on the way."""
    wall_start = time.perf_counter()
    fault = parse_fault(cfg.inject_fault) if cfg.inject_fault else None
    # Data: the same CV split and shards on every rank, computed locally.
    train_keys, cv_keys = split_cv(source.keys, cfg.data.cv_fraction, seed=cfg.seed)
    batches = FrameBatches(
        source, train_keys, context=cfg.data.context, minibatch=cfg.minibatch,
        buffer_frames=cfg.data.buffer_frames, seed=cfg.seed, rank=comm.rank, size=comm.size)
    # A worker joining an elastic run receives every state at its first round (_join): until
    # then it takes part in no collective.
    joining = getattr(comm, "joining", False)
    # Model: rank 0's initial parameters everywhere; parameters live in one flat buffer.
    model = build_model(cfg, source, train_keys, device)
    flat = flatten_parameters([model])
    if not joining:
        broadcast_parameters(flat, comm)
    optimizer = _make_optimizer(cfg, model)
    restored = None
    if resume and run_dir is not None:
        restored = rank_state.restore(run_dir, comm.rank, flat, optimizer)
    if restored is None and cfg.pretrain == "rbm" and not joining:
        yield from pretrain(model, cfg, source, train_keys, comm, device)
        broadcast_parameters(flat, comm)  # pretrained layers are averaged; make them exact
    progress = Progress() if restored is None else restored.progress
    progress.resized = resized(progress.resized, progress.step, restored, comm.size)
    layout = Layout(batches, train_keys, progress.resized, cfg.epochs)
    run = _RankRun(
        comm, cfg, source, device, run_dir, train_keys, cv_keys, layout,
        total_steps=layout.total_steps, model=model, flat=flat, optimizer=optimizer,
        averager=None, lr0=scale_lr(cfg.lr, comm.size, cfg.lr_scaling),  # the paper's N x lr
        lr_final=scale_lr(cfg.final_learning_rate(), comm.size, cfg.lr_scaling),
        progress=progress, wall_start=wall_start, wall_before=progress.wall_seconds, fault=fault,
        resumed_accepted=None if restored is None else restored.accepted_params,
    )
    if cfg.schedule == "newbob" and progress.newbob is None and not joining:
        cv_loss0, cv_acc0 = global_cv(run)
        progress.newbob = newbob_start(_newbob_value(cfg, cv_loss0, cv_acc0), cfg.newbob)
    elif progress.newbob is not None and progress.newbob.stopped:
        run.total_steps = progress.step  # resumed where the schedule ended training: finish
    # The averaging policy (K, the global model, any outer optimizer) from here on: every rank
    # holds the same parameters now, the broadcast or the checkpoint's.
    run.averager = new_averager(cfg.averaging, cfg.minibatch, flat, comm,
                                sizes=[p.numel() for p in model.parameters()])
    if restored is not None:
        run.averager.load_state_dict(restored.averager_state, flat)
    elastic = hasattr(comm, "admit")
    # An elastic run measures no speedup pairs: the N they are of could change under them.
    run.probe = make_probe(comm, 0 if elastic else cfg.speedup_pairs,
                           cfg.effective_average_every(), run.total_steps)
    if not elastic:
        run.cores = run_cores(comm)
        return run
    run.membership, run.joining = Membership(tuple(comm.members)), joining
    run.cores = usable_cores()
    comm.set_state(lambda: elastic_state(run), lambda state: elastic_load(run, state))
    return run


def _make_optimizer(cfg: TrainConfig, model: DNN) -> Optimizer:
    per_sample_limit, model_limit = cfg.max_change_limits()
    return make_optimizer(
        cfg.optimizer, model, max_change_per_sample=per_sample_limit,
        max_param_change=model_limit,
        **({"config": cfg.ngsgd} if cfg.optimizer == "ngsgd" else {}),
    )


def _run_started(run: _RankRun) -> RunStarted:
    comm, cfg = run.comm, run.cfg
    return RunStarted(
        rank=comm.rank, size=comm.size, pid=os.getpid(), host=socket.gethostname(),
        device=str(run.device), num_params=count_parameters(run.model),
        num_pdfs=run.source.num_pdfs, input_dim=input_dim(run.model),
        steps_per_epoch=run.layout.steps_per_epoch(), train_utterances=len(run.train_keys),
        cv_utterances=len(run.cv_keys), average_every=cfg.effective_average_every(),
        effective_lr=run.lr0, start_step=run.progress.step, cores=run.cores, backend=cfg.backend,
        load=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        **asdict(run.averager.describe(run.flat)),
    )


# An epoch -------------------------------------------------------------------------------------

def _train_epoch(run: _RankRun, epoch: int, start: int) -> Iterator[Event]:
    """Minibatches `start`.. of `epoch`, each followed by the round the averager says is due
    and by a checkpoint when one is due; returns (through `yield from`) whether the epoch ran
    to its end without a stop request, False when it stopped on request."""
    run.epoch_started = time.perf_counter()
    _keep_accepted_model(run, start)
    for x, y in run.layout.batches(epoch).epoch(epoch, start_step=start):
        yield from _train_minibatch(run, epoch, x, y)
        if (yield from _round_if_due(run)):
            break  # an epoch's end saves in _end_epoch
        yield from check_if_due(run)
    return not run.stopped


def _round_if_due(run: _RankRun, admitted: bool = False) -> Iterator[Event]:
    """The averaging round the averager says is due after the last minibatch, and the
    checkpoint when one is due; returns (through `yield from`) whether the epoch ends here,
    at its end or on a stop request. `admitted`: an elastic joiner's admission is done."""
    step = run.progress.step
    end_of_epoch = run.layout.epoch_ends(step)
    scope = run.averager.due(step, end_of_epoch)
    if scope is None:
        return False
    yield from _average(run, scope, admitted)
    yield from close_pair(run.probe, run.comm.rank, step, run.progress.rounds, end_of_epoch,
                          run.device)
    # A stop ends the run at this round, even an epoch end's: no CV, no epoch summary
    # after it (they took seconds on a class corpus), only the checkpoint to resume from.
    if run.run_dir is not None and (run.stopped or (
            not end_of_epoch and run.progress.rounds % run.cfg.checkpoint_every == 0)):
        yield _save(run)
    if run.stopped or end_of_epoch:
        return True
    start_pair(run.probe, run.comm, run.model, run.flat, run.optimizer, run.lr,
               run.progress.rounds, step, run.device)
    return False


def _join(run: _RankRun) -> Iterator[Event]:
    """A worker started by `labavg train --join`: it heals at the survivors' next round
    (their model, optimizer, averager, progress and membership become its own, bitwise) and
    goes through the rest of that round with them, then trains on as one of them."""
    run.comm.admit()
    run.membership.change(tuple(run.comm.members), run.progress.step)
    follow_members(run)
    run.epoch_started = time.perf_counter()
    start_clock(run)  # the survivors' clock is its own from here
    if not (yield from _round_if_due(run, admitted=True)):
        yield from check_if_due(run)  # the survivors take theirs after this round too
    elif not run.stopped:
        yield from _end_epoch(run, run.layout.position(run.progress.step - 1)[0])


def _keep_accepted_model(run: _RankRun, start: int) -> None:
    """Keep the model Newbob returns to if it rejects this epoch."""
    if run.progress.newbob is None:
        return
    # Newbob rolls a rejected epoch back to the model it started from, which a resume in
    # mid-epoch finds in the checkpoint, not in the parameters it restarts from.
    if start > 0 and run.resumed_accepted is not None:
        run.accepted_params = run.resumed_accepted.to(run.device)
    else:
        run.accepted_params = run.flat.clone()
    run.resumed_accepted = None


def _train_minibatch(run: _RankRun, epoch: int, x: torch.Tensor, y: torch.Tensor
                     ) -> Iterator[Event]:
    """One local SGD step, with its events."""
    progress, rank = run.progress, run.comm.rank
    made_progress()  # K slow steps between two rounds are not a hung rank
    run.lr = lr = _learning_rate(run, progress.step)
    t0 = time.perf_counter()
    result = train_step(run.model, run.optimizer, x.to(run.device), y.to(run.device), lr)
    seconds = time.perf_counter() - t0
    remember(run.probe, rank, x, y)
    progress.compute_seconds += seconds
    run.round_compute += seconds
    run.round_frames += result.frames
    progress.epoch_sums += torch.tensor(
        [result.loss_sum, result.correct, result.frames], dtype=torch.float64
    )
    run.averager.observe(result.loss_sum, result.frames)
    progress.step += 1
    step = progress.step
    if step % run.cfg.log_every == 0 or not result.stats.applied:
        yield MinibatchDone(
            rank=rank, epoch=epoch, step=step, loss=result.loss_sum / result.frames,
            frame_accuracy=result.correct / result.frames, frames=result.frames, lr=lr,
            applied=result.stats.applied, max_change_scale=result.stats.scale,
        )
    if not result.stats.applied:
        yield Message(rank=rank, step=step, text="non-finite update skipped")
    apply_fault(run.fault, rank, step, run.flat)


def _average(run: _RankRun, scope: str, admitted: bool = False) -> Iterator[Event]:
    """One averaging round (Su & Chen 2015) of `scope`, as the averager runs it; in an elastic
    run, opened by the admission round that says who is present."""
    rank, step = run.comm.rank, run.progress.step
    if run.membership is not None and not admitted:
        yield from admit(run.comm, run.membership, rank=rank, step=step, rounds=run.progress.rounds)
        follow_members(run)
    wants_stop = run.should_stop is not None and run.should_stop()
    stats = run.averager.round(run.flat, stop=wants_stop, scope=scope)
    run.progress.add_round(stats)
    if not stats.finite:
        yield Message(rank=rank, step=step, text="non-finite parameters left out of the "
                      "average; this rank restarts from the averaged model")
    compute = run.round_compute
    yield Averaged(
        rank=rank, round=run.progress.rounds, step=step, divergence=stats.divergence,
        compute_seconds=compute, comm_seconds=stats.comm_seconds,
        frames_per_second=run.round_frames / compute if compute > 0 else 0.0,
        bytes_sent=stats.bytes_sent, scope=scope, wait_seconds=stats.wait_seconds,
        in_flight_seconds=stats.in_flight_seconds, average_every=run.averager.average_every,
    )
    run.round_compute, run.round_frames = 0.0, 0
    if stats.stop:
        run.stopped = True
        yield Message(rank=rank, step=step, text="stopped on request")


def _end_epoch(run: _RankRun, epoch: int) -> Iterator[Event]:
    """Every rank holds the averaged model: evaluate it on the CV set, let Newbob decide,
    report the epoch, save."""
    progress = run.progress
    yield from epoch_cv(run)
    accepted = yield from _newbob_decides(run)
    loss_sum, correct, frames = progress.epoch_sums.tolist()
    yield EpochDone(
        rank=run.comm.rank, epoch=epoch, step=progress.step,
        train_loss=loss_sum / max(frames, 1), train_frame_accuracy=correct / max(frames, 1),
        cv_loss=run.cv_loss, cv_frame_accuracy=run.cv_acc, lr=run.lr, accepted=accepted,
        seconds=time.perf_counter() - run.epoch_started,
    )
    progress.epoch_sums = torch.zeros(3, dtype=torch.float64)
    if run.run_dir is not None:
        yield _save(run)


def _newbob_decides(run: _RankRun) -> Iterator[Event]:
    """Newbob's verdict on the epoch just evaluated (True without Newbob): a rejected epoch
    goes back to the last accepted model; a stop ends training here."""
    progress, cfg = run.progress, run.cfg
    if progress.newbob is None:
        return True
    decision = newbob_step(progress.newbob, _newbob_value(cfg, run.cv_loss, run.cv_acc),
                           cfg.newbob)
    progress.newbob = decision.state
    if not decision.accept:
        run.flat.copy_(run.accepted_params)
        run.averager.restart(run.flat)
    if decision.stop:
        yield Message(rank=run.comm.rank, step=progress.step,
                      text="Newbob schedule stopped training")
        run.total_steps = progress.step
    return decision.accept


def _run_finished(run: _RankRun) -> RunFinished:
    progress = run.progress
    # Resumed at the end: CV of the final model. A stopped run keeps its last epoch's CV (NaN
    # before the first epoch end): the user asked for the run to end now.
    if run.cv_step != progress.step and not run.stopped:
        run.cv_loss, run.cv_acc = global_cv(run)
    return RunFinished(
        rank=run.comm.rank, step=progress.step,
        wall_seconds=run.wall_before + time.perf_counter() - run.wall_start,
        compute_seconds=progress.compute_seconds, comm_seconds=progress.comm_seconds,
        averaging_rounds=progress.rounds,
        frames_trained=run.cfg.minibatch * (run.layout.worker_steps(progress.step)
                                            if run.membership is None
                                            else run.membership.worker_steps(progress.step)),
        cv_loss=run.cv_loss, cv_frame_accuracy=run.cv_acc, stopped=run.stopped,
        bytes_sent=progress.bytes_sent, node_rounds=progress.node_rounds,
        node_bytes_sent=progress.node_bytes_sent, overlap_seconds=progress.overlap_seconds,
        overlap_bytes_sent=progress.overlap_bytes_sent, wait_seconds=progress.wait_seconds,
        **(run.layout.finished_fields(progress.step, run.cfg.minibatch, run.comm.size)
           if run.membership is None else {
            "worker_steps": tuple(run.membership.steps),
            "worker_counts": tuple(run.membership.counts),
            "members": tuple(run.membership.members)}),
    )


# Small helpers --------------------------------------------------------------------------------

def _save(run: _RankRun) -> CheckpointSaved:
    run.progress.wall_seconds = run.wall_before + time.perf_counter() - run.wall_start
    train_seconds(run)
    with busy():  # one file written, however slow the disk: not a hung rank
        return rank_state.save(run.run_dir, run.comm, run.progress, run.flat, run.optimizer,
                               run.cfg, run.accepted_params, run.averager)


def _newbob_value(cfg: TrainConfig, cv_loss: float, cv_acc: float) -> float:
    # Kaldi's FRAME_ACCURACY is in percent; the loss criterion uses the loss itself.
    return cv_acc * 100.0 if cfg.newbob.criterion == "frame_accuracy" else cv_loss


def _learning_rate(run: _RankRun, step: int) -> float:
    if run.progress.newbob is not None:
        return run.lr0 * run.progress.newbob.lr_scale
    return exponential_lr(run.lr0, run.lr_final, step / max(run.total_steps - 1, 1))

