"""The choices of the comm layer a run's settings name, and its [elastic] section (torch-free,
for the settings schema)."""

from __future__ import annotations

from dataclasses import dataclass

from labavg.base.schema import POSITIVE, integer, real, setting

BACKENDS = ("inproc", "mpi", "torch")
# How the ranks compute the mean of their parameters (labavg.comm.reduce, docs/averaging.md).
REDUCE = ("allreduce", "butterfly", "ring")
# What the other workers do when one is lost: end the job (then `labavg train --resume`), or go
# on averaging among those present (labavg.comm.elastic, backend torch only).
ON_RANK_LOSS = ("stop", "continue")


@dataclass(frozen=True)
class ElasticConfig:
    """[elastic]: the quorum of a run with on_rank_loss = "continue" (labavg.comm.elastic)."""

    min_workers: int = setting(1, "fewest workers that go on averaging; below it the last "
                               "ones end after quorum_timeout_s (1: the last survivor trains "
                               "alone)", POSITIVE)
    heartbeat_ms: int = setting(1000, "silence after which the lighthouse drops a worker",
                                integer(100, 600_000))
    # A worker that is alive (its heartbeat goes on) but late to a round (a slow checkpoint, a
    # loaded machine, a joiner still building its model) is waited for this long before the
    # others go on without it; at 2 s, live workers were dropped under load, and a joiner
    # could meet a round of its own.
    join_timeout_ms: int = setting(30_000, "how long a round waits for a worker that is alive "
                                   "but late before the others go on without it",
                                   integer(0, 600_000))
    # A worker killed while the survivors set up a round's group is found only by this timeout
    # (measured: 30.1 s at 30 s, once in 5 kills); one that dies between rounds, by the
    # heartbeat. A round moves a few MB between workers already waiting for each other.
    round_timeout_s: float = setting(10.0, "a round's collective and its vote; a hung worker, "
                                     "or one lost while a round's group forms, is dropped after "
                                     "it", real(0.1, 86_400.0))
    quorum_timeout_s: float = setting(60.0, "how long a round waits for min_workers",
                                      real(0.1, 86_400.0))
