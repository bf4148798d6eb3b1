"""N simulated ranks in one process: one thread per rank, each with its own
`InProcCommunicator`; collectives meet at the rendezvous they share (labavg.comm.inproc_group).

For laptops, notebooks, CI and teaching: the per-rank training code is the same as under MPI.
torch ops release the GIL, so the ranks' compute overlaps. `run_inproc` runs a function as the
ranks, `iterate_inproc` a generator, whose items it yields as they come.

Threads: torch's intra-op thread pool is process-global, so this module never calls
`torch.set_num_threads`; the caller sets it (e.g. cores // size) before starting the ranks.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from labavg.comm.buffers import check_buffer, check_gather, check_peer, check_root
from labavg.comm.inproc_group import CollectiveMismatch, GroupAborted, GroupCall, InProcGroup
from labavg.comm.watchdog import watch_thread


class RankFailed(RuntimeError):
    """A simulated rank raised; `rank` names it and `exc` is the original exception."""

    def __init__(self, rank: int, exc: BaseException):
        super().__init__(f"rank {rank} failed: {type(exc).__name__}: {exc}")
        self.rank = rank
        self.exc = exc


class InProcCommunicator:
    """Rank `rank` of an `InProcGroup`; all ranks are on this host, so local_rank == rank."""

    def __init__(self, group: InProcGroup, rank: int):
        if not 0 <= rank < group.size:
            raise ValueError(f"rank {rank} is not in a group of {group.size}")
        self.group = group
        self.rank = rank
        self.size = group.size
        self.local_rank = rank

    def allreduce_mean(self, buf: torch.Tensor) -> None:
        """Replace `buf` with the element-wise mean over ranks (bitwise the same on every rank)."""
        check_buffer(buf)
        if self.size == 1:
            return
        mean = self.group.rendezvous(self.rank, GroupCall("allreduce_mean", buf))
        buf.copy_(mean)

    def iallreduce_mean(self, buf: torch.Tensor) -> "_InProcPending":
        """Start the mean of `buf`: its values are deposited (copied) now, as MPI would read
        them, and the ranks meet to combine them at `wait()`, with the blocking mean's bits."""
        check_buffer(buf)
        return _InProcPending(self, buf, buf.clone() if self.size > 1 else None)

    def broadcast(self, buf: torch.Tensor, root: int = 0) -> None:
        """Copy `root`'s `buf` into every rank's `buf`."""
        check_buffer(buf)
        check_root(root, self.size)
        if self.size == 1:
            return
        value = self.group.rendezvous(self.rank, GroupCall("broadcast", buf, root))
        if self.rank != root:
            buf.copy_(value)

    def allgather(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Fill `recv` with every rank's `send`, in rank order."""
        check_gather(send, recv, self.size)
        if self.size == 1:
            recv.copy_(send)
            return
        recv.copy_(self.group.rendezvous(self.rank, GroupCall("allgather", send)))

    def sendrecv(self, send: torch.Tensor | None, dst: int, recv: torch.Tensor | None,
                 src: int) -> None:
        """Send `send` to `dst` and receive `src`'s message into `recv` (either may be None)."""
        if send is not None:
            check_peer(dst, self.size)
            # A copy: the sender may change its buffer as soon as this returns, as under MPI.
            self.group.post(self.rank, dst, send.detach().clone())
        if recv is not None:
            check_peer(src, self.size)
            message = self.group.take(src, self.rank)
            if message.shape != recv.shape or message.dtype != recv.dtype:
                reason = (f"rank {self.rank} expected {recv.numel()} x {recv.dtype} from rank "
                          f"{src} but got {message.numel()} x {message.dtype}")
                self.group.abort(reason)
                raise CollectiveMismatch(reason)
            recv.copy_(message)

    def barrier(self) -> None:
        """Wait until every rank has arrived."""
        if self.size > 1:
            self.group.rendezvous(self.rank, GroupCall("barrier"))

    def idle_barrier(self) -> None:
        """`barrier`: threads wait on a condition, which keeps no core busy."""
        self.barrier()

    def split(self, color: int, key: int = 0) -> "InProcCommunicator":
        """This rank's communicator among the ranks that passed the same `color` (collective),
        ranked by (`key`, rank) as MPI_Comm_split; an abort of this group reaches it."""
        if self.size == 1:
            return InProcCommunicator(InProcGroup(1, self.group.timeout), 0)
        calls = self.group.rendezvous(self.rank, GroupCall("split", split=(int(color), int(key))))
        group, rank = calls[self.rank]
        return InProcCommunicator(group, rank)

    def node_color(self) -> int | None:
        """None: threads of one process share one memory, so there are no nodes to tell."""
        return None

    def abort(self, reason: str, code: int = 1, quiet: bool = False) -> None:
        """Break the group: every rank waiting in (or later entering) a collective raises."""
        self.group.abort(reason)

    def close(self) -> None:
        """Nothing to release; present for symmetry with the process backends."""


class _InProcPending:
    """An inproc mean in flight: the deposited values, combined at `wait` (once)."""

    def __init__(self, comm: InProcCommunicator, buf: torch.Tensor,
                 deposit: torch.Tensor | None) -> None:
        self._comm, self._buf, self._deposit = comm, buf, deposit

    def wait(self) -> None:
        """Meet the other ranks and write the mean into the buffer."""
        if self._deposit is None:
            return
        deposit, self._deposit = self._deposit, None
        comm = self._comm
        self._buf.copy_(comm.group.rendezvous(comm.rank, GroupCall("allreduce_mean", deposit)))


def _communicators(size: int, timeout: float | None = None) -> list[InProcCommunicator]:
    """One communicator per rank over a fresh group."""
    group = InProcGroup(size, timeout)
    return [InProcCommunicator(group, rank) for rank in range(size)]


def _root_cause(failures: list[tuple[int, BaseException]]) -> RankFailed:
    """The first failure that is not merely another rank's abort, wrapped with its rank."""
    for rank, exc in failures:
        if not isinstance(exc, GroupAborted):
            return RankFailed(rank, exc)
    rank, exc = failures[0]
    return RankFailed(rank, exc)


def _start(size: int, target: Callable[[int], None]) -> list[threading.Thread]:
    """Start one daemon thread per rank (daemon: a stuck rank must not keep Python alive)."""
    threads = [
        threading.Thread(target=target, args=(rank,), name=f"labavg-rank{rank}", daemon=True)
        for rank in range(size)
    ]
    for thread in threads:
        thread.start()
    return threads


def run_inproc(size: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Run `fn(comm, *args)` as `size` ranks in threads; return their results in rank order.

    If any rank raises, the group is aborted (the others stop at their next collective) and
    RankFailed(rank, exc) is raised for the root cause, chained to the original exception.
    """
    comms = _communicators(size)
    group = comms[0].group
    results: list[Any] = [None] * size
    failures: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def work(rank: int) -> None:
        try:
            results[rank] = fn(comms[rank], *args)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller's thread
            with lock:
                failures.append((rank, exc))
            group.abort(f"rank {rank} raised {type(exc).__name__}: {exc}")
        else:
            group.depart(rank)

    threads = _start(size, work)
    try:
        for thread in threads:
            thread.join()
    except BaseException:
        group.abort("the caller was interrupted")
        raise
    if failures:
        failure = _root_cause(failures)
        raise failure from failure.exc
    return results


@dataclass(frozen=True)
class _Finished:
    """End-of-stream marker of one rank: exc is None when its generator ran out."""

    rank: int
    exc: BaseException | None


def iterate_inproc(
    size: int, gen_fn: Callable[..., Iterator[Any]], *args: Any, max_queued: int = 64,
    timeout: float | None = None,
) -> Iterator[Any]:
    """Run generator `gen_fn(comm, *args)` as `size` ranks in threads; yield their items as they come.

    Items pass through a queue of at most `max_queued` entries (a slow consumer holds the ranks
    back), unchanged and interleaved in arrival order, so they should carry their rank. When a
    rank raises, the others are aborted and, once all have stopped, RankFailed is raised here.
    Closing this iterator early aborts the group, closes the ranks' generators and joins them.

    `timeout` is the watchdog: a rank that waits longer in one collective breaks the group
    (CollectiveTimeout names the missing ranks). A hung rank's thread cannot be stopped; it is
    left behind (a daemon) once the others have ended and `timeout` more seconds have passed.
    """
    comms = _communicators(size, timeout)
    drain = 5.0 if timeout else None  # aborted ranks end at once; only a hung one stays
    # After a failure the group is broken: the other ranks raise at their next collective.
    # Waiting `timeout` again for a hung one doubled the watchdog's time (250 s at 120).
    grace = min(timeout, drain) if timeout else None
    group = comms[0].group
    items: queue.Queue = queue.Queue(maxsize=max_queued)
    stop = threading.Event()

    def work(rank: int) -> None:
        _run_rank(rank, comms[rank], gen_fn, args, stop, items)

    threads = _start(size, work)
    finished = 0
    ended: set[int] = set()  # ranks that reported back (the rest are hung, or still going)
    hung = False
    failures: list[tuple[int, BaseException]] = []
    try:
        while finished < size:
            try:
                item = _get(items, grace if failures else None)
            except queue.Empty:
                hung = True  # a hung rank never finishes: report the others' failure without it
                break
            if isinstance(item, _Finished):
                finished += 1
                ended.add(item.rank)
                if item.exc is not None:
                    failures.append((item.rank, item.exc))
                    stop.set()
            elif not failures:
                yield item
        if failures:
            failure = _root_cause(failures)
            raise failure from failure.exc
    finally:
        if finished < size:
            # Closed early or interrupted: stop the ranks, then drain so none blocks on put().
            stop.set()
            group.abort("the consumer stopped iterating")
            while finished < size and not hung:
                try:
                    item = items.get(timeout=drain)
                except queue.Empty:
                    break
                if isinstance(item, _Finished):
                    finished += 1
                    ended.add(item.rank)
        for rank, thread in enumerate(threads):
            # A rank that never reported back is hung: joining it would only add `drain`.
            if rank in ended:
                thread.join(timeout=drain)


def _get(items: queue.Queue, timeout: float | None) -> Any:
    """`items.get(timeout=timeout)` in short waits: an exception raised in this thread from
    another (labavg.jobs.launch.ThreadRun.interrupt) is taken between them, not after the
    next item, which a rank deep in a CV pass may not send for minutes."""
    from labavg.base.waiting import Deadline

    deadline = Deadline(timeout)
    while True:
        left = deadline.left()
        try:
            return items.get(timeout=0.2 if left is None else min(0.2, left))
        except queue.Empty:
            if deadline.passed():
                raise


def _run_rank(rank: int, comm: InProcCommunicator, gen_fn: Callable[..., Iterator[Any]],
              args: tuple, stop: threading.Event, items: queue.Queue) -> None:
    """One rank's thread of `iterate_inproc`: its items into `items`, then its _Finished."""
    group = comm.group
    outcome = _Finished(rank, None)
    watch_thread(_RankWatcher(group, rank))  # this thread is the rank: its progress is its own
    try:
        gen = gen_fn(comm, *args)
        try:
            for item in _until(stop, gen):
                items.put(item)
        finally:
            # Runs the rank's own finally blocks when it is stopped mid-stream.
            gen.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the consumer's thread
        if not (stop.is_set() and isinstance(exc, GroupAborted)):
            outcome = _Finished(rank, exc)
    # Always reached, so the consumer's count of finished ranks cannot fall short.
    if outcome.exc is None:
        group.depart(rank)
    else:
        group.abort(f"rank {rank} raised {type(outcome.exc).__name__}: {outcome.exc}")
    watch_thread(None)
    items.put(outcome)


class _RankWatcher:
    """What an in-process rank's progress and busy work tell: its group (labavg.comm.watchdog)."""

    def __init__(self, group: InProcGroup, rank: int) -> None:
        self.group, self.rank = group, rank

    def progress(self) -> None:
        self.group.note_progress(self.rank)

    def busy(self, on: bool) -> None:
        self.group.note_busy(self.rank, on)


def _until(stop: threading.Event, gen: Iterator[Any]) -> Iterator[Any]:
    """Items of `gen`, checking `stop` before resuming it each time."""
    while not stop.is_set():
        try:
            item = next(gen)
        except StopIteration:
            return
        yield item

