"""The MPI backend: mpi4py over MPICH, one process per rank, started by mpiexec.

mpi4py is imported in the constructor, not at module import, so that merely importing this
module (for type hints, docs) does not initialise MPI. Start ranks with the command from
`labavg.comm.launchers.mpiexec_command`.

The mean is an in-place MPI_Allreduce(SUM) followed by a division by the size, as in Su & Chen
(2015) model averaging; `labavg.comm.inproc` reproduces MPICH's summation order so that both
backends give bitwise the same parameters.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from labavg.base.waiting import wait_until
from labavg.comm.base import IDLE_POLL_SECONDS
from labavg.comm.buffers import check_buffer, check_gather, check_peer, check_root
from labavg.comm.launchers import close_inherited_listeners

# The reduce algorithms' messages; collectives travel in a context of their own whatever the tag.
_P2P_TAG = 17


def query_cuda_aware(mpi: Any) -> bool:
    """Whether this MPI library can read and write CUDA memory (MPI 4.1 / MPIX query).

    False when the library cannot say: staging through host memory is always correct.
    """
    query = getattr(mpi, "Query_cuda_support", None)
    if query is None:
        return False
    try:
        return bool(query())
    except Exception:  # noqa: BLE001 - an MPI without the query is simply not CUDA-aware
        return False


ABORT_FLUSH_SECONDS = 1.0


class MpiCommunicator:
    """This process's rank in an MPI communicator (COMM_WORLD unless one is given)."""

    def __init__(self, comm: Any = None, *, cuda_aware: bool | None = None):
        # Before MPI starts: the rank does not keep hydra's control port open on every
        # interface (labavg.comm.launchers.close_inherited_listeners, docs/cluster.md).
        close_inherited_listeners()
        from mpi4py import MPI

        self._mpi = MPI
        self._comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = self._comm.Get_rank()
        self.size = self._comm.Get_size()
        self.local_rank = _local_rank(self._comm, MPI)
        self.cuda_aware = query_cuda_aware(MPI) if cuda_aware is None else cuda_aware
        self._staging: torch.Tensor | None = None

    def allreduce_mean(self, buf: torch.Tensor) -> None:
        """Replace `buf` on every rank with the element-wise mean over ranks."""
        check_buffer(buf)
        if self.size == 1:
            return
        with self._exposed(buf, writes_back=True) as view:
            self._comm.Allreduce(self._mpi.IN_PLACE, view, op=self._mpi.SUM)
        buf.div_(self.size)

    def iallreduce_mean(self, buf: torch.Tensor) -> "_MpiPending":
        """Start the mean of `buf`: an in-place MPI_Iallreduce(SUM), divided at `wait()`.

        MPICH advances a non-blocking collective only inside MPI calls unless asynchronous
        progress is on (MPIR_CVAR_ASYNC_PROGRESS=1; benchmarks/bench_overlap.py measures both).
        A staged (non-CUDA-aware) buffer gets a host copy of its own for the request's life.
        """
        check_buffer(buf)
        if self.size == 1:
            return _MpiPending(None, None, buf, 1)
        copy_back = None
        if buf.device.type == "cpu":
            view = buf.detach().numpy()
        elif buf.device.type == "cuda" and self.cuda_aware:
            torch.cuda.current_stream(buf.device).synchronize()
            view = buf.detach()
        else:
            host = buf.detach().cpu()
            view, copy_back = host.numpy(), host
        request = self._comm.Iallreduce(self._mpi.IN_PLACE, view, op=self._mpi.SUM)
        return _MpiPending(request, (view, copy_back), buf, self.size)

    def broadcast(self, buf: torch.Tensor, root: int = 0) -> None:
        """Copy `root`'s `buf` into every rank's `buf`."""
        check_buffer(buf)
        check_root(root, self.size)
        if self.size == 1:
            return
        with self._exposed(buf, writes_back=self.rank != root) as view:
            self._comm.Bcast(view, root=root)

    def allgather(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Fill `recv` with every rank's `send`, in rank order (MPI_Allgather)."""
        check_gather(send, recv, self.size)
        if self.size == 1:
            recv.copy_(send)
            return
        out = self._p2p_view(send, writes_back=False)
        into = self._p2p_view(recv, writes_back=True)
        self._comm.Allgather(out.view, into.view)
        into.__exit__(None, None, None)

    def sendrecv(self, send: torch.Tensor | None, dst: int, recv: torch.Tensor | None,
                 src: int) -> None:
        """Send `send` to `dst` and receive `src`'s message into `recv` (either may be None).

        One MPI_Sendrecv when both are given: each side of an exchange sends and receives at
        once, so a pair swapping large messages cannot deadlock the way two blocking MPI_Sends
        past the eager limit would.
        """
        comm = self._comm
        if send is not None:
            check_peer(dst, self.size)
        if recv is not None:
            check_peer(src, self.size)
        out = None if send is None else self._p2p_view(send, writes_back=False)
        into = None if recv is None else self._p2p_view(recv, writes_back=True)
        if out is not None and into is not None:
            comm.Sendrecv(out.view, dest=dst, sendtag=_P2P_TAG, recvbuf=into.view, source=src,
                          recvtag=_P2P_TAG)
        elif out is not None:
            comm.Send(out.view, dest=dst, tag=_P2P_TAG)
        elif into is not None:
            comm.Recv(into.view, source=src, tag=_P2P_TAG)
        if into is not None:
            into.__exit__(None, None, None)

    def barrier(self) -> None:
        """Wait until every rank has arrived."""
        if self.size > 1:
            self._comm.Barrier()

    def idle_barrier(self) -> None:
        """`barrier` as MPI_Ibarrier, tested between short sleeps instead of polled flat out."""
        if self.size > 1:
            wait_until(self._comm.Ibarrier().Test, None, IDLE_POLL_SECONDS)

    def split(self, color: int, key: int = 0) -> "MpiCommunicator":
        """This rank's communicator among the ranks passing the same `color` (MPI_Comm_split;
        collective), ranked by (`key`, rank)."""
        return MpiCommunicator(self._comm.Split(int(color), int(key)), cuda_aware=self.cuda_aware)

    def node_color(self) -> int:
        """The lowest rank on this rank's node: the ranks MPI_Comm_split_type(
        MPI_COMM_TYPE_SHARED) puts together (one host's memory) share it. Collective."""
        node = self._comm.Split_type(self._mpi.COMM_TYPE_SHARED, key=self.rank)
        try:
            return node.allreduce(self.rank, op=self._mpi.MIN)
        finally:
            node.Free()

    def abort(self, reason: str, code: int = 1, quiet: bool = False) -> None:
        """End every rank of the job (MPI_Abort): the others may be blocked in a collective.

        `code` becomes mpiexec's exit status; `quiet` when the caller has printed the reason.
        """
        import sys

        if not quiet:
            print(f"labavg: {reason}; aborting all {self.size} MPI ranks", file=sys.stderr, flush=True)
        # hydra's proxy relays a rank's stderr from a pipe; MPI_Abort has it killed at once, so a
        # line printed just before could be lost (seen in about 1 of 3 runs on 2 busy cores).
        time.sleep(ABORT_FLUSH_SECONDS)
        self._comm.Abort(code)
        import os

        os._exit(code)  # MPICH's Abort can return in the caller before the launcher kills it

    def close(self) -> None:
        """Drop the staging buffer; mpi4py finalizes MPI itself at interpreter exit."""
        self._staging = None

    def _exposed(self, buf: torch.Tensor, *, writes_back: bool) -> "_Exposed":
        """A context giving MPI a view of `buf`'s memory (staged through pinned host memory if needed)."""
        if buf.device.type == "cpu":
            return _Exposed(buf.detach().numpy())
        if buf.device.type == "cuda" and self.cuda_aware:
            # MPI does not know torch's streams: the kernels writing `buf` must be done.
            torch.cuda.current_stream(buf.device).synchronize()
            return _Exposed(buf.detach())
        host = self._staging_for(buf)
        host.copy_(buf)
        return _Exposed(host.numpy(), copy_back=(host, buf) if writes_back else None)

    def _p2p_view(self, buf: torch.Tensor, *, writes_back: bool) -> "_Exposed":
        """Like `_exposed`, but with a fresh host copy when staged: a send and a receive of
        one exchange need two buffers, and their sizes change from step to step."""
        if buf.device.type == "cpu":
            return _Exposed(buf.detach().numpy())
        if buf.device.type == "cuda" and self.cuda_aware:
            torch.cuda.current_stream(buf.device).synchronize()
            return _Exposed(buf.detach())
        host = buf.detach().cpu()
        return _Exposed(host.numpy(), copy_back=(host, buf) if writes_back else None)

    def _staging_for(self, buf: torch.Tensor) -> torch.Tensor:
        """A host buffer like `buf`, pinned for fast device copies, reused between calls."""
        staging = self._staging
        if staging is None or staging.numel() != buf.numel() or staging.dtype != buf.dtype:
            pin = buf.device.type == "cuda"
            staging = torch.empty(buf.numel(), dtype=buf.dtype, pin_memory=pin)
            self._staging = staging
        return staging


class _MpiPending:
    """An MPI_Iallreduce in flight; `keep` holds the memory MPI writes until it is done."""

    def __init__(self, request: Any, keep: Any, buf: torch.Tensor, size: int) -> None:
        self._request, self._keep, self._buf, self._size = request, keep, buf, size

    def wait(self) -> None:
        """MPI_Wait, then the same in-place division as `allreduce_mean`."""
        if self._request is None:
            return
        request, self._request = self._request, None
        request.Wait()
        _, host = self._keep
        self._keep = None
        if host is not None:
            self._buf.copy_(host)
        self._buf.div_(self._size)


class _Exposed:
    """The object handed to mpi4py, and the copy back to the device when staged."""

    def __init__(self, view: Any, copy_back: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.view = view
        self.copy_back = copy_back

    def __enter__(self) -> Any:
        return self.view

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and self.copy_back is not None:
            host, device_buf = self.copy_back
            device_buf.copy_(host)


def _local_rank(comm: Any, mpi: Any) -> int:
    """Rank among the processes sharing this node's memory (for binding a GPU)."""
    node = comm.Split_type(mpi.COMM_TYPE_SHARED)
    try:
        return node.Get_rank()
    finally:
        node.Free()


def world_rank_size() -> tuple[int, int]:
    """(rank, size) of MPI_COMM_WORLD, initialising MPI if needed (not collective)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
