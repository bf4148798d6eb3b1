"""The training step and the trainer.

`train_step` is pure (forward, loss, backward, update; no I/O, no communication).
`train_rank` is one rank's whole run as a generator of events: every consumer (the CLI, the
notebooks, the dashboard, ipyparallel engines) iterates it, directly or through `train`,
which starts the ranks of the chosen backend. Read `train_rank` top to bottom for the method:
shard the data, broadcast rank 0's model, run SGD locally, average every K minibatches.
"""

from __future__ import annotations

import ctypes
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from labavg import checkpoint
from labavg.averagers import make_averager
from labavg.averaging import broadcast_parameters, flatten_parameters
from labavg.comm.base import Communicator
from labavg.config import TrainConfig, to_dict
from labavg.data.base import UtteranceSource
from labavg.errors import PeerFailed, UserError, one_line, user_error_of
from labavg.data.frames import FrameBatches, cv_batches, feature_stats, split_cv, steps_per_epoch
from labavg.faults import apply_fault, parse_fault
from labavg.events import (
    Averaged,
    CheckpointSaved,
    EpochDone,
    Event,
    Message,
    MinibatchDone,
    RunFinished,
    RunStarted,
)
from labavg.model import DNN, count_parameters
from labavg.optim.base import Optimizer, StepStats
from labavg.optim.factory import make_optimizer
from labavg.schedules import exponential_lr, newbob_start, newbob_step, scale_lr, NewbobState


@dataclass(frozen=True)
class StepResult:
    """What one training step measured on its minibatch."""

    loss_sum: float  # summed cross-entropy over the minibatch's frames
    correct: int
    frames: int
    stats: StepStats


def train_step(
    model: torch.nn.Module, optimizer: Optimizer, x: torch.Tensor, y: torch.Tensor, lr: float
) -> StepResult:
    """Forward, cross-entropy (summed over frames, Kaldi's objective), backward, update."""
    logits = model(x)
    loss = F.cross_entropy(logits, y, reduction="sum")
    loss.backward()
    stats = optimizer.step(lr)
    correct = (logits.detach().argmax(dim=1) == y).sum()
    return StepResult(loss.item(), int(correct.item()), y.numel(), stats)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, device: torch.device) -> torch.Tensor:
    """[summed loss, correct frames, frames] of `model` over `batches`, as float64."""
    totals = torch.zeros(3, dtype=torch.float64)
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        totals[0] += F.cross_entropy(logits, y, reduction="sum").item()
        totals[1] += (logits.argmax(dim=1) == y).sum().item()
        totals[2] += y.numel()
    return totals


def _global_cv(model, source, cv_keys, cfg, comm, device) -> tuple[float, float]:
    """CV loss and frame accuracy of the (identical) model over every rank's part of the CV set."""
    mine = cv_keys[comm.rank :: comm.size]
    totals = evaluate(model, cv_batches(source, mine, context=cfg.data.context), device)
    comm.allreduce_mean(totals)  # float64 on CPU: sums are means times size
    loss_sum, correct, frames = (totals * comm.size).tolist()
    if frames == 0:
        return math.nan, math.nan
    return loss_sum / frames, correct / frames


def _build_model(cfg: TrainConfig, source: UtteranceSource, train_keys, device: torch.device) -> DNN:
    """The initial DNN with its fixed input normalisation (the same on every rank)."""
    generator = torch.Generator().manual_seed(cfg.seed)
    input_dim = source.feat_dim * (2 * cfg.data.context + 1)
    model = DNN(input_dim, source.num_pdfs, cfg.model, generator=generator)
    mean, std = feature_stats(source, train_keys, cfg.data.context)
    model.set_input_transform(torch.from_numpy(mean).float(), torch.from_numpy(std).float())
    return model.to(device)


def _pretrain(model, cfg, source, keys, comm, device) -> Iterator[Event]:
    """RBM pretraining of the sigmoid layers, itself data-parallel with periodic averaging."""
    from labavg.rbm import pretrain_dbn

    minibatch = cfg.rbm.minibatch_size
    num_steps = steps_per_epoch(keys, source.num_frames, comm.size, minibatch)
    batches = FrameBatches(
        source, keys, context=cfg.data.context, minibatch=minibatch,
        buffer_frames=max(cfg.data.buffer_frames, minibatch), seed=cfg.seed + 7919,
        rank=comm.rank, size=comm.size, num_steps=num_steps,
    )

    def batches_for_epoch(epoch: int):
        # The Gaussian RBM expects the DNN's normalised input, as pretrain_dbn.sh feeds it.
        return (model.normalize_input(x.to(device)) for x, _ in batches.epoch(epoch))

    yield from pretrain_dbn(
        model, batches_for_epoch, comm, cfg.rbm, average_every=cfg.averaging_interval(), device=device,
        reduce=cfg.reduce,
    )


def check_fits(cfg: TrainConfig, source: UtteranceSource, size: int | None = None) -> None:
    """UserError if the data cannot feed this configuration on `size` ranks (default cfg.ranks).

    Called before any rank allocates a model, so that what every rank would meet is reported once.
    """
    from labavg.config import check_hierarchy, check_model_size

    if size is not None:  # the launched ranks; validate checked cfg.ranks where it is known
        check_hierarchy(cfg, size)
    train_keys, _ = split_cv(source.keys, cfg.data.cv_fraction, seed=cfg.seed)
    steps_per_epoch(train_keys, source.num_frames, size or cfg.ranks, cfg.minibatch)
    check_model_size(cfg, source.feat_dim * (2 * cfg.data.context + 1), source.num_pdfs)


@dataclass
class Progress:
    """What changes on a rank as training goes on, besides the model and optimizer.

    Checkpointed with them. No random-number state is needed: after initialisation the only
    randomness is the data order, a pure function of (seed, epoch, rank).
    """

    step: int = 0  # minibatches done since the start of the run
    rounds: int = 0  # averaging rounds done
    bytes_sent: int = 0  # parameter (or payload) bytes this rank put into the rounds' collectives
    node_rounds: int = 0  # of `rounds`, those within the node only ([hierarchy])
    node_bytes_sent: int = 0  # of `bytes_sent`, those of the node rounds
    overlap_seconds: float = 0.0  # of `comm_seconds`, those of non-blocking means (overlap)
    overlap_bytes_sent: int = 0  # of `bytes_sent`, those of non-blocking means
    wait_seconds: float = 0.0  # of `overlap_seconds`, those inside the waits
    compute_seconds: float = 0.0
    comm_seconds: float = 0.0
    wall_seconds: float = 0.0  # training wall time up to the last checkpoint (resumes add to it)
    epoch_sums: torch.Tensor = field(  # this epoch's [summed loss, correct, frames]
        default_factory=lambda: torch.zeros(3, dtype=torch.float64)
    )
    newbob: NewbobState | None = None

    def state_dict(self) -> dict[str, Any]:
        """Plain values and tensors (loadable with weights_only=True)."""
        return {**asdict(self), "epoch_sums": self.epoch_sums.clone(),
                "newbob": None if self.newbob is None else asdict(self.newbob)}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Progress:
        """Inverse of state_dict."""
        newbob = state.get("newbob")
        return cls(**{**state, "newbob": None if newbob is None else NewbobState(**newbob)})


def train_rank(
    comm: Communicator,
    cfg: TrainConfig,
    source: UtteranceSource,
    run_dir: Path | None = None,
    resume: bool = False,
    device: torch.device | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Iterator[Event]:
    """One rank's training run, as a stream of events (see labavg.events).

    All ranks run this in lockstep: the same number of minibatches per epoch, averaging after
    every K-th minibatch and at each epoch end. Checkpoints go to `run_dir` when given.
    `should_stop` is polled at every averaging round; when it is true on any rank, all ranks
    stop together after that round (with a checkpoint, so the run can be resumed).
    """
    wall_start = time.perf_counter()
    device = device or torch.device("cpu")
    rank, size = comm.rank, comm.size
    K = cfg.averaging_interval()
    fault = parse_fault(cfg.inject_fault) if cfg.inject_fault else None

    # Data: the same CV split and shards on every rank, computed locally.
    train_keys, cv_keys = split_cv(source.keys, cfg.data.cv_fraction, seed=cfg.seed)
    num_steps = steps_per_epoch(train_keys, source.num_frames, size, cfg.minibatch)
    batches = FrameBatches(
        source, train_keys, context=cfg.data.context, minibatch=cfg.minibatch,
        buffer_frames=cfg.data.buffer_frames, seed=cfg.seed, rank=rank, size=size,
        num_steps=num_steps,
    )
    total_steps = num_steps * cfg.epochs

    # Model: rank 0's initial parameters everywhere; parameters live in one flat buffer.
    model = _build_model(cfg, source, train_keys, device)
    flat = flatten_parameters([model])
    broadcast_parameters(flat, comm)
    per_sample_limit, model_limit = cfg.max_change_limits()
    optimizer = make_optimizer(
        cfg.optimizer, model, max_change_per_sample=per_sample_limit,
        max_param_change=model_limit,
        **({"config": cfg.ngsgd} if cfg.optimizer == "ngsgd" else {}),
    )
    lr0 = scale_lr(cfg.lr, size, cfg.lr_scaling)  # the paper's N x learning rate
    lr_final = scale_lr(cfg.final_learning_rate(), size, cfg.lr_scaling)

    progress = Progress()
    resumed_accepted = None  # Newbob's accepted model of a checkpoint taken mid-epoch
    resumed_averager = None
    found = checkpoint.latest_step(run_dir) if (resume and run_dir is not None) else None
    if found is not None:
        state = checkpoint.load_rank_state(run_dir, found[0], rank)
        if state["params"].numel() != flat.numel():
            raise UserError(
                f"checkpoint {checkpoint.checkpoint_dir(run_dir) / f'{found[0]:09d}'} holds "
                f"{state['params'].numel()} parameters but the configured model has {flat.numel()}")
        flat.copy_(state["params"].to(device))
        optimizer.load_state_dict(state["optimizer"])
        progress = Progress.from_state_dict(state["progress"])
        resumed_accepted = state.get("accepted_params")
        resumed_averager = state.get("averager")
    elif cfg.pretrain == "rbm":
        yield from _pretrain(model, cfg, source, train_keys, comm, device)
        broadcast_parameters(flat, comm)  # pretrained layers are averaged; make them exact
    if cfg.schedule == "newbob" and progress.newbob is None:
        cv_loss0, cv_acc0 = _global_cv(model, source, cv_keys, cfg, comm, device)
        progress.newbob = newbob_start(_newbob_value(cfg, cv_loss0, cv_acc0), cfg.newbob)

    # The averaging policy (K, the global model, any outer optimizer) from here on: every rank
    # holds the same parameters now, the broadcast or the checkpoint's.
    averager = make_averager(cfg, flat, comm, sizes=[p.numel() for p in model.parameters()])
    if found is not None:
        averager.load_state_dict(resumed_averager, flat)
    wall_before = progress.wall_seconds

    def save() -> CheckpointSaved:
        progress.wall_seconds = wall_before + time.perf_counter() - wall_start
        return _save(run_dir, comm, progress, flat, optimizer, cfg, accepted_params, averager)

    yield RunStarted(
        rank=rank, size=size, pid=os.getpid(), host=socket.gethostname(), device=str(device), num_params=count_parameters(model),
        num_pdfs=source.num_pdfs, input_dim=_input_dim(model),
        steps_per_epoch=num_steps, train_utterances=len(train_keys), cv_utterances=len(cv_keys),
        average_every=K, effective_lr=lr0, start_step=progress.step, averaging=averager.method,
        reduce=averager.reduce,
        payload=averager.payload if averager.payload != "int" else f"int{averager.bits}",
        bytes_per_round=averager.bytes_per_round(flat),
        hierarchy_every=cfg.hierarchy.every,
        node_ranks=averager.node.size if cfg.hierarchy.every else 0,
        overlap=cfg.overlap, fragment_bytes=tuple(getattr(averager, "fragment_bytes", ())),
    )

    cv_loss = cv_acc = math.nan
    cv_step = -1
    round_compute, round_frames = 0.0, 0
    stopped = False
    accepted_params = None
    while progress.step < total_steps and not stopped:
        epoch, start = divmod(progress.step, num_steps)
        epoch_start_time = time.perf_counter()
        if progress.newbob is not None:
            # Newbob rolls a rejected epoch back to the model it started from, which a resume
            # in mid-epoch finds in the checkpoint, not in the parameters it restarts from.
            if start > 0 and resumed_accepted is not None:
                accepted_params = resumed_accepted.to(device)
            else:
                accepted_params = flat.clone()
            resumed_accepted = None
        for x, y in batches.epoch(epoch, start_step=start):
            lr = _learning_rate(progress.newbob, lr0, lr_final, progress.step, total_steps)
            t0 = time.perf_counter()
            result = train_step(model, optimizer, x.to(device), y.to(device), lr)
            seconds = time.perf_counter() - t0
            progress.compute_seconds += seconds
            round_compute += seconds
            round_frames += result.frames
            progress.epoch_sums += torch.tensor(
                [result.loss_sum, result.correct, result.frames], dtype=torch.float64
            )
            progress.step += 1
            step = progress.step
            if step % cfg.log_every == 0 or not result.stats.applied:
                yield MinibatchDone(
                    rank=rank, epoch=epoch, step=step, loss=result.loss_sum / result.frames,
                    frame_accuracy=result.correct / result.frames, frames=result.frames, lr=lr,
                    applied=result.stats.applied, max_change_scale=result.stats.scale,
                )
            if not result.stats.applied:
                yield Message(rank=rank, step=step, text="non-finite update skipped")
            apply_fault(fault, rank, step, flat)
            end_of_epoch = step % num_steps == 0
            scope = averager.due(step, end_of_epoch)
            if scope is None:
                continue

            # Averaging round (Su & Chen 2015): one allreduce of the flat parameter buffer, then
            # the method's update of the global model (labavg.averagers); with [hierarchy], a
            # "node" round is the plain mean of this rank's node only.
            wants_stop = should_stop is not None and should_stop()
            avg = averager.round(flat, stop=wants_stop, scope=scope)
            progress.rounds += 1
            progress.comm_seconds += avg.comm_seconds
            progress.bytes_sent += avg.bytes_sent
            if scope == "node":
                progress.node_rounds += 1
                progress.node_bytes_sent += avg.bytes_sent
            # Overlapped rounds (labavg.overlap) say which part of the round was non-blocking.
            progress.overlap_seconds += getattr(avg, "overlap_seconds", 0.0)
            progress.overlap_bytes_sent += getattr(avg, "overlap_bytes", 0)
            progress.wait_seconds += getattr(avg, "wait_seconds", 0.0)
            if not avg.finite:
                yield Message(rank=rank, step=step, text="non-finite parameters left out of the "
                              "average; this rank restarts from the averaged model")
            yield Averaged(
                rank=rank, round=progress.rounds, step=step, divergence=avg.divergence,
                compute_seconds=round_compute, comm_seconds=avg.comm_seconds,
                frames_per_second=round_frames / round_compute if round_compute > 0 else 0.0,
                bytes_sent=avg.bytes_sent, scope=scope,
                wait_seconds=getattr(avg, "wait_seconds", 0.0),
                in_flight_seconds=getattr(avg, "in_flight_seconds", 0.0),
            )
            round_compute, round_frames = 0.0, 0
            if avg.stop:
                stopped = True
                yield Message(rank=rank, step=step, text="stopped on request")
            # A stop ends the run at this round, even an epoch end's: no CV, no epoch summary
            # after it (they took seconds on a class corpus), only the checkpoint to resume from.
            if run_dir is not None and (stopped or (
                    not end_of_epoch and progress.rounds % cfg.checkpoint_every == 0)):
                yield save()
            if stopped or end_of_epoch:
                break
        if stopped:
            break

        # Epoch end: every rank holds the averaged model; evaluate it on the CV set.
        cv_loss, cv_acc = _global_cv(model, source, cv_keys, cfg, comm, device)
        cv_step = progress.step
        accepted = True
        if progress.newbob is not None:
            decision = newbob_step(progress.newbob, _newbob_value(cfg, cv_loss, cv_acc), cfg.newbob)
            accepted, progress.newbob = decision.accept, decision.state
            if not accepted:  # Newbob rejects the epoch: back to the last accepted model
                flat.copy_(accepted_params)
                averager.restart(flat)
            if decision.stop:
                yield Message(rank=rank, step=progress.step, text="Newbob schedule stopped training")
                total_steps = progress.step
        loss_sum, correct, frames = progress.epoch_sums.tolist()
        yield EpochDone(
            rank=rank, epoch=epoch, step=progress.step, train_loss=loss_sum / max(frames, 1),
            train_frame_accuracy=correct / max(frames, 1), cv_loss=cv_loss,
            cv_frame_accuracy=cv_acc, lr=lr, accepted=accepted,
            seconds=time.perf_counter() - epoch_start_time,
        )
        progress.epoch_sums = torch.zeros(3, dtype=torch.float64)
        if run_dir is not None:
            yield save()

    # Resumed at the end: CV of the final model. A stopped run keeps its last epoch's CV (NaN
    # before the first epoch end): the user asked for the run to end now.
    if cv_step != progress.step and not stopped:
        cv_loss, cv_acc = _global_cv(model, source, cv_keys, cfg, comm, device)
    yield RunFinished(
        rank=rank, step=progress.step, wall_seconds=wall_before + time.perf_counter() - wall_start,
        compute_seconds=progress.compute_seconds, comm_seconds=progress.comm_seconds,
        averaging_rounds=progress.rounds, frames_trained=progress.step * cfg.minibatch * size,
        cv_loss=cv_loss, cv_frame_accuracy=cv_acc, stopped=stopped, bytes_sent=progress.bytes_sent,
        node_rounds=progress.node_rounds, node_bytes_sent=progress.node_bytes_sent,
        overlap_seconds=progress.overlap_seconds, overlap_bytes_sent=progress.overlap_bytes_sent,
        wait_seconds=progress.wait_seconds,
    )


def _input_dim(model: DNN) -> int:
    return model.hidden[0].in_features if model.hidden else model.output.in_features


def _newbob_value(cfg: TrainConfig, cv_loss: float, cv_acc: float) -> float:
    # Kaldi's FRAME_ACCURACY is in percent; the loss criterion uses the loss itself.
    return cv_acc * 100.0 if cfg.newbob.criterion == "frame_accuracy" else cv_loss


def _learning_rate(newbob, lr0, lr_final, step, total_steps) -> float:
    if newbob is not None:
        return lr0 * newbob.lr_scale
    return exponential_lr(lr0, lr_final, step / max(total_steps - 1, 1))


def _save(run_dir, comm, progress: Progress, flat, optimizer, cfg,
          accepted_params=None, averager=None) -> CheckpointSaved:
    """Every rank saves its file; rank 0 publishes the checkpoint once all are on disk."""
    state = {
        "params": flat.detach().cpu().clone(),
        "optimizer": optimizer.state_dict(),
        "progress": progress.state_dict(),
        "config": to_dict(cfg),
    }
    if averager is not None:
        state["averager"] = averager.state_dict()
    if accepted_params is not None:
        state["accepted_params"] = accepted_params.detach().cpu().clone()
    checkpoint.save_rank_state(run_dir, progress.step, comm.rank, state)
    comm.barrier()
    if comm.rank == 0:
        checkpoint.commit_checkpoint(run_dir, progress.step, comm.size)
    comm.barrier()  # nobody runs ahead into a later save before the manifest is written
    path = checkpoint.checkpoint_dir(run_dir) / f"{progress.step:09d}"
    return CheckpointSaved(rank=comm.rank, step=progress.step, path=str(path))


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> None:
    """Have glibc keep freed heap memory for reuse instead of handing it back to the kernel.

    Every step frees and reallocates megabytes (the gradients, 4.3 MB on the default model,
    and the activations); with glibc's defaults the top of the heap is trimmed and refaulted
    page by page each step: ~500 minor page faults a step, and the step's GEMM share fell from
    ~0.88 to ~0.82 of its CPU time (benchmarks/bench_train.py, README "Performance"). Setting
    the trim threshold switches off glibc's dynamic mmap threshold, so that one is set too
    (32 MiB, glibc's own ceiling for it). Process-wide and kept after the run; the process
    keeps up to about 64 MiB of freed memory at the top of each malloc arena. A no-op without glibc.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    mallopt(_M_TRIM_THRESHOLD, 64 << 20)


def train(
    cfg: TrainConfig,
    source: UtteranceSource | Callable[[], UtteranceSource],
    run_dir: Path | None = None,
    resume: bool = False,
    should_stop: Callable[[], bool] | None = None,
) -> Iterator[Event]:
    """Run training on the configured backend and yield the events of the ranks it can see.

    `inproc` runs `cfg.ranks` simulated workers as threads of this process and yields every
    rank's events. `mpi` and `torch` run the rank of this process (started by mpiexec, srun or
    torchrun) and yield its own events.

    `source` may be a function that opens the data: the process backends then open it on every
    rank and agree on the outcome before training, so a data error that some ranks meet ends
    every rank, printed once (by the lowest failing rank). Any error on a rank after that ends
    the whole job at once (abort), and a watchdog ends it when a rank falls silent.

    torch's intra-op pool is process-wide: it has `cfg.threads` threads while the run goes and
    its size from before afterwards, so a process that trains now and then (the dashboard, a
    notebook) keeps its own setting. glibc's malloc thresholds (`keep_freed_memory`) stay raised.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    keep_freed_memory()
    try:
        yield from _train(cfg, source, run_dir, resume, should_stop)
    finally:
        torch.set_num_threads(before)


def _train(cfg: TrainConfig, source: UtteranceSource | Callable[[], UtteranceSource],
           run_dir: Path | None, resume: bool,
           should_stop: Callable[[], bool] | None) -> Iterator[Event]:
    if cfg.backend == "inproc":
        from labavg.comm.inproc import iterate_inproc
        from labavg.comm.devices import select_device

        source = source() if callable(source) else source
        device = select_device(cfg.device, 0)
        yield from iterate_inproc(
            cfg.ranks, train_rank, cfg, source, run_dir, resume, device, should_stop,
            timeout=cfg.watchdog_seconds or None,
        )
        return
    from labavg.comm.devices import select_device
    from labavg.comm.world import open_communicator
    from labavg.watchdog import Watchdog, WatchedCommunicator

    comm = open_communicator(cfg.backend, size=cfg.ranks if cfg.ranks > 1 else 1, device=cfg.device)
    watchdog = None
    step = 0
    started = False  # errors before this were met on every rank (agreed): no abort needed
    try:
        rank_comm = comm
        if comm.size > 1 and cfg.watchdog_seconds > 0:
            watchdog = Watchdog(comm, cfg.watchdog_seconds, run_dir).start()
            rank_comm = WatchedCommunicator(comm, watchdog)

        def start() -> tuple[UtteranceSource, torch.device]:
            opened = source() if callable(source) else source
            check_fits(cfg, opened, comm.size)
            return opened, select_device(cfg.device, comm.local_rank)

        source, device = _agree(rank_comm, start)
        started = True
        for event in train_rank(rank_comm, cfg, source, run_dir, resume, device, should_stop):
            step = getattr(event, "step", step)
            if watchdog is None:
                yield event
                continue
            watchdog.beat(step)
            watchdog.suspend()  # a slow consumer (a decoder, a plot) is not a hung rank
            try:
                yield event
            finally:
                watchdog.resume()
    except GeneratorExit:
        raise
    except BaseException as exc:
        if comm.size == 1 or not started:
            raise
        # The other ranks would wait for ever in their next collective: end the whole job,
        # with this rank's message printed once (MPI_Abort stops the others before they print).
        user = user_error_of(exc)
        if isinstance(exc, KeyboardInterrupt):
            comm.abort("interrupted", 130, quiet=True)
        elif user is not None:
            print(f"labavg: error: rank {comm.rank}: {one_line(user)}", file=sys.stderr, flush=True)
            comm.abort(str(user), 2, quiet=True)
        else:
            if _peer_lost(exc):
                # A peer that failed first reaches this rank as a broken connection; its
                # launcher is about to end us. Wait for that, so that the failure reported is
                # the peer's own, not this echo of it.
                time.sleep(PEER_LOST_GRACE_SECONDS)
            comm.abort(f"rank {comm.rank} failed: {type(exc).__name__}: {one_line(exc)} "
                       f"(after step {step})")
        raise
    finally:
        if watchdog is not None:
            watchdog.close()
        comm.close()


PEER_LOST_GRACE_SECONDS = 5.0


def _peer_lost(exc: BaseException) -> bool:
    """Whether `exc` is a collective failing because another process went away (gloo, nccl)."""
    text = str(exc)
    return any(mark in text for mark in ("Connection closed by peer", "Connection reset by peer",
                                         "Broken pipe", "NCCL communicator was aborted"))


def _agree(comm: Communicator, opener: Callable[[], Any]) -> Any:
    """Run `opener` on every rank; if any rank fails, every rank raises (one prints).

    One allreduce of a per-rank failure flag, before any other collective, so that a rank that
    cannot open its data cannot leave the others waiting in the first broadcast.
    """
    failure: BaseException | None = None
    result = None
    try:
        result = opener()
    except Exception as exc:  # noqa: BLE001 - agreed on below, re-raised on the rank that met it
        failure = exc
    flags = torch.zeros(comm.size, dtype=torch.float64)
    flags[comm.rank] = 1.0 if failure is not None else 0.0
    comm.allreduce_mean(flags)
    failed = [r for r in range(comm.size) if flags[r].item() > 0]
    if not failed:
        return result
    if comm.rank == failed[0]:
        raise failure
    raise PeerFailed(f"rank {failed[0]} could not start: see its message")
