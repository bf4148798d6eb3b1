"""The communicator seam: everything training needs from the other ranks."""

from __future__ import annotations

from typing import Protocol

import torch

# How often a rank waiting in `idle_barrier` looks again: short beside a minibatch (~20 ms).
IDLE_POLL_SECONDS = 0.0005


class Pending(Protocol):
    """A mean started by `Communicator.iallreduce_mean`, still in flight."""

    def wait(self) -> None:
        """Block until the buffer holds the mean (bitwise that of `allreduce_mean`)."""


class Done:
    """The handle of a mean with nothing to wait for (one rank)."""

    def wait(self) -> None:
        """Nothing to wait for."""


class Communicator(Protocol):
    """One rank's view of the group of workers.

    Buffers are flat (1-D), contiguous float tensors, modified in place. With one rank every
    collective is a no-op, so single-worker code pays nothing.
    """

    rank: int
    size: int
    local_rank: int  # rank among the processes on this host, for GPU binding

    def allreduce_mean(self, buf: torch.Tensor) -> None:
        """Replace `buf` on every rank with the element-wise mean over ranks."""

    def iallreduce_mean(self, buf: torch.Tensor) -> Pending:
        """Start replacing `buf` with the mean over ranks, without waiting for it.

        `buf` must not be read or written until `wait()` of the returned handle has returned;
        then it holds bitwise what `allreduce_mean` would have left there. Every rank starts
        its means in the same order, as with any collective (labavg.averaging.overlap's eager rounds).
        """

    def broadcast(self, buf: torch.Tensor, root: int = 0) -> None:
        """Copy `root`'s `buf` into every rank's `buf`."""

    def allgather(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Fill `recv` (size x len(send)) on every rank with every rank's `send`, in rank order.

        Unlike the other collectives the buffers may also be uint8 (compressed payloads); every
        rank must send the same length.
        """

    def sendrecv(self, send: torch.Tensor | None, dst: int, recv: torch.Tensor | None,
                 src: int) -> None:
        """Send `send` to rank `dst` while receiving rank `src`'s message into `recv`.

        Point-to-point, for the reduce algorithms (labavg.comm.reduce): either buffer may be
        None (only send, only receive; its rank is then ignored), and both sides must agree on
        the message's length. Returns once `recv` holds the message and `send` may be reused.
        Messages from one rank to another arrive in the order they were sent.
        """

    def barrier(self) -> None:
        """Wait until every rank has arrived."""

    def idle_barrier(self) -> None:
        """`barrier`, waiting without keeping a core busy.

        MPICH and gloo spin while they wait; a rank that waits for another one working alone
        (labavg.training.speedup_probe) must leave it the cores, or the solo time measured is
        that of a rank sharing its core with the spinning waiters.
        """

    def split(self, color: int, key: int = 0) -> "Communicator":
        """This rank's communicator among the ranks that passed the same `color`.

        Collective: every rank calls it. Ranks of the new group are numbered by (`key`, old
        rank), as MPI_Comm_split numbers them. Hierarchical averaging (labavg.averaging.methods) makes
        "my node" with it, and "the same rank on every node" with color = rank in the node.
        """

    def node_color(self) -> int | None:
        """The same number on exactly the ranks of this rank's node (the processes sharing one
        host's memory), or None where the backend cannot tell (inproc). Collective on mpi."""

    def abort(self, reason: str, code: int = 1, quiet: bool = False) -> None:
        """End the whole job now (the other ranks may be blocked in a collective).

        `code` is the job's exit status where the backend can set it; `quiet` when the caller
        has already printed `reason`.
        """

    def close(self) -> None:
        """Release the backend's resources (the process group, staging buffers)."""
