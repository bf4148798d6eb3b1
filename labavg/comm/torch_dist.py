"""The torch.distributed backend: one process per rank, started by torchrun (env:// rendezvous).

gloo for CPU buffers, nccl for CUDA ones. torch.distributed is imported in the constructor so
that importing this module does not pull it in. The mean is an all_reduce(SUM) followed by the
same in-place division as the other backends (ReduceOp.AVG exists only for nccl).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch

from labavg.base.waiting import wait_until
from labavg.comm.base import IDLE_POLL_SECONDS
from labavg.comm.buffers import check_buffer, check_gather, check_peer, check_root, split_members

DEFAULT_TIMEOUT_S = 300.0
LOOPBACK_ADDRESSES = ("127.0.0.1", "localhost", "::1")


def loopback_store(port: int = 0, *, host: str = "127.0.0.1",
                   timeout_s: float = DEFAULT_TIMEOUT_S):
    """A c10d TCPStore server listening on loopback `host` only (`port` 0: a free one).

    Given a host, TCPStore still listens on every interface ([::]); handed a socket already
    bound (`master_listen_fd`), it listens where that socket does.
    """
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=socket.SOMAXCONN)
    return dist.TCPStore(host, sock.getsockname()[1], is_master=True, wait_for_workers=False,
                         multi_tenant=True, master_listen_fd=sock.detach(),
                         timeout=timedelta(seconds=timeout_s))


def _job_store(rank: int, size: int, timeout_s: float):
    """The store of a local job's ranks at MASTER_ADDR:MASTER_PORT (a loopback address):
    rank 0 hosts it there, not on every interface as env:// would."""
    import torch.distributed as dist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank == 0:
        return loopback_store(port, host=host, timeout_s=timeout_s)
    return dist.TCPStore(host, port, size, is_master=False, timeout=timedelta(seconds=timeout_s))


class TorchDistCommunicator:
    """This process's rank in torch.distributed's default process group.

    Initialises the group from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (set by torchrun) unless
    it already exists. `timeout_s` bounds every collective, so a dead rank ends the run with an
    error instead of a hang.
    """

    def __init__(self, device: torch.device, *, timeout_s: float = DEFAULT_TIMEOUT_S):
        import torch.distributed as dist

        self._dist = dist
        self.device = torch.device(device)
        self._timeout_s = timeout_s
        self._group = None  # the default group; a `split` names its own
        self._members: list[int] | None = None  # the default group's ranks in a split's order
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            local = os.environ.get("MASTER_ADDR") in LOOPBACK_ADDRESSES
            if local:
                # A local job: gloo would otherwise listen on the address the host name
                # resolves to, reachable from the network (docs/cluster.md, listening sockets).
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            timeout = timedelta(seconds=timeout_s)
            if local and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
                # Not env://, whose rank 0 hosts the store on every interface. (torchrun's
                # agent store, when its workers use it, is the agent's: labavg.comm.torch_launch.)
                rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
                store = dist.PrefixStore("default_pg", _job_store(rank, size, timeout_s))
                dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                        timeout=timeout)
            else:
                dist.init_process_group(backend, init_method="env://", timeout=timeout)
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    def allreduce_mean(self, buf: torch.Tensor) -> None:
        """Replace `buf` on every rank with the element-wise mean over ranks."""
        check_buffer(buf)
        if self.size == 1:
            return
        self._dist.all_reduce(buf, op=self._dist.ReduceOp.SUM, group=self._group)
        buf.div_(self.size)

    def iallreduce_mean(self, buf: torch.Tensor) -> "_TorchPending":
        """Start the mean of `buf`: all_reduce(SUM, async_op=True), divided at `wait()`."""
        check_buffer(buf)
        if self.size == 1:
            return _TorchPending(None, buf, 1)
        work = self._dist.all_reduce(buf, op=self._dist.ReduceOp.SUM, group=self._group,
                                     async_op=True)
        return _TorchPending(work, buf, self.size)

    def broadcast(self, buf: torch.Tensor, root: int = 0) -> None:
        """Copy `root`'s `buf` into every rank's `buf`."""
        check_buffer(buf)
        check_root(root, self.size)
        if self.size > 1:
            self._dist.broadcast(buf, src=self._global(root), group=self._group)

    def allgather(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Fill `recv` with every rank's `send`, in rank order (all_gather_single)."""
        check_gather(send, recv, self.size)
        if self.size == 1:
            recv.copy_(send)
            return
        self._dist.all_gather_single(recv, send, group=self._group)

    def sendrecv(self, send: torch.Tensor | None, dst: int, recv: torch.Tensor | None,
                 src: int) -> None:
        """Send `send` to `dst` and receive `src`'s message into `recv` (either may be None).

        Both are posted before either is waited on, so two ranks swapping messages cannot
        deadlock. gloo (CPU) takes isend/irecv as they are; nccl wants a pair's send and
        receive in one group, which batch_isend_irecv makes.
        """
        dist = self._dist
        ops = []
        if recv is not None:
            check_peer(src, self.size)
            ops.append(dist.P2POp(dist.irecv, recv, self._global(src), self._group))
        if send is not None:
            check_peer(dst, self.size)
            ops.append(dist.P2POp(dist.isend, send, self._global(dst), self._group))
        if not ops:
            return
        if self.device.type == "cuda":
            works = dist.batch_isend_irecv(ops)
        else:
            works = [op.op(op.tensor, op.peer, group=self._group) for op in ops]
        for work in works:
            work.wait()

    def barrier(self) -> None:
        """Wait until every rank has arrived."""
        if self.size == 1:
            return
        if self.device.type == "cuda":
            self._dist.barrier(group=self._group, device_ids=[self.device.index or 0])
        else:
            self._dist.barrier(group=self._group)

    def idle_barrier(self) -> None:
        """`barrier` started asynchronously and checked between short sleeps (gloo's blocking
        wait spins); on CUDA the blocking barrier, whose spinning is NCCL's own thread."""
        if self.size == 1:
            return
        if self.device.type == "cuda":
            self.barrier()
            return
        work = self._dist.barrier(group=self._group, async_op=True)
        wait_until(work.is_completed, None, IDLE_POLL_SECONDS)
        work.wait()

    def split(self, color: int, key: int = 0) -> "TorchDistCommunicator":
        """This rank's communicator among the ranks passing the same `color` (collective),
        ranked by (`key`, rank) as MPI_Comm_split.

        new_group is collective over the whole default group, for every group, in one order:
        so the ranks first exchange their (color, key) and every rank creates every group.
        """
        pairs = torch.zeros(2 * self.size, dtype=torch.float64, device=self.device)
        pairs[2 * self.rank], pairs[2 * self.rank + 1] = float(color), float(key)
        self.allreduce_mean(pairs)  # one entry per rank: the mean times size is that entry
        values = (pairs * self.size).round().long().tolist()
        mine = None
        for members in split_members([(values[2 * r], values[2 * r + 1]) for r in range(self.size)]):
            ranks = [self._global(r) for r in members]
            group = self._dist.new_group(ranks, timeout=timedelta(seconds=self._timeout_s))
            if self.rank in members:
                mine = (group, ranks)
        sub = object.__new__(TorchDistCommunicator)
        sub._dist, sub.device, sub._timeout_s = self._dist, self.device, self._timeout_s
        sub._group, sub._members = mine
        sub._owns_group = False  # destroy_process_group() of the default group ends it
        sub.rank, sub.size = mine[1].index(self._global(self.rank)), len(mine[1])
        sub.local_rank = self.local_rank
        return sub

    def node_color(self) -> int | None:
        """torchrun's node (GROUP_RANK; with LOCAL_WORLD_SIZE alone, the rank's block of
        that many ranks, as torchrun numbers them), or None outside torchrun."""
        if "GROUP_RANK" in os.environ:
            return int(os.environ["GROUP_RANK"])
        if "LOCAL_WORLD_SIZE" in os.environ:
            return self.rank // int(os.environ["LOCAL_WORLD_SIZE"])
        return None

    def _global(self, rank: int) -> int:
        """The default group's rank of this group's `rank`."""
        return rank if self._members is None else self._members[rank]

    def abort(self, reason: str, code: int = 1, quiet: bool = False) -> None:
        """Exit this process at once with `code`; torchrun then ends the other ranks of the job."""
        import sys

        if not quiet:
            print(f"labavg: {reason}; exiting so torchrun ends the job", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(code)

    def close(self) -> None:
        """Destroy the process group if this communicator created it (torch warns otherwise)."""
        if self._owns_group and self._dist.is_initialized():
            self._dist.destroy_process_group()
        self._owns_group = False


class _TorchPending:
    """An asynchronous all_reduce in flight."""

    def __init__(self, work, buf: torch.Tensor, size: int) -> None:
        self._work, self._buf, self._size = work, buf, size

    def wait(self) -> None:
        """work.wait(), then the same in-place division as `allreduce_mean`."""
        if self._work is None:
            return
        work, self._work = self._work, None
        work.wait()
        self._buf.div_(self._size)
