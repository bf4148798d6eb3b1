"""The rendezvous the simulated ranks of one process share (labavg.comm.inproc): collectives
meet in an `InProcGroup`, point-to-point messages go through its mailboxes.

Determinism: `allreduce_mean` adds the ranks' buffers in the association MPICH uses for a
commutative SUM (recursive doubling, mpich src/mpi/coll/allreduce/
allreduce_intra_recursive_doubling.c and the reduce-scatter/allgather variant: pairs (0,1),
(2,3), ... first, non-power-of-two extras folded into their even neighbour), then divides by
the size exactly as the MPI backend does. Every rank gets the bitwise identical result, on
every run; measured bitwise equal to MPICH 5.0.2 for 2-8 ranks here.

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
from dataclasses import dataclass

import torch

from labavg.comm.buffers import split_members

# Seconds between a waiting receiver's checks for an abort, a departed sender, the watchdog.
_POLL_S = 0.1


class GroupAborted(RuntimeError):
    """This rank's collective was cut short because another rank failed or the group was aborted."""


class CollectiveTimeout(RuntimeError):
    """A rank waited longer than the group's timeout for the others (one hung or stopped)."""


class CollectiveMismatch(RuntimeError):
    """The ranks did not call the same collective on buffers of the same shape, or one had left."""

@dataclass(frozen=True)
class GroupCall:
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


def _check_same(calls: list[GroupCall]) -> None:
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


def _combine(calls: list[GroupCall]) -> torch.Tensor | None:
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


def _split_groups(parent: "InProcGroup", calls: list[GroupCall]) -> dict[int, tuple["InProcGroup", int]]:
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
        self._calls: list[GroupCall | None] = [None] * size
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
        # Per rank: when it last said it made progress (labavg.comm.watchdog.progress, or
        # arriving at a collective) and how deep in busy() blocks it is. A rank the others
        # wait for that is still moving is working, not hung (a long CV pass).
        self._moved = [time.monotonic()] * size
        self._busy = [0] * size

    def note_progress(self, rank: int) -> None:
        """Rank `rank` made progress in local work; GroupAborted if the group is broken, so
        that a rank of an ended run stops at its next batch, not at the end of its pass."""
        self._moved[rank] = time.monotonic()
        for child, ranks in self._children:  # its node's group may be the one waiting for it
            if rank in ranks:
                child.note_progress(ranks[rank])
        if self._broken is not None:
            raise GroupAborted(self._broken)

    def note_busy(self, rank: int, on: bool) -> None:
        self._busy[rank] += 1 if on else -1
        self._moved[rank] = time.monotonic()
        for child, ranks in self._children:
            if rank in ranks:
                child.note_busy(ranks[rank], on)

    def _silent(self, ranks: list[int]) -> list[int]:
        """Those of `ranks` that have not made progress for `timeout` seconds, nor are busy."""
        now = time.monotonic()
        return [r for r in ranks if not self._busy[r] and now - self._moved[r] > self.timeout]

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

    def rendezvous(self, rank: int, call: GroupCall) -> torch.Tensor | None:
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
            self._moved[rank] = time.monotonic()
            if self._arrived == self.size:
                return self._complete(rank)
            since = time.monotonic()
            while generation == self._generation and self._broken is None:
                if not self._cond.wait(timeout=self.timeout):
                    # Confirm: after the whole process was stopped and continued, the wait
                    # times out at once while the other ranks are about to arrive.
                    arrived = self._arrived
                    self._cond.wait(timeout=min(self.timeout, 5.0))
                    silent = self._silent([r for r, c in enumerate(self._calls) if c is None])
                    if (generation == self._generation and self._broken is None
                            and self._arrived == arrived and silent):
                        reason = (f"watchdog: rank(s) {silent} did not reach {call.op} within "
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
            if self.timeout and waited > self.timeout and self._silent([src]):
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
