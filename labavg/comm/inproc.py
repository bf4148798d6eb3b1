"""N simulated ranks in one process: one thread per rank, collectives meet at a shared rendezvous.

For laptops, notebooks, CI and teaching: the per-rank training code is the same as under MPI,
each thread gets its own `InProcCommunicator`, and all of them share one `InProcGroup`. torch
ops release the GIL, so the ranks' compute overlaps.

Determinism: `allreduce_mean` adds the ranks' buffers in the association MPICH uses for a
commutative SUM (recursive doubling, mpich src/mpi/coll/allreduce/
allreduce_intra_recursive_doubling.c and the reduce-scatter/allgather variant: pairs (0,1),
(2,3), ... first, non-power-of-two extras folded into their even neighbour), then divides by
the size exactly as the MPI backend does. Every rank gets the bitwise identical result, on
every run; measured bitwise equal to MPICH 5.0.2 for 2-8 ranks here.

Threads: torch's intra-op thread pool is process-global, so this module never calls
`torch.set_num_threads`; the caller sets it (e.g. cores // size) before starting the ranks.

Point-to-point messages (`sendrecv`, for the reduce algorithms of labavg.comm.reduce) go
through one FIFO mailbox per ordered pair of ranks; a send copies its buffer and never blocks,
so no exchange pattern can deadlock here, while MPI and gloo need Sendrecv / isend+irecv for it.

A rank that raises aborts the group, so the others get `GroupAborted` from their next (or
current) collective or receive instead of waiting forever; a rank that returns while others
still call collectives (or wait for its message) also breaks the group (`CollectiveMismatch`),
as do ranks calling different collectives or with different buffer shapes.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from labavg.comm.buffers import check_buffer, check_gather, check_peer, check_root, split_members

# Seconds between a waiting receiver's checks for an abort, a departed sender, the watchdog.
_POLL_S = 0.1


class GroupAborted(RuntimeError):
    """This rank's collective was cut short because another rank failed or the group was aborted."""


class CollectiveTimeout(RuntimeError):
    """A rank waited longer than the group's timeout for the others (one hung or stopped)."""


class CollectiveMismatch(RuntimeError):
    """The ranks did not call the same collective on buffers of the same shape, or one had left."""


class RankFailed(RuntimeError):
    """A simulated rank raised; `rank` names it and `exc` is the original exception."""

    def __init__(self, rank: int, exc: BaseException):
        super().__init__(f"rank {rank} failed: {type(exc).__name__}: {exc}")
        self.rank = rank
        self.exc = exc


@dataclass(frozen=True)
class _Call:
    """What one rank asked the group for."""

    op: str
    buf: torch.Tensor | None = None
    root: int = 0
    split: tuple[int, int] | None = None  # (color, key) of a `split`

    def describe(self) -> str:
        """`op(numel, dtype, device)` for mismatch messages."""
        if self.buf is None:
            return f"{self.op}()"
        where = f", root={self.root}" if self.op == "broadcast" else ""
        return f"{self.op}(numel={self.buf.numel()}, {self.buf.dtype}, {self.buf.device}{where})"


def tree_sum(bufs: list[torch.Tensor]) -> torch.Tensor:
    """Sum of `bufs` (a new tensor) in MPICH's recursive-doubling association.

    With p the largest power of two <= n and r = n - p, the first 2r buffers are added in pairs
    (0+1, 2+3, ...), then the p partial sums are added pairwise, level by level.
    """
    n = len(bufs)
    if n == 1:
        return bufs[0].clone()
    pof2 = 1 << (n.bit_length() - 1)
    rem = n - pof2
    parts = [bufs[2 * i] + bufs[2 * i + 1] for i in range(rem)] + list(bufs[2 * rem :])
    while len(parts) > 1:
        parts = [parts[2 * i] + parts[2 * i + 1] for i in range(len(parts) // 2)]
    return parts[0]


def _check_same(calls: list[_Call]) -> None:
    """Raise CollectiveMismatch unless every rank made the same call on alike buffers."""
    first = calls[0]
    for rank, call in enumerate(calls[1:], start=1):
        same = call.op == first.op and call.root == first.root
        if same and first.buf is not None:
            same = (
                call.buf.numel() == first.buf.numel()
                and call.buf.dtype == first.buf.dtype
                and call.buf.device == first.buf.device
            )
        if not same:
            raise CollectiveMismatch(
                f"rank 0 called {first.describe()} but rank {rank} called {call.describe()}"
            )


def _combine(calls: list[_Call]) -> torch.Tensor | None:
    """The collective's result, computed once for the whole group."""
    _check_same(calls)
    first = calls[0]
    if first.op == "allreduce_mean":
        # Same in-place division as the MPI and torch backends, so the results agree bitwise.
        return tree_sum([call.buf for call in calls]).div_(len(calls))
    if first.op == "allgather":
        return torch.cat([call.buf for call in calls])
    if first.op == "broadcast":
        # A copy, because the root may change its buffer before the others have read it.
        return calls[first.root].buf.clone()
    return None


def _split_groups(parent: "InProcGroup", calls: list[_Call]) -> dict[int, tuple["InProcGroup", int]]:
    """For each parent rank, its new group and rank in it, as MPI_Comm_split orders them."""
    out: dict[int, tuple[InProcGroup, int]] = {}
    for members in split_members([call.split for call in calls]):
        child = InProcGroup(len(members), parent.timeout)
        ranks = {parent_rank: new for new, parent_rank in enumerate(members)}
        parent._children.append((child, ranks))
        out.update({parent_rank: (child, new) for parent_rank, new in ranks.items()})
    return out


class InProcGroup:
    """The rendezvous shared by the `size` simulated ranks of one process.

    A hand-written generation barrier on a Condition rather than threading.Barrier: a rank that
    leaves right after the last collective must not break the barrier for ranks that have
    been released but not yet woken (threading.Barrier.abort would make them raise).
    """

    def __init__(self, size: int, timeout: float | None = None):
        if size < 1:
            raise ValueError(f"group size must be at least 1, got {size}")
        self.size = size
        self.timeout = timeout  # seconds a rank may wait in one collective (the watchdog)
        self._cond = threading.Condition()
        self._calls: list[_Call | None] = [None] * size
        self._arrived = 0
        self._generation = 0
        self._result: torch.Tensor | None = None
        self._broken: str | None = None
        self._departed: list[int] = []
        self._mail: dict[tuple[int, int], queue.SimpleQueue] = {}
        self._mail_lock = threading.Lock()
        # Groups made by `split`, with parent rank -> child rank: an abort or a departure
        # here reaches them, since their ranks may be waiting there instead.
        self._children: list[tuple[InProcGroup, dict[int, int]]] = []

    @property
    def aborted(self) -> bool:
        """Whether the group is broken; every later collective raises."""
        return self._broken is not None

    def abort(self, reason: str = "the group was aborted") -> None:
        """Break the group: ranks waiting in (or later entering) a collective raise GroupAborted."""
        with self._cond:
            self._break(reason)

    def depart(self, rank: int) -> None:
        """Rank `rank` has finished; a collective that still needs it can never complete."""
        with self._cond:
            self._departed.append(rank)
            for child, ranks in self._children:
                if rank in ranks:
                    child.depart(ranks[rank])
            if self._arrived:
                waiting = [r for r, call in enumerate(self._calls) if call is not None]
                self._break(f"rank {rank} finished while rank(s) {waiting} wait in a collective")

    def rendezvous(self, rank: int, call: _Call) -> torch.Tensor | None:
        """Block until every rank has made its call; return the group's result."""
        with self._cond:
            if self._broken is not None:
                raise GroupAborted(self._broken)
            if self._departed:
                reason = f"rank {rank} called {call.describe()} but rank(s) {self._departed} had finished"
                self._break(reason)
                raise CollectiveMismatch(reason)
            generation = self._generation
            self._calls[rank] = call
            self._arrived += 1
            if self._arrived == self.size:
                return self._complete(rank)
            since = time.monotonic()
            while generation == self._generation and self._broken is None:
                if not self._cond.wait(timeout=self.timeout):
                    # Confirm: after the whole process was stopped and continued, the wait
                    # times out at once while the other ranks are about to arrive.
                    arrived = self._arrived
                    self._cond.wait(timeout=min(self.timeout, 5.0))
                    if (generation == self._generation and self._broken is None
                            and self._arrived == arrived):
                        missing = [r for r, c in enumerate(self._calls) if c is None]
                        reason = (f"watchdog: rank(s) {missing} did not reach {call.op} within "
                                  f"{time.monotonic() - since:.0f} s (watchdog_seconds = "
                                  f"{self.timeout:g}) while rank {rank} waited")
                        self._break(reason)
                        raise CollectiveTimeout(reason)
            if generation != self._generation:
                # The next collective cannot overwrite _result before this rank arrives there.
                return self._result
            raise GroupAborted(self._broken)

    def post(self, src: int, dst: int, message: torch.Tensor) -> None:
        """Leave `message` (the sender's own copy) in the mailbox from `src` to `dst`."""
        if self._broken is not None:
            raise GroupAborted(self._broken)
        self._mailbox(src, dst).put(message)

    def take(self, src: int, dst: int) -> torch.Tensor:
        """The next message from `src` to `dst`, waiting for it as a collective waits.

        The mailbox is polled so that an abort, a sender that has finished and the watchdog are
        noticed without a wake-up from each of them.
        """
        box = self._mailbox(src, dst)
        since = time.monotonic()
        while True:
            try:
                return box.get(timeout=_POLL_S)
            except queue.Empty:
                pass
            if self._broken is not None:
                raise GroupAborted(self._broken)
            if src in self._departed:
                try:
                    return box.get_nowait()  # sent just before it left
                except queue.Empty:
                    reason = f"rank {dst} waits for a message from rank {src}, which had finished"
                    self.abort(reason)
                    raise CollectiveMismatch(reason) from None
            waited = time.monotonic() - since
            if self.timeout and waited > self.timeout:
                try:
                    # Confirm, as `rendezvous` does: a stopped and continued process sees its
                    # whole pause at once.
                    return box.get(timeout=min(self.timeout, 5.0))
                except queue.Empty:
                    reason = (f"watchdog: rank {dst} waited {waited:.0f} s for a message from "
                              f"rank {src} (watchdog_seconds = {self.timeout:g})")
                    self.abort(reason)
                    raise CollectiveTimeout(reason) from None

    def _mailbox(self, src: int, dst: int) -> queue.SimpleQueue:
        with self._mail_lock:
            box = self._mail.get((src, dst))
            if box is None:
                box = self._mail[(src, dst)] = queue.SimpleQueue()
            return box

    def _complete(self, rank: int) -> torch.Tensor | None:
        """Run by the last rank to arrive, holding the lock: compute the result, release all."""
        calls = self._calls
        self._calls = [None] * self.size
        self._arrived = 0
        try:
            self._result = _split_groups(self, calls) if calls[0].op == "split" else _combine(calls)
        except BaseException as exc:
            self._break(f"rank {rank}: {type(exc).__name__}: {exc}")
            raise
        self._generation += 1
        self._cond.notify_all()
        return self._result

    def _break(self, reason: str) -> None:
        """Mark the group broken (first reason wins) and wake every waiter. Caller holds the lock."""
        if self._broken is None:
            self._broken = reason
        for child, _ in self._children:  # child locks are only ever taken below a parent's
            child.abort(reason)
        self._cond.notify_all()


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
        mean = self.group.rendezvous(self.rank, _Call("allreduce_mean", buf))
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
        value = self.group.rendezvous(self.rank, _Call("broadcast", buf, root))
        if self.rank != root:
            buf.copy_(value)

    def allgather(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Fill `recv` with every rank's `send`, in rank order."""
        check_gather(send, recv, self.size)
        if self.size == 1:
            recv.copy_(send)
            return
        recv.copy_(self.group.rendezvous(self.rank, _Call("allgather", send)))

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
            self.group.rendezvous(self.rank, _Call("barrier"))

    def split(self, color: int, key: int = 0) -> "InProcCommunicator":
        """This rank's communicator among the ranks that passed the same `color` (collective),
        ranked by (`key`, rank) as MPI_Comm_split; an abort of this group reaches it."""
        if self.size == 1:
            return InProcCommunicator(InProcGroup(1, self.group.timeout), 0)
        calls = self.group.rendezvous(self.rank, _Call("split", split=(int(color), int(key))))
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
        self._buf.copy_(comm.group.rendezvous(comm.rank, _Call("allreduce_mean", deposit)))


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
        outcome = _Finished(rank, None)
        try:
            gen = gen_fn(comms[rank], *args)
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
        items.put(outcome)

    threads = _start(size, work)
    finished = 0
    ended: set[int] = set()  # ranks that reported back (the rest are hung, or still going)
    hung = False
    failures: list[tuple[int, BaseException]] = []
    try:
        while finished < size:
            try:
                item = items.get(timeout=grace if failures else None)
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


def _until(stop: threading.Event, gen: Iterator[Any]) -> Iterator[Any]:
    """Items of `gen`, checking `stop` before resuming it each time."""
    while not stop.is_set():
        try:
            item = next(gen)
        except StopIteration:
            return
        yield item

