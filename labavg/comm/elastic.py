"""Elastic rounds on torchft: the group is whoever is present at each round.

Each worker is its own torchft replica group: one process with its own TCPStore, a
reconfigurable gloo (nccl on a GPU) process group and a `Manager` that asks the job's lighthouse
for a quorum of the workers present. Every collective is one round: a quorum, the reduction among
its members, and `should_commit`, which all members answer alike. A worker that died is left out
of the next quorum once its heartbeat stops; the round it cut short fails on every member and is
run again among the survivors, so no worker keeps a half-reduced buffer.

A worker behind the others (started by `labavg train --join`) "heals": the lighthouse names a
survivor, whose state (`set_state`) it receives (labavg.comm.elastic_transport) while the
others reduce without it; its own contribution to that round is zeros and not counted. The
trainer reads `last_round` to learn who was present and whether this worker just healed.

Ranks keep the number they were launched with (their shard, their log); `size` is the number of
workers in the last round, and `members` says which. Point-to-point messages and splits have no
elastic form: the reduce algorithms (ring, butterfly) and the hierarchy are refused with it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

import torch

from labavg.base.errors import UserError
from labavg.comm.base import Done
from labavg.comm.buffers import check_buffer, check_gather, check_root

# Rounds a cut-short reduction is tried again among the survivors before the worker gives up.
ROUND_RETRIES = 3


class ElasticUnsupported(RuntimeError):
    """A collective with no elastic form (point-to-point, splits)."""


class TooFewWorkers(RuntimeError):
    """Fewer workers than `min_workers` stayed for `quorum_timeout_s`."""


class JobFinished(RuntimeError):
    """The others finished the job while this worker was away (stopped): it must not go on
    alone and write the run's results over theirs."""


@dataclass(frozen=True)
class Round:
    """Who took part in one committed round, as this worker saw it."""

    number: int  # committed rounds so far, this one included (torchft's step)
    members: tuple[int, ...]  # launch ranks whose buffers were reduced
    healed: bool  # this worker received a survivor's state in this round
    attempts: int  # 1, or more where a member was lost during the round


def _quiet_torchft() -> None:
    """torchft's Rust side logs every quorum at INFO on stderr, which would bury labavg's own
    lines; its warnings and errors still show. A RUST_LOG the user set is kept. Its Python side
    warns of a GPU trace recorder on every reconfiguration, CPU or not."""
    import logging

    os.environ.setdefault("RUST_LOG", "warn")  # a level only: torchft reads no per-module filter
    # Its Manager logs every failed collective with a traceback (a lost worker's "Connection
    # reset by peer"); such a round is run again among the survivors, and a worker that gives up
    # says why in labavg's one line (TooFewWorkers), so those logs are only noise beside it.
    logging.getLogger("torchft").setLevel(logging.CRITICAL)


class Lighthouse:
    """The job's quorum server (torchft's lighthouse), on `host` at `port` (0: a free one)."""

    def __init__(self, *, min_workers: int = 1, heartbeat_ms: int = 1000,
                 join_timeout_ms: int = 30_000, host: str = "127.0.0.1", port: int = 0):
        _quiet_torchft()
        from torchft._torchft import LighthouseServer

        try:
            self._server = LighthouseServer(bind=f"{host}:{port}", min_replicas=min_workers,
                                            join_timeout_ms=join_timeout_ms,
                                            heartbeat_timeout_ms=heartbeat_ms)
        except RuntimeError as exc:  # the Rust side's bind error, e.g. "Address already in use"
            raise UserError(f"the lighthouse cannot listen on {host}:{port}: {exc}") from None
        # The server names itself by the machine's host name; the workers dial where it listens.
        port = urlsplit(self._server.address()).port
        self.address = f"http://{host}:{port}"

    def close(self) -> None:
        self._server.shutdown()


def _job_finished() -> bool:
    """Whether the launcher's state file (labavg.comm.elastic_launch) says a worker finished."""
    path = os.environ.get("LABAVG_ELASTIC_STATE")  # elastic_launch.STATE_ENV
    if not path:
        return False
    try:
        return json.loads(Path(path).read_text(encoding="utf-8")).get("finished") is True
    except (OSError, ValueError, AttributeError):
        return False  # being replaced (os.replace) or gone: nothing said


class ElasticCommunicator:
    """This worker's view of the elastic group; collectives as in labavg.comm.base."""

    def __init__(self, rank: int, launch_size: int, lighthouse: str, *,
                 device: torch.device | str = "cpu", min_workers: int = 1,
                 timeout_s: float = 30.0, quorum_timeout_s: float = 60.0,
                 host: str = "127.0.0.1", joining: bool = False):
        _quiet_torchft()
        from torchft import Manager, ProcessGroupGloo

        from labavg.comm.torch_dist import loopback_store

        self.rank, self.launch_size, self.local_rank = rank, launch_size, 0
        self._min_workers, self._quorum_timeout_s = min_workers, quorum_timeout_s
        self.joining = joining  # started to join a running job: its first collective is admit()
        self.device = torch.device(device)
        self._state: Callable[[], Any] = dict
        self._load: Callable[[Any], None] = lambda state: None
        self._healed = False
        self._spectator = False
        self._gathered = False
        timeout = timedelta(seconds=timeout_s)
        # Given a host, TCPStore still listens on every interface: a socket bound there does not.
        self._store = loopback_store(host=host, timeout_s=timeout_s)
        if self.device.type == "cuda":
            from torchft import ProcessGroupNCCL

            pg = ProcessGroupNCCL(timeout=timeout)
        else:
            pg = ProcessGroupGloo(timeout=timeout)
        self._pg = pg
        from labavg.comm.elastic_transport import StateTransport

        self._transport = StateTransport(host, timeout)
        self._manager = Manager(
            pg=pg, load_state_dict=self._on_heal, state_dict=lambda: self._state(),
            min_replica_size=min_workers, use_async_quorum=True, timeout=timeout,
            quorum_timeout=timedelta(seconds=quorum_timeout_s), connect_timeout=timeout,
            rank=0, world_size=1, store_addr=host, store_port=self._store.port,
            lighthouse_addr=lighthouse, replica_id=f"rank{rank}", hostname=host,
            checkpoint_transport=self._transport,
            # Every worker starts from the same seed: a first sync would divide their sum by N
            # with the joiners' zeros in it (torchft's default).
            init_sync=False)
        self.size = launch_size
        self.members: tuple[int, ...] = tuple(range(launch_size))
        self.last_round: Round | None = None

    def set_state(self, state: Callable[[], Any], load: Callable[[Any], None]) -> None:
        """What a joining worker receives from a survivor, and how it takes it in."""
        self._state, self._load = state, load

    def gather(self, timeout_s: float = 120.0) -> None:
        """Wait until every launched worker takes part in a round: the job's start.

        Workers start seconds apart (imports, data); the lighthouse forms a quorum of whoever
        is there, so the first rounds may hold only some of them. Those are empty rounds (a
        barrier); a worker that arrives behind heals from one that was there, with the same
        state, since all start from one seed.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            self.admit()
            if self.size == self.launch_size:
                self._gathered = True
                return
            if time.monotonic() > deadline:
                raise TooFewWorkers(f"only ranks {list(self.members)} of {self.launch_size} "
                                    f"started within {timeout_s:.0f} s")

    def _on_heal(self, state: Any) -> None:
        self._healed = True
        self._load(state)

    def _reduce(self, buf: torch.Tensor, mean: bool, admit: bool = False) -> None:
        """One round: quorum, SUM of float `buf` with a membership row beside it, commit.

        The row is 1 at each member's launch rank: a healing worker's contribution is zeroed by
        torchft and a spectator's by us, so the row says exactly whose buffers are in the sum.
        Only an `admit` round lets a new worker in (torchft's shrink_only quorum elsewhere):
        its first collective is an admission round too, so the shapes of what both sides
        reduce always match.
        """
        from torch.distributed import ReduceOp

        row = torch.zeros(self.launch_size, dtype=buf.dtype, device=buf.device)
        row[self.rank] = 1
        healed = False  # in any attempt: torchft loads the state before the vote, commit or not
        for attempt in range(1, ROUND_RETRIES + 2):
            self._healed = False
            # `buf` is untouched until a round commits: each attempt starts from it again.
            work = torch.cat([buf, row])
            if self._spectator or healed:  # healed in an attempt before: `buf` predates it
                work.zero_()
            self._manager.start_quorum(shrink_only=not admit)
            votes = torch.ones(1, dtype=torch.float64)
            try:
                self._manager.wait_quorum()
                if self._gathered and not admit and not self._manager.is_participating():
                    # Behind inside an averaging round (a dropped worker is let in only at an
                    # admission round): the others committed a round that failed here and have
                    # moved on to a collective of another shape, which this worker cannot know.
                    raise TooFewWorkers(self._behind())
                self._manager.allreduce(work, reduce_op=ReduceOp.SUM).wait()
                # torchft's commit is each worker's own: where a loss cut the reduction short
                # on some members only, the others would commit and move on. The vote says
                # whether every participant came through; one that failed casts none.
                self._manager.allreduce(votes, reduce_op=ReduceOp.SUM).wait()
            except TimeoutError:
                raise TooFewWorkers(self._no_quorum(admit)) from None
            committed = (self._manager.should_commit()
                         and round(votes.item()) == self._manager.num_participants())
            healed = healed or self._healed
            if not committed:
                # Closing this worker's connections fails the members still waiting in the
                # reduction or the vote at once, not after round_timeout_s.
                self._pg.abort()
                continue  # a member was lost during the round: again, among the survivors
            present = work[buf.numel():].round().to(torch.int64)
            self.members = tuple(int(r) for r in torch.nonzero(present).flatten())
            self.size = len(self.members)
            buf.copy_(work[: buf.numel()])
            if mean:
                buf.div_(self.size)
            # A worker that healed sits out the rest of the averaging round it joined in: the
            # survivors' buffers in it were computed before its state was theirs.
            self._spectator = self._spectator or healed
            self._gathered = self._gathered or (healed and self.joining)
            self.last_round = Round(self._manager.current_step(), self.members, healed, attempt)
            return
        raise TooFewWorkers(f"a round failed {ROUND_RETRIES + 1} times in a row among the "
                            f"workers present: {self._manager.errored()}")

    def _behind(self) -> str:
        return (f"rank {self.rank} fell behind the others: a round they committed failed here "
                f"(a worker was lost at its end); it leaves the job, and `labavg train --join` "
                f"starts a worker in its place")

    def _dropped(self, what: str) -> str:
        return (f"rank {self.rank} was dropped by the others (silent for longer than "
                f"elastic.heartbeat_ms or elastic.round_timeout_s: stopped?) and {what}; "
                f"`labavg train --join` starts a worker in its place")

    def _no_quorum(self, admit: bool) -> str:
        """Why no round formed within quorum_timeout_s, in one line."""
        waited = f"elastic.quorum_timeout_s = {self._quorum_timeout_s:g} s"
        # A worker the others dropped waits in vain inside an averaging round (only the last
        # round's members are let in: shrink_only), or in the quorum request it was stopped in;
        # with min_workers = 1 nothing else can hold a quorum up.
        if not self._gathered:  # at the start, or a joiner before its heal
            return f"rank {self.rank} met no running worker within {waited}"
        dropped = self._dropped(f"no round took it back within {waited}")
        if self._min_workers == 1:
            return dropped
        return (f"fewer than elastic.min_workers = {self._min_workers} workers were present for "
                f"{waited} (the last round had ranks {list(self.members)} of "
                f"{self.launch_size})" + ("" if admit else f"; or {dropped}"))

    def admit(self) -> Round:
        """The round that opens each averaging round: who is present, joiners let in (they heal
        here and sit out the rest of this averaging round; they take part from the next)."""
        # A worker ends with 0 only once the job's training is done, after its last round, so
        # a worker still opening rounds then was away (stopped) while the others finished.
        if self._gathered and _job_finished():
            raise JobFinished(f"the job finished while rank {self.rank} was away (stopped?): "
                              f"it ends without writing")
        self._spectator = False
        self._reduce(torch.zeros(1, dtype=torch.float64), mean=False, admit=True)
        if self.joining and not self._gathered:
            # Not healed at its first round: no worker was left to take the state from (the
            # others finished as it started), and training alone from step 0 would write over
            # the job's results.
            raise JobFinished(f"rank {self.rank} found no worker to join: the job finished, or "
                              f"lost every worker, before it arrived; it ends without writing")
        return self.last_round

    def allreduce_mean(self, buf: torch.Tensor) -> None:
        """Replace `buf` with the mean over the workers present at this round."""
        check_buffer(buf)
        self._reduce(buf, mean=True)

    def iallreduce_mean(self, buf: torch.Tensor) -> Done:
        """The mean, done now: a round is a quorum and a vote, not only a reduction."""
        self.allreduce_mean(buf)
        return Done()

    def broadcast(self, buf: torch.Tensor, root: int = 0) -> None:
        """Copy launch rank `root`'s `buf` to every worker present (root must be present)."""
        check_buffer(buf)
        check_root(root, self.launch_size)
        if self.rank != root:
            buf.zero_()
        self._reduce(buf, mean=False)
        if root not in self.members:
            raise TooFewWorkers(f"rank {root}, the source of a broadcast, has left the job")

    def allgather(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """`recv` row i: the `send` of the i-th worker present (in launch-rank order)."""
        rows = torch.zeros((self.launch_size, send.numel()), dtype=torch.float64,
                           device=send.device)
        rows[self.rank] = send.to(torch.float64)  # uint8 payloads too: sums of one term each
        flat = rows.flatten()
        self._reduce(flat, mean=False)
        check_gather(send, recv, self.size)
        recv.copy_(flat.view(self.launch_size, -1)[list(self.members)].flatten().to(recv.dtype))

    def sendrecv(self, send, dst, recv, src) -> None:
        raise ElasticUnsupported("point-to-point messages have no elastic form: use the "
                                 "default reduce algorithm with on_rank_loss = \"continue\"")

    def barrier(self) -> None:
        self._reduce(torch.zeros(1, dtype=torch.float64), mean=False)

    def idle_barrier(self) -> None:
        self.barrier()

    def split(self, color: int, key: int = 0) -> "ElasticCommunicator":
        raise ElasticUnsupported("a split group has no elastic form: hierarchical averaging "
                                 "cannot run with on_rank_loss = \"continue\"")

    def node_color(self) -> int | None:
        return None

    def abort(self, reason: str, code: int = 1, quiet: bool = False) -> None:
        """End this worker only: the others go on without it (that is the point)."""
        if not quiet:
            print(f"labavg: error: rank {self.rank}: {reason}", file=sys.stderr, flush=True)
        os._exit(code)

    def close(self) -> None:
        self._manager.shutdown(wait=False)
        self._transport.shutdown(wait=False)
