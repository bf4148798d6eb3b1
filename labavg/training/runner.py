"""Starting the ranks of a run on its backend (`train`), and what every backend needs around
them: the data checked before any rank allocates a model (`check_fits`), ranks agreeing on a
failure to start, an abort that ends every rank, glibc's malloc kept from trimming.

`train` yields the events of labavg.training.rank.train_rank on the ranks this process runs.
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from labavg.training.config import TrainConfig
from labavg.base.errors import PeerFailed, one_line, user_error_of
from labavg.base.events import Event
from labavg.data.base import UtteranceSource
from labavg.data.frames import split_cv, steps_per_epoch

if TYPE_CHECKING:  # the trainer is imported by `train`: a job's launcher runs check_fits alone,
    import torch  # without torch

    from labavg.comm.base import Communicator


def check_fits(cfg: TrainConfig, source: UtteranceSource, size: int | None = None) -> None:
    """UserError if the data cannot feed this configuration on `size` ranks (default cfg.ranks).

    Called before any rank allocates a model, so that what every rank would meet is reported once.
    """
    from labavg.training.config import check_hierarchy, check_model_size

    if size is not None:  # the launched ranks; validate checked cfg.ranks where it is known
        check_hierarchy(cfg, size)
    train_keys, cv_keys = split_cv(source.keys, cfg.data.cv_fraction, seed=cfg.seed)
    steps_per_epoch(train_keys, source.num_frames, size or cfg.ranks, cfg.minibatch)
    check_model_size(cfg, source.feat_dim * (2 * cfg.data.context + 1), source.num_pdfs)
    if size is None:  # the preflight's call: once per process, before any rank trains
        check_cv_data(source, cv_keys)


def check_cv_data(source: UtteranceSource, cv_keys: list[str]) -> None:
    """Load every cross-validation utterance once, so that a NaN or Inf (or a matrix that
    cannot be read) in one is reported before training, not at the first CV pass an epoch in.
    The CV set is a small share of the data and is read at every epoch's end anyway."""
    from labavg.base.errors import DataError

    for key in cv_keys:
        feats, _ = source.load(key)  # a Kaldi source's loader names the file, frame and dim
        if not np.all(np.isfinite(feats)):
            frame, dim = np.argwhere(~np.isfinite(feats))[0]
            raise DataError(f"cross-validation utterance {key!r}: NaN or Inf in its features "
                            f"(frame {frame}, dim {dim})")


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
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    keep_freed_memory()
    try:
        yield from _train(cfg, source, run_dir, resume, should_stop)
    finally:
        torch.set_num_threads(before)


def _train_inproc(cfg: TrainConfig, source: UtteranceSource | Callable[[], UtteranceSource],
                  run_dir: Path | None, resume: bool,
                  should_stop: Callable[[], bool] | None) -> Iterator[Event]:
    """`cfg.ranks` simulated workers as threads of this process: every rank's events."""
    from labavg.comm.inproc import iterate_inproc
    from labavg.comm.devices import select_device
    from labavg.training.rank import train_rank

    source = source() if callable(source) else source
    device = select_device(cfg.device, 0)
    yield from iterate_inproc(
        cfg.ranks, train_rank, cfg, source, run_dir, resume, device, should_stop,
        timeout=cfg.watchdog_seconds or None,
    )


def _train(cfg: TrainConfig, source: UtteranceSource | Callable[[], UtteranceSource],
           run_dir: Path | None, resume: bool,
           should_stop: Callable[[], bool] | None) -> Iterator[Event]:
    if cfg.backend == "inproc":
        yield from _train_inproc(cfg, source, run_dir, resume, should_stop)
        return
    from labavg.training.rank import train_rank
    from labavg.comm.devices import select_device
    from labavg.comm.world import open_communicator
    from labavg.comm.watchdog import Watchdog, WatchedCommunicator

    elastic = cfg.elastic if cfg.on_rank_loss == "continue" else None
    comm = open_communicator(cfg.backend, size=cfg.ranks if cfg.ranks > 1 else 1, device=cfg.device,
                             elastic=elastic)
    watchdog = None
    step = 0
    started = False  # errors before this were met on every rank (agreed): no abort needed
    try:
        rank_comm = comm
        # An elastic run's rounds have torchft's timeouts, which drop a hung worker and go on.
        if comm.size > 1 and cfg.watchdog_seconds > 0 and elastic is None:
            watchdog = Watchdog(comm, cfg.watchdog_seconds, run_dir).start()
            rank_comm = WatchedCommunicator(comm, watchdog)

        def start() -> tuple[UtteranceSource, torch.device]:
            opened = source() if callable(source) else source
            check_fits(cfg, opened, comm.size)
            return opened, select_device(cfg.device, comm.local_rank)

        # A joiner takes part in no collective before its first round (labavg.training.rank).
        source, device = start() if getattr(comm, "joining", False) else _agree(rank_comm, start)
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
        if watchdog is not None:  # the abort below ends every rank before its own close()
            watchdog.close(job_ends=True)
        # The other ranks would wait for ever in their next collective: end the whole job,
        # with this rank's message printed once (MPI_Abort stops the others before they print).
        user = user_error_of(exc)
        if isinstance(exc, KeyboardInterrupt):  # SIGTERM's too (labavg.cli.signals): 143
            comm.abort("interrupted", 128 + getattr(exc, "signum", 2), quiet=True)
        elif user is not None:
            # One write, newline included: hydra relays ranks' output in the chunks written.
            print(f"labavg: error: rank {comm.rank}: {one_line(user)}\n", end="", file=sys.stderr,
                  flush=True)
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
    import torch

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
